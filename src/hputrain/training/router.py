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
× batch 2 train as batch 4. Under gradient accumulation the loss is taken per micro-batch, as
transformers computes it, and the step's loss is the mean of its micro-batches'. The optimizer
sees `LM loss + coef · aux`; the logs keep them apart (`loss`, `aux_loss`; `eval_loss`,
`eval_aux_loss`). Everything in the step has a static shape (softmax, top-k, scatter_add): no host
read, nothing that depends on the routing.

Families without this loss: DeepSeek-V3 (its routing is balanced by a bias, not a loss) and
Llama 4 (none in transformers); their models get no router loss and no load metrics here.
transformers has no router z-loss in these families (OLMoE's config has none), so none is added.

Router health, at every logging step, per MoE layer (<i> its decoder layer's number), over the
tokens of every rank since the last record: `router/max_load.layer<i>`, the busiest expert's picks
over the mean (1 is perfectly balanced, E / k is every token on the same experts), and
`router/dead_experts.layer<i>`, the share of experts no token picked.
"""
from __future__ import annotations

import contextlib
import inspect
import re

import torch

from ..data.batching import base_model
from ..models.kind import experts_and_top_k

AUX_LOSS = "aux_loss"
MAX_LOAD = "router/max_load.layer{}"
DEAD_EXPERTS = "router/dead_experts.layer{}"


def token_mask(batch) -> torch.Tensor | None:
    """The real tokens of a device batch, [batch, length] as 1.0 / 0.0: a packed block's examples
    (`seq_lens`, padding after them), else a 2-D padding mask; None (every token) otherwise."""
    if not isinstance(batch, dict):
        return None
    seq_lens = batch.get("seq_lens")
    if isinstance(seq_lens, torch.Tensor) and isinstance(batch.get("input_ids"), torch.Tensor):
        length = batch["input_ids"].shape[-1]
        rows = seq_lens if seq_lens.dim() > 1 else seq_lens[None]
        positions = torch.arange(length, device=rows.device)
        return (positions[None, :] < rows.sum(-1, keepdim=True)).float()
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.float()
    return None


def load_balancing_parts(logits: list[torch.Tensor], num_experts: int, top_k: int,
                         mask: torch.Tensor | None):
    """(picks per expert [layers, E], summed router probabilities per expert [E], real tokens)
    of one forward: the picks without gradient, the probabilities with it. The ops are those of
    transformers' load_balancing_loss_func, in its order, so the loss is its number."""
    rows = logits[0].shape[0]
    weights = (torch.ones(rows, device=logits[0].device) if mask is None
               else mask.reshape(-1).to(logits[0].device, torch.float32))
    picks, probs = [], torch.zeros(num_experts, device=logits[0].device)
    for layer in logits:
        routing = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(routing, top_k, dim=-1)
        picks.append(torch.zeros(num_experts, device=layer.device).scatter_add_(
            0, chosen.reshape(-1), weights.repeat_interleave(top_k)))
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


class NoRouter:
    """A model without a router loss: every hook does nothing (the loop calls them all alike)."""

    trained = False
    forward_kwargs: dict = {}

    def recording(self, mask: torch.Tensor | None = None):
        return contextlib.nullcontext()

    def add_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def metrics(self, group, prefix: str = "") -> dict:
        return {}

    def evaluating(self):
        return contextlib.nullcontext()

    def uncounted(self, inner=None):
        return inner if inner is not None else contextlib.nullcontext()


def router_of(model: torch.nn.Module, args, group, inputs: frozenset[str] | None,
              device: torch.device | None = None):
    """The model's Router, or NoRouter for a model without the load-balancing loss; `args` (the
    TrainingArguments) give its weight (router_aux_loss_coef) and the micro-batches of a step."""
    coef_flag, accumulate = args.router_aux_loss_coef, args.gradient_accumulation_steps
    base = base_model(model)
    # the model's own class: fully_shard makes it a subclass FSDP<Class> in torch's module
    own = next(cls for cls in type(base).__mro__ if not cls.__module__.startswith("torch.distributed"))
    module = inspect.getmodule(own)
    config = getattr(base, "config", None)
    # from the config (a sequence classifier, a reward model, holds no counts of its own)
    experts, top_k = experts_and_top_k(config) or (None, None)
    recorded = _recorded_router(base)
    if recorded is None or getattr(module, "load_balancing_loss_func", None) is None or not (
            experts and top_k):
        return NoRouter()
    if coef_flag is not None:
        coef = float(coef_flag)
    else:
        coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
        coef = coef if getattr(config, "output_router_logits", False) else 0.0
    return Router(model, recorded, int(experts), int(top_k), coef, group, accumulate, inputs, device)


def _recorded_router(model: torch.nn.Module):
    """(router class, index in its output) transformers records router_logits from, or None."""
    for module in model.modules():
        recorders = getattr(type(module), "_can_record_outputs", None) or {}
        spec = recorders.get("router_logits") if isinstance(recorders, dict) else None
        if spec is not None and getattr(spec, "target_class", None) is not None:
            return spec.target_class, spec.index
    return None


class Router(NoRouter):
    """Records the router logits of the forwards run inside `recording`, and keeps the sums its
    metrics report (see the module docstring). Made once per Trainer."""

    def __init__(self, model: torch.nn.Module, recorded, num_experts: int, top_k: int, coef: float,
                 group, accumulate: int, inputs: frozenset[str] | None,
                 device: torch.device | None = None) -> None:
        router_class, index = recorded
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, router_class)]
        self.routers = [m for _, m in named]
        self.layers = [_layer_number(name, i) for i, (name, _) in enumerate(named)]
        for router in self.routers:
            router.register_forward_hook(self._hook(index))
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.trained = coef > 0
        self.group, self.accumulate, self.device = group, accumulate, device
        if inputs is None or "output_router_logits" in inputs:  # transformers' own loss: off
            self.forward_kwargs = {"output_router_logits": False}
        self._logits: list | None = None  # recording: this forward's logits, layer by layer
        self._pending: list[torch.Tensor] = []  # the aux losses of this micro-batch's forwards
        self._train = self._sums()
        self._eval: dict | None = None  # while evaluating: the evaluation's sums
        self._counting = True
        self._weight_tensor: torch.Tensor | None = None

    def _hook(self, index: int):
        def record(module, args, output):
            if self._logits is not None:
                self._logits.append(output[index] if isinstance(output, tuple) else output)
        return record

    def _sums(self) -> dict:
        device = self.device
        return {"aux": torch.zeros(()).to(device), "picks": torch.zeros(
            len(self.routers), self.num_experts).to(device), "forwards": 0}

    @contextlib.contextmanager
    def recording(self, mask: torch.Tensor | None = None):
        """Around one forward of the model on a batch whose real tokens are `mask` (token_mask)."""
        self._logits = []
        try:
            yield
            logits = self._logits
        finally:
            self._logits = None
        if logits and self._counting:
            self._recorded(logits, mask)

    def _recorded(self, logits: list[torch.Tensor], mask: torch.Tensor | None) -> None:
        picks, probs, tokens = load_balancing_parts(logits, self.num_experts, self.top_k, mask)
        if torch.is_grad_enabled() and self.trained:  # a training forward: the global counts
            counts = torch.cat([picks.reshape(-1), tokens.reshape(1)])
            self.group.all_reduce_sum(counts)
            aux = load_balancing_loss(counts[:-1].view_as(picks), probs, counts[-1],
                                      self.num_experts)
            self._pending.append(aux)
            self._train["aux"] = self._train["aux"] + aux.detach()
            self._add(self._train, picks)
        elif self._eval is not None:  # an evaluation batch: its own tokens
            aux = load_balancing_loss(picks, probs.detach(), tokens, self.num_experts)
            self._eval["aux"] = self._eval["aux"] + aux
            self._add(self._eval, picks)
        elif torch.is_grad_enabled():  # training, the loss not trained: the load only
            self._add(self._train, picks)

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
