"""Unit tests for the byte-level corpus reader and its windows."""

import re

import pytest
import torch

from hputrain.data.batching import (DataError, TokenWindows, load_corpus, read_corpus,
                                    split_windows, stdlib_source_dir)


@pytest.fixture
def text_folder(tmp_path):
    """A folder with text files, a binary file, and directories that must be skipped."""
    (tmp_path / "b.txt").write_text("bravo\n")
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("charlie ü\n")
    (tmp_path / "image.bin").write_bytes(bytes(range(256)))  # contains NUL and invalid UTF-8
    (tmp_path / "nul.txt").write_bytes(b"text\0with nul")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for skipped in ("__pycache__", "site-packages", ".hidden"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.txt").write_text("SKIPPED\n")
    return tmp_path


def test_stdlib_dir_has_os_py():
    directory = stdlib_source_dir()
    assert directory.is_dir()
    assert (directory / "os.py").is_file()


def test_read_corpus_reads_only_text_in_sorted_order(text_folder):
    corpus = read_corpus(text_folder)
    assert corpus == b"alpha\n\nbravo\n\n" + "charlie ü\n".encode()
    assert b"SKIPPED" not in corpus


def test_read_corpus_accepts_a_single_file(text_folder):
    assert read_corpus(text_folder / "b.txt") == b"bravo\n"


def test_read_corpus_max_bytes_truncates_exactly(text_folder):
    assert read_corpus(text_folder, max_bytes=9) == b"alpha\n\nbr"
    assert read_corpus(text_folder, max_bytes=1) == b"a"


def test_default_corpus_is_stdlib_python():
    corpus = read_corpus(max_bytes=200_000)
    assert len(corpus) == 200_000
    assert b"def " in corpus and b"import " in corpus


def test_windows_are_shifted_pairs_of_the_stream():
    tokens = torch.arange(23, dtype=torch.uint8)
    windows = TokenWindows(tokens, seq_len=5)
    assert len(windows) == 4  # (23 - 1) // 5
    for i in range(len(windows)):
        item = windows[i]
        assert item["input_ids"].dtype == torch.long
        assert item["input_ids"].tolist() == list(range(5 * i, 5 * i + 5))
        assert item["labels"].tolist() == list(range(5 * i + 1, 5 * i + 6))
    with pytest.raises(IndexError):
        windows[4]


def test_windows_from_loaded_corpus_match_the_file(tmp_path):
    text = "".join(f"line {i}\n" for i in range(400)).encode()
    (tmp_path / "corpus.txt").write_bytes(text)
    train, val = load_corpus(tmp_path / "corpus.txt", seq_len=16, val_fraction=0.1)
    for dataset in (train, val):
        for i in range(len(dataset)):
            item = dataset[i]
            start = int(dataset.window_ids[i]) * 16
            assert bytes(item["input_ids"].tolist()) == text[start : start + 16]
            assert bytes(item["labels"].tolist()) == text[start + 1 : start + 17]


def test_split_is_deterministic_disjoint_and_non_empty(tmp_path):
    (tmp_path / "corpus.txt").write_text("abcdefghij" * 5000)
    train, val = load_corpus(tmp_path, seq_len=32, val_fraction=0.1)
    again_train, again_val = load_corpus(tmp_path, seq_len=32, val_fraction=0.1)
    assert torch.equal(train.window_ids, again_train.window_ids)
    assert torch.equal(val.window_ids, again_val.window_ids)
    assert len(train) > 0 and len(val) > 0
    train_ids, val_ids = set(train.window_ids.tolist()), set(val.window_ids.tolist())
    assert not train_ids & val_ids
    assert train_ids | val_ids == set(range((50_000 - 1) // 32))
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15


def test_split_spreads_validation_along_the_stream():
    train, val = split_windows(32 * 100, val_fraction=0.05)
    assert len(val) == 32 * 5
    assert val.min() < 32 * 20 and val.max() >= 32 * 99  # not one lump at the end


def test_split_of_two_windows_gives_one_each():
    train, val = split_windows(2, val_fraction=0.05)
    assert train.tolist() == [0] and val.tolist() == [1]


def test_missing_path_raises(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match="does not exist") as info:
        read_corpus(missing)
    assert str(missing) in str(info.value)


def test_folder_without_text_raises(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match="no readable text files") as info:
        read_corpus(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_empty_folder_raises(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path))):
        load_corpus(tmp_path)


def test_corpus_too_small_raises(tmp_path):
    (tmp_path / "short.txt").write_text("x" * 40)
    with pytest.raises(DataError, match="too small") as info:
        load_corpus(tmp_path, seq_len=32)
    assert str(tmp_path) in str(info.value)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


READ_IN_A_CHILD = ("import sys; from hputrain.data.batching import read_corpus\n"
                   "try:\n    sys.stdout.buffer.write(read_corpus(sys.argv[1]))\n"
                   "except ValueError as exc:\n    print(exc, file=sys.stderr); sys.exit(2)")


def read_in_a_child(path):
    """read_corpus(path) in a child process, so that a hang fails the test instead of blocking it."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", READ_IN_A_CHILD, str(path)], capture_output=True,
                          timeout=60)


def test_fifos_in_a_corpus_folder_are_skipped_not_waited_on(tmp_path):
    import os

    (tmp_path / "a.txt").write_text("alpha\n")
    os.mkfifo(tmp_path / "b.txt")  # no writer: opening it to read would wait for ever
    (tmp_path / "c.txt").symlink_to(tmp_path / "b.txt")
    (tmp_path / "d.txt").write_text("delta\n")
    proc = read_in_a_child(tmp_path)
    assert proc.returncode == 0 and proc.stdout == b"alpha\n\ndelta\n", proc.stderr


def test_a_fifo_as_the_corpus_path_is_one_line(tmp_path):
    import os

    os.mkfifo(tmp_path / "corpus.txt")
    proc = read_in_a_child(tmp_path / "corpus.txt")
    assert proc.returncode == 2 and b"neither a regular file nor a folder" in proc.stderr
    assert proc.stderr.count(b"\n") == 1


def test_reading_opens_a_fifo_without_waiting(tmp_path):
    """The check made when a file is opened (it may have become a FIFO since the walk)."""
    import os
    import subprocess
    import sys

    os.mkfifo(tmp_path / "late.txt")
    code = "import sys; from hputrain.data.batching import _read_text_file; print(_read_text_file(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "late.txt")],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout == "None\n", proc.stderr  # returned: no writer needed
