"""Stops delivered on purpose, for tests/distributed/test_stop_agreement.py: started by `hputrain launch` on 2
processes, it runs several cases one after another in the same processes, each in its own folder.

    stop_script.py OUT STRATEGY CASE [CASE ...]

A case is KIND.PHASE.RANKS, optionally +save (the run also saves inside the loop at step K):

    KIND    sigterm, sigint: the signal raised in-process (signal.raise_signal) on RANKS
            mixed: SIGINT on rank 0, SIGTERM on rank 1 (RANKS is "both")
            launcher: RANKS sends SIGTERM to the launcher, which passes it on to every worker
            stop: a callback sets trainer.should_stop on RANKS
            nan: the model's loss is NaN on RANKS at step K; PHASE says where the trainer sees it
                 ("log": logging_steps 1; "save": no logging before a save at step K)
    PHASE   where during step K (of N) it happens, see PHASES
    RANKS   0, 1 or both

For each case every rank first trains until it stops (or fails), then resumes the case's latest
checkpoint up to step N and compares its weights, shard by shard, with those of one uninterrupted
run of N steps made at the start. Each rank appends one JSON line per case to OUT/results-RANK.jsonl
(the step it stopped at, the signal it stopped for, its exit status, the checkpoints, whether the
resumed run ended on the uninterrupted run's weights). The process then exits as the last case's
run would: 128 + the signal, 2 with "hputrain: error: ..." on stderr after a NaN, else 0.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Callback, Trainer, TrainingArguments  # noqa: E402
from hputrain.errors import InputError  # noqa: E402
from hputrain.models.gpt import GPT, GPTConfig  # noqa: E402
from tests.dist_script import data  # noqa: E402

STEPS, K = 6, 3  # each run is N=6 steps; things happen during step K=3

PHASES = {
    # phase: what it is; the step the ranks must stop at is K, except where said
    "before_agreement": "just before step K's agreement (the stop is step K-1)",
    "during_agreement": "in step K's agreement, after this rank read its flags, before the all-reduce",
    "after_agreement": "in step K's agreement, after the all-reduce returned",
    "step_begin": "on_step_begin of step K",
    "forward": "in the model's forward of step K",
    "backward": "in the backward of step K (a hook on the first block's output), DDP's all-reduce under way",
    "optimizer": "in the optimizer step of step K (a step pre-hook)",
    "step_end": "on_step_end of step K",
    "log": "on_log of step K's record",
    "evaluate": "in the model's forward during the evaluation at step K",
    "on_evaluate": "on_evaluate at step K",
    "save": "in the save at step K (its first barrier)",
    "on_save": "on_save at step K",
}
SAVING_PHASES = ("save", "on_save")  # these need a save at step K


def parse(case: str) -> dict:
    spec, _, extra = case.partition("+")
    kind, phase, ranks = spec.split(".")
    assert phase in PHASES and ranks in ("0", "1", "both") and extra in ("", "save"), case
    return {"name": case, "kind": kind, "phase": phase,
            "ranks": (0, 1) if ranks == "both" else (int(ranks),),
            "saves_at_k": extra == "save" or phase in SAVING_PHASES}


def arguments(out: Path, strategy: str, case: dict | None, resume: bool = False) -> TrainingArguments:
    """The run's settings: the same numbers for every case (only when it logs and saves differs)."""
    logging_steps, save_steps = 1, 0  # save_steps 0: only at the end (or at the stop)
    if case is not None and case["saves_at_k"]:
        save_steps = K
    if case is not None and case["kind"] == "nan" and case["phase"] == "save":
        logging_steps = 100  # no log before the save at step K: its check sees the NaN first
    if case is None or resume:
        save_steps = -1  # the reference and the resumed runs need no checkpoint
    return TrainingArguments(
        output_dir=str(out), max_steps=STEPS, learning_rate=3e-3, per_device_train_batch_size=4,
        logging_steps=logging_steps, eval_steps=K, save_steps=save_steps, disable_tqdm=True,
        throughput_warmup_steps=0, accelerator="cpu", strategy=strategy, ddp_timeout=60,
        report_to="none", resume_from_checkpoint="latest" if resume else None)


def new_trainer(out: Path, strategy: str, case: dict | None, callbacks=(), resume: bool = False) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    return Trainer(model, arguments(out, strategy, case, resume), train_dataset=data(),
                   eval_dataset=data(16), callbacks=list(callbacks))


def local_weights(model) -> dict:
    """This rank's part of each weight (its shard under fsdp), copied."""
    return {key: (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
            for key, value in model.state_dict().items()}


def called_from(name: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


class Inject(Callback):
    """Does the case's deed once, on the case's ranks, at the case's phase of step K."""

    def __init__(self, case: dict, rank: int) -> None:
        self.case, self.rank, self.trainer, self.done = case, rank, None, False

    # -- the deed ----------------------------------------------------------------------------
    def fire(self, phase: str, step: int) -> None:
        """`step`: the step the phase belongs to, by the trainer's count at that moment."""
        case = self.case
        if self.done or phase != case["phase"] or step != K or self.rank not in case["ranks"]:
            return
        self.done = True
        kind = case["kind"]
        if kind == "stop":
            self.trainer.should_stop = True
        elif kind == "launcher":  # passed on to every rank; here, wait for it (so it lands in this phase)
            os.kill(int(os.environ["HPUTRAIN_LAUNCHER_PID"]), signal.SIGTERM)
            wait_until(lambda: self.trainer._signals.received is not None)
        elif kind in ("sigterm", "sigint", "mixed"):
            signum = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}.get(kind)
            if kind == "mixed":
                signum = signal.SIGINT if self.rank == 0 else signal.SIGTERM
            signal.raise_signal(signum)

    def attach(self, trainer: Trainer) -> None:
        """The phases no callback hook reaches: wrappers and module hooks on this trainer."""
        self.trainer = trainer
        step = lambda: trainer.global_step + 1  # the step under way (global_step counts those done)
        agree, host_sum, barrier = trainer._agree_to_stop, trainer.group.host_sum, trainer.group.barrier

        def agree_to_stop(counts, seen, *failed):
            self.fire("before_agreement", step())
            return agree(counts, seen, *failed)

        def wrapped_host_sum(values):
            in_agreement = called_from("_agree_to_stop")
            if in_agreement:
                self.fire("during_agreement", step())
            result = host_sum(values)
            if in_agreement:
                self.fire("after_agreement", step())
            return result

        def wrapped_barrier():
            if called_from("save_checkpoint"):
                self.fire("save", trainer.global_step)
            return barrier()

        trainer._agree_to_stop, trainer.group.host_sum, trainer.group.barrier = (
            agree_to_stop, wrapped_host_sum, wrapped_barrier)
        model = trainer.model
        model.register_forward_pre_hook(
            lambda module, args: self.fire("forward" if module.training else "evaluate",
                                           step() if module.training else trainer.global_step))

        def on_block_output(module, args, output):
            if module.training and output.requires_grad:
                output.register_hook(lambda grad: self.fire("backward", step()))

        model.blocks[0].register_forward_hook(on_block_output)
        if self.case["kind"] == "nan":
            model.register_forward_hook(self._nan_loss)

    def _nan_loss(self, module, args, output):
        if module.training and self.trainer.global_step + 1 == K and self.rank in self.case["ranks"]:
            return {**output, "loss": output["loss"] * float("nan")}
        return output

    # -- the callback hooks ------------------------------------------------------------------
    def on_train_begin(self, trainer):
        trainer.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: self.fire("optimizer", trainer.global_step + 1))

    def on_step_begin(self, trainer):
        self.fire("step_begin", trainer.global_step + 1)

    def on_step_end(self, trainer):
        self.fire("step_end", trainer.global_step)

    def on_log(self, trainer, record):
        if "loss" in record:
            self.fire("log", record["step"])

    def on_evaluate(self, trainer, metrics):
        self.fire("on_evaluate", trainer.global_step)

    def on_save(self, trainer, folder):
        self.fire("on_save", trainer.global_step)


def wait_until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def run_case(out: Path, strategy: str, case: dict, rank: int, reference: dict) -> dict:
    inject = Inject(case, rank)
    trainer = new_trainer(out, strategy, case, [inject])
    inject.attach(trainer)
    result = {"case": case["name"], "rank": rank}
    late = []
    if case["kind"] == "launcher":  # the SIGTERM the launcher passes on may reach a rank only once
        # its train() has returned: noted here (the trainer puts this handler back), not fatal
        signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
    try:
        output = trainer.train()
    except InputError as exc:  # a NaN: every rank must stop with the same line
        result.update(error=str(exc), exit=2, step=trainer.global_step)
    else:
        signum = output.interrupted_by
        result.update(step=output.global_step, signal=signum, should_stop=trainer.should_stop,
                      exit=128 + signum if signum is not None else 0, fired=inject.done)
    if case["kind"] == "launcher":  # before the resumed run, which it would stop
        wait_until(lambda: trainer._signals.received is not None or late)
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    result["checkpoints"] = checkpoints
    if checkpoints:
        result["consolidated"] = (out / f"checkpoint-{checkpoints[-1]}" / "model.safetensors").exists()
        resumed = new_trainer(out, strategy, case, resume=True)
        resumed.train()
        mine = local_weights(resumed.model)
        result["resumed_identical"] = all(torch.equal(mine[key], reference[key]) for key in reference)
    return result


def main(out: str, strategy: str, cases: list[str]) -> int:
    out = Path(out)
    rank = int(os.environ["RANK"])
    reference = new_trainer(out / "uninterrupted", strategy, None)
    reference.train()
    weights = local_weights(reference.model)
    result = {}
    for name in cases:
        start = time.monotonic()
        result = run_case(out / name, strategy, parse(name), rank, weights)
        result["seconds"] = round(time.monotonic() - start, 2)
        with open(out / f"results-{rank}.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
    torch.distributed.barrier()  # each rank's work done before either exits (see test_stop_agreement)
    if "error" in result:
        print(f"hputrain: error: {result['error']}", file=sys.stderr)
    return result.get("exit", 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
