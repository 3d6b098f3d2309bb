"""Direct preference optimisation: TRL's DPO loss and metrics as an objective the training loop
calls, and `DPOTrainer`, the Trainer that trains with it.

A batch holds each pair's chosen sequence and rejected sequence (methods/dpo/data.py), which go
through the model in one forward. A completion's log-probability is the sum of its tokens'
log-probabilities (the prompt and the padding left out); the reference's comes from one of
(cheapest first):

- the batch itself, precomputed once before training for the training and evaluation pairs
  (precompute_ref_log_probs: each rank runs its share of the batches, the results gathered and
  kept as an array beside the pairs' tokens, cached under output_dir/.cache, so a resume or a
  rerun runs no reference forward at all; a frozen reference model is freed afterwards);
- the policy with its LoRA adapters disabled (a PEFT model and no ref_model): no second copy;
- a separate frozen model (ref_model), placed like the policy (sharded under fsdp).

The loss of a step is the mean over the pairs of its global batch, however the batch is split
into micro-batches and ranks: the Trainer weighs each micro-batch's mean by its share of the
step's pairs (loss.py's rule, with pairs for tokens). The metrics carry TRL's names
(rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
logps/rejected): summed on the device each micro-batch and read back only at logging steps.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .config import DPOConfig
from .data import REF_KEYS, EncodedPairs, PairCollator, encode_pairs, pairs_in
from ...errors import InputError
from ...training.logps import shifted_labels, token_logps
from ...training.loss import IGNORE_INDEX
from ...training.objective import Objective, adapters_disabled
from ...training.trainer import Trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
"""TRL's metric names, in the order the objective sums them."""


def preference_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *,
                    beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                    chosen_tokens=None, rejected_tokens=None) -> torch.Tensor:
    """Each pair's loss, as TRL 1.16's DPOTrainer computes it for these loss types (sigmoid with
    label smoothing is conservative DPO, as TRL computed it up to 0.2x). `*_tokens`: completion
    token counts, which ipo divides by."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    logits = beta * (chosen_ratio - rejected_ratio)
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return torch.relu(1 - logits)
    if loss_type == "ipo":
        delta = (chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1))
        return (delta - 1 / (2 * beta)) ** 2
    raise InputError(f"loss_type {loss_type!r} is not one hputrain computes")


def completion_logps(logits: torch.Tensor, input_ids: torch.Tensor,
                     completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens (position t predicts token
    t + 1), computed in float32. The labels are shifted, not the logits (as transformers' causal
    loss does it): a sliced [:, :-1] copy of the logits would be one more vocabulary-wide tensor."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(completion_mask[:, 1:] == 0, IGNORE_INDEX)
    per_token = -F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="none")
    return per_token.view(labels.shape).sum(dim=1)


class PreferenceObjective(Objective):
    """DPO as the loop's objective (objective.py): pairs collated chosen-then-rejected, the loss a
    mean over pairs, TRL's metrics summed on the device (`metrics` reads them), the reference
    placed beside the policy or precomputed before training (`prepare`), and reference forwards
    counted."""

    has_perplexity = False  # exp of a DPO loss means nothing

    def __init__(self, config: DPOConfig, reference=None, adapters=None, *, pad: int = 0,
                 max_length: int = 2, ref_key: str | None = None, tokenizer=None) -> None:
        self.config = config
        self.collate = PairCollator(pad, max_length)  # pairs keep every key: it builds the inputs
        self.reference = reference  # a frozen module (placed by `bind`), or None
        self.adapters = adapters  # a PEFT model whose disabled adapters give the reference
        self.ref_key, self.tokenizer = ref_key, tokenizer
        self.reference_forwards = 0
        self.precompute_forwards = 0  # reference forwards run by precompute_reference
        self.sums: torch.Tensor | None = None
        self.pairs = 0  # this rank's pairs summed into `sums`

    def bind(self, loop) -> None:
        super().bind(loop)
        if loop.group.cp_size > 1:
            raise InputError("DPO under context parallelism is not supported: "
                             "set context_parallel_size=1")
        if self.reference is not None:
            self.reference = loop.place_frozen(self.reference)

    def count_tokens(self, model):
        return PairCount()  # the step's loss is a mean over pairs

    @property
    def has_reference(self) -> bool:
        """Whether a reference forward can still run (the frozen model is freed once every split
        carries precomputed log-probs)."""
        return self.reference is not None or self.adapters is not None

    @contextlib.contextmanager
    def evaluating(self):
        training = self.sums, self.pairs  # summed since the last log: kept for it
        self.sums, self.pairs = None, 0
        try:
            yield
        finally:
            self.sums, self.pairs = training

    def compute_loss(self, module, batch) -> torch.Tensor:
        """The DPO loss of a batch: the mean over its pairs."""
        # The reference first: its logits are freed before the policy's forward keeps its own
        # (the adapter-disabled policy under fsdp too: see adapters_disabled).
        ref_logps = batch.get("ref_logps")
        if ref_logps is None:
            ref_logps = self.reference_logps(module, batch)
        logps = self._logps(module, batch)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = ref_logps.to(logps.dtype).chunk(2)
        tokens = batch["completion_mask"].sum(dim=1).chunk(2)
        cfg = self.config
        losses = preference_loss(chosen, rejected, ref_chosen, ref_rejected, beta=cfg.beta,
                                 loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
                                 chosen_tokens=tokens[0], rejected_tokens=tokens[1])
        self._add_metrics(chosen.detach(), rejected.detach(), ref_chosen, ref_rejected)
        return losses.mean()

    def reference_logps(self, module, batch) -> torch.Tensor:
        """The reference's log-probabilities of the batch's completions (no gradient), counted
        in `reference_forwards`."""
        self.reference_forwards += 1
        return self._reference_logps(module, batch)

    def _reference_logps(self, module, batch) -> torch.Tensor:
        if not self.has_reference:
            raise InputError("these pairs carry no reference log-probs and the reference model was "
                             "freed after precomputing the training and evaluation pairs: evaluate "
                             "them before train(), or pass pairs with ref_chosen_logps and "
                             "ref_rejected_logps")
        with torch.no_grad():
            if self.reference is not None:
                return self._logps(self.reference, batch)
            with adapters_disabled(self.adapters):
                return self._logps(module, batch)

    def _logps(self, module, batch) -> torch.Tensor:
        # per-token log-probs in chunks of positions, never the whole vocabulary-wide logits
        labels = shifted_labels(batch["input_ids"], batch["completion_mask"])
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        return token_logps(lambda m, x: self.loop.call_model(m, **x), module, inputs,
                           labels).logps.sum(dim=1)

    def _add_metrics(self, chosen, rejected, ref_chosen, ref_rejected) -> None:
        if not self.counting:
            return
        beta = self.config.beta
        chosen_rewards, rejected_rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        sums = torch.stack([chosen_rewards.sum(), rejected_rewards.sum(),
                            (chosen_rewards > rejected_rewards).float().sum(),
                            (chosen_rewards - rejected_rewards).sum(), chosen.sum(), rejected.sum()])
        self.sums = sums if self.sums is None else self.sums + sums
        self.pairs += chosen.shape[0]

    def metrics(self, group, prefix: str = "") -> dict:
        """The metrics' means over every rank's pairs since the last call (one device read), then
        zeroed; {} when no rank summed a pair. Every rank calls it and enters the all-reduce,
        with zeros when its share of the data gave it nothing to sum."""
        device = self.loop.device
        mine = self.sums if self.sums is not None else torch.zeros(len(METRICS), device=device)
        sums = torch.cat([mine.float(), torch.tensor([float(self.pairs)]).to(mine.device)])
        sums = group.all_reduce_sum(sums).tolist()
        self.sums, self.pairs = None, 0
        if sums[-1] == 0:
            return {}
        return {f"{prefix}{name}": value / sums[-1] for name, value in zip(METRICS, sums)}

    # -- the reference, precomputed ------------------------------------------------------------
    def prepare(self, train_dataset, eval_dataset):
        if not self.config.precompute_ref_log_probs:
            return train_dataset, eval_dataset
        # Every split that will be evaluated, as TRL does (train and eval): the frozen reference
        # is freed only once no split needs it.
        train_dataset = self.precompute_reference(train_dataset)
        if eval_dataset:
            eval_dataset = self.precompute_reference(eval_dataset)
        self.reference = None  # no longer needed: free its memory
        return train_dataset, eval_dataset

    def eval_dataset(self, dataset):
        """Pairs encoded; without reference log-probs once the reference is freed
        (precompute_ref_log_probs, after train) they take them from the cache, else the error says
        what to do."""
        pairs = _encoded(dataset, self.tokenizer, self.config)
        if pairs and not self.has_reference and not _carries_reference(pairs):
            with self.loop.on_device():
                pairs = self.precompute_reference(pairs)
        return pairs

    def precompute_reference(self, pairs) -> EncodedPairs:
        """`pairs` (EncodedPairs, or a list of encoded pairs) carrying the reference's
        log-probabilities, as an array beside their tokens (EncodedPairs.ref_logps: the memory-
        mapped pairs are never made Python lists). Read from the cache under output_dir/.cache
        (keyed by the pairs, the reference and the tokenizer) when every rank finds it there;
        else computed once, each rank its share of the batches (`_reference_pass`), and cached
        by each node's first process."""
        loop = self.loop
        pairs = pairs if isinstance(pairs, EncodedPairs) else EncodedPairs.of(list(pairs))
        cache = Path(loop.args.output_dir) / ".cache" / f"dpo-ref-{self._cache_key(pairs)}.npy"
        values = _read_logps(cache, len(pairs))
        # Decided together: the pass is collective (fsdp's gathers, the gather of its results),
        # and a rank may miss a cache its peers see (another node's disk, a file written since).
        if loop.group.host_sum([values is None])[0]:
            values = self._reference_pass(pairs)
            if loop.group.local_rank == 0:
                _write_logps(cache, values)
            loop.group.barrier()
        return pairs.with_reference(values)

    def _reference_pass(self, pairs: EncodedPairs) -> np.ndarray:
        """[len(pairs), 2] float64: the reference's log-probs of each pair's chosen and rejected
        completions. The batches are one process's (per_device_eval_batch_size pairs in order,
        so the numbers do not depend on the number of ranks); each rank runs a consecutive share
        of them, and the shares are gathered in rank order. Every rank runs as many forwards
        (one short of batches repeats one and drops its result): under fsdp, and for the
        adapter-disabled policy under ddp, a forward is a collective."""
        loop, group = self.loop, self.loop.group
        size = loop.args.per_device_eval_batch_size
        shares = np.array_split(np.arange(0, len(pairs), size), group.world_size)
        mine = [int(start) for start in shares[group.rank]]
        values = []
        loop.model.eval()
        try:
            for turn in range(max(map(len, shares))):
                real = turn < len(mine)
                start = mine[turn] if real else (mine or [0])[0]
                batch = self.collate(pairs[start:start + size])  # lists for this batch only
                batch = {k: v.to(loop.device) for k, v in batch.items()}
                with loop.forward_context():
                    logps = self._reference_logps(loop.module, batch)
                loop.accelerator.mark_step()
                if real:
                    values.append(torch.stack(logps.float().chunk(2), dim=1).cpu().numpy())
                    self.precompute_forwards += 1
        finally:
            loop.model.train()
        mine = np.concatenate(values) if values else np.zeros((0, 2), dtype=np.float32)
        return np.concatenate(group.gather_objects(mine)).astype(np.float64)

    def _cache_key(self, pairs: EncodedPairs) -> str:
        digest = hashlib.sha256()
        for i in range(len(pairs)):
            for tokens in pairs.tokens(i).values():  # prompt, chosen, rejected
                digest.update(tokens.astype(np.int64).tobytes() + b"|")
        tokenizer = self.tokenizer
        digest.update(repr((self.ref_key, str(self.loop.precision.compute_dtype),
                            getattr(tokenizer, "name_or_path", None), len(tokenizer or ()),
                            getattr(tokenizer, "chat_template", None))).encode())
        return digest.hexdigest()[:24]


class PairCount:
    """What a DPO step's loss is the mean of: pairs (in place of loss.TokenCount's tokens)."""

    takes_item_count = False
    shifts_labels = False

    def __call__(self, batch) -> int:
        return pairs_in(batch)

    def samples(self, batch) -> int:
        """Throughput's samples: pairs (a pair's chosen and rejected rows are one sample, as in
        TRL)."""
        return pairs_in(batch)

    def seen(self, batches: list, counts: list[int]) -> int:
        """Throughput counts the tokens of the sequences (prompts and completions, chosen and
        rejected, no padding)."""
        return sum(int(batch["attention_mask"].sum()) for batch in batches)


class DPOTrainer(Trainer):
    """A Trainer whose objective is DPO's (see the module docstring). `train_dataset` and
    `eval_dataset` are preference rows (prompt / chosen / rejected, text or messages, encoded
    with `processing_class`) or pairs already encoded (methods/dpo/data.py). `ref_model`: the
    reference; None means the adapter-disabled base of a PEFT model, else a frozen copy of the
    starting weights (the recipe passes that copy: the Trainer never deep-copies a model)."""

    def __init__(self, model, args: DPOConfig | dict | None = None, ref_model=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, **kwargs) -> None:
        args = args if isinstance(args, DPOConfig) else DPOConfig(**(args or {}))
        adapters = model if ref_model is None and hasattr(model, "disable_adapter") else None
        if ref_model is None and adapters is None:
            raise InputError("DPO needs a reference: pass ref_model (a frozen copy of the starting "
                             "model), train LoRA adapters, or precompute_ref_log_probs with ref_model")
        ref_key = args.ref_key or (_fingerprint(ref_model if ref_model is not None else model)
                                   if args.precompute_ref_log_probs else None)
        train_dataset, eval_dataset = (_encoded(d, processing_class, args)
                                       for d in (train_dataset, eval_dataset))
        objective = PreferenceObjective(
            args, ref_model, adapters, pad=_pad_id(processing_class),
            max_length=args.max_length or _longest(train_dataset, eval_dataset), ref_key=ref_key,
            tokenizer=processing_class)
        super().__init__(model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, objective=objective, **kwargs)

    @property
    def precompute_forwards(self) -> int:
        """Reference forwards run to precompute the pairs' log-probs."""
        return self.objective.precompute_forwards

    def precompute_reference(self, pairs) -> EncodedPairs:
        """The pairs with the reference's log-probs (PreferenceObjective.precompute_reference)."""
        return self.objective.precompute_reference(pairs)


# -- helpers ---------------------------------------------------------------------------------------

def _encoded(dataset, tokenizer, config: DPOConfig):
    """Preference rows encoded (a list of pairs); pairs already encoded pass through as they are
    (the recipe's memory-mapped EncodedPairs stay shared between the ranks, never made lists)."""
    if dataset is None:
        return None
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and len(dataset) \
            and _is_encoded(dataset[0]):
        return dataset
    rows = list(dataset)
    if not rows or _is_encoded(rows[0]):
        return rows
    if tokenizer is None:
        raise InputError("DPOTrainer needs processing_class (the tokenizer) to encode preference rows")
    pairs, _ = encode_pairs(((f"row {i + 1}", row) for i, row in enumerate(rows)), tokenizer,
                            max_length=config.max_length, max_prompt_length=config.max_prompt_length)
    return pairs


def _is_encoded(row) -> bool:
    return all(key in row for key in ("prompt_ids", "chosen_ids", "rejected_ids"))


def _carries_reference(pairs) -> bool:
    if isinstance(pairs, EncodedPairs):
        return pairs.ref_logps is not None
    return all(REF_KEYS[0] in pair for pair in pairs)


def _pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0
    return next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)


def _longest(*datasets) -> int:
    return max((len(p["prompt_ids"]) + max(len(p["chosen_ids"]), len(p["rejected_ids"]))
                for d in datasets if d for p in d), default=2)


def _fingerprint(model) -> str:
    """A reference's identity for the cache, from its weights: names, shapes and two sums per
    tensor (a pass over the weights, no copy). Meta tensors give names and shapes only."""
    if model is None:
        return "none"
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            if tensor.is_floating_point() and tensor.device.type != "meta":
                t = tensor.detach().double()
                digest.update(np.asarray([t.sum().item(), (t * t).sum().item()]).tobytes())
    return digest.hexdigest()[:24]


def _read_logps(path: Path, count: int) -> np.ndarray | None:
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return values if values.shape == (count, 2) else None


def _write_logps(path: Path, values: np.ndarray) -> None:
    """Written beside its name and renamed: a kill mid-write leaves no half file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npy")
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, values)
        os.replace(temp, path)
    except OSError as exc:
        raise InputError(f"the reference cache {path.parent} cannot be written: {exc.strerror}") from None

