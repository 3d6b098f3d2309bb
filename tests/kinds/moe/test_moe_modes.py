"""Mixture-of-experts models in lazy and compile modes (issue 40, item 4): with hputrain's
static-shape experts, no graph is compiled after warm-up in either mode, for every family, across
steps whose routing differs; `hputrain doctor` finds nothing on them, and on transformers' own
experts ("eager", "grouped_mm") explains the recompilations as routing-dependent shapes and names
the fix. Also the CPU lazy backend's routes that let transformers' experts run lazily at all."""
import copy
import sys
from pathlib import Path

import pytest
import torch

from hputrain import Callback, Trainer, TrainingArguments
from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.accelerators.cpu_lazy import HostReads, LazyBackendGaps
from hputrain.rehearsal import doctor
from hputrain.kinds.moe.doctor import ExpertsSeen
from hputrain.rehearsal.findings import SyncSite, diagnose

from ...hf_fixtures import lazy_rehearses_hf_models
from ...moe_fixtures import FAMILIES, mixtral_folder, moe_folders  # noqa: F401

transformers = pytest.importorskip("transformers")
experts = pytest.importorskip("hputrain.kinds.moe.experts")

SCRIPT = Path(__file__).parents[2] / "doctor_scripts" / "moe.py"
FAST = ("mixtral",)  # the rest of the families run in the slow tier
STEPS, WARMUP = 6, 2


def tiered(families=FAMILIES, fast=FAST):
    return [pytest.param(f, marks=() if f in fast else pytest.mark.slow) for f in families]


def rows(vocab: int, n: int = 2 * STEPS, length: int = 32) -> list[dict]:
    """One batch shape for the whole run: only the routing changes from step to step."""
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, vocab, (n, length), generator=g)]


def load(folder: Path):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(folder)


def routings(model, data: list[dict], batch: int = 2) -> list[list[int]]:
    """The tokens each expert gets in each batch (first MoE layer), in eager mode on a copy of the
    model with the static experts: the steps' routings, to show that they differ."""
    model = copy.deepcopy(model)
    experts.use_static_experts(model, None)
    seen = []
    routed = experts.route

    def route(top_k_index, num_experts):
        routing = routed(top_k_index, num_experts)
        seen.append(routing.counts.tolist())
        return routing

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(sys.modules["hputrain.kinds.moe.experts.forward"], "route", route)
        patch.setattr(sys.modules["hputrain.kinds.moe.experts.llama4"], "route", route)
        counts = []
        for start in range(0, len(data), batch):
            seen.clear()
            model(input_ids=torch.stack([r["input_ids"] for r in data[start:start + batch]]))
            counts.append(seen[0])
    return counts


class DynamoGraphs(Callback):
    """Graphs torch.compile made inside each optimizer step (dynamo's count of unique graphs)."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        # dynamo keeps what it compiled for the process: a test that compiled the same forward
        # earlier in the session (the whole slow suite in one process) would leave this run's
        # warm-up nothing to compile
        torch._dynamo.reset()

    @staticmethod
    def _graphs() -> int:
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]

    def on_step_begin(self, trainer) -> None:
        self._before = self._graphs()

    def on_step_end(self, trainer) -> None:
        self.per_step.append(self._graphs() - self._before)


def train(folder: Path, tmp_path: Path, mode: str, callbacks=()):
    model = load(folder)
    data = rows(model.config.vocab_size)
    assert len({tuple(c) for c in routings(model, data)}) == STEPS  # a new routing every step
    args = TrainingArguments(output_dir=str(tmp_path / mode), max_steps=STEPS, logging_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-3, save_steps=0,
                             disable_tqdm=True, execution_mode=mode, accelerator="cpu",
                             throughput_warmup_steps=WARMUP, report_to="none")
    trainer = Trainer(model, args, train_dataset=data, callbacks=list(callbacks))
    out = trainer.train()
    assert any(name.startswith("experts:") for name in trainer.kernels), trainer.kernels
    return out.metrics


@lazy_rehearses_hf_models
@pytest.mark.parametrize("family", tiered())
def test_lazy_mode_compiles_nothing_after_warmup(family, moe_folders, tmp_path):  # noqa: F811
    """hputrain's static experts (selected by fused_kernels "auto") on the CPU's lazy backend, the
    router's loss trained and its metrics logged every 2 steps, as MoE fine-tuning runs: graphs in
    the first steps, none after warm-up, though every step routes differently."""
    metrics = train(moe_folders(family, output_router_logits=True), tmp_path, "lazy")
    assert metrics["graph_compiles"] > 0 and metrics["graph_compiles_after_warmup"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compile_mode_compiles_nothing_after_warmup(family, moe_folders, tmp_path):  # noqa: F811
    """torch.compile with the accelerator's backend (inductor on the CPU): the step's graphs are
    made in the warm-up steps, none after, though every step routes differently."""
    graphs = DynamoGraphs()
    train(moe_folders(family), tmp_path, "compile", callbacks=[graphs])
    assert sum(graphs.per_step[:WARMUP]) > 0 and graphs.per_step[WARMUP:] == [0] * (STEPS - WARMUP)


# -- hputrain doctor --------------------------------------------------------------------------------

def rehearse(folder: Path, tmp_path, monkeypatch, *implementation: str) -> dict:
    """`hputrain doctor --steps 6 moe.py FOLDER [IMPLEMENTATION]`, in this process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")  # run() sets it; put back afterwards
    return doctor.run(str(SCRIPT), [str(folder), *implementation], steps=STEPS, warmup=WARMUP)


def recompilations(report: dict) -> list[str]:
    return [f["message"] for f in report["findings"] if f["kind"] == "recompilation"]


@lazy_rehearses_hf_models
@pytest.mark.parametrize("family", tiered(fast=()))
def test_doctor_finds_nothing_in_static_experts(family, moe_folders, tmp_path, monkeypatch):  # noqa: F811
    """No recompilation, no host read; eager ops, if any, outside the experts (DeepSeek-V3's
    attention copies into slices of its keys, which the CPU's lazy backend runs eagerly)."""
    report = rehearse(moe_folders(family), tmp_path, monkeypatch)
    assert [f for f in report["findings"] if f["kind"] != "fallback"] == [], report["findings"]
    assert report["compiles_per_step"][WARMUP:] == [0] * (STEPS - WARMUP)
    assert not any(seen["fallbacks"] or seen["host_reads"] for seen in report["experts"])


@lazy_rehearses_hf_models
@pytest.mark.parametrize("implementation", [
    "eager", pytest.param("grouped_mm", marks=pytest.mark.slow)])
def test_doctor_explains_transformers_experts(implementation, mixtral_folder, tmp_path, monkeypatch):  # noqa: F811
    """transformers' own experts size their work by the routing: graphs after warm-up at every
    step, explained in one finding (what in the experts does it, and the fix), which stands for
    the generic "something other than the shapes" finding; the reads it makes are left to it."""
    report = rehearse(mixtral_folder, tmp_path, monkeypatch, implementation)
    assert all(report["compiles_per_step"][WARMUP:])
    [message] = recompilations(report)
    assert message.startswith("the experts' shapes follow the routing: MixtralExperts "
                              f'(experts_implementation="{implementation}": ')
    assert f"step(s) {list(range(WARMUP + 1, STEPS + 1))} compiled" in message
    assert f'experts_implementation="{experts.NAME}"' in message and "fused_kernels on" in message
    read = {"eager": "transformers/models/mixtral/modeling_mixtral.py",
            "grouped_mm": "transformers/integrations/moe.py"}[implementation]
    assert f"read back to the host {sum(report['host_syncs_per_step'])}x, at {read}" in message
    [syncs] = [f["message"] for f in report["findings"] if f["kind"] == "host_sync"]
    assert "see the recompilation finding for the experts" in syncs
    [seen] = report["experts"]
    assert seen["name"] == "MixtralExperts" and seen["implementation"] == implementation
    fallbacks = next((f["message"] for f in report["findings"] if f["kind"] == "fallback"), "")
    assert not any(f"{op} (" in fallbacks for op in seen["fallbacks"])  # told in the experts' finding


def test_diagnose_without_experts_keeps_the_generic_finding():
    """The control of the test above, on records alone: a step compiling again for a known batch
    shape is the generic finding unless experts whose shapes follow the routing explain it."""
    records = [{"step": i + 1, "compiles": c, "host_syncs": 1, "fallbacks": {"nonzero": 2, "sort": 1},
                "shapes": {"input_ids": [2, 32]}, "attention_mask": None}
               for i, c in enumerate([9, 5, 3, 3])]
    site = SyncSite("tolist", "moe.py:29", "transformers/integrations/moe.py:379", "_grouped_mm")
    reads = HostReads(locate=None)
    reads.where[site] = 4
    plain = diagnose(records, 2, reads)
    assert "Make it a tensor" in recompilations(plain)[0]
    seen = ExpertsSeen("MixtralExperts", "grouped_mm", {"nonzero": 8}, {site: 4})
    static = ExpertsSeen("MixtralExperts", experts.NAME)
    assert diagnose(records, 2, reads, experts=[static])["findings"] == plain["findings"]
    explained = diagnose(records, 2, reads, experts=[seen])
    [message] = recompilations(explained)
    assert "step(s) [3, 4] compiled [3, 3] new graphs" in message and "nonzero (8x)" in message
    fallback = [f["message"] for f in explained["findings"] if f["kind"] == "fallback"]
    assert fallback and "sort (4x)" in fallback[0] and "nonzero (" not in fallback[0]


# -- the CPU lazy backend's routes for transformers' experts ----------------------------------------

def lazy(fn, *args):
    """`fn` on the lazy device under LazyBackendGaps, its result brought back."""
    device = CPUAccelerator("lazy").setup()
    with LazyBackendGaps():
        out = fn(*(a.to(device) for a in args))
    torch._lazy.mark_step()
    return out


def test_where_on_a_condition_indexes_like_eager():
    """`torch.where(mask)` hands back nonzero's columns; unbound by the backend, the next op (an
    embedding lookup of the integer indexing route) met a tensor it had lost track of."""
    g = torch.Generator().manual_seed(0)
    mask, x = torch.rand(5, 3, generator=g) > 0.5, torch.randn(3, 4, generator=g)
    rows, cols = torch.where(mask)
    by_where = lazy(lambda m, x: [t.cpu() for t in (*torch.where(m), x[torch.where(m)[1]])], mask, x)
    by_nonzero = lazy(lambda m, x: x[m.nonzero(as_tuple=True)[1]].cpu(), mask, x)
    for got, want in zip([*by_where, by_nonzero], [rows, cols, x[cols], x[cols]]):
        torch.testing.assert_close(got, want)


def test_histc_counts_integers_and_grouped_mm_runs_per_group():
    """transformers' grouped_mm experts on the lazy device: histc of int32 expert numbers (no
    integer kernel on the CPU) and torch's grouped_mm (no lazy kernel), each as eager computes it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (12,), generator=g, dtype=torch.int32)
    counts = lazy(lambda i: torch.histc(i, bins=4, min=0, max=3).cpu(), ids)
    assert counts.dtype == torch.int32 and counts.tolist() == torch.bincount(ids, minlength=4).tolist()
    x, w = torch.randn(12, 5, generator=g), torch.randn(4, 5, 3, generator=g)
    offsets = torch.tensor([3, 3, 9, 12], dtype=torch.int32)
    want = torch.cat([x[0:3] @ w[0], x[3:9] @ w[2], x[9:12] @ w[3]])
    kernel = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    torch.testing.assert_close(lazy(lambda x, w, o: kernel(x, w, offs=o).cpu(), x, w, offsets), want)


# -- expert parallelism in lazy mode (issue 47, item 4) ---------------------------------------------

@lazy_rehearses_hf_models
@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=pytest.mark.slow), "gpt_oss"])
def test_lazy_expert_parallelism_compiles_once_and_reads_nothing(family):
    """Expert parallelism rehearsed on the CPU's lazy backend, which runs one process: a group of
    one rank (--expert-parallel-size N's layout for N = 1, every expert local), so the whole
    expert-parallel forward runs: pairs placed in their peer's block, the all-to-all's place (a
    group of one keeps its buffer), the static experts on the received rows with their empty
    slots masked (GPT-OSS's biases), the combine, and backward through all of it. Every step routes
    differently; after the first two no graph is compiled, and no value is read back (the
    backend's own reads, aten::_local_scalar_dense, included: F.one_hot read its largest class,
    and the token counts were gathered every layer). A group of more ranks adds per MoE layer
    the exchange's sizes (docs/moe.md), which one process cannot rehearse."""
    from torch._lazy import metrics

    from hputrain.kinds.moe.expert_parallel import ExpertLayout, split_experts
    from hputrain.execution import kernels
    from hputrain.kinds.moe.experts import parallel

    from ...moe_fixtures import tiny_moe_config

    accelerator = CPUAccelerator("lazy")
    device = accelerator.setup()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family))
    kernels.substitute(model, accelerator, True)
    parallel.register()
    split = split_experts(model, ExpertLayout(1, 0, None, None, None, None))
    assert split and all(m.config._experts_implementation == parallel.EXPERT_PARALLEL
                         for m in model.modules() if hasattr(m, "_is_expert_parallel"))
    local_reads = metrics.counter_value("aten::_local_scalar_dense") or 0
    compiles, reads = lazy_steps(model, accelerator, device)
    assert compiles[WARMUP:] == [compiles[WARMUP - 1]] * (STEPS - WARMUP), compiles
    assert reads.count == 0, reads.where
    assert (metrics.counter_value("aten::_local_scalar_dense") or 0) == local_reads


def lazy_steps(model, accelerator, device) -> tuple[list[int], HostReads]:
    """STEPS training steps of `model` on the lazy device, each on new random tokens (so each
    routes differently): the graphs compiled so far after each step, and the host reads made."""
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    compiles, reads = [], HostReads(locate=lambda name: name)
    with reads:
        reads.in_step = True
        for _ in range(STEPS):
            ids = torch.randint(4, model.config.vocab_size, (2, 32), generator=g).to(device)
            with accelerator.forward_context():
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            accelerator.mark_step()
            compiles.append(accelerator.graph_compiles())
    return compiles, reads


@lazy_rehearses_hf_models
@pytest.mark.parametrize("factor,per_step", [(1.25, 1), (2.0, 0)], ids=["average buffers", "worst-case buffers"])
def test_lazy_expert_parallelism_of_two_reads_once_a_forward(factor, per_step, monkeypatch):
    """A group of two ranks on the lazy backend, rank 0 of 2 (experts 0-3 of 8), its peer a
    loopback (the all-to-all returns what was sent: a peer holding the same experts), the Gloo
    host agreement of the token count answered, and the flag's all-reduce over one rank: every
    MoE layer exchanges its N·C rows and the whole forward agrees once. After the first two steps
    no graph is compiled, though each step routes differently; each step reads back one value,
    the overflow flag after the forward (--expert-capacity-factor 1.25), or none where the buffers
    hold any routing (2.0 = N·min(k, E/N)/k): none inside the forward, where the layers agreed one
    by one before (two layers, two reads)."""
    import torch.distributed as dist

    from hputrain.kinds.moe.expert_parallel import ExpertLayout, forwards_run_again, split_experts
    from hputrain.execution import kernels
    from hputrain.kinds.moe.experts import parallel

    from ...moe_fixtures import tiny_moe_config

    accelerator = CPUAccelerator("lazy")
    device = accelerator.setup()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("gpt_oss"))
    kernels.substitute(model, accelerator, True)
    parallel.register()
    monkeypatch.setattr(parallel, "_exchange", lambda tensor, send, receive, group: tensor.clone())
    monkeypatch.setattr(parallel, "_largest", lambda tokens, group: tokens)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: None)  # over one rank
    split_experts(model, ExpertLayout(2, 0, "ep", "ep on Gloo", None, None), factor)
    again = forwards_run_again()
    compiles, reads = lazy_steps(model, accelerator, device)
    assert forwards_run_again() == again  # no overflow: the reads are the flag's alone
    assert compiles[WARMUP:] == [compiles[WARMUP - 1]] * (STEPS - WARMUP), compiles
    assert reads.where == ({"item": per_step * STEPS} if per_step else {})  # the flag's .item()
