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


def test_a_run_resumed_from_a_checkpoint_supersedes_the_later_records(tmp_path):
    """Issue 47 item 16: a run resumed from checkpoint-10 after one that logged up to step 14
    (then failed) never logs a step twice: the records of steps 11 to 14 (an evaluation's too)
    move, in their order, to metrics.superseded.jsonl, whole; those up to step 10, a record
    without a step and the torn last line's cut are as before; a second resume from the same
    checkpoint moves its own later records after them. Nothing else is left in the folder."""
    path, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.superseded.jsonl"
    logged = [{"step": s, "loss": 1 / s} for s in range(1, 15)]
    logged.insert(12, {"step": 12, "eval_loss": 0.5})
    logged.insert(3, {"note": "no step"})
    path.write_text("".join(json.dumps(r) + "\n" for r in logged) + '{"step": 15, "lo')
    sink = MetricsFile(tmp_path)
    sink.open(10)
    sink.write({"step": 11, "loss": 0.25})
    sink.close()
    kept = [r for r in logged if r.get("step", 0) <= 10]
    assert records(path) == kept + [{"step": 11, "loss": 0.25}]
    assert records(aside) == [r for r in logged if r.get("step", 0) > 10]
    sink.open(10)
    sink.close()
    assert records(path) == kept
    assert records(aside) == [r for r in logged if r.get("step", 0) > 10] + [{"step": 11, "loss": 0.25}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "metrics.superseded.jsonl"]


def test_a_run_from_its_start_or_its_last_step_moves_nothing(tmp_path):
    """open() without a step (a run's own writer), or at the last step logged, leaves the file
    as it was (no rewrite: the same inode)."""
    (tmp_path / "metrics.jsonl").write_text(WHOLE)
    inode = (tmp_path / "metrics.jsonl").stat().st_ino
    for start in (None, 2, 7):
        sink = MetricsFile(tmp_path)
        sink.open(start)
        sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == WHOLE
    assert (tmp_path / "metrics.jsonl").stat().st_ino == inode
    assert not (tmp_path / "metrics.superseded.jsonl").exists()
