"""metrics.jsonl across a kill: a resumed run appends on a fresh line, whatever the killed run
left unfinished, so every line of the file is one whole record."""
import json

import pytest

from hputrain.errors import InputError
from hputrain.callbacks.writers import MetricsFile, open_jsonl

WHOLE = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def append(folder, record):
    sink = MetricsFile(folder)
    sink.open()
    sink.write(record)
    sink.close()


@pytest.mark.parametrize("tail, kept", [
    ("", []),                                          # ended cleanly
    ('{"step": 3, "lo', []),                           # torn mid-record: cut
    ('{"step": 3, "loss": 1.25}', [{"step": 3, "loss": 1.25}]),  # whole, only its newline lost
    ('{"step": 3, "note": "' + "x" * 70_000, []),      # torn, longer than one read-back chunk
])
def test_a_resumed_run_starts_on_a_fresh_line(tmp_path, tail, kept):
    (tmp_path / "metrics.jsonl").write_text(WHOLE + tail)
    append(tmp_path, {"step": 4, "loss": 1.0})
    assert records(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, *kept, {"step": 4, "loss": 1.0}]


def test_a_file_that_is_one_torn_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo')
    append(tmp_path, {"step": 1, "loss": 3.0})
    assert records(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 3.0}]


def test_an_output_dir_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="Not a directory") as err:
        open_jsonl(tmp_path / "file" / "out" / "metrics.jsonl")
    assert "\n" not in str(err.value) and str(tmp_path / "file") in str(err.value)


def test_nan_and_infinities_are_written_as_null(tmp_path):
    """Issue 39 item 7: JSON has no NaN nor Infinity; Python's json writes them bare, and strict
    readers (JSON.parse, jq, Go, serde) refuse the line. metrics.jsonl writes null instead."""
    append(tmp_path, {"step": 1, "reward": float("nan"), "kl": float("inf"),
                      "nested": {"values": [1.5, float("-inf")]}, "name": "x"})
    line = (tmp_path / "metrics.jsonl").read_text()
    strict = json.loads(line, parse_constant=lambda word: pytest.fail(f"{word} in {line}"))
    assert strict == {"step": 1, "reward": None, "kl": None, "nested": {"values": [1.5, None]},
                      "name": "x"}
