"""Issue 26: what `hputrain plan` suggests, and the traces behind it: the same plan traced again
gives the same figure (the suggestions are traced after the plan, in the same process), the
suggestions come cheapest first, cpu offload leaves the model state in host memory and is offered
only where the device has a host to offload to."""
from __future__ import annotations

from pathlib import Path

import pytest

from hputrain.accelerators import detect_accelerator
from hputrain.rehearsal.plan import _changes, plan, trace_step

from ...hf_fixtures import llama_config_folder
from ...plan_step_script import settings

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return llama_config_folder(tmp_path_factory.mktemp("llama-config"), vocab_size=2048,
                               hidden_size=128, intermediate_size=352, layers=2, heads=4)


def flags_of(llama: Path, *more: str) -> list[str]:
    return ["--model", str(llama), "--block-size", "128", "--per-device-train-batch-size", "4",
            *more]


def traced(flags: list[str], backend: str | None = None):
    step, args = settings(flags)
    return trace_step(step, args, detect_accelerator("cpu", "eager"), backend=backend)


def test_a_plan_traced_twice_in_one_process_gives_the_same_peak(llama):
    """DTensor propagates an operation's sharding once and caches it; the first propagation ran
    on placeholders in the plan's fake mode and was counted as memory (the first trace of bf16
    fsdp with checkpointing came out 19% above every later one)."""
    flags = flags_of(llama, "--precision", "bf16-mixed", "--strategy", "fsdp", "--devices", "2",
                     "--gradient-checkpointing")
    first, again = traced(flags), traced(flags)
    assert first.peak_bytes == again.peak_bytes and first.breakdown == again.breakdown


def test_gloo_counts_the_copy_it_reduces_in(llama):
    """On short sequences with checkpointing the peak is the root's reduce-scatter at the end of
    backward (as in the measured 2-process step of test_plan_accuracy.py), where Gloo adds a
    copy of its input."""
    flags = ["--model", str(llama), "--block-size", "32", "--per-device-train-batch-size", "1",
             "--precision", "bf16-mixed", "--strategy", "fsdp", "--devices", "2",
             "--gradient-checkpointing"]
    native, gloo = traced(flags), traced(flags, backend="gloo")
    assert gloo.peak_bytes > native.peak_bytes
    assert gloo.breakdown["optimizer"] == native.breakdown["optimizer"]


def test_cpu_offload_leaves_the_model_state_in_host_memory(llama):
    flags = flags_of(llama, "--precision", "bf16-mixed", "--strategy", "fsdp", "--devices", "2")
    on_device, offloaded = traced(flags), traced([*flags, "--fsdp-cpu-offload"])
    assert on_device.breakdown["optimizer"] > 0 and offloaded.breakdown["optimizer"] == 0
    # the host holds this rank's fp32 shards, their gradients and AdamW's two moments: 4x them
    assert on_device.host_bytes == 0
    assert offloaded.host_bytes == pytest.approx(2 * on_device.breakdown["optimizer"], rel=0.01)
    # what the device still holds: the block being computed, gathered, and the activations
    assert offloaded.peak_bytes < on_device.peak_bytes - on_device.breakdown["optimizer"]
    assert offloaded.breakdown["activations"] == on_device.breakdown["activations"]


def test_offload_is_offered_only_where_the_device_has_a_host(llama):
    step, args = settings(flags_of(llama, "--strategy", "fsdp", "--devices", "2"))
    offered = lambda offload: [f for _, f in _changes(step, args, offload)]  # noqa: E731
    assert ["--strategy", "fsdp", "--fsdp-cpu-offload"] in offered(True)
    assert all("--fsdp-cpu-offload" not in f for f in offered(False))
    step, args = settings(flags_of(llama))  # one device: nothing to shard, nothing to offload
    assert all("--fsdp-cpu-offload" not in f for f in offered(True))


def test_the_suggestions_come_cheapest_first_and_each_is_traced(llama):
    """Two devices under ddp, short sequences (the model state is most of the peak), on a device
    25% too small: sharding over the same two devices is the cheapest change (the same training,
    no device more) and fits; every suggestion carries its own traced peak, the fitting ones
    first, in order of cost."""
    flags = ["--model", str(llama), "--block-size", "32", "--per-device-train-batch-size", "2",
             "--precision", "fp32", "--strategy", "ddp", "--devices", "2"]
    step, args = settings(flags)
    whole = trace_step(step, args, detect_accelerator("cpu", "eager"), backend="hccl")
    tight = int(whole.peak_bytes * 0.75)
    result = plan(step, args, "gaudi2", tight, accelerator=detect_accelerator("cpu", "eager"))
    assert not result.fits and result.peak_bytes == whole.peak_bytes
    fitting = [s for s in result.suggestions if s["fits"]]
    assert fitting[0]["flags"] == ["--strategy", "fsdp"]
    assert all(s["peak_bytes"] <= tight for s in fitting)
    assert all(s["peak_bytes"] > tight for s in result.suggestions if not s["fits"])
    costs = [f for _, f in _changes(step, args, offload=True)]
    order = [costs.index(s["flags"]) for s in fitting]
    assert order == sorted(order)
    assert result.suggestions[:len(fitting)] == fitting
