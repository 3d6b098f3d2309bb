"""Issue 32: GRPO in lazy mode on the CPU (torch's lazy backend, the rehearsal of Gaudi's). The
references: the same run in eager mode, and the lazy backend's own compile counter.

The rollout is fixed (the trainer's `complete` hook), so that both runs train on the same rows:
left-padded prompts of several lengths, whose padding attends to nothing (the NaN that lazy mode
had there came from the lazy backend's composed attention: accelerators/cpu_lazy.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hputrain.callbacks import Callback

from ...hf_fixtures import lazy_rehearses_hf_models, tiny_llama_folder

transformers = pytest.importorskip("transformers", reason="GRPO fine-tunes Hugging Face models")

from hputrain import GRPOConfig, GRPOTrainer  # noqa: E402

PROMPTS = ["the quick brown fox", "to be", "a stitch in time saves nine", "def"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("grpo_lazy") / "llama", seed=0)


def fixed_completions(vocab: int, eos: int, width: int):
    """Completions that depend only on the generation, the prompt and the row: of several lengths
    (some end with eos, some run to `width`), different within a group so that advantages are
    not all zero."""
    def complete(generation: int, prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for row, prompt in enumerate(prompts):
            start = (sum(prompt) + 37 * generation + 11 * row) % vocab
            tokens = [4 + (start + 13 * j) % (vocab - 4) for j in range(width)]
            length = 2 + (row + generation) % width
            out.append(tokens[:length - 1] + [eos] if length < width else tokens)
        return out
    return complete


def tens(prompts, completions, completion_ids, **columns):
    """The share of completion tokens whose id is a multiple of ten."""
    return [sum(t % 10 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class Compiles(Callback):
    """The lazy backend's graphs compiled so far at each step's logging record (after its reads;
    the run's summary record, after the model is handed back, is left out)."""

    def __init__(self) -> None:
        self.at_log: list[int] = []

    def on_log(self, trainer, record: dict) -> None:
        if "graph_compiles" not in record:
            self.at_log.append(trainer.accelerator.graph_compiles())


def run(folder: Path, out: Path, mode: str, callbacks=(), **overrides) -> list[dict]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    values = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=6, learning_rate=3e-2, max_steps=5, logging_steps=1,
                  disable_tqdm=True, save_steps=0, report_to=[], seed=0, execution_mode=mode,
                  throughput_warmup_steps=2, prompt_buckets=[16])
    args = GRPOConfig(**(values | overrides))
    complete = fixed_completions(len(tokenizer), tokenizer.eos_token_id, args.max_completion_length)
    trainer = GRPOTrainer(model, args, reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS],
                          processing_class=tokenizer, complete=complete, callbacks=list(callbacks))
    trainer.train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@lazy_rehearses_hf_models
@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no_reference", "reference"])
def test_lazy_mode_trains_as_eager_and_compiles_nothing_after_warm_up(folder, tmp_path, beta):
    """Per-step losses (and the loss's metrics) equal eager mode's within 1e-4; after the warm-up
    no graph is compiled, in a step or between steps (the rollouts, the logging reads). The
    warm-up is two steps, as for every lazy run: the first rollout and step, and the second step,
    the first whose optimizer finds its state on the device."""
    eager = run(folder, tmp_path / "eager", "eager", beta=beta)
    compiles = Compiles()
    lazy = run(folder, tmp_path / "lazy", "lazy", callbacks=[compiles], beta=beta)
    steps = [r for r in eager if "loss" in r and "train_runtime" not in r]
    lazy_steps = [r for r in lazy if "loss" in r and "train_runtime" not in r]
    assert [r["step"] for r in lazy_steps] == [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert len({r["loss"] for r in steps}) > 1  # the rows train something
    names = ["loss", "entropy", "reward", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    for ours, theirs in zip(lazy_steps, steps):
        for name in names:
            assert ours[name] == pytest.approx(theirs[name], abs=1e-4), (name, ours, theirs)
    summary = lazy[-1]
    assert summary["graph_compiles"] > 0  # lazy mode really ran
    assert summary["graph_compiles_after_warmup"] == 0
    warm = compiles.at_log[1]  # after step 2's record; the rollouts that follow compile nothing
    assert len(compiles.at_log) == 5 and compiles.at_log[2:] == [warm] * 3, compiles.at_log


@lazy_rehearses_hf_models
def test_sampling_noise_on_the_lazy_device_is_a_cpu_generators_draws():
    """The CPU's lazy backend has no generators: a CPU one's draws, copied over, are what eager
    mode draws from the same seed (so rollouts and resumes repeat)."""
    from hputrain.accelerators.cpu import _start_lazy_backend
    from hputrain.execution.generation import uniform_noise

    _start_lazy_backend()
    like = torch.zeros(3, 5, device="lazy")
    drawn = uniform_noise(3, like, torch.Generator().manual_seed(7))
    eager = uniform_noise(3, torch.zeros(3, 5), torch.Generator().manual_seed(7))
    assert drawn.device.type == "lazy" and drawn.shape == (3, 1)
    assert torch.equal(drawn.cpu(), eager)
    assert torch.equal(eager, 1 - torch.empty(3, 1).uniform_(generator=torch.Generator().manual_seed(7)))


@pytest.mark.parametrize("mode", ["eager", pytest.param("lazy", marks=lazy_rehearses_hf_models)])
@pytest.mark.parametrize("lora", [False, True], ids=["frozen_copy", "lora"])
def test_in_bf16_the_old_and_reference_log_probs_are_the_training_forwards_at_step_1(
        folder, tmp_path, monkeypatch, mode, lora):
    """Issue 39 item 3: under bf16-mixed the rollout's old-policy and reference log-probs are
    computed as the training forward computes its own (autocast, the lazy backend's context, the
    reference in the policy's dtype, as TRL loads it): at step 1 nothing has changed the weights,
    so the log-ratio the loss clips and the KL's log-ratio are exactly 0 (they were 1.4e-3 and
    2e-3 in eager mode, when those passes ran outside autocast)."""
    import hputrain.methods.grpo.trainer as grpo

    seen = []

    def spy(logps, old, ref, *args, **kwargs):
        if not seen:  # step 1's micro-batch, as the training forward sees it
            seen.append((logps.detach() - old, logps.detach() - ref))
        return grpo_loss(logps, old, ref, *args, **kwargs)

    grpo_loss = grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", spy)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    if lora:  # the reference is the policy with its adapters disabled
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, max_steps=1, disable_tqdm=True, save_steps=0,
                      report_to=[], seed=0, execution_mode=mode, prompt_buckets=[16], bf16=True,
                      num_iterations=2, beta=0.04)  # old log-probs, and a reference
    trainer = GRPOTrainer(model, args, reward_funcs=[tens],
                          train_dataset=[{"prompt": p} for p in PROMPTS], processing_class=tokenizer,
                          complete=fixed_completions(len(tokenizer), tokenizer.eos_token_id, 6))
    assert trainer.precision.compute_dtype == torch.bfloat16
    trainer.train()
    (to_old, to_reference), = seen
    assert torch.equal(to_old.cpu(), torch.zeros(4, 6)), to_old.abs().max()
    assert torch.equal(to_reference.cpu(), torch.zeros(4, 6)), to_reference.abs().max()
