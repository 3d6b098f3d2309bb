"""Optimizer and learning-rate schedules."""
from __future__ import annotations

import math

import torch

from ..checkpoint.saving import rng_note
from ..config.accelerator_config import AcceleratorConfig
from ..config.names import OPTIMIZERS
from ..config.sections import OptimizerSettings


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (weights of Linear, embeddings); leave biases and norm gains alone,
    as the Hugging Face Trainer and nanoGPT do."""
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def create_optimizer(model, settings: OptimizerSettings, config: AcceleratorConfig, accelerator):
    """AdamW from the accelerator: fused where the device has it, where settings.optim asks for it
    (adamw_torch_fused, adamw_hpu) or where the config says (its use_fused_adam wins, as in
    Optimum for Intel Gaudi, whose scripts pair optim="adamw_torch" with a fused GaudiConfig)."""
    fused = config.use_fused_adam if config.use_fused_adam is not None else OPTIMIZERS[settings.optim]
    return accelerator.make_adamw(
        parameter_groups(model, settings.weight_decay), lr=settings.learning_rate,
        betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_epsilon,
        weight_decay=settings.weight_decay, fused=fused)


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    """The multiplier of the peak learning rate at each step: linear warm-up from 0, then
    linear decay to 0, cosine decay to 0, or constant."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(progress, 1.0)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress
    return factor


def warmup_steps(settings: OptimizerSettings, total_steps: int) -> int:
    """warmup_steps, or warmup_ratio of the total steps rounded up (the Hugging Face Trainer's rule)."""
    return settings.warmup_steps or math.ceil(settings.warmup_ratio * total_steps)


def create_scheduler(optimizer, settings: OptimizerSettings, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(settings.lr_scheduler_type, warmup_steps(settings, total_steps), total_steps))


def resume_notes(state: dict, global_batch_size: int, scheduler, learning_rate: float,
                 world_size: int) -> list[str]:
    """One line for each setting a resumed run changes (the global batch, the learning rate),
    saying which value wins, and one for the ranks a checkpoint of fewer processes has no
    generator state for. `state` is the checkpoint's trainer state ({} for a fresh run),
    `scheduler` the one it was loaded into, `world_size` the run's processes."""
    lines = []
    saved_batch = state.get("global_batch_size")
    if saved_batch is not None and saved_batch != global_batch_size:
        lines.append(f"resuming with a global batch of {global_batch_size} samples where the "
                     f"checkpoint's run had {saved_batch}: {global_batch_size} wins, so "
                     "the steps from here see other samples than the original run would have")
    saved_lr = scheduler.base_lrs[0] if state else None
    if saved_lr is not None and not math.isclose(saved_lr, learning_rate, rel_tol=1e-9):
        lines.append(f"resuming with learning_rate {learning_rate:g} where the checkpoint's "
                     f"run had {saved_lr:g}: the checkpoint's wins (its schedule continues)")
    note = rng_note(state, world_size)
    return lines if note is None else [*lines, note]
