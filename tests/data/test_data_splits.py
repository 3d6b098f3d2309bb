"""Issue 46 item 13: a data folder's files are split by their names as datasets' load_dataset splits
them (train.jsonl, dev.jsonl, test.jsonl; a Hub snapshot's data/test-00000-of-00001.parquet; a
validation/ subfolder): the test split is never trained on, the validation split is validated on,
the header names the files of each split, and `hputrain evaluate --split` reads one split."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ..hf_fixtures import SAMPLE_TEXT, llama_folder  # noqa: F401
from ..methods.sft.test_sft_recipe import chat_model, conversation  # noqa: F401

transformers = pytest.importorskip("transformers", reason="the Hugging Face recipe needs transformers")

from hputrain.cli import main  # noqa: E402
from hputrain.recipes import hf  # noqa: E402
from hputrain.recipes.hf import data as hf_data

BLOCK = 32
TRAIN = [f"{i} {SAMPLE_TEXT[i % 4]}" for i in range(120)]
VALIDATION = [f"{SAMPLE_TEXT[i % 4].upper()} {i}" for i in range(30)]
TEST = [f"zz {SAMPLE_TEXT[i % 4][::-1]} {i}" for i in range(40)]  # rows no other split holds


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def tokenizer(llama_folder):  # noqa: F811
    return transformers.AutoTokenizer.from_pretrained(llama_folder)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def texts(values: list[str]) -> list[dict]:
    return [{"text": value} for value in values]


def packed(tokenizer, values: list[str]) -> np.ndarray:
    """The blocks of `values` as hf_data packs one split: tokens and eos, cut into blocks."""
    ids = sum((tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for t in values), [])
    return np.array(ids[:len(ids) // BLOCK * BLOCK]).reshape(-1, BLOCK)


def blocks(path, tokenizer, tmp_path, **kw):
    kw = {"validation_percentage": 0, "cache_dir": tmp_path / "cache"} | kw
    return hf_data.load_blocks(str(path), tokenizer, BLOCK, **kw)


# -- the split names are datasets' -----------------------------------------------------------------

LAYOUTS = [
    ["train.jsonl", "test.jsonl", "dev.jsonl"],
    ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
     "data/test-00000-of-00001.parquet", "data/unsupervised-00000-of-00001.parquet"],
    ["data/train/a.jsonl", "data/test/b.jsonl", "data/valid_2/c.jsonl"],
    ["train_0.jsonl", "train_1.jsonl", "wiki.test.jsonl", "my-val.jsonl", "eval.jsonl",
     "evaluation-x.jsonl", "training.jsonl", "val2.jsonl"],
    ["training/x.jsonl", "testing/y.jsonl", "validation/z.jsonl", "dev-set/w.jsonl"],
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[names[0] for names in LAYOUTS])
def test_split_names_are_those_datasets_gives(tmp_path, layout):
    """Each file's split is the one datasets' own resolution (get_data_patterns, the patterns of
    the installed datasets) gives it, on layouts where it names a train split."""
    data_files = pytest.importorskip("datasets.data_files")
    from hputrain.data.splits import folder_splits

    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    expected = {}
    for split, patterns in data_files.get_data_patterns(str(tmp_path)).items():
        for pattern in patterns:
            try:
                found = data_files.resolve_pattern(pattern, str(tmp_path))
            except FileNotFoundError:
                continue
            expected.setdefault(str(split), set()).update(os.path.relpath(f, tmp_path) for f in found)
    files = sorted(tmp_path / name for name in layout)
    got = folder_splits(tmp_path, files)
    assert not got.unnamed
    assert {split: {f.relative_to(tmp_path).as_posix() for f in fs} for split, fs in got.files.items()} \
        == expected


# -- training reads the train split, validates on the validation split -----------------------------

def test_a_folders_test_file_is_never_trained_on(tmp_path, tokenizer):
    """train.jsonl + test.jsonl: every training and held-out block is the train rows' alone, in
    their order; the test rows are a split of their own, packed by themselves."""
    folder = tmp_path / "data"
    write_rows(folder / "train.jsonl", texts(TRAIN))
    write_rows(folder / "test.jsonl", texts(TEST))
    data = blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert not data.own_validation
    assert np.array_equal(np.concatenate([data.train.blocks, data.validation.blocks]),
                          packed(tokenizer, TRAIN))
    assert hf_data.saved_splits(str(folder)) == ["train", "test"]
    test = blocks(folder, tokenizer, tmp_path, split="test")
    assert np.array_equal(test.train.blocks, packed(tokenizer, TEST))


def test_a_hub_snapshot_is_read_by_its_splits(tmp_path, tokenizer):
    """The Hub's Parquet layout (data/{split}-NNNNN-of-NNNNN.parquet, a README.md card): train
    shards trained on, the validation shard validated on, the test shard read by no run."""
    pytest.importorskip("pyarrow")
    folder = tmp_path / "snapshot"
    write_rows(folder / "data/train-00000-of-00002.parquet", texts(TRAIN[:70]))
    write_rows(folder / "data/train-00001-of-00002.parquet", texts(TRAIN[70:]))
    write_rows(folder / "data/validation-00000-of-00001.parquet", texts(VALIDATION))
    write_rows(folder / "data/test-00000-of-00001.parquet", texts(TEST))
    (folder / "README.md").write_text("---\nconfigs: []\n---\n# a data set\n")
    data = blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert data.own_validation
    assert np.array_equal(data.train.blocks, packed(tokenizer, TRAIN))
    assert np.array_equal(data.validation.blocks, packed(tokenizer, VALIDATION))
    assert hf_data.splits_line(str(folder)) == (
        "hputrain: splits, by file name: train: data/train-00000-of-00002.parquet, "
        "data/train-00001-of-00002.parquet; validation: data/validation-00000-of-00001.parquet; "
        "test: data/test-00000-of-00001.parquet (not read)\n")


def test_sft_rows_of_a_test_file_are_not_trained_on(tmp_path, chat_model):  # noqa: F811
    """Chat rows: train.jsonl's rows are the training examples, dev.jsonl's the validation
    examples, test.jsonl's neither."""
    folder = tmp_path / "chat"
    write_rows(folder / "train.jsonl", [{"messages": conversation(i)} for i in range(12)])
    write_rows(folder / "dev.jsonl", [{"messages": conversation(i)} for i in range(12, 15)])
    write_rows(folder / "test.jsonl", [{"messages": conversation(i)} for i in range(15, 22)])
    options = hf.HFOptions(model=str(chat_model), dataset=str(folder), block_size=256)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_model)
    data = hf.load_data(options, tokenizer, 256, chat_model, tmp_path / "cache")
    assert data.own_validation and data.rows.rows == 12 + 3
    whole = hf.load_data(hf.HFOptions(model=str(chat_model), dataset=str(folder / "train.jsonl"),
                                      block_size=256, validation_split_percentage=0),
                         tokenizer, 256, chat_model, tmp_path / "cache")
    assert len(data.train) == len(whole.train)
    for ours, theirs in zip(data.train, whole.train):
        assert all(np.array_equal(np.asarray(ours[key]), np.asarray(theirs[key])) for key in theirs)


def test_a_folder_of_test_files_alone_is_not_trained_on(tmp_path, llama_folder, capsys):  # noqa: F811
    folder = tmp_path / "data"
    write_rows(folder / "test.jsonl", texts(TEST))
    assert main(["train", "--model", str(llama_folder), "--dataset", str(folder), "--output-dir",
                 str(tmp_path / "run"), "--precision", "fp32", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no files to train on" in err, err
    assert "test: test.jsonl" in err


def test_the_header_names_the_files_of_each_split(tmp_path, llama_folder, tokenizer, capsys):  # noqa: F811
    folder = tmp_path / "data"
    write_rows(folder / "train.jsonl", texts(TRAIN))
    write_rows(folder / "dev.jsonl", texts(VALIDATION))
    write_rows(folder / "test.jsonl", texts(TEST))
    assert main(["train", "--model", str(llama_folder), "--dataset", str(folder), "--output-dir",
                 str(tmp_path / "run"), "--precision", "fp32", "--block-size", str(BLOCK),
                 "--max-steps", "1", "--save-steps", "-1", "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    assert ("hputrain: splits, by file name: train: train.jsonl; validation: dev.jsonl; "
            "test: test.jsonl (not read)\n") in out, out
    count = len(packed(tokenizer, VALIDATION))
    assert f"hputrain: validation: the data set's own validation split, {count} blocks" in out, out


def test_a_validation_subfolder_and_unnamed_shards_read_as_before(tmp_path, tokenizer):
    """Issue 39's layout: shards that name no split are the train split, validation/ the
    validation split; beside a train file, a file that names no split is left out (as datasets
    leaves it) and the header says so."""
    folder = tmp_path / "shards"
    write_rows(folder / "part-0.jsonl", texts(TRAIN[:60]))
    write_rows(folder / "part-1.jsonl", texts(TRAIN[60:]))
    write_rows(folder / "validation/part-0.jsonl", texts(VALIDATION))
    data = blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert data.own_validation and np.array_equal(data.train.blocks, packed(tokenizer, TRAIN))
    other = tmp_path / "named"
    write_rows(other / "train.jsonl", texts(TRAIN))
    write_rows(other / "notes.jsonl", texts(TEST))
    assert np.array_equal(blocks(other, tokenizer, tmp_path).train.blocks, packed(tokenizer, TRAIN))
    assert "left out, naming no split beside the train files: notes.jsonl" in hf_data.splits_line(str(other))


def test_a_dataset_dicts_test_split_is_not_trained_on(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "dict"
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": values}) for name, values in
                          (("train", TRAIN), ("test", TEST))}).save_to_disk(str(folder))
    data = blocks(folder, tokenizer, tmp_path, validation_percentage=5)
    assert np.array_equal(np.concatenate([data.train.blocks, data.validation.blocks]),
                          packed(tokenizer, TRAIN))
    assert np.array_equal(blocks(folder, tokenizer, tmp_path, split="test").train.blocks,
                          packed(tokenizer, TEST))
    assert hf_data.splits_line(str(folder)) == "hputrain: splits of the DatasetDict: train, test (not read)\n"


# -- hputrain evaluate --split ---------------------------------------------------------------------

def evaluate(capsys, model, dataset, *argv) -> tuple[dict, str]:
    assert main(["evaluate", "--model", str(model), "--dataset", str(dataset), "--json",
                 "--block-size", str(BLOCK), "--batch-size", "64", *argv]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


def test_evaluate_reads_the_split_asked_for(tmp_path, llama_folder, tokenizer, capsys):  # noqa: F811
    """--split test reads exactly the test rows (the numbers of those rows in a file by
    themselves), --split validation the dev rows and the default the train rows (as many
    counted tokens as their blocks hold); stderr names the files read."""
    folder = tmp_path / "data"
    for name, values in (("train", TRAIN), ("dev", VALIDATION), ("test", TEST)):
        write_rows(folder / f"{name}.jsonl", texts(values))
    alone, _ = evaluate(capsys, llama_folder, write_rows(tmp_path / "test-rows.jsonl", texts(TEST)))
    for split, name, values in (("test", "test", TEST), ("validation", "dev", VALIDATION),
                                (None, "train", TRAIN)):
        got, err = evaluate(capsys, llama_folder, folder, *(["--split", split] if split else []))
        assert got["eval_tokens"] == len(packed(tokenizer, values)) * (BLOCK - 1)
        if split == "test":
            assert (got["eval_tokens"], got["eval_loss"]) == (alone["eval_tokens"], alone["eval_loss"])
        listed = [f"{s}: {n}.jsonl" + ("" if n == name else " (not read)")
                  for s, n in (("train", "train"), ("validation", "dev"), ("test", "test"))]
        assert f"hputrain: splits, by file name: {'; '.join(listed)}\n" in err, err


def test_evaluate_a_dataset_dicts_test_split(tmp_path, llama_folder, capsys):  # noqa: F811
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "dict"
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": values}) for name, values in
                          (("train", TRAIN), ("test", TEST))}).save_to_disk(str(folder))
    got, _ = evaluate(capsys, llama_folder, folder, "--split", "test")
    alone, _ = evaluate(capsys, llama_folder, write_rows(tmp_path / "test-rows.jsonl", texts(TEST)))
    assert (got["eval_tokens"], got["eval_loss"]) == (alone["eval_tokens"], alone["eval_loss"])


@pytest.mark.parametrize("layout, words", [
    ({"train.jsonl": TRAIN}, "has no test split (train: train.jsonl)"),
    ({"one.jsonl": TRAIN}, "has no test split (train: one.jsonl)"),
    ("file", "is one file, the train split: --split test reads a folder's files"),
    ("dict", "has no 'test' split: its DatasetDict holds 'train'"),
])
def test_evaluate_a_split_the_data_set_lacks_is_one_line(tmp_path, llama_folder, capsys,  # noqa: F811
                                                         layout, words):
    folder = tmp_path / "data"
    if layout == "file":
        folder = write_rows(tmp_path / "rows.jsonl", texts(TRAIN))
    elif layout == "dict":
        datasets = pytest.importorskip("datasets")
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TRAIN})}).save_to_disk(str(folder))
    else:
        for name, values in layout.items():
            write_rows(folder / name, texts(values))
    capsys.readouterr()  # datasets' progress bars
    assert main(["evaluate", "--model", str(llama_folder), "--dataset", str(folder), "--split", "test"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


# -- image rows ------------------------------------------------------------------------------------

def test_an_image_folders_splits(tmp_path):
    """An image data folder (train.jsonl and test.jsonl beside the images they name): each split's
    rows are its file's, their image paths relative to it."""
    pytest.importorskip("PIL")
    from hputrain.kinds.vlm.data.rows import split_rows

    from ..vlm_fixtures import image_rows, write_images

    folder = tmp_path / "images-data"
    names = write_images(folder, 6)
    rows = image_rows(10, names)
    write_rows(folder / "train.jsonl", rows[:7])
    write_rows(folder / "test.jsonl", rows[7:])
    for split, expected in (("train", rows[:7]), ("test", rows[7:])):
        read = list(split_rows(str(folder), split, hf_data.records, hf_data.source_files))
        assert [row for _, row, _ in read] == expected
        assert {place for _, _, place in read} == {folder}
    assert hf_data.saved_splits(str(folder)) == ["train", "test"]
