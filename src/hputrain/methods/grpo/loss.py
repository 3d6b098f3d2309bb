"""GRPO's loss and advantages, equal to TRL 1.16's GRPOTrainer on the same numbers.

Two halves, one per side of a rollout:

- `group_advantages`: the rewards of each prompt's `num_generations` completions become
  advantages (TRL's "sum_then_normalize": weighted sum of the reward functions, minus the group's
  mean, over the group's or the batch's standard deviation). Rewards live on the host, so
  `reward_metrics` may read them back freely.
- `grpo_loss`: one micro-batch's clipped-surrogate loss (loss types grpo, bnpo, dr_grpo, dapo),
  with TRL's k3 KL penalty when beta != 0, scaled for gradient accumulation as TRL scales it.
  Its metrics stay on the device as sums and counts (`METRIC_SLOTS`), because the training step
  must not wait for the host: each micro-batch keeps its own, and at a logging step
  `logged_means` gives TRL's values from every rank's: per micro-batch the global masked mean of
  each metric (`metric_means`: sums and counts added over the ranks), then TRL's logging
  average over the micro-batches (`logging_average`: NaN left out). TRL's clip_ratio/low_min
  and high_max are a minimum and a maximum over each micro-batch's completions on every rank,
  not sums: each micro-batch keeps its own (`GRPOLoss.extremes`), and `clip_extremes` combines
  them over ranks and averages them over micro-batches.

Only torch and the error type are imported: the loop, the rollout and the tests share this file.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ...errors import InputError, did_you_mean

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""The loss types computed here (TRL's clipped-surrogate family)."""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")

METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""TRL's names of the metrics `grpo_loss` sums, in the order of `METRIC_SLOTS`."""

METRIC_SLOTS = tuple(f"{name}/{part}" for name in METRICS for part in ("sum", "count"))
"""What each entry of `GRPOLoss.sums` holds: a sum and a count per metric. A metric the call did
not compute (kl when beta == 0, entropy when no entropies were given) has NaN in both, which
survives addition and all-reduce, so `metric_means` can leave it out."""


EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")
"""TRL's names of `GRPOLoss.extremes`: the smallest share of low-clipped tokens of a completion,
the largest share of high-clipped ones."""


@dataclasses.dataclass
class GRPOLoss:
    """One micro-batch's loss, its metric sums (a float32 tensor on the loss's device) and its
    EXTREMES over this rank's completions ([2] float32, NaN where no completion has a token)."""
    loss: torch.Tensor
    sums: torch.Tensor
    extremes: torch.Tensor | None = None


@dataclasses.dataclass
class Advantages:
    """Each completion's summed reward (NaN where no function scored it), its advantage and
    whether the spread it was divided by is zero."""
    rewards: torch.Tensor
    advantages: torch.Tensor
    std_is_zero: torch.Tensor


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction; NaN where at most one value
    counts (TRL's nanstd)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.reshape(()) if dim is None else std.squeeze(dim)


def grpo_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages,
              completion_mask, *, loss_type: str = "dapo", beta: float = 0.0, epsilon: float = 0.2,
              epsilon_high: float | None = None, delta: float | None = None,
              importance_sampling_level: str = "token", use_bias_correction_kl: bool = True,
              num_items_in_batch=None, num_processes: int = 1, gradient_accumulation_steps: int = 1,
              steps_per_generation: int = 1, max_completion_length: int | None = None,
              entropies: torch.Tensor | None = None) -> GRPOLoss:
    """TRL's GRPO loss of one training micro-batch. Tensors are [B, C] (advantages [B]);
    old_per_token_logps None means the policy's own, detached (one update per generation);
    ref_per_token_logps is needed iff beta != 0. num_items_in_batch (dapo): the active tokens of
    the whole generation batch, all ranks. max_completion_length (dr_grpo): defaults to C."""
    _check(loss_type, importance_sampling_level, beta, ref_per_token_logps, num_items_in_batch)
    mask = completion_mask.to(per_token_logps.dtype)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "sequence":
        # One ratio per completion: the mean log-ratio over its tokens (GSPO).
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    kl = None
    if beta != 0.0:
        to_ref = ref_per_token_logps - per_token_logps
        kl = torch.exp(to_ref) - to_ref - 1  # k3: unbiased and never negative
        if use_bias_correction_kl:  # the samples came from the old policy
            kl = kl * ratio
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    if delta is not None:  # two-sided clipping: the unclipped branch is bounded too
        ratio = torch.clamp(ratio, max=delta)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if kl is not None:
        per_token_loss = per_token_loss + beta * kl
    loss = _reduce(per_token_loss, mask, loss_type, num_items_in_batch, num_processes,
                   gradient_accumulation_steps, steps_per_generation, max_completion_length)
    sums = _metric_sums(mask, kl, entropies, ratio, advantages, epsilon, epsilon_high)
    return GRPOLoss(loss=loss, sums=sums,
                    extremes=_extremes(mask, ratio, advantages, epsilon, epsilon_high))


def _check(loss_type, importance_sampling_level, beta, ref_per_token_logps, num_items_in_batch):
    """One line for each argument grpo_loss cannot work with."""
    if loss_type not in LOSS_TYPES:
        raise InputError(f"GRPO loss_type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}"
                         f"{did_you_mean(loss_type, LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise InputError(f"importance_sampling_level {importance_sampling_level!r} is not one of "
                         f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    if beta != 0.0 and ref_per_token_logps is None:
        raise InputError(f"GRPO with beta={beta} needs the reference's per-token log-probs")
    if loss_type == "dapo" and num_items_in_batch is None:
        raise InputError("GRPO loss_type 'dapo' needs num_items_in_batch (the generation "
                         "batch's active tokens over all ranks)")


def _reduce(per_token_loss, mask, loss_type, num_items_in_batch, num_processes,
            gradient_accumulation_steps, steps_per_generation, max_completion_length):
    """The micro-batch's scalar, normalised as TRL normalises each loss type in training."""
    masked = per_token_loss * mask
    if loss_type == "grpo":  # mean over completions of each completion's token mean
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gradient_accumulation_steps
    if loss_type == "bnpo":  # token mean over the micro-batch
        return masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    if loss_type == "dr_grpo":  # a constant divisor: no length bias
        length = max_completion_length or mask.shape[-1]
        return masked.sum() / (per_token_loss.size(0) * length) / gradient_accumulation_steps
    # dapo: a token mean over the whole generation batch. num_items_in_batch counts the tokens of
    # steps_per_generation optimizer steps on all ranks; the loop sums the micro-batches of one
    # step and the ranks average, hence the rescaling to one accumulation window of one rank.
    items = _on_device(num_items_in_batch, masked.device).clamp(min=1.0)
    normaliser = items / num_processes * gradient_accumulation_steps / steps_per_generation
    return masked.sum() / normaliser


def _metric_sums(mask, kl, entropies, ratio, advantages, epsilon, epsilon_high) -> torch.Tensor:
    """The METRIC_SLOTS of one micro-batch, detached float32 on the device (no host read)."""
    def masked(x):
        if x is None:
            nan = _on_device(float("nan"), mask.device)
            return nan, nan
        x = x.detach().float()
        if x.shape[-1] == 1:  # sequence level: one value per completion, masked or not (as TRL)
            return x.sum(), _on_device(float(x.shape[0]), mask.device)
        return (x * mask).sum(), mask.sum().float()

    ratio = ratio.detach()
    low = (ratio < 1 - epsilon) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    parts = [masked(kl), masked(entropies), masked(low.float()), masked(high.float()),
             masked((low | high).float())]
    return torch.stack([value for part in parts for value in part])


def _extremes(mask, ratio, advantages, epsilon, epsilon_high) -> torch.Tensor:
    """[smallest low-clipped share, largest high-clipped share] over this micro-batch's
    completions: each completion's share of its tokens (its one value at sequence level); a
    completion without tokens (0/0, NaN) is left out, as TRL's nanmin and nanmax leave it; NaN
    when every one is. On the device, no host read."""
    ratio = ratio.detach()
    low = ((ratio < 1 - epsilon) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    if low.shape[-1] == 1:
        shares = torch.stack([low[:, 0], high[:, 0]])
    else:
        mask = mask.float()
        shares = torch.stack([(low * mask).sum(-1), (high * mask).sum(-1)]) / mask.sum(-1)
    inf = torch.full_like(shares, float("inf"))
    smallest = torch.where(shares.isnan(), inf, shares).amin(dim=1)  # [2]: low's min, high's min
    largest = torch.where(shares.isnan(), -inf, shares).amax(dim=1)
    extremes = torch.stack([smallest[0], largest[1]])
    return torch.where(extremes.isinf(), torch.full_like(extremes, float("nan")), extremes)


def logging_average(values) -> float | None:
    """TRL's value of a metric appended several times between two records (its `log`): the mean
    of the values that are not NaN, None where none is (JSON has no NaN)."""
    valid = [v for v in values if v is not None and not math.isnan(v)]
    return sum(valid) / len(valid) if valid else None


def logged_means(per_rank: list) -> dict[str, float | None]:
    """TRL's loss metrics at a logging record from each rank's micro-batches since the last one
    (per_rank[r][i] = rank r's METRIC_SLOTS then EXTREMES of micro-batch i): per micro-batch
    each metric's mean over every rank's tokens (`metric_means`), then the logging average over
    the micro-batches, as TRL appends one value per `_compute_loss` call; and `clip_extremes`."""
    slots = len(METRIC_SLOTS)
    values: dict[str, list[float]] = {}
    for i in range(max((len(part) for part in per_rank), default=0)):
        rows = [part[i][:slots] for part in per_rank if i < len(part)]
        for name, value in metric_means([sum(column) for column in zip(*rows)]).items():
            values.setdefault(name, []).append(value)
    means = {name: logging_average(found) for name, found in values.items()}
    means.update(clip_extremes([[row[slots:] for row in part] for part in per_rank]))
    return means


def clip_extremes(per_rank: list) -> dict[str, float | None]:
    """TRL's clip_ratio/low_min and high_max from each rank's `extremes` of the micro-batches
    since the last record (per_rank[r][i] = rank r's [low_min, high_max] of micro-batch i): per
    micro-batch the minimum (maximum) over the ranks, as TRL takes it over the completions
    gathered from every process; then the mean over micro-batches of those that are not NaN,
    None where none is (TRL's logging average)."""
    count = max((len(part) for part in per_rank), default=0)
    out = {}
    for slot, (name, pick) in enumerate(zip(EXTREMES, (min, max))):
        values = []
        for i in range(count):
            mine = [part[i][slot] for part in per_rank if i < len(part)]
            mine = [v for v in mine if not math.isnan(v)]
            if mine:
                values.append(pick(mine))
        out[name] = logging_average(values)
    return out


def _on_device(value, device) -> torch.Tensor:
    """`value` as a float32 tensor on `device`. A Python number is written by a fill kernel:
    torch.tensor(number, device=...) would copy from the host, and that copy waits for the
    device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), float(value), dtype=torch.float32, device=device)


def metric_means(sums) -> dict[str, float]:
    """TRL's values of one micro-batch's metrics from its `sums` added over the ranks (a host
    read): each sum over its count, the count at least 1 (TRL's global_masked_mean)."""
    values = sums.tolist() if isinstance(sums, torch.Tensor) else list(sums)
    means = {}
    for i, name in enumerate(METRICS):
        total, count = values[2 * i], values[2 * i + 1]
        if not math.isnan(count):  # NaN: not computed in this run
            means[name] = total / max(count, 1.0)
    return means


def _summed_rewards(rewards_per_func, reward_weights) -> torch.Tensor:
    """Each completion's weighted sum over the reward functions that scored it; NaN where none did
    (a 0 would bias its group's mean and give it an advantage)."""
    weights = torch.as_tensor(reward_weights, dtype=rewards_per_func.dtype,
                              device=rewards_per_func.device)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return rewards.masked_fill(unscorable, float("nan"))


def group_advantages(rewards_per_func: torch.Tensor, reward_weights, num_generations: int,
                     scale_rewards: str = "group") -> Advantages:
    """TRL's advantages ("sum_then_normalize") of [N, F] rewards (NaN: no reward), N a multiple
    of num_generations, each prompt's completions consecutive."""
    if scale_rewards not in SCALE_REWARDS:
        raise InputError(f"scale_rewards {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    if num_generations < 1 or rewards_per_func.shape[0] % num_generations:
        raise InputError(f"{rewards_per_func.shape[0]} completions do not make groups of "
                         f"num_generations={num_generations}")
    rewards = _summed_rewards(rewards_per_func, reward_weights)
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:  # "none" divides by nothing but still reports zero spreads
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    std_is_zero = torch.isclose(std, torch.zeros_like(std))
    # Unscorable completions (NaN) carry no signal: advantage 0.
    return Advantages(rewards, torch.nan_to_num(advantages, nan=0.0), std_is_zero)


def reward_metrics(rewards_per_func: torch.Tensor, reward_weights, names,
                   std_is_zero: torch.Tensor) -> dict[str, float]:
    """TRL's reward metrics of one generation batch (all ranks' completions): each function's
    mean and spread over the completions it scored, the summed reward's, and the share of
    completions whose group had no spread."""
    metrics = {}
    for i, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    rewards = _summed_rewards(rewards_per_func, reward_weights)
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    metrics["frac_reward_zero_std"] = std_is_zero.float().mean().item()
    return metrics
