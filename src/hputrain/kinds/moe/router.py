"""The router of a mixture-of-experts model: its load-balancing loss and its load metrics.

transformers computes the router's loss (`load_balancing_loss_func`, the Switch Transformer's
auxiliary loss, the same function in Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS and their kin)
inside the model's forward, over a 2-D padding mask. A packed block's 4-D block mask breaks it
(a traceback), and its counts are those of one process. So the model is called with
`output_router_logits=False` (it computes no loss of its own), each router's logits are recorded
by a forward hook on the modules transformers itself records them from (`_can_record_outputs`),
and the loss is computed here, as transformers defines it:

    aux = E · Σ_e f_e · P_e,   f_e = (top-k picks of expert e) / N,   P_e = (Σ softmax_e) / N

over every MoE layer's rows together (N = layers × real tokens), where the real tokens are those
of the examples in a packed block (`seq_lens`) or of the padding mask, padding left out. On an
unpacked batch it is transformers' number.

Across ranks, the picks f carry no gradient: their counts (and N) are summed over every rank in
the step (one all-reduce of E + 1 numbers), and each rank's loss uses its own P against the global
counts. The ranks' losses then sum to the loss of the global batch, with its gradient, so 2 ranks
× batch 2 train as batch 4. Balanced, aux is k (every f_e = k/E, P_e = 1/E); every token on the
same k experts, E.

Under gradient accumulation the loss is taken per micro-batch, as transformers computes it, and
the step's loss is the mean of its micro-batches': accumulation 2 × batch 2 is not batch 4 for
the router's loss (it is for the LM loss). Pooling the counts over the step would need every
micro-batch's picks before the first backward (the gradient of micro-batch m's P is weighted by
the counts of the micro-batches after it): a second forward of the step, or every micro-batch's
activations held until its end. The run header says so.

The optimizer sees `LM loss + coef · aux`; the logs keep them apart (`loss`, `aux_loss`;
`eval_loss`, `eval_aux_loss`). Everything in the step has a static shape (softmax, top-k,
scatter_add): no host read, nothing that depends on the routing.

The families (`balancing_kind`):
- "loss": the families whose model computes load_balancing_loss_func, and DeepSeek-V2, whose
  router is a softmax over the experts but whose model in transformers computes no loss (its own
  expert-level balance loss is this sum over k): trained there only when asked by
  `router_aux_loss_coef`.
- "bias": routers that pick their experts by scores plus a correction bias
  (`e_score_correction_bias`: DeepSeek-V3, GLM-4-MoE). DeepSeek-V3 balances them without a
  loss: after each step, each expert's bias moves by γ towards balance, +γ for an expert under
  the mean load of the step's global batch and -γ over it (its paper, section 2.1.2). With
  `router_bias_update_rate` γ the run does the same, from the picks of every micro-batch and
  rank of the step (one all-reduce of layers × E numbers, on the device, no host read); off, the
  bias stays as loaded.
- "none": Llama 4 (no router loss in transformers, no bias).
transformers has no router z-loss in these families (OLMoE's config has none), so none is added.

Router health, for every family, at every logging step, per MoE layer (<i> its decoder layer's
number), over the tokens of every rank since the last record: `router/max_load.layer<i>`, the
busiest expert's picks over the mean (1 is perfectly balanced, E / k is every token on the same
experts), and `router/dead_experts.layer<i>`, the share of experts no token picked. The picks are
the router's own (its top-k indices where it returns them: DeepSeek's grouped and biased top-k
are not the top-k of its logits).
"""
from __future__ import annotations

import contextlib
import inspect
import re

import torch

from ...data.batching import base_model
from ...errors import InputError
from ...training.extras import ModelExtras
from . import experts_and_top_k

AUX_LOSS = "aux_loss"
MAX_LOAD = "router/max_load.layer{}"
DEAD_EXPERTS = "router/dead_experts.layer{}"
BIAS = "e_score_correction_bias"
"""The buffer of a router that picks its experts by scores plus a correction bias (DeepSeek-V3)."""
SOFTMAX_WITHOUT_LOSS = ("deepseek_v2",)
"""Model types whose router is a softmax over the experts, as the load-balancing loss assumes,
but whose model in transformers computes no router loss: trained when asked."""


def load_balancing_parts(logits: list[torch.Tensor], num_experts: int, top_k: int,
                         mask: torch.Tensor | None, chosen: list | None = None):
    """(picks per expert [layers, E], summed router probabilities per expert [E], real tokens)
    of one forward: the picks without gradient, the probabilities with it. The ops are those of
    transformers' load_balancing_loss_func, in its order, so the loss is its number. `chosen`:
    each layer's top-k indices as its router picked them (None: the top-k of the logits)."""
    rows = logits[0].shape[0]
    weights = (torch.ones(rows, device=logits[0].device) if mask is None
               else mask.reshape(-1).to(logits[0].device, torch.float32))
    picks, probs = [], torch.zeros(num_experts, device=logits[0].device)
    for layer, picked in zip(logits, chosen or [None] * len(logits)):
        routing = torch.softmax(layer, dim=-1)
        if picked is None:
            _, picked = torch.topk(routing, top_k, dim=-1)
        picks.append(torch.zeros(num_experts, device=layer.device).scatter_add_(
            0, picked.reshape(-1), weights.repeat_interleave(top_k)))
        probs = probs + (routing.float() * weights.unsqueeze(-1)).sum(dim=0)
    return torch.stack(picks).detach(), probs, weights.sum().detach()


def load_balancing_loss(picks: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor,
                        num_experts: int) -> torch.Tensor:
    """transformers' formula on the parts: picks [layers, E] and `tokens` real tokens a layer
    (summed over ranks when global), probs [E] (this rank's)."""
    total = picks[0]
    for layer in picks[1:]:  # layer by layer, as transformers sums them
        total = total + layer
    rows = (tokens * picks.shape[0]).clamp(min=1)
    return torch.sum(total / rows * (probs / rows).unsqueeze(0)) * num_experts


def router_of(model: torch.nn.Module, args, group, inputs: frozenset[str] | None,
              device: torch.device | None = None):
    """The model's Router, or None for a model without routers; `args` (the
    TrainingArguments) give the balancing (router_aux_loss_coef, router_bias_update_rate) and the
    micro-batches of a step. A balancing the model's family has not is refused in one line."""
    base = base_model(model)
    # the model's own class: fully_shard makes it a subclass FSDP<Class> in torch's module
    own = next(cls for cls in type(base).__mro__ if not cls.__module__.startswith("torch.distributed"))
    config = getattr(base, "config", None)
    # from the config (a sequence classifier, a reward model, holds no counts of its own)
    experts, top_k = experts_and_top_k(config) or (None, None)
    recorded = _recorded_router(base)
    rate = float(getattr(args, "router_bias_update_rate", 0.0) or 0.0)
    if recorded is None or not (experts and top_k):
        if rate:
            raise InputError(f"router_bias_update_rate={rate:g}: {own.__name__} has no router that "
                             "picks its experts with a correction bias (DeepSeek-V3's routing)")
        return None
    routers = [m for m in base.modules() if isinstance(m, recorded[0])]
    kind = balancing_kind(inspect.getmodule(own), routers, config)
    coef, line = _balancing(kind, args.router_aux_loss_coef, rate, config, own.__name__,
                            args.gradient_accumulation_steps)
    router = Router(model, recorded, int(experts), int(top_k), coef, group,
                    args.gradient_accumulation_steps, inputs, device, rate=rate)
    router.line = line
    return router


def balancing_kind(module, routers: list[torch.nn.Module], config) -> str:
    """How a family balances its experts (the module docstring): "bias" for a router with a
    correction bias, "loss" where the load-balancing loss applies (the model's modeling `module`
    computes it, or its router is a softmax without one), else "none"."""
    if routers and all(isinstance(getattr(r, BIAS, None), torch.Tensor) for r in routers):
        return "bias"
    if (getattr(module, "load_balancing_loss_func", None) is not None
            or getattr(config, "model_type", None) in SOFTMAX_WITHOUT_LOSS):
        return "loss"
    return "none"


def _balancing(kind: str, coef_flag: float | None, rate: float, config, name: str,
               accumulate: int) -> tuple[float, str]:
    """(the router loss's weight, the header's words) of a family of `kind` under the flags; a
    flag asking for what the family has not is one line."""
    load = "; load logged per MoE layer (router/max_load, router/dead_experts)"
    if rate and kind != "bias":
        raise InputError(f"router_bias_update_rate={rate:g}: {name}'s router picks its experts "
                         "without a correction bias (DeepSeek-V3's routing), so there is none to "
                         "update" + ("; balance it with router_aux_loss_coef" if kind == "loss" else ""))
    if coef_flag and kind != "loss":
        raise InputError(f"router_aux_loss_coef={coef_flag:g}: {name} " + (
            "balances its experts by its routing's correction bias (DeepSeek-V3's), not by a loss: "
            "set router_bias_update_rate instead (DeepSeek-V3 trained with 0.001)" if kind == "bias"
            else "has no router loss in transformers: leave router_aux_loss_coef unset"))
    if kind == "bias":
        return 0.0, (f"router balancing: DeepSeek-V3's bias update, each expert's correction bias "
                     f"moved by {rate:g} a step towards the mean load of the step's global batch "
                     "(--router-bias-update-rate)" if rate else
                     "router balancing off (the routing's correction bias stays as loaded; "
                     "--router-bias-update-rate R updates it as DeepSeek-V3 does)") + load
    if kind == "none":
        return 0.0, f"router balancing: none ({name} has no router loss in transformers)" + load
    if coef_flag is not None:
        coef, source = float(coef_flag), "--router-aux-loss-coef"
        off = "router loss off (--router-aux-loss-coef 0)"
    elif getattr(config, "model_type", None) in SOFTMAX_WITHOUT_LOSS:
        coef, off = 0.0, (f"router loss off ({name} computes none in transformers; "
                          "--router-aux-loss-coef C turns on the load-balancing loss)")
    elif not getattr(config, "output_router_logits", False):
        coef, off = 0.0, ("router loss off (the config's output_router_logits is false; "
                          "--router-aux-loss-coef C turns it on)")
    else:
        coef, source = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0), \
            "the config's router_aux_loss_coef"
        off = ("router loss off (the config's router_aux_loss_coef is 0; --router-aux-loss-coef C "
               "turns it on)")
    if not coef:
        return 0.0, off + load
    pooled = ("; per micro-batch: the {} micro-batches of a step do not pool their counts "
              "(docs/moe.md)".format(accumulate) if accumulate > 1 else "")
    return coef, (f"router loss: load balancing × {coef:g} ({source}), its expert counts pooled "
                  f"over every rank's tokens{pooled}" + load)


def _recorded_router(model: torch.nn.Module):
    """(router class, index in its output) transformers records router_logits from, or None."""
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None) or {}
        spec = recorders.get("router_logits") if isinstance(recorders, dict) else None
        if spec is not None and getattr(spec, "target_class", None) is not None:
            return spec.target_class, spec.index
    return None


class Router(ModelExtras):
    """Records the router logits of the forwards run inside `recording`, and keeps the sums its
    metrics report (see the module docstring). Made once per Trainer."""

    def __init__(self, model: torch.nn.Module, recorded, num_experts: int, top_k: int, coef: float,
                 group, accumulate: int, inputs: frozenset[str] | None,
                 device: torch.device | None = None, rate: float = 0.0) -> None:
        router_class, index = recorded
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, router_class)]
        self.routers = [m for _, m in named]
        self.layers = [_layer_number(name, i) for i, (name, _) in enumerate(named)]
        for router in self.routers:
            router.register_forward_hook(self._hook(index))
        self.num_experts, self.top_k, self.coef, self.rate = num_experts, top_k, coef, rate
        self.trained = coef > 0
        self.group, self.accumulate, self.device = group, accumulate, device
        if inputs is None or "output_router_logits" in inputs:  # transformers' own loss: off
            self.forward_kwargs = {"output_router_logits": False}
        # recording: this forward's (logits, picks) by router, in layer order; a forward run again
        # (expert parallelism's overflow: kinds/moe/experts/parallel.py) replaces the first's
        self._logits: dict | None = None
        self._pending: list[torch.Tensor] = []  # the aux losses of this micro-batch's forwards
        self._train = self._sums()
        self._eval: dict | None = None  # while evaluating: the evaluation's sums
        self._counting = True
        self._weight_tensor: torch.Tensor | None = None
        self._step = self._sums() if rate else None  # the step's picks, for the bias update
        self._masters: torch.Tensor | None = None  # [layers, E] the biases in fp32, from the first update

    def _hook(self, index: int):
        def record(module, args, output):
            if self._logits is not None:
                logits = output[index] if isinstance(output, tuple) else output
                self._logits[module] = (logits, _picked(output, logits))
        return record

    def _sums(self) -> dict:
        device = self.device
        return {"aux": torch.zeros(()).to(device), "picks": torch.zeros(
            len(self.routers), self.num_experts).to(device), "forwards": 0}

    @contextlib.contextmanager
    def recording(self, mask: torch.Tensor | None = None):
        """Around one forward of the model on a batch whose real tokens are `mask` (token_mask)."""
        self._logits = {}
        try:
            yield
            logits = list(self._logits.values())
        finally:
            self._logits = None
        if logits and self._counting:
            self._recorded([layer for layer, _ in logits], mask, [picked for _, picked in logits])

    def _recorded(self, logits: list[torch.Tensor], mask: torch.Tensor | None,
                  chosen: list) -> None:
        picks, probs, tokens = load_balancing_parts(logits, self.num_experts, self.top_k, mask,
                                                    chosen)
        if torch.is_grad_enabled():  # a training forward
            if self.trained:  # the loss, against the global counts
                counts = torch.cat([picks.reshape(-1), tokens.reshape(1)])
                self.group.all_reduce_sum(counts)
                aux = load_balancing_loss(counts[:-1].view_as(picks), probs, counts[-1],
                                          self.num_experts)
                self._pending.append(aux)
                self._train["aux"] = self._train["aux"] + aux.detach()
            self._add(self._train, picks)
            if self._step is not None:
                self._add(self._step, picks)
        elif self._eval is not None:  # an evaluation batch: its own tokens
            aux = load_balancing_loss(picks, probs.detach(), tokens, self.num_experts)
            self._eval["aux"] = self._eval["aux"] + aux
            self._add(self._eval, picks)

    def _add(self, sums: dict, picks: torch.Tensor) -> None:
        if picks.shape == sums["picks"].shape:  # (a forward of part of the layers: not counted)
            sums["picks"] = sums["picks"] + picks
        sums["forwards"] += 1

    def add_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What the optimizer sees for this micro-batch: its LM loss plus coef · aux (the mean over
        the micro-batch's forwards), weighted as the LM loss is (loss.py): times the ranks (the
        strategy averages gradients where the losses sum), over the micro-batches of the step."""
        pending, self._pending = self._pending, []
        if not pending:
            return loss
        aux = pending[0] if len(pending) == 1 else torch.stack(pending).mean()
        return loss + aux * self._weight

    def step_done(self) -> None:
        """DeepSeek-V3's aux-loss-free balancing, after the optimizer step (the step's backward
        is over, so no recompute of activation checkpointing sees the new bias): each layer's
        bias += rate · sign(mean load − load), the loads of the step's global batch. On the
        device, no host read; every rank computes the same update from the same sums. The bias
        is kept in fp32 here (a bf16 buffer would round a 0.001 step away near 1)."""
        if self._step is None:
            return
        loads = self.group.all_reduce_sum(self._step["picks"])
        self._step["picks"] = torch.zeros_like(loads)
        with torch.no_grad():
            biases = [getattr(router, BIAS) for router in self.routers]
            if self._masters is None:  # now: a resumed run has loaded its checkpoint's biases
                self._masters = torch.stack([bias.detach().float() for bias in biases])
                # a device tensor, as _weight (lazy mode takes no Python float as alpha)
                self._rate = torch.tensor([self.rate]).to(biases[0].device).view(())
            # every layer at once, and sign(mean - load) by comparisons: on the CPU's lazy
            # backend sign falls back to eager, and a row's mean comes back on the host
            mean = loads.mean(dim=-1, keepdim=True)
            self._masters.add_(((loads < mean).float() - (loads > mean).float()) * self._rate)
            for layer, bias in enumerate(biases):
                bias.copy_(self._masters[layer])

    @property
    def _weight(self) -> torch.Tensor:
        """coef · ranks / micro-batches, a constant of the run copied over once as graph input
        data (a Python float in the graph is a double in lazy mode, whose backward then meets
        float32 gradients)."""
        if self._weight_tensor is None:
            value = self.coef * self.group.world_size / self.accumulate
            self._weight_tensor = torch.tensor([value]).to(self.device).view(())
        return self._weight_tensor

    def metrics(self, group, prefix: str = "") -> dict:
        """aux_loss (the mean micro-batch's, over the global batch) and the load of each layer
        since the last record (training); eval_aux_loss, the mean batch's, while evaluating.
        Every rank calls it: one all-reduce."""
        evaluating = self._eval is not None
        sums = self._eval if evaluating else self._train
        if not evaluating:
            self._train = self._sums()
        forwards = sums["forwards"]
        total = torch.cat([sums["aux"].reshape(1).float(), sums["picks"].reshape(-1),
                           torch.tensor([float(forwards)]).to(sums["aux"].device)])
        group.all_reduce_sum(total)
        values = total.tolist()
        aux, picks, forwards = values[0], values[1:-1], values[-1]
        record = {}
        if self.trained and forwards:
            # training: each rank's aux is its share of the global one; evaluating: per batch
            record[prefix + AUX_LOSS] = aux / (forwards / group.world_size if not evaluating
                                               else forwards)
        if not evaluating and forwards:
            record.update(load_metrics(torch.tensor(picks).view(len(self.routers), -1), self.layers))
        return record

    @contextlib.contextmanager
    def evaluating(self):
        """Around an evaluation: its sums apart from training's."""
        self._eval = self._sums()
        try:
            yield
        finally:
            self._eval = None

    @contextlib.contextmanager
    def uncounted(self, inner=None):
        """Around a batch a rank repeats only to keep in step with its peers (and around `inner`,
        the method's own context for it, when given)."""
        self._counting = False
        try:
            with inner if inner is not None else contextlib.nullcontext():
                yield
        finally:
            self._counting = True


def _picked(output, logits: torch.Tensor) -> torch.Tensor | None:
    """The top-k indices a router returned beside its logits ([tokens, k] integers: Mixtral's
    router_indices, DeepSeek's topk_indices), or None (Llama 4's router returns its scores)."""
    if not isinstance(output, tuple):
        return None
    return next((t for t in output if isinstance(t, torch.Tensor) and t is not logits
                 and not t.is_floating_point() and t.dim() == 2), None)


def _layer_number(name: str, position: int) -> int:
    """The decoder layer a router sits in, from its module name (model.layers.3.mlp.gate: 3), so
    that a model whose first layers are dense names its MoE layers as the model does."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(numbers[0]) if numbers else position


def load_metrics(picks: torch.Tensor, layers: list[int] | None = None) -> dict:
    """Per MoE layer ([layers, E] picks; `layers` their decoder layer numbers, else 0, 1, ...):
    the busiest expert's picks over the mean, and the share of experts picked by none."""
    record = {}
    for layer, counts in zip(layers or range(len(picks)), picks):
        mean = counts.mean().item()
        record[MAX_LOAD.format(layer)] = counts.max().item() / mean if mean > 0 else 0.0
        record[DEAD_EXPERTS.format(layer)] = (counts == 0).float().mean().item()
    return record
