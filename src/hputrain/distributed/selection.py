"""Which strategy a run uses, and the mesh dimensions it needs before the processes join."""
from __future__ import annotations

from ..config.sections import ParallelismSettings
from ..errors import InputError
from ..models.kind import registered
from .group import ProcessGroup
from .strategies import DDP, FastDDP, Strategy


def set_layout(settings: ParallelismSettings, group: ProcessGroup) -> None:
    """Before the processes join: the refusals of the kinds' layouts (an expert-parallel one:
    kinds/moe/), and the mesh's dimensions the strategy needs (fsdp's shards)."""
    for kind in registered():
        kind.check_layout(settings, group.world_size)
    if settings.strategy == "fsdp" and group.distributed:
        from .fsdp import dp_shard_size

        group.set_dp_shard(dp_shard_size(settings, group.world_size))


def select_strategy(settings: ParallelismSettings, group: ProcessGroup, accelerator=None, precision=None) -> Strategy:
    """strategy="auto": ddp across processes, single for one. fsdp needs an accelerator that
    runs it in its execution mode (not lazy). expert_parallel_size > 1: the experts split over
    ranks (expert_parallel.py), the strategy on the rest."""
    strategy = _strategy(settings, group, accelerator, precision)
    for kind in registered():  # a kind's parallel layout around it (expert parallelism)
        strategy = kind.parallel(strategy, settings, group)
    return strategy


def _strategy(settings: ParallelismSettings, group: ProcessGroup, accelerator, precision) -> Strategy:
    name = settings.strategy
    if name == "fsdp":
        if accelerator is not None and not accelerator.supports_fsdp():
            raise InputError(f"strategy='fsdp' runs in eager or compile mode, not in execution_mode="
                             f"{accelerator.execution_mode!r} on {accelerator.name}: set "
                             "execution_mode='eager' or 'compile'")
        from .fsdp import FSDP

        return FSDP(group, settings, precision)
    if name == "auto":
        name = "ddp" if group.distributed else "single"
    if name == "single":
        if group.distributed:
            raise InputError(f"strategy 'single' runs one process, but WORLD_SIZE={group.world_size}; "
                             "use ddp or fast_ddp")
        return Strategy()
    if not group.distributed:
        return Strategy()  # ddp of one process is one process
    if accelerator is not None and not accelerator.collectives_take_device_tensors():
        raise InputError(f"execution_mode={accelerator.execution_mode!r} on {accelerator.name} "
                         f"runs one process, not {group.world_size}: the collectives between "
                         "processes take no lazy tensors; rehearse one rank (devices=1) or set "
                         "execution_mode='eager'")
    if name == "ddp":
        return DDP(settings.ddp_bucket_cap_mb, settings.ddp_find_unused_parameters)
    return FastDDP(group, settings.fast_ddp_bf16_gradients)
