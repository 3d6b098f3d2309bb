"""Issue 30: the choices a user makes in `hputrain train --model DIR --dataset FILE`, run together.

The cases come from a covering array (tests/combinations.py): every pair of levels a user can ask
for runs in at least one case (`make test`); under `-m slow`, every triple. Each case is a 2-step
run on a tiny Llama that must exit 0 with finite losses, leave a checkpoint from which a second
run continues to the same loss (and the same validation loss), write a final folder that
transformers or PEFT loads, and leave no process behind within the time limit. Single-process
runs call the CLI in this process (no interpreter start-up); runs on 2 processes are real ones,
in their own session, so that a hang is a timeout failure and every leftover is found.

The pairs refused by design are tested here for their one line and exit 2."""
from __future__ import annotations

import contextlib
import json
import math
import re
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from . import combinations as combos
from .hf_fixtures import tiny_llama_config, tiny_tokenizer
from .moe_fixtures import tiny_moe_config
from .vlm_fixtures import real_template, tiny_vlm_folder, write_image_dataset, write_string_dataset

transformers = pytest.importorskip("transformers", reason="the combinations fine-tune HF models")
peft = pytest.importorskip("peft", reason="half the combinations train LoRA adapters")

from hputrain.cli import main  # noqa: E402

TEMPLATES = Path(__file__).parent / "chat_templates"
TIMEOUT_S = 90  # one `hputrain train --devices 2` started as a user starts it
RUN_TIMEOUT_S = 60  # one run among the pooled 2-process runs; a hang in a collective shows up so
WORDS = ["the quick brown fox", "jumps over the lazy dog", "a stitch in time", "saves nine",
         "to be or not to be", "that is the question", "def add(a, b):", "return a + b"]

PAIRWISE = combos.covering_cases(strength=2)


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _save_llama(folder: Path, tokenizer, seed: int) -> str:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config(len(tokenizer), max_position_embeddings=256))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _save_mixtral(folder: Path, tokenizer, seed: int) -> str:
    """The "moe" level's model: a tiny Mixtral (8 experts, top-2) with the same tokenizer."""
    torch.manual_seed(seed)
    config = tiny_moe_config("mixtral", len(tokenizer), max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _datasets(root: Path) -> dict:
    """40 rows of each shape: 8% held out is 3 rows (1 block of text), under an eval batch of 4."""
    n = len(WORDS)
    text = [{"text": f"{i} {WORDS[i % n]} {WORDS[(i + 3) % n]}"} for i in range(40)]
    chat = [{"messages": [{"role": "user", "content": f"{i}: {WORDS[i % n]}?"},
                          {"role": "assistant", "content": WORDS[(i + 1) % n]}]} for i in range(40)]
    completion = [{"prompt": f"{i}: {WORDS[i % n]} ", "completion": WORDS[(i + 1) % n]}
                  for i in range(40)]
    pairs = [{"prompt": f"{i}: {WORDS[i % n]}", "chosen": " " + WORDS[(i + 1) % n],
              "rejected": " " + WORDS[(i + 5) % n]} for i in range(40)]
    prompts = [{"prompt": f"{i}: {WORDS[i % n]}", "answer": WORDS[(i + 1) % n]} for i in range(40)]
    return {name: _write_jsonl(root / f"{name}.jsonl", rows) for name, rows in
            (("text", text), ("chat", chat), ("completion", completion), ("dpo", pairs),
             ("grpo", prompts))}


def _shard_folders(root: Path) -> dict:
    """(method, validation level) -> a folder of two JSON Lines shards (one a rank under 2
    processes) of 160 rows each, enough for two passes' worth of batches on every rank, with a
    validation/ subfolder of 3 rows under "val"."""
    n, folders = len(WORDS), {}
    shapes = {
        "text": lambda i: {"text": " ".join(f"{i} {WORDS[(i + k) % n]}" for k in range(6))},
        "chat": lambda i: {"messages": [{"role": "user", "content": f"{i}: {WORDS[i % n]}?"},
                                        {"role": "assistant", "content": WORDS[(i + 1) % n]}]},
        "completion": lambda i: {"prompt": f"{i}: {WORDS[i % n]} ", "completion": WORDS[(i + 1) % n]}}
    for method, row in shapes.items():
        for validation in ("noval", "val"):
            folder = root / f"{method}-shards-{validation}"
            (folder / "validation").mkdir(parents=True, exist_ok=validation == "noval")
            for shard in (0, 1):
                _write_jsonl(folder / f"part-{shard}.jsonl", [row(i) for i in range(shard, 320, 2)])
            if validation == "val":
                _write_jsonl(folder / "validation" / "part-0.jsonl", [row(1000 + i) for i in range(3)])
            else:
                (folder / "validation").rmdir()
            folders[method, validation] = str(folder)
    return folders


def _record_folders(root: Path, datasets: dict) -> dict:
    """(method, validation level) -> a folder of each data set's rows cut into two JSON Lines
    files, read whole (no --streaming), with a validation/ subfolder of its last 3 rows (text: one
    document of a block) under "val": the validation split, as a DatasetDict's own."""
    folders = {}
    for method, path in datasets.items():
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        for validation in ("noval", "val"):
            folder = root / f"{method}-folder-{validation}"
            (folder / "validation").mkdir(parents=True)
            train = rows[:-3] if validation == "val" else rows
            for part in (0, 1):
                _write_jsonl(folder / f"part-{part}.jsonl", train[part::2])
            if validation == "val":  # text: one longer document, a block of 128 tokens
                held = ([{"text": " ".join(r["text"] for r in rows[-24:])}] if method == "text"
                        else rows[-3:])
                _write_jsonl(folder / "validation" / "part-0.jsonl", held)
            else:
                (folder / "validation").rmdir()
            folders[method, validation] = str(folder)
    return folders


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> combos.Inputs:
    """A tiny Llama whose tokenizer carries ChatML's markers and template, another of the same
    shape with other weights (--ref-model), a tiny Mixtral and its reference alike, a tiny LLaVA
    with its processor, and the data sets (the LLaVA's: 40 image conversations and 40
    prompt-completion rows with images, their PNG files beside them)."""
    root = tmp_path_factory.mktemp("combinations")
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = (TEMPLATES / "chatml_tagged.jinja").read_text()
    return combos.Inputs(model=_save_llama(root / "model", tokenizer, seed=0),
                         ref_model=_save_llama(root / "reference", tokenizer, seed=1),
                         datasets=(datasets := _datasets(root)), streams=_shard_folders(root),
                         folders=_record_folders(root, datasets), reward_funcs=_reward_file(root),
                         moe_model=_save_mixtral(root / "moe", tokenizer, seed=0),
                         moe_ref_model=_save_mixtral(root / "moe-reference", tokenizer, seed=1),
                         vlm_model=str(tiny_vlm_folder(root / "vlm", "llava")),
                         vlm_datasets={method: str(write_image_dataset(root / f"vlm-{method}", fmt, rows=40))
                                       for method, fmt in (("chat", "messages"),
                                                           ("completion", "prompt_completion"))},
                         # issue 47: llava-1.5's own template, rows of plain strings
                         vlm_real_model=str(tiny_vlm_folder(root / "vlm-real", "llava",
                                                            template=real_template("llava"))),
                         vlm_real_datasets={
                             method: str(write_string_dataset(root / f"vlm-real-{method}", fmt, rows=40))
                             for method, fmt in (("chat", "messages"), ("completion", "prompt_completion"))})


def _reward_file(root: Path) -> str:
    """GRPO's reward (FILE.py:NAME): the share of completion tokens that are even, and whether the
    answer column's word appears (a column passed per completion, as TRL passes it)."""
    path = root / "rewards.py"
    path.write_text("def even(prompts, completions, completion_ids, answer, **_):\n"
                    "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) + (a in c)\n"
                    "            for ids, a, c in zip(completion_ids, answer, completions)]\n")
    return f"{path}:even"


# -- running a case --------------------------------------------------------------------------------

class Run:
    """One `hputrain train`: its exit status (or what stopped it), its log and its metrics."""

    def __init__(self, out: Path, status, log: str, seconds: float, err: str = ""):
        self.out, self.status, self.log, self.seconds, self.err = out, status, log, seconds, err
        metrics = out / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        self.records = [json.loads(line) for line in lines]

    def steps(self) -> list[dict]:
        return [r for r in self.records if "loss" in r and "step" in r]

    def evals(self) -> list[dict]:
        return [r for r in self.records if "eval_loss" in r]

    def why(self) -> str:
        """For an assertion message: where the run's files are and the end of its log."""
        return f"\n[{self.out}: status {self.status}, {self.seconds:.1f} s]\n{self.log[-6000:]}"


def _train_here(argv: list[str], out: Path, capsys) -> Run:
    """`hputrain train` through the CLI's main in this process (one process: nothing can hang in
    a collective); a traceback is kept as the status and in the log."""
    capsys.readouterr()
    # what this process had started before (an earlier test's wandb-core service, the
    # multiprocessing resource tracker): they live as long as the process, by design
    earlier = set(_children_now())
    start, status, trace = time.perf_counter(), None, ""
    try:
        status = main(["train", *argv, "--output-dir", str(out)])
    except BaseException as exc:  # noqa: BLE001  (SystemExit included: the run's own outcome)
        status, trace = f"raised {type(exc).__name__}", traceback.format_exc()
    captured = capsys.readouterr()
    log = captured.out + captured.err + trace
    children = [child for child in _children_now() if child not in earlier]
    if children and status == 0:
        status = "returned 0 but left child processes behind"
    log += "".join(f"\nleft behind: {line}" for line in children)
    out.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.log").write_text(log)
    return Run(out, status, log, time.perf_counter() - start, err=captured.err + trace)


def _children_now() -> list[str]:
    import psutil

    return [f"pid {p.pid}: {p.name()}" for p in psutil.Process().children(recursive=True)]


def _marked_processes(marker: str) -> list:
    """Every process (the launcher, its agent's workers in their own sessions) whose environment
    carries this run's marker."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("HPUTRAIN_COMBINATION_RUN") == marker:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def _end_leftovers(marker: str, grace_s: float = 10.0) -> list[str]:
    """Wait up to grace_s for the run's processes to be gone; kill (by pid) and name those left."""
    deadline = time.monotonic() + grace_s
    while (left := _marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    named = []
    for proc in left:
        try:
            named.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
        except Exception:  # noqa: BLE001  (gone meanwhile)
            continue
    return named


def _start(command: list[str], log_path: Path, marker: str, rank_logs: Path,
           err_path: Path | None = None) -> subprocess.Popen:
    """A process of its own (its own session), its output in log_path (stderr too, unless
    err_path); each rank's output is also kept under rank_logs (torchrun's PET_LOG_DIR, PET_TEE);
    `marker` finds its processes later, the workers in their own sessions included."""
    env = dict(os.environ, HPUTRAIN_COMBINATION_RUN=marker, PET_TEE="3", PET_LOG_DIR=str(rank_logs))
    with open(log_path, "w") as log, open(err_path or os.devnull, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "hputrain.cli", *command], stdout=log,
                                stderr=err if err_path else subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def train_processes(argv: list[str], out: Path) -> Run:
    """`hputrain train` as a user starts it, in processes of its own, within TIMEOUT_S."""
    marker, log_path, err_path = f"{os.getpid()}-{out}", Path(f"{out}.log"), Path(f"{out}.err")
    start = time.perf_counter()
    proc = _start(["train", *argv, "--output-dir", str(out)], log_path, marker, Path(f"{out}-ranks"),
                  err_path)
    try:
        status = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        status = f"timed out after {TIMEOUT_S} s (a hang?)"
        _stop(proc)
    seconds = time.perf_counter() - start
    leftovers = _end_leftovers(marker, grace_s=0 if isinstance(status, str) else 10.0)
    if leftovers and status == 0:
        status = "exited 0 but left processes behind"
    err = err_path.read_text() + "".join(f"\nleft behind: {line}" for line in leftovers)
    log = f"{log_path.read_text()}\n--- stderr ---\n{err}"
    return Run(out, status, log, seconds, err=err)


# -- the 2-process cases: one pair of processes for many runs (tests/combinations_ranks.py) -------

RANKS_SCRIPT = str(Path(__file__).with_name("combinations_ranks.py"))


def _progress(plan: Path) -> dict:
    """name -> {rank: {"start": time, "status": ..., "seconds": ...}} from both ranks' notes."""
    runs: dict = {}
    for rank in (0, 1):
        path = Path(f"{plan}.rank{rank}.jsonl")
        for line in path.read_text().splitlines() if path.is_file() else []:
            note = json.loads(line)
            entry = runs.setdefault(note["name"], {}).setdefault(rank, {})
            entry.update({"start": note["time"]} if note["event"] == "start" else note)
    return runs


def _hung(plan: Path) -> str | None:
    """The run that has been going on one rank longer than RUN_TIMEOUT_S, if any."""
    for name, ranks in _progress(plan).items():
        for entry in ranks.values():
            if "status" not in entry and time.time() - entry["start"] > RUN_TIMEOUT_S:
                return name
    return None


def _run_pool(runs: list[dict], plan: Path) -> tuple[dict, str]:
    """Launch two ranks on `runs`; stop them when a run goes past RUN_TIMEOUT_S. Returns
    (name -> {"status", "seconds"} for the runs that started, what ended the pool)."""
    plan.write_text(json.dumps(runs))
    marker = f"{os.getpid()}-{plan}"
    proc = _start(["launch", "--nproc-per-node", "2", "--cpu", RANKS_SCRIPT, str(plan)],
                  Path(f"{plan}.log"), marker, Path(f"{plan}-ranks"))
    hung = None
    while proc.poll() is None and hung is None:
        time.sleep(0.5)
        hung = _hung(plan)
    if hung is not None:
        _stop(proc)
    # after a hang the pool was killed here: what is left of it is ended, not held against it
    leftovers = _end_leftovers(marker, grace_s=2.0 if hung else 10.0)
    ended = (f"{hung} timed out after {RUN_TIMEOUT_S} s (a hang?)" if hung
             else f"the launcher exited {proc.returncode}")
    leftovers = [] if hung else leftovers
    ended += "".join(f"; left behind: {line}" for line in leftovers)
    results = {}
    for name, ranks in _progress(plan).items():
        unended = f"timed out after {RUN_TIMEOUT_S} s (a hang?)" if name == hung else "did not end"
        statuses = [ranks.get(r, {}).get("status", unended) for r in (0, 1)]
        bad = [s for s in statuses if s != 0]
        results[name] = {"status": bad[0] if bad else ("0, but " + ended if leftovers else 0),
                         "seconds": max(ranks.get(r, {}).get("seconds", 0.0) for r in (0, 1)),
                         "ended": ended}
    return results, ended


def run_pooled(cases: list[dict], inputs: combos.Inputs, root: Path) -> dict:
    """Every run of the 2-process cases (each case's run, then its resumed run), in as few pairs
    of processes as failures allow: after a failed run the case's next run is left out and the
    cases left start in new processes. Returns run name -> result."""
    results, pending, pool = {}, list(cases), 0
    while pending:
        runs = [run for case in pending for run in _case_runs(case, inputs, root)]
        done, ended = _run_pool(runs, root / f"pool{pool}")
        results.update(done)
        failed = [i for i, case in enumerate(pending)
                  if any(done.get(run["name"], {}).get("status", 0) != 0
                         for run in _case_runs(case, inputs, root))]
        if not done:  # nothing started: the launcher itself failed; say so for every case
            results.update({run["name"]: {"status": ended, "seconds": 0.0, "ended": ended}
                            for run in runs})
            break
        pending = pending[failed[0] + 1:] if failed else []
        pending = [case for case in pending if _case_runs(case, inputs, root)[0]["name"] not in done]
        pool += 1
    return results


def _case_runs(case: dict, inputs: combos.Inputs, root: Path) -> list[dict]:
    name = combos.case_id(case)
    argv = combos.case_flags(case, inputs)
    first = str(root / name / "run")
    return [{"name": f"{name}/run", "argv": argv, "out": first},
            {"name": f"{name}/resumed", "out": str(root / name / "resumed"),
             "argv": [*argv, "--resume-from-checkpoint", f"{first}/checkpoint-1"]}]


def pooled_run(results: dict, run: dict, pool_root: Path) -> Run:
    """The Run of one pooled run: its status, both ranks' output and the launcher's."""
    out = Path(run["out"])
    result = results.get(run["name"], {"status": "not run (an earlier run of the case failed)",
                                       "seconds": 0.0, "ended": ""})
    logs = [f"--- {p.name} ---\n{p.read_text()}" for p in sorted(out.parent.glob(f"{out.name}.rank*.log"))]
    log = "\n".join(logs) + f"\n--- pool: {result['ended']} (launcher logs in {pool_root}) ---"
    return Run(out, result["status"], log, result["seconds"])


# -- what each case checks -------------------------------------------------------------------------

def check_run(run: Run, case: dict | None = None) -> list[dict]:
    """Exit 0, steps 1 and 2 logged with finite losses (and a finite validation loss when
    evaluated), a mixture of experts' router loss beside them: the step records."""
    assert run.status == 0, run.why()
    steps = run.steps()
    assert [r["step"] for r in steps] == [1, 2], run.why()
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps), run.why()
    assert all(math.isfinite(r["eval_loss"]) for r in run.evals()), run.why()
    if case is not None and case["model"] == "moe":  # asked by --router-aux-loss-coef
        assert all(r["aux_loss"] > 0 for r in steps), run.why()
    return steps


def check_reference(case: dict, run: Run) -> None:
    """GRPO with the starting weights as its reference (a frozen copy, or the adapters disabled):
    at step 1 the policy is still those weights, and the reference's log-probs run on the
    training forward's path (issue 39 item 3: autocast, lazy mode, the policy's dtype), so the
    KL is exactly 0, as in TRL."""
    if case["method"] == "grpo" and case["reference"] in ("ref_frozen", "ref_adapters"):
        if case["processes"] == "ep2" and case["precision"] == "bf16":
            # the frozen reference computes its experts whole, the policy splits them over the
            # two ranks, whose pairs travel in bf16 under autocast (issue 47 item 3): the same
            # weights, rounded at another place (measured: 3e-8)
            assert abs(run.steps()[0]["kl"]) <= 1e-6, run.why()
        else:
            assert run.steps()[0]["kl"] == 0.0, run.why()


def check_final(case: dict, inputs: combos.Inputs, run: Run) -> None:
    """final/ loads as what it is (a whole model, or adapters on the base) and gives finite logits."""
    final = run.out / "final"
    base = inputs.models(case)[0]
    # a vision-language model's final/ loads as one, with its processor beside it (issue 41)
    auto = (transformers.AutoModelForImageTextToText if case["model"] in combos.VLM_LEVELS
            else transformers.AutoModelForCausalLM)
    model = auto.from_pretrained(base if case["adapters"] == "lora" else final)
    if case["adapters"] == "lora":
        assert not (final / "model.safetensors").exists(), run.why()
        model = peft.PeftModel.from_pretrained(model, final)
    batch = {"input_ids": torch.tensor([[1, 5, 7, 9]])}
    if case["model"] in combos.VLM_LEVELS:  # an image through the tower, made by final/'s own processor
        from PIL import Image

        processor = transformers.AutoProcessor.from_pretrained(final)
        batch = processor(text=["<image>what is it"], images=[Image.new("RGB", (40, 30), "red")],
                           return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert torch.isfinite(logits).all(), run.why()


def check_resumed(case: dict, first: Run, resumed: Run) -> None:
    """The run continued from checkpoint-1 logs step 2 alone, with the uninterrupted run's loss;
    both end on the same weights, so the same validation loss."""
    steps = [r for r in resumed.steps()]
    assert [r["step"] for r in steps] == [2], resumed.why()
    expected = first.steps()[1]
    assert steps[0]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6), (
        f"resumed loss {steps[0]['loss']} != {expected['loss']} uninterrupted" + resumed.why())
    if case["validation"] == "val":
        ours, theirs = first.evals()[-1]["eval_loss"], resumed.evals()[-1]["eval_loss"]
        assert theirs == pytest.approx(ours, rel=1e-5, abs=1e-6), resumed.why()


@pytest.fixture(scope="module")
def pooled(request, inputs, tmp_path_factory) -> tuple[Path, dict]:
    """Every selected 2-process case of this module, run once in pooled processes: (root, results)."""
    cases = {}
    for item in request.session.items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if item.module is request.module and case and case["processes"] != "1proc":
            cases.setdefault(combos.case_id(case), case)
    root = tmp_path_factory.mktemp("pooled")
    return root, run_pooled(list(cases.values()), inputs, root)


def case_runs(case: dict, inputs: combos.Inputs, tmp_path: Path, request) -> tuple[Run, Run | None]:
    """(the 2-step run, the run resumed from its checkpoint-1, or None where the first failed)."""
    if case["processes"] != "1proc":
        root, results = request.getfixturevalue("pooled")
        first, resumed = _case_runs(case, inputs, root)
        return pooled_run(results, first, root), pooled_run(results, resumed, root)
    capsys = request.getfixturevalue("capsys")
    argv = combos.case_flags(case, inputs)
    first = _train_here(argv, tmp_path / "run", capsys)
    if first.status != 0:
        return first, None
    resume = ["--resume-from-checkpoint", str(first.out / "checkpoint-1")]
    return first, _train_here([*argv, *resume], tmp_path / "resumed", capsys)


def run_case(case: dict, inputs: combos.Inputs, tmp_path: Path, request) -> None:
    first, resumed = case_runs(case, inputs, tmp_path, request)
    check_run(first, case)
    check_reference(case, first)
    assert (first.out / "checkpoint-1").is_dir(), first.why()
    check_final(case, inputs, first)
    assert resumed.status == 0, resumed.why()
    check_resumed(case, first, resumed)


@pytest.mark.parametrize("case", PAIRWISE, ids=combos.case_id)
def test_pairwise(case, inputs, tmp_path, request):
    run_case(case, inputs, tmp_path, request)


@pytest.mark.slow  # the pooled case dpo-lora-ddp2-eager-val-ref_adapters-fp32-file runs it in make test
def test_issue_item_3_as_a_user_starts_it(inputs, tmp_path):
    """The pooled cases share their two processes; this one is `hputrain train --devices 2` itself
    (the relaunch, the launcher's end): LoRA DPO whose 3 validation pairs leave rank 1 without a
    batch exits 0 within TIMEOUT_S, leaves no process behind, and its final/ loads."""
    case = combos.EARLIER | combos.ISSUE_CASES[2]  # written before the accumulation factor
    run = train_processes(combos.case_flags(case, inputs), tmp_path / "run")
    check_run(run)
    assert run.evals(), run.why()  # the validation split was evaluated
    check_final(case, inputs, run)


@pytest.mark.slow
@pytest.mark.parametrize("case", combos.covering_cases(strength=3), ids=combos.case_id)
def test_triples(case, inputs, tmp_path, request):
    run_case(case, inputs, tmp_path, request)


# -- the table itself ------------------------------------------------------------------------------

def _all_allowed() -> list[dict]:
    import itertools

    cases = [dict(zip(combos.FACTORS, levels)) for levels in itertools.product(*combos.FACTORS.values())]
    return [case for case in cases if combos.allowed(case)]


@pytest.mark.parametrize("strength", [2, 3])
def test_the_table_covers_every_tuple_a_user_can_ask_for(strength):
    """Every pair (triple) of levels found together in some allowed case is in a chosen case;
    every chosen case is allowed; the names are unique; the issue's three cases come first."""
    import itertools

    chosen = PAIRWISE if strength == 2 else combos.covering_cases(strength=3)
    names = list(combos.FACTORS)

    def tuples(case):
        return {tuple((n, case[n]) for n in group) for group in itertools.combinations(names, strength)}

    wanted = set().union(*map(tuples, _all_allowed()))
    assert wanted - set().union(*map(tuples, chosen)) == set()
    assert all(combos.allowed(case) for case in chosen)
    assert len({combos.case_id(case) for case in chosen}) == len(chosen)
    assert chosen[:len(combos.ISSUE_CASES)] == [combos.EARLIER | case for case in combos.ISSUE_CASES]


def test_refused_and_meaningless_pairs_are_left_out():
    allowed = _all_allowed()
    levels = [set(case.items()) for case in allowed]
    for pair in combos.REFUSED_PAIRS:
        assert not any(pair <= case for case in levels)
    assert not any(case["reference"] != combos.NA for case in allowed
                   if case["method"] not in ("dpo", "grpo"))
    assert not any(case["reference"] == "ref_precomputed" for case in allowed
                   if case["method"] == "grpo")
    assert any(case["validation"] == "val" for case in allowed if case["method"] == "grpo")
    assert not any(case["reference"] == "ref_adapters" for case in allowed if case["adapters"] == "full")
    assert not any(case["packing"] != combos.NA for case in allowed
                   if case["method"] in ("text", "dpo", "grpo"))
    # issue 41: image rows are SFT rows read from a file (no text, pairs, prompts, folders, streams)
    assert {(case["method"], case["source"]) for case in allowed if case["model"] == "vlm"} == {
        ("chat", "file"), ("completion", "file")}
    # issue 47: expert parallelism on the mixture of experts only, in eager mode
    assert {(case["model"], case["mode"]) for case in allowed if case["processes"] == "ep2"} == {
        ("moe", "eager")}
    # each factor's every level is still in some allowed case
    assert all({case[f] for case in allowed} == set(levels_) for f, levels_ in combos.FACTORS.items())


def _error_lines(err: str) -> set[str]:
    """The error lines of stderr: each rank's `hputrain: error: ...` (two ranks' may share a
    line) and the launcher's `rank R failed (exit code 2): LINE` (`ranks 0, 1 failed ...` for ranks
    that failed alike), as the lines they carry."""
    said, rest = set(), []
    err = re.sub(r"\[\w+?\d+\]:", "", err)  # the rank prefix of torchrun's tee (PET_TEE)
    for line in err.splitlines():
        launcher = re.fullmatch(r"hputrain launch: ranks? [\d, -]+ failed \(exit code 2\): (.*)", line)
        said.update([launcher.group(1)] if launcher else [])
        rest += [] if launcher else [line]
    for piece in re.split(r"hputrain: error: ", "\n".join(rest)):
        said.update([f"hputrain: error: {piece.strip()}"] if piece.strip() else [])
    return said


# Each refusal that needs real processes starts two (~12 s): make test keeps one of them.
SLOW_REFUSALS = ("lazy+fsdp2", "fsdp2+context_parallel", "packed_sft+context_parallel", "dpo+context_parallel",
                 "lazy+ep2")


@pytest.mark.parametrize("refusal", [pytest.param(r, marks=pytest.mark.slow) if r.name in SLOW_REFUSALS
                                     else r for r in combos.REFUSED], ids=lambda refusal: refusal.name)
def test_refused_pairs_say_one_line_and_exit_2(refusal, inputs, tmp_path, capsys):
    """Refused before any rank starts: exactly one line on stderr. Refused in the ranks: every
    rank says the one line and the launcher repeats it (`rank R failed (exit code 2): LINE`).
    Either way exit 2, no traceback, no process left."""
    argv, line = combos.refusal_flags(refusal, inputs)
    run = (train_processes(argv, tmp_path / "run") if refusal.processes
           else _train_here(argv, tmp_path / "run", capsys))
    assert run.status == 2, run.why()
    assert "Traceback" not in run.err and "left behind" not in run.err, run.why()
    if "hputrain launch:" not in run.err:
        assert run.err.strip() == line, run.why()
    assert _error_lines(run.err) == {line}, run.why()
