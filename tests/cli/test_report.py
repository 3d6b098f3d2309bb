"""Unit tests for `hputrain report`: reading metrics.jsonl, the series plotted, the PNGs written."""
import argparse
import json
import subprocess
import sys

import pytest

from hputrain.errors import InputError
from hputrain.cli.report import add_report_parser
from hputrain.training.report import read_metrics, series, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train(step, loss, tps=1000.0, **extra):
    return {"step": step, "epoch": 0, "loss": loss, "learning_rate": 1e-3, "grad_norm": 1.0,
            "memory_allocated_gb": 1.0 + step / 100, "max_memory_allocated_gb": 2.0 + step / 100,
            "total_memory_available_gb": 16.0, "tokens_per_second": tps, **extra}


def _records():
    return [
        _train(10, 4.0, tps=None),  # warm-up: no throughput yet
        _train(20, 3.0),
        {"step": 20, "epoch": 0, "eval_loss": 3.2, "eval_perplexity": 24.5},
        _train(30, 9.9, tps=500.0),  # the run died here and was resumed from step 20
        _train(30, 2.5, tps=1500.0, note="after restart"),
        _train(40, 2.0, tps=2000.0),
        {"step": 40, "epoch": 1, "eval_loss": 2.4, "eval_perplexity": 11.0},
        {"step": 40, "train_runtime": 12.5, "train_samples_per_second": 3.2,
         "train_tokens_per_second": 1800.0, "train_steps_per_second": 3.2, "mfu": None},
    ]


def _write(run_dir, records, blank_lines=False):
    run_dir.mkdir(exist_ok=True)
    sep = "\n\n" if blank_lines else "\n"
    (run_dir / "metrics.jsonl").write_text(sep.join(json.dumps(r) for r in records) + "\n")
    return run_dir


def test_read_metrics_skips_blank_lines_and_keeps_order(tmp_path):
    run = _write(tmp_path / "run", _records(), blank_lines=True)
    records = read_metrics(run / "metrics.jsonl")
    assert records == _records()


def test_series_dedups_steps_and_separates_eval_from_train():
    data = series(_records())
    assert data["loss"] == ([10, 20, 30, 40], [4.0, 3.0, 2.5, 2.0])  # step 30: the last record wins
    assert data["eval_loss"] == ([20, 40], [3.2, 2.4])
    assert data["tokens_per_second"] == ([20, 30, 40], [1000.0, 1500.0, 2000.0])  # null dropped
    assert data["memory_allocated_gb"] == ([10, 20, 30, 40], [1.1, 1.2, 1.3, 1.4])
    assert data["max_memory_allocated_gb"][1] == [2.1, 2.2, 2.3, 2.4]
    assert data["total_memory_available_gb"][1] == [16.0] * 4


def test_series_leaves_out_series_without_values():
    records = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "tokens_per_second": None},
               {"step": 2, "train_runtime": 1.0, "mfu": None}, {"unrelated": True}]
    assert series(records) == {"loss": ([1, 2], [3.0, 2.0])}


def test_write_report_writes_three_valid_pngs(tmp_path):
    run = _write(tmp_path / "run-7", _records())
    written = write_report(run)
    assert [p.name for p in written] == ["loss.png", "throughput.png", "memory.png"]
    for path in written:
        assert path.parent == run
        blob = path.read_bytes()
        assert blob.startswith(PNG_MAGIC)
        assert len(blob) > 5_000  # an actual plot, not an empty canvas


def test_no_throughput_values_means_no_throughput_png(tmp_path):
    records = [_train(s, 3.0, tps=None) for s in (1, 2, 3)]
    for r in records[1:]:
        del r["tokens_per_second"]
    run = _write(tmp_path / "run", records)
    assert [p.name for p in write_report(run)] == ["loss.png", "memory.png"]
    assert not (run / "throughput.png").exists()


def test_missing_run_dir_and_missing_metrics(tmp_path):
    with pytest.raises(InputError, match="no such run directory"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="metrics.jsonl: no such file"):
        write_report(tmp_path / "empty")


def test_malformed_line_names_file_and_line_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": \n')
    with pytest.raises(InputError, match=r"metrics\.jsonl:3: not valid JSON"):
        read_metrics(path)
    path.write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n')
    with pytest.raises(InputError, match=r"metrics\.jsonl:2: expected a JSON object"):
        read_metrics(path)


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    run = _write(tmp_path / "run", _records())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(InputError, match=r"pip install matplotlib.*hputrain\[plot\]"):
        write_report(run)


def test_report_subcommand_prints_each_file(tmp_path, capsys):
    run = _write(tmp_path / "run", _records())
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(run)])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [str(run / name) for name in ("loss.png", "throughput.png", "memory.png")]


def test_importing_report_does_not_import_matplotlib():
    code = "import sys, hputrain.training.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_torn_last_line_is_skipped(tmp_path):
    """A run killed while writing a record leaves half a line, without its newline."""
    run = _write(tmp_path / "run", _records())
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "epoch": 1, "lo')
    assert read_metrics(run / "metrics.jsonl") == _records()
    assert [p.name for p in write_report(run)] == ["loss.png", "throughput.png", "memory.png"]


def test_the_cli_reports_a_run_with_a_torn_last_line(tmp_path):
    run = _write(tmp_path / "run", _records())
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "loss": 1.')
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "report", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[0] == str(run / "loss.png")


def test_a_bad_line_that_is_not_the_last_is_still_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}')
    with pytest.raises(InputError, match=r"metrics\.jsonl:2: not valid JSON"):
        read_metrics(path)


def test_a_grpo_run_plots_its_reward_not_its_near_zero_loss(tmp_path):
    """Issue 39, item 8: GRPO's loss is near 0 by construction (a group's advantages sum to 0);
    its report plots the train and eval reward (reward.png) instead."""
    records = [_train(s, 1e-4 * (-1) ** s, reward=0.1 * s) for s in (1, 2, 3)]
    records.append({"step": 3, "epoch": 0, "eval_loss": 0.0, "eval_reward": 0.35})
    run = _write(tmp_path / "grpo", records)
    written = write_report(run)
    assert sorted(p.name for p in written) == ["memory.png", "reward.png", "throughput.png"]
    assert (run / "reward.png").read_bytes().startswith(PNG_MAGIC)
    assert series(records)["reward"] == ([1, 2, 3], [0.1, 0.2, 0.30000000000000004])
    assert series(records)["eval_reward"] == ([3], [0.35])
    plain = write_report(_write(tmp_path / "lm", _records()))  # a run without rewards: its loss
    assert "loss.png" in {p.name for p in plain} and "reward.png" not in {p.name for p in plain}


def test_a_moe_run_plots_its_router_loss_and_load_per_layer(tmp_path):
    """Issue 40: router.png beside the others, with aux_loss, eval_aux_loss and each layer's load
    (layer 10 after layer 9); a run without a router gets none (test above)."""
    router = lambda step, k: {"aux_loss": 2.0 - step / 100, **{  # noqa: E731
        f"router/{name}.layer{layer}": k * (layer + 1) for layer in (0, 9, 10)
        for name in ("max_load", "dead_experts")}}
    records = [_train(10, 4.0, **router(10, 0.1)), _train(20, 3.0, **router(20, 0.2)),
               {"step": 20, "eval_loss": 3.2, "eval_aux_loss": 1.9}]
    data = series(records)
    assert data["aux_loss"] == ([10, 20], [1.9, 1.8]) and data["eval_aux_loss"] == ([20], [1.9])
    assert [n for n in data if n.startswith("router/max_load")] == [
        "router/max_load.layer0", "router/max_load.layer9", "router/max_load.layer10"]
    assert data["router/dead_experts.layer10"] == ([10, 20], [pytest.approx(1.1), pytest.approx(2.2)])
    written = write_report(_write(tmp_path / "moe", records))
    assert [p.name for p in written] == ["loss.png", "throughput.png", "memory.png", "router.png"]
    assert (tmp_path / "moe" / "router.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "moe" / "router.png").stat().st_size > 20_000  # three panels drawn
