"""Length buckets (data.PadToBuckets, data.default_collator_for): the padded shapes and values,
the loss of a tiny Llama unchanged by the padding, and lazy mode compiling no graph after warm-up
with buckets where it keeps compiling without (in the Trainer's summary and in `hputrain doctor`)."""
import json

import pytest
import torch

from hputrain import TrainingArguments
from hputrain.data.batching import (PadToBuckets, bucket_lengths, default_collate,
                                    default_collator_for)
from hputrain.errors import InputError
from hputrain.models.gpt import GPT, GPTConfig
from hputrain.config.sections import DataSettings

from ..doctor_scripts import ragged
from ..hf_fixtures import tiny_llama_config
from ..rehearsal.doctor.test_doctor import doctor


def rows(*lengths, mask=True):
    out = []
    for n in lengths:
        ids = torch.arange(10, 10 + n)
        row = {"input_ids": ids, "labels": ids + 100, "label": 7, "text": "t"}
        if mask:
            row["attention_mask"] = torch.ones(n, dtype=torch.long)
        out.append(row)
    return out


def test_bucket_lengths_are_spaced_evenly_up_to_the_maximum():
    assert bucket_lengths(4, 128) == [32, 64, 96, 128]
    assert bucket_lengths(3, 100) == [34, 67, 100]
    assert bucket_lengths(3, 100, multiple=8) == [40, 72, 100]  # never past the maximum
    assert bucket_lengths(1, 50) == [50] and bucket_lengths(10, 4) == [1, 2, 3, 4]


@pytest.mark.parametrize("lengths, width", [((3, 5), 32), ((32, 1), 32), ((33, 2), 64), ((100, 128), 128)])
def test_rows_are_padded_to_the_smallest_bucket_that_holds_them(lengths, width):
    batch = PadToBuckets(pad_token_id=3, buckets=4, max_length=128)(rows(*lengths))
    for key in ("input_ids", "labels", "attention_mask"):
        assert batch[key].shape == (2, width), key
    for row, n in enumerate(lengths):
        assert batch["input_ids"][row, :n].tolist() == list(range(10, 10 + n))
        assert batch["labels"][row, :n].tolist() == list(range(110, 110 + n))
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert (batch["input_ids"][row, n:] == 3).all() and (batch["labels"][row, n:] == -100).all()
    # values that are not one per token are batched as default_collate does
    assert batch["label"].tolist() == [7, 7] and batch["text"] == ["t", "t"]


def test_no_mask_is_added_and_lists_are_padded_too():
    batch = PadToBuckets(0, buckets=2, max_length=16)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert set(batch) == {"input_ids"} and batch["input_ids"].tolist() == [[5, 6, 7] + [0] * 5, [8] + [0] * 7]


def test_pad_to_multiple_of_rounds_the_longest_row_up():
    pad = PadToBuckets(0, pad_to_multiple_of=8)
    assert pad(rows(3, 9))["input_ids"].shape == (2, 16)
    assert pad(rows(8, 8))["input_ids"].shape == (2, 8)  # equal rows: stacked, already a multiple
    capped = PadToBuckets(0, pad_to_multiple_of=64, max_length=100)
    assert capped(rows(70))["input_ids"].shape == (1, 100)  # never past the model's maximum
    with_buckets = PadToBuckets(0, pad_to_multiple_of=8, buckets=3, max_length=100)
    assert with_buckets(rows(45))["input_ids"].shape == (1, 72)


def test_a_row_longer_than_the_largest_bucket_is_one_line():
    with pytest.raises(InputError) as error:
        PadToBuckets(0, buckets=2, max_length=32)(rows(5, 40))
    assert str(error.value) == ("a row of 40 tokens is longer than the model's maximum length 32: "
                                "cut the rows to at most 32 tokens")
    with pytest.raises(InputError, match="give samples as dicts with input_ids"):
        PadToBuckets(0, pad_to_multiple_of=8)([(torch.ones(3),)])
    with pytest.raises(InputError, match="length buckets need a maximum length"):
        PadToBuckets(0, buckets=4)
    with pytest.raises(InputError, match="buckets must be a whole number of at least 1"):
        PadToBuckets(0, buckets=0, max_length=8)


def test_default_collator_for_reads_the_model_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(tiny_llama_config(64))
    plain = TrainingArguments(output_dir=str(tmp_path))
    assert default_collator_for(llama, DataSettings.of(plain)) is default_collate
    collate = default_collator_for(llama, DataSettings.of(TrainingArguments(output_dir=str(tmp_path), length_buckets=4)))
    assert isinstance(collate, PadToBuckets) and collate.pad_token_id == 3
    assert collate.lengths == [32, 64, 96, 128]
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64))
    collate = default_collator_for(gpt, DataSettings.of(TrainingArguments(output_dir=str(tmp_path), pad_to_multiple_of=16)))
    assert collate.pad_token_id == 0 and collate.max_length == 64 and collate.lengths is None

    bucketed = TrainingArguments(output_dir=str(tmp_path), length_buckets=2)
    with pytest.raises(InputError) as error:
        default_collator_for(torch.nn.Linear(2, 2), DataSettings.of(bucketed))
    assert "Linear does not give: use pad_to_multiple_of instead" in str(error.value)


def test_padding_leaves_a_llama_loss_unchanged():
    """A ragged batch padded to a bucket of 32 (no attention mask, labels -100) has the loss of
    the rows taken one by one, unpadded: their token mean over the predicted tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(tiny_llama_config(64, max_position_embeddings=32)).eval()
    samples = ragged.rows(n=4, shortest=5, longest=14)
    batch = PadToBuckets(3, buckets=2, max_length=32)(samples)
    assert batch["input_ids"].shape == (4, 16) and set(batch) == {"input_ids", "labels"}
    with torch.no_grad():
        padded = llama(**batch).loss
        losses = [llama(input_ids=s["input_ids"][None], labels=s["labels"][None]).loss for s in samples]
    counts = [len(s["input_ids"]) - 1 for s in samples]  # each row predicts all but its first token
    unpadded = sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)
    assert padded.item() == pytest.approx(unpadded.item(), abs=1e-6)


# -- lazy mode ---------------------------------------------------------------------------------------

def lazy_summary(tmp_path, layout):
    out = tmp_path / layout
    ragged.main(layout, output_dir=str(out), max_steps=8, save_steps=0, disable_tqdm=True,
                execution_mode="lazy", accelerator="cpu")
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.ci
def test_lazy_mode_compiles_nothing_after_warmup_with_buckets(tmp_path):
    """Ragged rows of 4 to 20 tokens on CPU lazy mode: with two buckets (16, 32, both seen by step
    4, the warm-up) no graph compiles afterwards; padded to the longest row, graphs keep compiling."""
    pytest.importorskip("transformers")
    bucketed = lazy_summary(tmp_path, "buckets")
    assert bucketed["graph_compiles"] > 0 and bucketed["graph_compiles_after_warmup"] == 0
    longest = lazy_summary(tmp_path, "longest")
    assert longest["graph_compiles_after_warmup"] > 0


@pytest.mark.slow
def test_doctor_finds_buckets_fine_and_longest_padding_recompiling(tmp_path):
    pytest.importorskip("transformers")
    bucketed = doctor(tmp_path, "buckets", steps=8, script="ragged.py")
    assert bucketed["findings"] == [] and bucketed["shapes"]["distinct"] == ["[4, 32]", "[4, 16]"]
    assert not bucketed["shapes"]["growing"] and bucketed["compiles_per_step"][4:] == [0, 0, 0, 0]
    longest = doctor(tmp_path, "longest", steps=8, script="ragged.py")
    assert [f["kind"] for f in longest["findings"]] == ["recompilation"] and longest["shapes"]["growing"]
