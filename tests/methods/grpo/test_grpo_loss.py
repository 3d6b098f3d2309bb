"""Issue 32, item 3: GRPO's loss, metrics and advantages against TRL 1.16's own code.

The loss: `GRPOTrainer._compute_loss` runs unbound on a small stub standing in for the trainer
(the attributes it reads, and a `_get_per_token_logps_and_entropies` that returns prepared
log-probs), so TRL's code, not a copy of it, is the reference for the loss, its gradient and the
metrics it appends. The advantages: `GRPOTrainer._generate_and_score_completions` runs the same
way, with the generation and the reward functions stubbed to return prepared rewards."""
from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hputrain.errors import InputError
from hputrain.methods.grpo.loss import (EXTREMES, METRIC_SLOTS, clip_extremes, group_advantages,
                                        grpo_loss, logged_means, logging_average, metric_means,
                                        nanstd, reward_metrics)

trl = pytest.importorskip("trl", reason="TRL is the reference")
from trl import GRPOTrainer  # noqa: E402
from trl.trainer import utils as trl_utils  # noqa: E402

B, C, P = 6, 7, 3
LENGTHS = [7, 5, 3, 0, 6, 1]  # padding, and row 3 fully masked
ADVANTAGES = [1.3, -0.7, 0.4, -1.1, 0.9, -2.0]
MAX_COMPLETION_LENGTH = 10


def batch(seed: int = 0, lengths=LENGTHS, advantages=ADVANTAGES) -> dict:
    """Random log-probs far enough from the old and reference ones that ratios clip."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    logps = -torch.rand(rows, C, generator=g) * 3
    return {
        "logps": logps,
        "old": logps + torch.randn(rows, C, generator=g) * 0.8,
        "ref": logps + torch.randn(rows, C, generator=g) * 0.5,
        "entropies": torch.rand(rows, C, generator=g) * 2,
        "mask": (torch.arange(C) < torch.tensor(lengths).unsqueeze(1)).int(),
        "advantages": torch.tensor(advantages),
    }


class _Accelerator:
    """One process standing for `num_processes`: reduce and gather are the identity."""
    def __init__(self, num_processes: int):
        self.num_processes = num_processes
        self.device = torch.device("cpu")
        self.process_index = 0
        self.sync_gradients = True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor


def trl_loss(data, logps, *, loss_type, beta, epsilon, epsilon_high, delta, level, bias_kl,
             old_given, num_items, num_processes, accumulation, steps_per_generation):
    """TRL 1.16's `_compute_loss` on `data`, with `logps` as the policy's log-probs; its loss and
    the metrics it appended."""
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, data["entropies"], None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=False, vllm_importance_sampling_correction=False,
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_kl,
                             steps_per_generation=steps_per_generation),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        accelerator=_Accelerator(num_processes), _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        max_completion_length=MAX_COMPLETION_LENGTH)
    rows = data["mask"].shape[0]
    inputs = {"prompt_ids": torch.zeros(rows, P, dtype=torch.long),
              "prompt_mask": torch.ones(rows, P, dtype=torch.long),
              "completion_ids": torch.zeros(rows, C, dtype=torch.long),
              "completion_mask": data["mask"], "advantages": data["advantages"],
              "num_items_in_batch": torch.tensor(num_items)}
    if old_given:
        inputs["old_per_token_logps"] = data["old"]
    if beta != 0.0:
        inputs["ref_per_token_logps"] = data["ref"]
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {name: values[0] for name, values in stub._metrics["train"].items()}


def ours(data, logps, *, loss_type, beta, epsilon, epsilon_high, delta, level, bias_kl, old_given,
         num_items, num_processes, accumulation, steps_per_generation):
    return grpo_loss(logps, data["old"] if old_given else None, data["ref"] if beta else None,
                     data["advantages"], data["mask"], loss_type=loss_type, beta=beta,
                     epsilon=epsilon, epsilon_high=epsilon_high, delta=delta,
                     importance_sampling_level=level, use_bias_correction_kl=bias_kl,
                     num_items_in_batch=torch.tensor(num_items), num_processes=num_processes,
                     gradient_accumulation_steps=accumulation,
                     steps_per_generation=steps_per_generation,
                     max_completion_length=MAX_COMPLETION_LENGTH, entropies=data["entropies"])


KL = {"no kl": (0.0, True), "kl": (0.04, True), "kl uncorrected": (0.04, False)}
CLIPPING = {"symmetric": (0.2, None, None), "high and delta": (0.2, 0.6, 2.0)}
SCALE = {"one step": (1, 1, 1, 27), "accumulated": (2, 2, 4, 93)}  # accumulation, processes,
# steps per generation, num_items_in_batch (the generation batch's tokens, all ranks)


@pytest.mark.parametrize("loss_type, kl, level, old_given, clipping, scale", list(itertools.product(
    ["grpo", "bnpo", "dr_grpo", "dapo"], KL, ["token", "sequence"], [False, True], CLIPPING, SCALE)))
def test_loss_gradient_and_metrics_equal_trl(loss_type, kl, level, old_given, clipping, scale):
    data = batch(seed=len(loss_type) + 10 * old_given)
    beta, bias_kl = KL[kl]
    epsilon, epsilon_high, delta = CLIPPING[clipping]
    accumulation, processes, steps_per_generation, items = SCALE[scale]
    settings = dict(loss_type=loss_type, beta=beta, epsilon=epsilon, epsilon_high=epsilon_high,
                    delta=delta, level=level, bias_kl=bias_kl, old_given=old_given,
                    num_items=items, num_processes=processes, accumulation=accumulation,
                    steps_per_generation=steps_per_generation)

    theirs_logps = data["logps"].clone().requires_grad_(True)
    theirs, their_metrics = trl_loss(data, theirs_logps, **settings)
    (their_grad,) = torch.autograd.grad(theirs, theirs_logps)
    mine_logps = data["logps"].clone().requires_grad_(True)
    result = ours(data, mine_logps, **settings)
    (my_grad,) = torch.autograd.grad(result.loss, mine_logps)

    torch.testing.assert_close(result.loss, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(my_grad, their_grad, rtol=0, atol=1e-6)
    assert my_grad.abs().sum() > 0
    assert result.sums.dtype == torch.float32 and not result.sums.requires_grad
    assert result.sums.shape == (len(METRIC_SLOTS),)
    means = metric_means(result.sums)
    expected = {name: their_metrics[name] for name in
                ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean") if name in their_metrics}
    assert set(means) == set(expected)
    for name, value in expected.items():
        assert means[name] == pytest.approx(value, abs=1e-6), name
    # min and max over the completions (one rank standing for all, as TRL's gather here)
    extremes = clip_extremes([[result.extremes.tolist()]])
    for name in EXTREMES:
        assert extremes[name] == pytest.approx(their_metrics[name], abs=1e-6), name


def test_the_batches_clip_on_both_sides():
    """The data above exercises clipping (else the clipped branch would go untested)."""
    data = batch(seed=14)
    result = grpo_loss(data["logps"], data["old"], None, data["advantages"], data["mask"],
                       num_items_in_batch=27)
    means = metric_means(result.sums)
    assert means["clip_ratio/low_mean"] > 0 and means["clip_ratio/high_mean"] > 0


def test_sums_add_over_ranks_to_the_global_masked_mean():
    """Two ranks' shares of a micro-batch: their sums, added (the all-reduce), give TRL's metric
    over the micro-batch as one batch (its global_masked_mean)."""
    first, second = batch(seed=1), batch(seed=2, lengths=[2, 7, 4, 4, 0, 3])
    whole = {key: torch.cat([first[key], second[key]]) for key in first}
    settings = dict(loss_type="bnpo", beta=0.04, epsilon=0.2, epsilon_high=None, delta=None,
                    level="token", bias_kl=True, old_given=True, num_items=1, num_processes=1,
                    accumulation=1, steps_per_generation=1)
    _, their_metrics = trl_loss(whole, whole["logps"], **settings)
    sums = ours(first, first["logps"], **settings).sums + ours(second, second["logps"], **settings).sums
    for name, value in metric_means(sums).items():
        assert value == pytest.approx(their_metrics[name], abs=1e-6), name


def trl_log(metrics: dict[str, list[float]]) -> dict:
    """What TRL 1.16's `GRPOTrainer.log` writes for the values its steps appended to _metrics
    (run unbound on a stub of the few attributes it and transformers' Trainer.log read)."""
    stub = GRPOTrainer.__new__(GRPOTrainer)
    stub.model = SimpleNamespace(training=True)
    stub._metrics = {"train": defaultdict(list, {k: list(v) for k, v in metrics.items()})}
    stub.state = SimpleNamespace(epoch=None, global_step=1, log_history=[])
    stub.args = SimpleNamespace(include_num_input_tokens_seen="no")
    stub.callback_handler = SimpleNamespace(on_log=lambda *args: None)
    stub.control, stub.log_completions = None, False
    stub.accelerator = SimpleNamespace(is_main_process=False)
    GRPOTrainer.log(stub, {})
    return stub.state.log_history[-1]


def test_logged_metrics_average_each_micro_batchs_mean_as_trl_logs_them():
    """Issue 39 item 7: between two records TRL appends each micro-batch's metrics (a masked mean
    over that micro-batch's tokens on every rank) and logs their average, NaN left out (None
    where nothing is left), not a mean pooled over every token. Here three micro-batches of
    unequal token counts (gradient accumulation), each split over two ranks, against TRL's
    `_compute_loss` on each whole micro-batch and TRL's `log`; rollout metrics with a NaN (a
    reward no function gave) through the same average (grpo_loss.logging_average)."""
    settings = dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28, delta=None,
                    level="token", bias_kl=True, old_given=True, num_items=40, num_processes=2,
                    accumulation=3, steps_per_generation=3)
    micro = [batch(seed=21, lengths=[7, 7, 6, 7, 5, 7]), batch(seed=22, lengths=[1, 0, 2, 1, 1, 0]),
             batch(seed=23, lengths=[3, 7, 1, 5, 6, 2])]
    micro[1]["entropies"] = micro[1]["entropies"] / 10  # a few tokens unlike the others
    appended, per_rank = defaultdict(list), [[], []]
    for data in micro:
        _, metrics = trl_loss(data, data["logps"], **settings)
        for name, value in metrics.items():
            appended[name].append(value)
        for rank, rows in enumerate((slice(0, 3), slice(3, 6))):
            part = {key: value[rows] for key, value in data.items()}
            result = ours(part, part["logps"], **settings)
            per_rank[rank].append(torch.cat([result.sums, result.extremes]).tolist())
    rollouts = {"reward": [float("nan"), 0.25, 0.5], "rewards/f/std": [float("nan")] * 3}
    theirs = trl_log({**appended, **rollouts})
    got = logged_means(per_rank)
    assert set(got) == set(appended)
    for name in got:
        assert got[name] == pytest.approx(theirs[name], abs=1e-6), name
    for name, values in rollouts.items():
        assert logging_average(values) == theirs[name]
    assert theirs["reward"] == 0.375 and theirs["rewards/f/std"] is None
    # the pooled mean over every token, what was logged before, is another number
    mask = torch.cat([data["mask"] for data in micro]).float()
    entropies = torch.cat([data["entropies"] for data in micro])
    assert abs((entropies * mask).sum() / mask.sum() - got["entropy"]) > 0.2


def test_clip_extremes_are_over_every_rank_then_averaged_over_micro_batches():
    """TRL's clip_ratio/low_min and high_max: per micro-batch the minimum (maximum) over the
    completions gathered from every process, then the logging average over micro-batches (NaN
    left out). Here two micro-batches, each split over two ranks; TRL's `_compute_loss` on each
    whole micro-batch is what its gather over the two ranks sees. In the first micro-batch rank
    1's completions are all empty (NaN on that rank, left out of the minimum)."""
    settings = dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None,
                    level="token", bias_kl=True, old_given=True, num_items=40, num_processes=2,
                    accumulation=1, steps_per_generation=1)
    micro = [batch(seed=5, lengths=[7, 4, 2, 0, 0, 0]), batch(seed=6, lengths=[3, 7, 1, 5, 6, 2])]
    theirs = {name: [] for name in EXTREMES}
    per_rank = [[], []]
    for data in micro:
        _, metrics = trl_loss(data, data["logps"], **settings)
        for name in EXTREMES:
            theirs[name].append(metrics[name])
        for rank, rows in enumerate((slice(0, 3), slice(3, 6))):
            part = {key: value[rows] for key, value in data.items()}
            per_rank[rank].append(ours(part, part["logps"], **settings).extremes.tolist())
    assert all(v != v for v in per_rank[1][0])  # NaN: no completion with a token
    got = clip_extremes(per_rank)
    for name in EXTREMES:  # TRL's logging average: the mean of the values that are not NaN
        valid = [v for v in theirs[name] if v == v]
        assert got[name] == pytest.approx(sum(valid) / len(valid), abs=1e-6), name
    assert got["clip_ratio/low_min"] < got["clip_ratio/high_max"]  # the data clips unevenly
    assert max(theirs["clip_ratio/high_max"]) > 0
    assert clip_extremes([[[float("nan")] * 2], []]) == dict.fromkeys(EXTREMES)  # TRL's None


@pytest.mark.parametrize("change, words", [
    (dict(loss_type="cispo"), "loss_type 'cispo'"),
    (dict(loss_type="dapo", num_items_in_batch=None), "num_items_in_batch"),
    (dict(beta=0.1), "reference"),
    (dict(importance_sampling_level="segment"), "importance_sampling_level"),
])
def test_unusable_settings_are_one_line(change, words):
    data = batch()
    kwargs = dict(loss_type="bnpo", num_items_in_batch=10) | change
    with pytest.raises(InputError, match=words) as error:
        grpo_loss(data["logps"], None, None, data["advantages"], data["mask"], **kwargs)
    assert "\n" not in str(error.value)


def test_nanstd_equals_trl():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=g)
    x[0, 1] = x[2, :3] = x[4, :] = float("nan")  # a column with one value: NaN there
    x[:, 3] = float("nan")
    x[1:, 2] = float("nan")
    for dim in (None, 0, 1):
        torch.testing.assert_close(nanstd(x, dim), trl_utils.nanstd(x, dim=dim), equal_nan=True,
                                   rtol=0, atol=1e-7)


# Rewards of 3 groups of 4 completions from 2 functions; NaN is a function's None.
NAN = float("nan")
REWARDS = [[1.0, 0.5], [0.0, NAN], [2.5, 1.0], [NAN, NAN],     # one unscorable completion
           [1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0],     # no spread: std 0
           [-1.0, NAN], [0.3, 0.7], [4.0, -2.0], [0.5, 0.25]]
WEIGHTS = [1.0, 0.5]
NAMES = ["accuracy", "format"]


def trl_advantages(rewards_per_func, num_generations, scale_rewards):
    """TRL 1.16's `_generate_and_score_completions` with the generation and the reward functions
    stubbed: the advantages it returns and the reward metrics it appends."""
    n = rewards_per_func.shape[0]
    stub = SimpleNamespace(
        accelerator=_Accelerator(1),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None, environments=None, tools=None, _is_vlm=False,
        _generate=lambda prompts: ([[1, 2]] * n, [[3, 4, 5]] * n, None, ["c"] * n, None, {},
                                   None, None),
        _calculate_rewards=lambda *a: rewards_per_func.clone(),
        _tokenizer=SimpleNamespace(pad_token_id=0), pad_to_multiple_of=None,
        mask_truncated_completions=False, num_iterations=1, use_vllm=False,
        vllm_importance_sampling_correction=False, beta=0.0,
        args=SimpleNamespace(per_device_train_batch_size=n, steps_per_generation=1,
                             gradient_accumulation_steps=1, gradient_checkpointing_kwargs=None),
        num_generations=num_generations, num_generations_eval=num_generations,
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.tensor(WEIGHTS), scale_rewards=scale_rewards, reward_func_names=NAMES,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list)},
        _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False)
    output = GRPOTrainer._generate_and_score_completions(stub, [{"prompt": "p"}] * n)
    return output["advantages"], {name: values[0] for name, values in stub._metrics["train"].items()}


@pytest.mark.parametrize("scale_rewards, num_generations", list(itertools.product(
    ["group", "batch", "none"], [4, 2, 1])))
def test_advantages_and_reward_metrics_equal_trl(scale_rewards, num_generations):
    rewards_per_func = torch.tensor(REWARDS)
    theirs, their_metrics = trl_advantages(rewards_per_func, num_generations, scale_rewards)
    result = group_advantages(rewards_per_func, WEIGHTS, num_generations, scale_rewards)
    torch.testing.assert_close(result.advantages, theirs, rtol=0, atol=1e-6)
    assert torch.isnan(result.rewards[3]) and result.advantages[3] == 0
    metrics = reward_metrics(rewards_per_func, WEIGHTS, NAMES, result.std_is_zero)
    assert list(metrics) == [name for name in their_metrics if name in metrics]
    assert len(metrics) == 2 * len(NAMES) + 3
    for name, value in metrics.items():
        assert value == pytest.approx(their_metrics[name], abs=1e-6, nan_ok=True), name
    if num_generations == 4 and scale_rewards != "batch":
        assert metrics["frac_reward_zero_std"] == pytest.approx(4 / 12)  # the group of equals


def test_unusable_reward_settings_are_one_line():
    with pytest.raises(InputError, match="scale_rewards 'groups'"):
        group_advantages(torch.tensor(REWARDS), WEIGHTS, 4, "groups")
    with pytest.raises(InputError, match="num_generations=5"):
        group_advantages(torch.tensor(REWARDS), WEIGHTS, 5)


def test_the_loss_reads_nothing_back_and_compiles_once_per_shape():
    """On the CPU's lazy backend (the dry run of a Gaudi lazy step): the loss, its backward and
    the metric sums read no value back to the host, and a repeated step reuses its graphs."""
    from torch._lazy import metrics

    from hputrain.accelerators.cpu import CPUAccelerator
    from hputrain.accelerators.cpu_lazy import HostReads, LazyBackendGaps

    accelerator = CPUAccelerator("lazy")
    device = accelerator.setup()
    reads, compiled = HostReads(locate=lambda name: name), []
    metrics.reset()
    for step in range(4):
        data = {key: value.to(device) for key, value in batch(seed=step).items()}
        logps = data["logps"].requires_grad_(True)
        reads.in_step = True
        with reads, LazyBackendGaps():
            result = grpo_loss(logps, data["old"], data["ref"], data["advantages"], data["mask"],
                               beta=0.04, delta=2.0, entropies=data["entropies"],
                               num_items_in_batch=torch.tensor(27).to(device),
                               importance_sampling_level=("token", "sequence")[step % 2])
            result.loss.backward()
        reads.in_step = False
        accelerator.mark_step()
        compiled.append(metrics.counter_value("UncachedCompile"))
    assert reads.count == 0, reads.where
    assert not metrics.counter_value("aten::_local_scalar_dense")
    assert compiled[3] == compiled[1] > compiled[0] > 0  # each level compiled once
    assert set(metric_means(result.sums.cpu())) == {"kl", "entropy", "clip_ratio/low_mean",
                                                     "clip_ratio/high_mean", "clip_ratio/region_mean"}
