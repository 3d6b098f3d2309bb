"""Expert parallelism (issue 40 item 5, bad input item 9): the send buffers' layout, two processes
splitting the experts training as one process with the doubled batch, and the one-line refusals."""
from pathlib import Path

import pytest
import torch

from hputrain.kinds.moe.expert_parallel import check_expert_parallel
from hputrain.errors import InputError
from hputrain.kinds.moe.experts.parallel import dispatch_slots

from ... import expert_parallel_script
from ...hf_fixtures import llama_folder, write_text_file  # noqa: F401
from ...moe_fixtures import mixtral_folder, moe_folders  # noqa: F401
from ...distributed.test_distributed import hputrain_launch

SCRIPT = str(Path(__file__).parents[2] / "expert_parallel_script.py")


# -- the send buffers ----------------------------------------------------------------------------

@pytest.mark.parametrize("routing", ["random", "one expert", "one peer"])
@pytest.mark.parametrize("experts,ranks,k", [(8, 2, 2), (8, 4, 2), (8, 8, 2), (4, 2, 3)])
def test_each_pair_gets_its_own_place_in_its_peers_block(routing, experts, ranks, k):
    """Every pair's peer is its expert's owner, and its place among the pairs sent there is its
    rank in pair order: places 0..count-1 per peer, distinct, whatever the routing."""
    tokens, local = 5, experts // ranks
    g = torch.Generator().manual_seed(0)
    if routing == "random":
        index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    elif routing == "one expert":  # every token's first choice the same expert
        index = torch.stack([torch.cat([torch.tensor([3 % experts]),
                                        torch.tensor([e for e in range(experts) if e != 3 % experts][:k - 1])])
                             for _ in range(tokens)])
    else:  # as many choices as fit on peer 0
        index = torch.stack([torch.cat([torch.randperm(local, generator=g)[:min(k, local)],
                                        local + torch.arange(k - min(k, local))]) for _ in range(tokens)])
    peer, place, counts = dispatch_slots(index, local, ranks)
    assert torch.equal(peer, index // local)
    assert counts.tolist() == [int((peer == p).sum()) for p in range(ranks)]
    for p in range(ranks):
        assert place[peer == p].tolist() == list(range(int(counts[p])))  # pair order, from 0


def test_placing_the_pairs_reads_nothing_back():
    """The dispatch runs on the device alone: F.one_hot (which read the largest expert number back,
    `.item()`, to check it against the classes) is gone, and nothing else reads a value."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    index = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(6)])
    with Reads() as seen:
        dispatch_slots(index, 2, 4)
    assert not [op for op in seen.ops if op.startswith(("_local_scalar_dense", "one_hot", "max", "min"))], seen.ops


def test_the_buffers_are_sized_for_the_average_pair_count():
    """C = min(ceil(1.25·T·k/N), T·min(k, E/N)) rows a peer: N·C is 1.25·T·k (or the worst case,
    when that is smaller); a group of one exchanges its T·k pairs."""
    from hputrain.kinds.moe.experts.sizes import expert_sizes

    qwen = expert_sizes(4096, 8, 128, 8)  # Qwen3-30B-A3B, EP 8 (docs/moe.md)
    assert (qwen.capacity, qwen.exchange_rows, qwen.worst_rows_per_peer) == (5120, 40960, 32768)
    assert qwen.exchange_rows / qwen.pairs == 1.25
    assert expert_sizes(10, 2, 2, 2).capacity == 10  # T·min(k, E/N) = 10 < ceil(1.25·T·k/N) = 13
    assert expert_sizes(10, 2, 8, 1).exchange_rows == 0 and expert_sizes(10, 2, 8, 1).expert_rows == 20


# -- the one-line refusals (item 9) ----------------------------------------------------------------

def test_layout_refusals_name_the_numbers():
    config = type("Config", (), {"num_local_experts": 8, "num_experts_per_tok": 2, "model_type": "mixtral"})()
    with pytest.raises(InputError, match=r"tiny-mixtral has 8 experts, which expert_parallel_size=3"):
        check_expert_parallel(3, 3, config=config, model_name="tiny-mixtral")
    with pytest.raises(InputError, match=r"expert_parallel_size=4 must divide the 2 processes"):
        check_expert_parallel(4, 2, config=config)
    with pytest.raises(InputError, match=r"expert_parallel_size=2 must divide the 3 processes"):
        check_expert_parallel(2, 3, config=config)
    with pytest.raises(InputError, match=r"context_parallel_size=2 is not supported"):
        check_expert_parallel(2, 4, config=config, context_parallel_size=2)
    dense = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(InputError, match=r"has none"):
        check_expert_parallel(2, 2, config=dense, model_name="llama")
    llama4 = type("Config", (), {"num_local_experts": 8, "num_experts_per_tok": 1, "model_type": "llama4_text"})()
    with pytest.raises(InputError, match=r"outside transformers' ExpertsInterface"):
        check_expert_parallel(2, 2, config=llama4, model_name="llama4")
    with pytest.raises(InputError, match=r"strategy ddp or fsdp, not 'fast_ddp'"):
        check_expert_parallel(2, 2, config=config, strategy="fast_ddp")
    check_expert_parallel(2, 4, config=config)  # 8 experts over 2 of 4 ranks: fine


def _train(cli_here, tmp_path, model, *argv):
    data = write_text_file(tmp_path / "text.txt")
    return cli_here("train", "--model", model, "--dataset", data, "--output-dir", tmp_path / "out",
                    "--max-steps", "1", "--cpu", *argv)


@pytest.mark.parametrize("argv,words", [
    (["--devices", "3", "--expert-parallel-size", "3"], ["has 8 experts", "expert_parallel_size=3"]),
    (["--expert-parallel-size", "2"], ["expert_parallel_size=2", "1 process"]),
    (["--devices", "4", "--expert-parallel-size", "2", "--context-parallel-size", "2"],
     ["context_parallel_size=2"]),
    (["--devices", "2", "--expert-parallel-size", "2", "--lora-r", "4", "--lora-target-modules", "experts"],
     ["LoRA adapters on the experts"]),
    (["--devices", "2", "--expert-parallel-size", "2", "--expert-capacity-factor", "0"],
     ["expert_capacity_factor must be positive, got 0"]),
], ids=["experts not divisible", "larger than the world", "with context parallelism", "lora on the experts",
        "capacity factor 0"])
def test_bad_expert_parallel_layouts_are_one_line_exit_2(cli_here, tmp_path, mixtral_folder, argv, words):
    status, _, err = _train(cli_here, tmp_path, mixtral_folder, *argv)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert all(word in err for word in words), err
    assert not (tmp_path / "out").exists()  # refused before any process started


def test_expert_parallel_on_a_dense_model_is_one_line_exit_2(cli_here, tmp_path, llama_folder):
    status, _, err = _train(cli_here, tmp_path, llama_folder, "--devices", "2", "--expert-parallel-size", "2")
    assert status == 2 and err.count("\n") == 1, err
    assert "has none" in err and "expert_parallel_size=1" in err


# -- two processes, the experts split, train as one ------------------------------------------------

def _reference(tmp_path_factory, family):
    out = tmp_path_factory.mktemp(f"{family}-one")
    expert_parallel_script.main([str(out), "4", family])
    return torch.load(out / "result.pt")


def _launch(tmp_path, *argv, nproc=2):
    proc, _ = hputrain_launch("--nproc-per-node", str(nproc), SCRIPT, str(tmp_path), *argv, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / "result.pt")


def assert_same(expected, actual, tol=1e-5):
    assert actual["losses"] == pytest.approx(expected["losses"], abs=tol)
    assert len(actual["losses"]) == 3
    for kind in ("grads", "weights"):
        assert expected[kind].keys() == actual[kind].keys()
        for name in expected[kind]:
            torch.testing.assert_close(actual[kind][name], expected[kind][name], rtol=tol, atol=tol,
                                       msg=lambda m, name=name: f"{kind} {name}: {m}")


@pytest.fixture(scope="module")
def mixtral_one(tmp_path_factory):
    return _reference(tmp_path_factory, "mixtral")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_two_expert_parallel_ranks_train_as_one_process(tmp_path, tmp_path_factory, family, mixtral_one):
    """EP=2 over 2 Gloo processes (ddp on the rest), of batch 2, or for mixtral 2 micro-batches of 1
    (gradient accumulation): the losses, the first step's whole gradients (clipped to a global
    norm) and the weights after 3 steps equal one process of batch 4 within 1e-5 in fp32;
    qwen2_moe adds its shared expert beside the split ones."""
    if family == "mixtral":
        assert_same(mixtral_one, _launch(tmp_path, "1", family, "--ep", "2", "--accumulate", "2"))
    else:
        assert_same(_reference(tmp_path_factory, family), _launch(tmp_path, "2", family, "--ep", "2"))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4], ids=["ep2", "ep2 x fsdp2"])
def test_expert_parallelism_composes_with_fsdp(tmp_path, mixtral_one, nproc):
    """fsdp on the rest of the model, each experts module an fsdp unit over the ranks holding the
    same experts (none on 2 ranks; 2 on 4 ranks, which also gives each expert-parallel group its
    replica): equal to one process with the global batch, as above."""
    batch = str(4 // nproc)
    assert_same(mixtral_one, _launch(tmp_path, batch, "mixtral", "--ep", "2", "--strategy", "fsdp", nproc=nproc))


@pytest.mark.parametrize("strategy,factor,checkpointing", [
    ("ddp", 1.25, False),
    pytest.param("ddp", 0.25, True, marks=pytest.mark.slow),
    pytest.param("fsdp", 0.25, False, marks=pytest.mark.slow)],
    ids=["ddp", "ddp overflowing, recomputed", "fsdp overflowing"])
def test_a_forward_run_again_for_an_overflow_trains_as_one_process(tmp_path, mixtral_one, strategy, factor,
                                                                   checkpointing):
    """Issue 47 item 4 across processes: the exchange agreed once a forward (one flag read back
    after it) trains as one process. At --expert-capacity-factor 0.25 the buffers hold a fifth of
    the pairs, so forwards overflow and run again on the exact path (counted), under ddp with
    activation checkpointing (its recompute in backward reuses the forward's sizes) and under
    fsdp (whose second forward gathers the parameters again on every rank): still one process's
    losses, gradients and weights."""
    result = _launch(tmp_path, "2", "mixtral", "--ep", "2", "--strategy", strategy,
                     "--capacity-factor", str(factor), *(["--checkpointing"] if checkpointing else []))
    assert_same(mixtral_one, result)
    assert (result["forwards_run_again"] >= 3) == (factor < 1)  # every step's forward, at 0.25


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_expert_parallel_size(tmp_path):
    """Saved at step 2 of 4 with the experts split over 2 ranks (DCP, each rank its experts),
    resumed with expert_parallel_size 1 (every rank every expert): the same run, to the bit, as
    resumed with the size it was saved with (model and optimizer state resharded), and the
    uninterrupted run's weights. final/ holds every expert (gathered from the ranks) and loads in
    from_pretrained as the trained weights."""
    import shutil

    import transformers

    _launch(tmp_path / "saved", "2", "mixtral", "--ep", "2", "--save-steps", "2", "--steps", "4", "--final")
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved" / "final")
    trained = torch.load(tmp_path / "saved" / "result.pt")["weights"]
    for name, value in final.named_parameters():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
    runs = {}
    for size in ("2", "1"):
        folder = Path(shutil.copytree(tmp_path / "saved", tmp_path / f"ep{size}"))
        shutil.rmtree(folder / "checkpoint-4")
        runs[size] = _launch(folder, "2", "mixtral", "--ep", size, "--resume", "--steps", "4")
    assert runs["1"]["losses"] == pytest.approx(runs["2"]["losses"], abs=1e-6)
    assert runs["2"]["weights"].keys() == trained.keys()
    for name, value in runs["2"]["weights"].items():
        torch.testing.assert_close(runs["1"]["weights"][name], value, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(value, trained[name], rtol=1e-5, atol=1e-5)


def _cli(*argv):
    import subprocess
    import sys

    from ...distributed.test_distributed import ENV, ROOT

    return subprocess.run([sys.executable, "-m", "hputrain.cli", "train", *map(str, argv)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT, env=ENV)


def _losses(folder):
    import json

    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_train_command_resumes_an_fsdp_checkpoint_with_the_experts_split(tmp_path, mixtral_folder):
    """`hputrain train --devices 2 --strategy fsdp`, saved at step 2 of 4 with every rank holding
    every expert (shard-by-shard loading), resumed with --expert-parallel-size 2 (each rank reads
    its experts from the shards): steps 3 and 4 log the uninterrupted run's losses, and final/
    (every expert, on-disk form) holds its weights."""
    import shutil

    from safetensors.torch import load_file

    data = write_text_file(tmp_path / "text.txt")
    common = ["--model", mixtral_folder, "--dataset", data, "--max-steps", "4", "--cpu", "--devices", "2",
              "--strategy", "fsdp", "--logging-steps", "1", "--save-steps", "2", "--disable-tqdm",
              "--per-device-train-batch-size", "2",
              "--precision", "fp32"]  # 1e-5 between two layouts: fp32 on every CPU, not "auto"
    whole = tmp_path / "whole"
    proc = _cli(*common, "--output-dir", whole)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = Path(shutil.copytree(whole, tmp_path / "resumed"))
    for leftover in ("checkpoint-4", "final"):
        shutil.rmtree(resumed / leftover)
    proc = _cli(*common, "--output-dir", resumed, "--expert-parallel-size", "2",
                "--resume-from-checkpoint", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = _losses(whole), _losses(resumed)
    assert [got[step] for step in (3, 4)] == pytest.approx([want[step] for step in (3, 4)], abs=1e-5)
    expected, actual = load_file(whole / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5)


# -- the forward on ranks simulated by threads -------------------------------------------------------

class _Threads:
    """`ranks` ranks in threads of this process: all-to-all and the exchange's sizes agreed
    through shared lists and a barrier (what Gloo does between processes)."""

    def __init__(self, ranks: int) -> None:
        import threading

        self.ranks, self.barrier, self.box = ranks, threading.Barrier(ranks), [None] * ranks

    def share(self, rank: int, value):
        self.barrier.wait()
        self.box[rank] = value
        self.barrier.wait()
        values = list(self.box)
        self.barrier.wait()
        return values

    def exchange(self, rank, tensor, send_sizes, receive_sizes):
        parts = self.share(rank, list(tensor.split(send_sizes)))
        received = torch.cat([parts[peer][rank] for peer in range(self.ranks)])
        assert received.shape[0] == sum(receive_sizes)
        return received


class _Uninitialised(torch.autograd.Function):
    """The CPU's grouped_mm (CUDA's kernel on the CPU), with the rows it leaves unwritten, past
    the last offset, set as uninitialised memory may hold them (torch.empty: measured garbage such
    as -9e36 there): 1.0 in its output (finite, inside GPT-OSS's clamps, which would stop a NaN's
    gradient) and NaN in backward's input gradient."""

    @staticmethod
    def forward(ctx, x, weight, offsets, kernel):
        with torch.enable_grad():
            x_, weight_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            out = kernel(x_, weight_, offsets)
        ctx.kept = (x_, weight_, out, int(offsets[-1]))
        return out.detach().clone().index_fill_(0, torch.arange(int(offsets[-1]), x.size(0)), 1.0)

    @staticmethod
    def backward(ctx, grad):
        x_, weight_, out, end = ctx.kept
        grad_x, grad_weight = torch.autograd.grad(out, (x_, weight_), grad)
        grad_x = grad_x.clone().index_fill_(0, torch.arange(end, grad_x.size(0)), float("nan"))
        return grad_x, grad_weight, None, None


def uninitialised_cpu_kernel():
    """kernels._Kernels of a CPU accelerator whose grouped_mm leaves garbage where torch's leaves
    its rows unwritten (_Uninitialised)."""
    from hputrain.accelerators.cpu import CPUAccelerator
    from hputrain.execution import kernels

    class Accelerator(CPUAccelerator):
        def grouped_mm_kernel(self, x, weight):
            kernel = super().grouped_mm_kernel(x, weight)
            assert kernel is not None  # eager mode: torch's grouped_mm
            return lambda x, weight, offsets: _Uninitialised.apply(x, weight, offsets, kernel)

    return kernels._Kernels(Accelerator("eager"), {})


def pick(routing, experts, k, local, tokens, g):
    if routing == "one expert":
        return torch.stack([torch.tensor([0, 1 + i % (experts - 1)]) for i in range(tokens)])
    if routing == "one peer":  # every choice on rank 0's experts: past its block's C rows
        return torch.stack([torch.randperm(local, generator=g)[:k] for _ in range(tokens)])
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])


@pytest.mark.parametrize("family,ranks,tokens,routing,inner,kernel", [
    ("mixtral", 2, (5, 3), "random", "hputrain", None),
    ("mixtral", 8, (4,) * 8, "random", "grouped_mm", None),
    ("gpt_oss", 4, (6, 2, 4, 3), "random", "grouped_mm", None),
    ("gpt_oss", 2, (6, 4), "random", "hputrain", "cpu grouped_mm"),
    ("gpt_oss", 2, (5, 3), "one peer", "hputrain", "cpu grouped_mm"),
    ("gpt_oss", 2, (5, 3), "random", "eager", None),
    ("mixtral", 2, (6, 6), "one peer", "hputrain", None),
    ("qwen3_moe", 2, (4, 4), "one expert", "hputrain", None),
    ("deepseek_v3", 2, (3, 5), "random", "hputrain", None),
    ("olmoe", 4, (2, 2, 2, 2), "random", "hputrain", None)],
    ids=["mixtral ep2 uneven static", "mixtral ep8 one expert a rank", "gpt_oss ep4 biases",
         "gpt_oss ep2 biases through the cpu grouped_mm", "gpt_oss ep2 overflow through the cpu grouped_mm",
         "gpt_oss ep2 transformers eager", "mixtral ep2 overflow static",
         "qwen3_moe ep2 every token to expert 0", "deepseek_v3 ep2", "olmoe ep4"])
def test_expert_parallel_forward_equals_the_whole_experts(monkeypatch, family, ranks, tokens, routing, inner,
                                                          kernel):
    """Each rank's experts module holds its E/ranks experts; tokens (a different count per rank)
    go to their experts' ranks and back, computed there by hputrain's static experts (the
    fixed-shape form, or torch's grouped_mm as on CUDA, whose unwritten rows hold NaN here),
    transformers' grouped_mm or its eager loop (GPT-OSS's one_hot took no empty slot): the
    outputs and the gradients of the inputs, the router weights and each rank's experts (GPT-OSS's
    biases too) equal the whole module's (transformers' grouped_mm) within 1e-5. "one peer" sends
    every pair to rank 0's experts, past its block: a second exchange carries them."""
    from hputrain.kinds.moe.experts import parallel
    from hputrain.kinds.moe.experts.sizes import peer_capacity

    whole = whole_experts(family)
    case = Case.random(whole, tokens, routing)
    overflows = parallel.overflow_exchanges()
    results = in_threads(monkeypatch, whole, case, inner, uninitialised_cpu_kernel if kernel else None)
    local = whole.num_experts // len(tokens)
    capacity = peer_capacity(max(tokens), case.k, whole.num_experts, len(tokens))
    most = max(int(torch.bincount(i.reshape(-1) // local, minlength=len(tokens)).max()) for i in case.index)
    assert (parallel.overflow_exchanges() > overflows) == (most > capacity)  # a second exchange
    assert most > capacity or routing != "one peer"
    assert_equals_the_whole(whole, case, results)


def test_under_autocast_the_pairs_travel_in_bf16(monkeypatch):
    """bf16-mixed: the pairs are sent in the dtype the static experts compute in (half a float32
    residual stream's bytes), the outputs come back as computed, and the result is one process's
    static experts' under the same autocast, within bf16's rounding."""
    from hputrain.kinds.moe.experts import experts_forward

    whole = whole_experts("mixtral")
    case, sent = Case.random(whole, (6, 4), "random"), []

    def autocast(rank):
        return torch.autocast("cpu", dtype=torch.bfloat16)

    results = in_threads(monkeypatch, whole, case, "hputrain", around=autocast, sent=sent)
    assert {dtype for _, shape, dtype in sent if len(shape) == 2} == {torch.bfloat16}
    for rank, result in enumerate(results):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts_forward(whole, case.inputs[rank], case.index[rank], case.weights[rank])
        assert result.out.dtype == out.dtype == torch.float32
        torch.testing.assert_close(result.out, out.detach(), rtol=2e-2, atol=2e-2)


class _Saved:
    """The bytes of the floating-point activations autograd keeps (parameters, inputs and their
    views left out; tensors sharing storage counted once): saved_tensors_hooks, in this thread."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def __enter__(self):
        def pack(tensor):
            base = tensor if tensor._base is None else tensor._base
            if tensor.is_floating_point() and not (base.is_leaf and base.requires_grad):
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def test_the_static_experts_cost_what_they_compute_at_4096_tokens(monkeypatch):
    """Qwen3-30B-A3B's proportions in small (top-k over the expert-parallel size 1, 4 experts a
    rank; docs/moe.md has its figures), T = 4096 tokens a rank routed at random, on 4 ranks with
    the fixed-shape products (Gaudi's form): the rows each all-to-all moves, the rows the products
    multiply (their FLOPs over 2·in·out, forward and backward) and the bytes kept for backward,
    measured, are those sizes.py gives, and against T·k pairs (and the bytes transformers'
    grouped_mm keeps in one process for the same tokens) at most 1.25 times plus one tile a local
    expert."""
    from torch.utils.flop_counter import FlopCounterMode

    from hputrain.kinds.moe.experts.sizes import expert_sizes

    tokens, ranks, k, experts, hidden, inner = 4096, 4, 4, 16, 32, 16
    whole = whole_experts("qwen3_moe", num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=inner)
    case = Case.random(whole, (tokens,) * ranks, "random")
    sizes = expert_sizes(tokens, k, experts, ranks)
    flops, saved, sent = [FlopCounterMode(display=False) for _ in range(ranks)], [_Saved() for _ in range(ranks)], []

    def around(rank):
        import contextlib

        stack = contextlib.ExitStack()
        stack.enter_context(flops[rank])
        stack.enter_context(saved[rank])
        return stack

    in_threads(monkeypatch, whole, case, "hputrain", around=around, sent=sent)
    hidden_rows = {shape[0] for _, shape, _ in sent if len(shape) == 2}  # the hidden states' buffers
    assert hidden_rows == {sizes.exchange_rows} and sizes.exchange_rows / sizes.pairs == 1.25
    per_row = 2 * hidden * 2 * inner + 2 * inner * hidden  # the up and down products, forward
    for rank in range(ranks):
        multiplied = flops[rank].get_total_flops() / (3 * per_row)  # and backward's two
        assert multiplied == sizes.tiled_rows
    bound = 1.25 + sizes.local_experts * sizes.tile / sizes.pairs
    assert sizes.tiled_rows / sizes.pairs <= bound
    whole.config._experts_implementation = "grouped_mm"  # one process, the same tokens, no padding
    with _Saved() as reference:
        x, w = case.inputs[0].clone().requires_grad_(), case.weights[0].clone().requires_grad_()
        whole(x, case.index[0], w)
    assert reference.bytes == pytest.approx(4 * sizes.minimum_saved(hidden, inner), rel=0.03)
    for rank in range(ranks):
        assert saved[rank].bytes == pytest.approx(4 * sizes.saved(hidden, inner), rel=0.03)
        assert saved[rank].bytes / reference.bytes <= bound


def whole_experts(family, dtype=torch.float32, **config):
    """The first experts module of a tiny `family` model (`config`: other sizes), every parameter
    random (biases too: GPT-OSS's start at zero)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config_for(family, **config))
    whole = next(m for m in model.modules() if hasattr(m, "_is_expert_parallel"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in whole.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return whole.to(dtype)


class Case:
    """Each rank's inputs, routing and router weights."""

    def __init__(self, inputs, index, weights) -> None:
        self.inputs, self.index, self.weights = inputs, index, weights
        self.k = index[0].shape[1]

    @classmethod
    def random(cls, whole, tokens, routing, seed=2):
        g = torch.Generator().manual_seed(seed)
        experts, k = whole.num_experts, whole.config.num_experts_per_tok
        local = experts // len(tokens)
        return cls([torch.randn(t, whole.config.hidden_size, generator=g) for t in tokens],
                   [pick(routing, experts, k, local, t, g) for t in tokens],
                   [torch.rand(t, k, generator=g) for t in tokens])


def in_threads(monkeypatch, whole, case, inner, kernels=None, around=None, device="cpu", sent=None,
               body=False, factor=None, calls=None):
    """expert_parallel_forward on len(case.inputs) ranks in threads, each with its share of
    `whole`'s experts (`kernels()`: the accelerator's kernels they run on; `around(rank)`: a
    context the rank's forward and backward run in; `sent`: a list that gets each all-to-all's
    (rank, the shape and dtype it sent)): each rank's output and gradients. `body`: the experts
    run twice (_TwoLayers), agreeing on the sizes once a forward (OnceAForward at capacity factor
    `factor`), or layer by layer (None); `calls` gets the name of each agreement made."""
    import contextlib
    import copy
    import functools
    import threading
    from types import SimpleNamespace

    from hputrain.kinds.moe import expert_parallel
    from hputrain.kinds.moe.expert_parallel import SHARD_ATTRIBUTE, ExpertShard
    from hputrain.kinds.moe.experts import parallel
    from hputrain.kinds.moe.experts.parallel import expert_parallel_forward

    ranks = len(case.inputs)
    threads, local = _Threads(ranks), whole.num_experts // ranks

    def exchange(tensor, send, receive, group):
        if sent is not None:
            sent.append((group, tuple(tensor.shape), tensor.dtype))
        return threads.exchange(group, tensor, send, receive)

    def counted(name, answer):
        def agreement(*args):
            if calls is not None:
                calls.append(name)
            return answer(*args)
        return agreement

    here = threading.local()
    monkeypatch.setattr(parallel, "_exchange", exchange)
    monkeypatch.setattr(parallel, "_agree", counted("per layer", lambda count, most, group: tuple(
        max(values) for values in zip(*threads.share(group, (count, int(most)))))))
    monkeypatch.setattr(parallel, "_largest", counted("tokens", lambda count, group: max(threads.share(group, count))))
    monkeypatch.setattr(expert_parallel, "_any_rank", counted("overflow", lambda flag: any(threads.share(here.rank, bool(flag)))))
    results = [None] * ranks

    def run(rank):
        here.rank = rank
        module = copy.deepcopy(whole)
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach()[rank * local:(rank + 1) * local].clone()))
        module.num_experts, module._is_expert_parallel = local, True
        if kernels:
            module._hputrain_kernels = kernels()
        once = None if factor is None else expert_parallel.OnceAForward(factor)
        setattr(module, SHARD_ATTRIBUTE, ExpertShard(whole.num_experts, ranks, rank, rank, rank, inner, once))
        forward = functools.partial(expert_parallel_forward, module)
        if body:
            forward = _TwoLayers(module)
            if once is not None:
                expert_parallel.agree_once_a_forward(forward, once)
                forward = copy.deepcopy(forward) if rank == 0 else forward  # a copy: its own agreement
            module = forward.experts
        x = case.inputs[rank].to(device, module.down_proj.dtype).requires_grad_()
        w = case.weights[rank].to(device, module.down_proj.dtype).requires_grad_()
        with around(rank) if around else contextlib.nullcontext():
            out = forward(x, case.index[rank].to(device), w)
            out.backward(torch.linspace(-1, 1, out.numel(), device=device, dtype=out.dtype).view_as(out))
        results[rank] = SimpleNamespace(out=out.detach(), x=x.grad, w=w.grad,
                                        params={n: p.grad for n, p in module.named_parameters()})

    workers = [threading.Thread(target=run, args=(rank,)) for rank in range(ranks)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert all(result is not None for result in results)
    return results


class _TwoLayers(torch.nn.Module):
    """Two MoE layers on the same experts and routing, as a decoder's body runs its layers."""

    def __init__(self, experts) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x, index, weights):
        from hputrain.kinds.moe.experts.parallel import expert_parallel_forward

        first = expert_parallel_forward(self.experts, x, index, weights)
        return expert_parallel_forward(self.experts, torch.tanh(first), index, weights)


@pytest.mark.parametrize("routing,factor,reads", [
    ("random", 1.25, ["tokens", "overflow"]),
    ("one peer", 1.25, ["tokens", "overflow", "per layer", "per layer"]),
    ("one peer", 2.0, ["tokens"])], ids=["balanced", "overflow runs the forward again", "worst-case buffers"])
def test_the_exchange_is_agreed_once_a_forward(monkeypatch, routing, factor, reads):
    """Issue 47 item 4: a body of two MoE layers agrees on its exchange once a forward, not once a
    layer: the token count on the host (no device read), then one flag read back after the
    forward. Routing that overflows the buffers (every pair for rank 0's experts) runs the forward
    again on the exact path (its layers agree one by one), counted; at a capacity factor of
    N·min(k, E/N)/k the buffers hold any routing, and nothing is read. Each way, every rank's
    output and gradients equal the exact path's, layer by layer (rank 0's body is a deep copy,
    with its own agreement)."""
    from hputrain.kinds.moe.expert_parallel import forwards_run_again

    whole = whole_experts("mixtral")
    case = Case.random(whole, (6, 4), routing)
    calls, before = [], forwards_run_again()
    results = in_threads(monkeypatch, whole, case, "hputrain", body=True, factor=factor, calls=calls)
    # each rank (thread) counts its own forward run again
    assert forwards_run_again() - before == 2 * (routing == "one peer" and factor < 2)
    assert sorted(calls) == sorted(reads * 2)  # each of the two ranks
    exact = []
    monkeypatch.undo()
    expected = in_threads(monkeypatch, whole, case, "hputrain", body=True, calls=exact)
    assert exact == ["per layer"] * 4
    for got, want in zip(results, expected):
        torch.testing.assert_close(got.out, want.out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.x, want.x, rtol=1e-5, atol=1e-5)
        for name in want.params:
            torch.testing.assert_close(got.params[name], want.params[name], rtol=1e-5, atol=1e-5)


def assert_equals_the_whole(whole, case, results, tol=1e-5):
    """Each rank's output and input gradients are the whole module's (transformers' grouped_mm)
    on its tokens, and the ranks' expert gradients, put together, the whole module's."""
    whole.config._experts_implementation = "grouped_mm"
    device, dtype = whole.down_proj.device, whole.down_proj.dtype
    for rank, result in enumerate(results):
        x = case.inputs[rank].to(device, dtype).requires_grad_()
        w = case.weights[rank].to(device, dtype).requires_grad_()
        out = whole(x, case.index[rank].to(device), w)
        out.backward(torch.linspace(-1, 1, out.numel(), device=device, dtype=out.dtype).view_as(out))
        torch.testing.assert_close(result.out, out.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(result.x, x.grad, rtol=tol, atol=tol)
        torch.testing.assert_close(result.w, w.grad, rtol=tol, atol=tol)
    for name, param in whole.named_parameters():  # the whole module's gradient: every rank's tokens
        split = torch.cat([result.params[name] for result in results])
        torch.testing.assert_close(split, param.grad, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


def tiny_moe_config_for(family, **config):
    from ...moe_fixtures import tiny_moe_config

    return tiny_moe_config(family, **config)


# -- loading: each rank places and reads only its experts (issue 47 item 1) -------------------------

def test_the_experts_are_split_before_the_model_is_placed(monkeypatch):
    """ExpertParallel.place keeps this rank's experts (rank 1 of 2: experts 4-7) before the
    inner strategy places the model, so that the device never receives every expert (today the
    whole model is placed, then split in wrap)."""
    from types import SimpleNamespace

    import transformers

    from hputrain.kinds.moe import expert_parallel as ep
    from hputrain.distributed.strategies import Strategy
    from hputrain.kinds.moe.experts.parallel import register

    from ...moe_fixtures import tiny_moe_config

    register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config("mixtral"))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    whole = model.get_parameter(key).detach().clone()
    layout = SimpleNamespace(size=2, rank=1, group=None, host_group=None, replicate_group=None, mesh=None)
    monkeypatch.setattr(ep.ExpertLayout, "build", classmethod(lambda cls, size, device_type: layout))
    placed = {}

    class Recording(Strategy):
        name = "ddp"

        def place(self, module, device):
            placed.update({n: p.detach().clone() for n, p in module.named_parameters() if ".experts." in n})
            return module

    group = SimpleNamespace(mesh=SimpleNamespace(device_type="cpu"), distributed=False)
    ep.ExpertParallel(Recording(), group, 2).place(model, torch.device("cpu"))
    assert torch.equal(placed[key], whole[4:8])


@pytest.mark.slow
def test_each_ddp_expert_parallel_rank_peaks_below_one_process_by_its_share(tmp_path):
    """`hputrain train --devices 2 --strategy ddp --expert-parallel-size 2` on a Mixtral folder of
    201 MB of experts (bench/moe_memory.py): each rank's peak RSS when training begins (loaded,
    split, placed) is below one process's by more than 0.3 × the experts (it holds half of
    them; today every rank loads the whole model, then splits it: no lower than one process)."""
    import importlib.util

    path = Path(__file__).resolve().parents[3] / "bench" / "moe_memory.py"
    spec = importlib.util.spec_from_file_location("bench_moe_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    folder, sizes = bench.moe_folder(tmp_path, layers=4, hidden=512, intermediate=1024)
    assert 200e6 < sizes["experts"] and sizes["dense"] < 0.1 * sizes["experts"]
    one = bench.run(folder, tmp_path, "1 process", bench.RUNS["1 process"])[0]["loaded"]
    ranks = bench.run(folder, tmp_path, "ddp + EP 2", bench.RUNS["ddp + EP 2"])
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["loaded"] < one - 0.3 * sizes["experts"], (one, ranks, sizes)
