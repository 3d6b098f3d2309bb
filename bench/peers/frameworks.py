"""One training run, the same in five frameworks: a hand-written PyTorch loop, hputrain's Trainer,
the Hugging Face Trainer, Lightning's Trainer and Accelerate.

Every run trains the built-in GPT from the same seed on the same windows of the same corpus, with
the same settings: batch, sequence length, bf16 autocast (or fp32), torch's fused AdamW (lr 1e-3,
betas (0.9, 0.999), eps 1e-8, weight decay 0.1 on matrices only), gradients clipped to norm 1.0,
linear warm-up then linear decay to 0, the loss logged every 10 steps by the framework's own
logging, data loaded in the main process, no evaluation, no checkpoints, no progress bar.

A `Probe` reads what happens from inside the model and the optimizer, the same way in every
framework: the time each step's forward pass starts (so start-up, data set-up and the end of the
run never count) and the page faults so far, torch's thread count, whether autocast was on inside
the forward pass, the optimizer actually built, the learning rate of every step, the gradient norm
the optimizer saw (after clipping) in the first steps, and the loss.

Run by run.py, one framework per process; it imports the peers only inside their own function.
"""
from __future__ import annotations

import resource
import tempfile
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from hputrain.models.gpt import GPT, GPTConfig

LR, BETAS, EPS, WEIGHT_DECAY, CLIP, LOG_EVERY = 1e-3, (0.9, 0.999), 1e-8, 0.1, 1.0, 10

# What a peer needs, beyond its own settings, to train as the others do.
WORKAROUNDS = {
    "lightning": "Trainer(gradient_clip_val=1.0) refuses torch's fused AdamW under precision="
                 "'bf16-mixed' (\"does not allow for gradient clipping because it performs "
                 "unscaling of gradients internally\"), although bf16 needs no unscaling; the "
                 "LightningModule clips instead, in configure_gradient_clipping, with "
                 "torch.nn.utils.clip_grad_norm_(..., 1.0, foreach=True), at the same point of the "
                 "step (after backward, before optimizer.step).",
}


class LM(torch.nn.Module):
    """The built-in GPT as every framework here gets it. The wrapper only hides `GPT.config` (a
    dataclass), which the Hugging Face Trainer would take for a PretrainedConfig and write to."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        return self.gpt(input_ids, labels=labels)


def build_model(opts) -> LM:
    torch.manual_seed(opts.seed)
    return LM(GPT(GPTConfig.from_size(opts.size, block_size=opts.seq_len)))


class Probe:
    """Stamps and settings read from inside the model and the optimizer; see the module docstring."""

    def __init__(self, model: LM, device_type: str, checked_steps: int) -> None:
        self.device_type, self.checked_steps = device_type, checked_steps
        self.synchronize = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
        self.stamps: list[float] = []
        self.faults: list[int] = []  # minor page faults so far, at each stamp
        self.lrs: list[float] = []
        self.clipped_norms: list[float] = []
        self.losses: list[torch.Tensor] = []
        self.autocast: str | None = None
        self.optimizer: dict | None = None
        self.threads: int | None = None
        model.register_forward_pre_hook(self._stamp)
        model.register_forward_hook(self._loss)
        # The embedding runs inside any wrapper the framework put around forward (Accelerate and
        # the HF Trainer enter autocast inside model.forward, after the model's own pre-hooks).
        model.gpt.wte.register_forward_pre_hook(self._autocast)
        register_optimizer_step_post_hook(self._after_step)

    def _stamp(self, module, args) -> None:
        if not self.stamps:
            self.threads = torch.get_num_threads()  # what the framework left it at
        self.synchronize()
        self.stamps.append(time.perf_counter())
        self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

    def _loss(self, module, args, output) -> None:
        self.losses.append(output["loss"].detach())

    def _autocast(self, module, args) -> None:
        if self.autocast is None:
            dtype = str(torch.get_autocast_dtype(self.device_type)).removeprefix("torch.")
            self.autocast = dtype if torch.is_autocast_enabled(self.device_type) else "off"

    def _after_step(self, optimizer, args, kwargs) -> None:
        """After optimizer.step() and before the scheduler's step: this step's learning rate, and
        in the first steps (left out of the timing) the norm of the gradients it applied."""
        self.lrs.append(optimizer.param_groups[0]["lr"])
        if self.optimizer is None:
            self.optimizer = _describe(optimizer)
        if len(self.lrs) <= self.checked_steps:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.clipped_norms.append(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item())

    def record(self) -> dict:
        last = self.losses[-LOG_EVERY:]
        timed = self.faults[self.checked_steps:]
        faults = (timed[-1] - timed[0]) / (len(timed) - 1) if len(timed) > 1 else None
        return {"stamps": self.stamps, "lrs": self.lrs, "clipped_norms": self.clipped_norms,
                "autocast": self.autocast, "optimizer": self.optimizer, "threads": self.threads,
                "forward_calls": len(self.stamps), "page_faults_per_step": faults,
                "final_loss": torch.stack(last).float().mean().item() if last else None}


def _describe(optimizer) -> dict:
    groups = optimizer.param_groups
    return {"type": type(optimizer).__name__, "fused": bool(groups[0].get("fused")),
            "betas": list(groups[0]["betas"]), "eps": groups[0]["eps"],
            "weight_decay": [g["weight_decay"] for g in groups],
            "params": [len(g["params"]) for g in groups]}


# -- what the hand-written runs share --------------------------------------------------------------

def fused_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """Decay on matrices (linear weights, embeddings), none on norm gains, as every trainer here does."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS, fused=True)


def linear_schedule(optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 over `warmup` steps, then linear decay to 0 at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def shuffled_loader(data, opts) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=opts.batch, shuffle=True, drop_last=True,
                                       num_workers=0, generator=torch.Generator().manual_seed(opts.seed))


def _autocast(opts):
    return torch.autocast(opts.device, dtype=torch.bfloat16, enabled=opts.bf16)


# -- the five runs ----------------------------------------------------------------------------------

def run_loop(model, data, opts) -> None:
    """Plain PyTorch, written as nanoGPT would: forward under autocast, backward, clip, step."""
    device = torch.device(opts.device)
    model.to(device).train()
    optimizer = fused_adamw(model)
    scheduler = linear_schedule(optimizer, opts.lr_warmup, opts.steps)
    batches = iter(shuffled_loader(data, opts))
    for step in range(1, opts.steps + 1):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        with _autocast(opts):
            loss = model(**batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)


def run_hputrain(model, data, opts) -> None:
    from hputrain import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, accelerator=opts.device, max_steps=opts.steps, seed=opts.seed,
            per_device_train_batch_size=opts.batch, bf16=opts.bf16, learning_rate=LR,
            adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=WEIGHT_DECAY,
            max_grad_norm=CLIP, lr_scheduler_type="linear", warmup_steps=opts.lr_warmup,
            logging_steps=LOG_EVERY, save_steps=-1, disable_tqdm=True)
        Trainer(model, args, train_dataset=data).train()  # fused AdamW is the default off Gaudi


def run_hf(model, data, opts) -> None:
    import transformers

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, use_cpu=opts.device == "cpu", max_steps=opts.steps, seed=opts.seed,
            per_device_train_batch_size=opts.batch, bf16=opts.bf16, learning_rate=LR,
            adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=WEIGHT_DECAY,
            optim="adamw_torch_fused", max_grad_norm=CLIP, lr_scheduler_type="linear",
            warmup_steps=opts.lr_warmup, logging_strategy="steps", logging_steps=LOG_EVERY,
            eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
            dataloader_num_workers=0, dataloader_drop_last=True)
        transformers.Trainer(model=model, args=args, train_dataset=data).train()


def run_lightning(model, data, opts) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch)["loss"]
            self.log("train_loss", loss)  # written by the logger every log_every_n_steps
            return loss

        def configure_optimizers(self):
            optimizer = fused_adamw(self.model)
            scheduler = linear_schedule(optimizer, opts.lr_warmup, opts.steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            # See WORKAROUNDS["lightning"]: Trainer(gradient_clip_val=1.0) refuses a fused optimizer.
            torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP, foreach=True)

    with tempfile.TemporaryDirectory() as out:
        trainer = L.Trainer(
            accelerator="gpu" if opts.device == "cuda" else "cpu", devices=1,
            precision="bf16-mixed" if opts.bf16 else "32-true", max_steps=opts.steps,
            logger=CSVLogger(out), log_every_n_steps=LOG_EVERY, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0, default_root_dir=out)
        trainer.fit(LitLM(), train_dataloaders=shuffled_loader(data, opts))


def run_accelerate(model, data, opts) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=opts.device == "cpu", mixed_precision="bf16" if opts.bf16 else "no")
    optimizer = fused_adamw(model)
    scheduler = linear_schedule(optimizer, opts.lr_warmup, opts.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, shuffled_loader(data, opts),
                                                              scheduler)
    model.train()
    batches = iter(loader)
    for step in range(1, opts.steps + 1):
        loss = model(**next(batches))["loss"]  # prepare() put autocast around forward
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            accelerator.print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")


RUNS = {"loop": run_loop, "hputrain": run_hputrain, "hf": run_hf, "lightning": run_lightning,
        "accelerate": run_accelerate}
NAMES = {"loop": "hand-written loop", "hputrain": "hputrain Trainer", "hf": "Hugging Face Trainer",
         "lightning": "Lightning Trainer", "accelerate": "Accelerate"}


def measure(name: str, data, opts) -> dict:
    """Train with framework `name` and return what the probe saw."""
    model = build_model(opts)
    probe = Probe(model, opts.device, checked_steps=opts.warmup)
    RUNS[name](model, data, opts)
    return {"framework": name, **probe.record()}
