"""bench/vlm.py's count of trained tokens is the same for both trainers: on the same image
conversations, hputrain's blocks (seq_lens) and TRL 1.16's vision collator (attention mask, its
assistant mask) give each example the same trained and learned tokens, packed or not."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ...vlm_fixtures import tiny_vlm_folder, write_image_dataset

trl = pytest.importorskip("trl", reason="the bench compares against TRL's SFTTrainer")
BENCH = Path(__file__).resolve().parents[3] / "bench" / "vlm.py"


@pytest.fixture(scope="module")
def bench():
    import sys

    sys.path.insert(0, str(BENCH.parent))  # the bench's own imports (common, sft, hf_finetune)
    spec = importlib.util.spec_from_file_location("bench_vlm", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-vlm")
    folder = tiny_vlm_folder(root / "llava", "llava", tagged=True)  # TRL's assistant mask needs tags
    return folder, write_image_dataset(root / "data", "messages", rows=16)


def hputrain_blocks(folder: Path, data: Path, packing: bool):
    from hputrain.kinds.vlm.data.encode import Processing
    from hputrain.kinds.vlm.data.loading import load_image_data

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    options = SimpleNamespace(packing=packing, validation_split_percentage=0, image_slots=None,
                              dataset_num_proc=None, assistant_only_loss=True, completion_only_loss=True)
    made = load_image_data(str(data), "messages", Processing.load(folder), 256, options,
                           rows=lambda split: [(f"{data} line {i + 1}", row, data.parent)
                                               for i, row in enumerate(rows)])
    return [made.collator([made.train[i]]) for i in range(len(made.train))]


def trl_batches(bench, folder: Path, data: Path):
    import transformers
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collate = DataCollatorForVisionLanguageModeling(
        processor=transformers.AutoProcessor.from_pretrained(folder), max_length=256,
        assistant_only_loss=True)
    dataset = bench.trl_dataset(data)
    return [collate([dataset[i]]) for i in range(len(dataset))]


def test_both_trainers_count_the_same_tokens_of_each_example(bench, setting):
    folder, data = setting
    ours = [bench.counted(batch) for batch in hputrain_blocks(folder, data, packing=False)]
    theirs = [bench.counted(batch) for batch in trl_batches(bench, folder, data)]
    assert len(ours) == len(theirs) == 16
    # one example a block, padded to a length bucket; TRL's one-row batch has no padding
    assert [(c["tokens"], c["learned"]) for c in ours] == [(c["tokens"], c["learned"]) for c in theirs]
    assert all(c["slots"] >= c["tokens"] for c in ours)
    assert all(c["slots"] == c["tokens"] for c in theirs)


def test_packed_blocks_count_every_example_once(bench, setting):
    folder, data = setting
    packed = [bench.counted(batch) for batch in hputrain_blocks(folder, data, packing=True)]
    theirs = [bench.counted(batch) for batch in trl_batches(bench, folder, data)]
    for key in ("examples", "tokens", "learned"):
        assert sum(c[key] for c in packed) == sum(c[key] for c in theirs), key
    assert len(packed) < len(theirs)  # examples share blocks
