"""Packed image blocks in lazy and compile modes (issue 41, item 4): LLaVA, Gemma 3 and
Qwen2.5-VL trained by hputrain's Trainer on blocks whose image counts and image positions differ
every step (K=2 slots, padded with blank images, the batch's real images first) compile their
graphs in the warm-up steps and none after, and read nothing back to the host inside a step: the
static image merge (kinds/vlm/execution.py) and the device-built masks (training/packed.py) hold the
step's graph fixed."""
import copy
from pathlib import Path

import pytest
import torch

from hputrain import Callback, Trainer, TrainingArguments
from hputrain.accelerators.cpu_lazy import HostReads
from hputrain.rehearsal import doctor

from ...hf_fixtures import lazy_rehearses_hf_models
from ...kinds.moe.test_moe_modes import DynamoGraphs, lazy
from ...kinds.vlm.test_vlm_forward import TEXTS, Family, block, collate, images
from ...vlm_fixtures import FAMILIES, image_data, vlm_folders  # noqa: F401

transformers = pytest.importorskip("transformers")

STEPS, WARMUP, BATCH = 6, 2, 2
SCRIPT = Path(__file__).parents[2] / "doctor_scripts" / "vlm.py"
PAIRS = [(1, 0), (0, 2), (1, 1), (0, 0), (2, 0), (0, 1), (1, 0), (0, 0), (1, 1), (0, 2), (2, 0), (0, 1)]
"""Images of the two examples of each block: 0 to 2 a block, at places that change every step."""


def blocks(family: Family) -> list[dict]:
    """A block of two examples per PAIRS entry, every block the same length."""
    pairs = [[family.encode(*TEXTS[(2 * i + j) % len(TEXTS)], images(family.family, count, seed=2 * i + j))
              for j, count in enumerate(pair)] for i, pair in enumerate(PAIRS)]
    size = max(sum(e["input_ids"].shape[1] for e in p) for p in pairs) + 2
    return [block(family, family.model, p, size) for p in pairs]


class StepReads(Callback):
    """Counts reads of lazy tensors back to the host inside each optimizer step (HostReads)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads, self.per_step = reads, []

    def on_step_begin(self, trainer) -> None:
        self.reads.in_step, self._before = True, self.reads.count

    def on_step_end(self, trainer) -> None:
        self.reads.in_step = False
        self.per_step.append(self.reads.count - self._before)


def train(family: str, folder, tmp_path, mode: str, callbacks=()) -> dict:
    f = Family(family, folder)
    data = blocks(f)
    counts = [[int(b["image_count"]) for b in data[i:i + BATCH]] for i in range(0, len(data), BATCH)]
    places = {tuple(torch.cat([b["input_ids"] for b in data[i:i + BATCH]]).eq(f.image_token).nonzero()[:, 0].tolist())
              for i in range(0, len(data), BATCH)}
    assert len({tuple(c) for c in counts}) > 2 and len(places) >= STEPS - 1  # the images move
    args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=STEPS, logging_steps=STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3, save_steps=0,
                             disable_tqdm=True, execution_mode=mode, accelerator="cpu", seed=0,
                             throughput_warmup_steps=WARMUP, report_to="none",
                             remove_unused_columns=False)  # the collator reads image_count
    trainer = Trainer(copy.deepcopy(f.model), args, train_dataset=data, data_collator=collate,
                      callbacks=list(callbacks))
    return trainer.train().metrics


@lazy_rehearses_hf_models
@pytest.mark.parametrize("family", FAMILIES)
def test_lazy_mode_compiles_nothing_after_warmup(family, vlm_folders, tmp_path):  # noqa: F811
    """CPU lazy mode (torch._lazy): graphs in the warm-up steps only, and no value of the lazy
    device read back to the host inside a step, though each step's images differ."""
    reads = HostReads(locate=lambda name: name)
    watch = StepReads(reads)
    with reads:
        metrics = train(family, vlm_folders(family), tmp_path, "lazy", [watch])
    assert metrics["graph_compiles"] > 0 and metrics["graph_compiles_after_warmup"] == 0, metrics
    assert watch.per_step == [0] * STEPS, reads.where


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compile_mode_compiles_nothing_after_warmup(family, vlm_folders, tmp_path):  # noqa: F811
    """torch.compile (inductor on the CPU): the step's graphs are made in the warm-up steps, none
    after."""
    graphs = DynamoGraphs()
    train(family, vlm_folders(family), tmp_path, "compile", [graphs])
    assert sum(graphs.per_step[:WARMUP]) > 0 and graphs.per_step[WARMUP:] == [0] * (STEPS - WARMUP)


@lazy_rehearses_hf_models
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "qwen2_5_vl" else pytest.mark.slow)
                                    for f in FAMILIES])
def test_doctor_finds_nothing_in_packed_image_blocks(family, vlm_folders, image_data, tmp_path,  # noqa: F811
                                                     monkeypatch):
    """`hputrain doctor --steps 6 vlm.py FOLDER DATA`: the image data path's blocks (buckets,
    slots, the real-first collator) through the Trainer: no recompilation after warm-up and no
    host read; eager ops, if any, are the CPU lazy backend's own."""
    folder = vlm_folders(family)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")  # run() sets it; put back afterwards
    report = doctor.run(str(SCRIPT), [str(folder), str(image_data("messages"))], steps=STEPS, warmup=WARMUP)
    assert [f for f in report["findings"] if f["kind"] != "fallback"] == [], report["findings"]
    assert report["compiles_per_step"][WARMUP:] == [0] * (STEPS - WARMUP)
    assert report["host_syncs_per_step"] == [0] * STEPS


# -- the CPU lazy backend's routes for the vision-language forward -----------------------------------

def test_lazy_masked_scatter_and_indexing_by_rows():
    """masked_scatter (the image merge) and `tensor[index, :, :]` (Qwen's window order) on the lazy
    device equal eager, gradients included: a source longer than the mask needs (padding image
    slots) leaves its tail unread."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 5, 3, generator=g, requires_grad=True)
    features = torch.randn(6, 3, generator=g, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)[..., None]

    def merged(e, f, m):
        return e.masked_scatter(m, f)

    expected = merged(embeds, features, mask)
    (grad_e, grad_f) = torch.autograd.grad(expected.square().sum(), (embeds, features))
    got = lazy(lambda e, f, m: merged(e, f, m), embeds, features, mask).cpu()
    assert torch.equal(got, expected.detach())
    e, f = (t.detach().requires_grad_() for t in (embeds, features))
    out = lazy(lambda e_, f_, m: merged(e_, f_, m), e, f, mask)
    out.square().sum().backward()
    torch._lazy.mark_step()
    assert torch.allclose(e.grad.cpu(), grad_e) and torch.allclose(f.grad.cpu(), grad_f)
    assert f.grad[4:].abs().sum() == 0
    hidden = torch.randn(4, 2, 3, generator=g)
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(lazy(lambda h, i: h[i, :, :], hidden, order).cpu(), hidden[order])
