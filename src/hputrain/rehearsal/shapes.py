"""The batch shapes a training run will see, counted without the model: a census of its collated
micro-batches.

Lazy mode on Gaudi (and any graph-compiling backend) compiles the step's graphs once per batch
shape, so the number of distinct shapes a run meets is the number of compilations it pays for. A
few steps watched cannot tell a bounded set from one that keeps growing; walking the run's own
batches (collation only, no model: seconds) counts them. `take_census` walks any iterable of
micro-batches (`hputrain doctor` hands it the Trainer's own batch source, see doctor.py) for as
many as the run takes, within a time and batch budget, and says how the batches are padded:

- to a fixed length: one shape;
- to each batch's longest row: every batch's padded length equals its longest real row, read
  from its attention_mask (ones) or, without one, its labels (the last one that is not -100);
- to other lengths (buckets, multiples): anything else.

The rule (`ShapeCensus.bounded`): the shapes are unbounded, which on Gaudi means compiling all
through the run, when there are more than MAX_SHAPES of them; or when each batch is padded to its
longest row and the rows come in more than MAX_SHAPES lengths (a longer run, or more data, meets
more of them, whatever the walk happened to see); or when a walk cut short by its budget still
met new shapes in its second half. Anything else is a bounded set, each shape compiled once.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

MAX_SHAPES = 8
"""More distinct batch shapes than this is not a bounded set (length buckets are a handful)."""

MAX_BATCHES = 20_000
"""Micro-batches walked at most; past that the count is a lower bound."""

SECONDS = 10.0
"""Time the walk may take at most; past that the count is a lower bound."""

IGNORE_INDEX = -100
"""The label of a padded position (and of any other position the loss leaves out)."""


def batch_shapes(batch) -> dict[str, list[int]]:
    """The shape of each tensor of a batch (a dict, a list or tuple, or one tensor), by name."""
    if isinstance(batch, Mapping):
        return {str(k): list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if isinstance(batch, (list, tuple)):
        return {str(i): list(v.shape) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)}
    return {"batch": list(batch.shape)} if isinstance(batch, torch.Tensor) else {}


def shape_text(shapes: dict) -> str:
    """A batch's shapes: "[4, 32]" when all its tensors have that shape, else per tensor."""
    distinct = {_list_text(shape) for shape in shapes.values()}
    if len(distinct) == 1:
        return distinct.pop()
    return "{" + ", ".join(f"{name}: {_list_text(shape)}" for name, shape in sorted(shapes.items())) + "}"


def _list_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class ShapeCensus:
    """What a walk over a run's micro-batches found."""

    shapes: list[str] = field(default_factory=list)
    """The distinct batch shapes (shape_text), in the order they first came."""
    first_at: list[int] = field(default_factory=list)
    """For each shape, the micro-batch (counted from 0) that brought it."""
    batches: int = 0
    """Micro-batches walked."""
    planned: int = 0
    """Micro-batches the run takes (what the walk set out to cover)."""
    widths: set[int] = field(default_factory=set)
    """The padded sequence lengths (dimension 1 of the token tensors)."""
    row_lengths: set[int] = field(default_factory=set)
    """The real lengths of the rows, where the batches show them (attention_mask or labels)."""
    to_longest: bool | None = None
    """Every batch padded exactly to its longest row; None when the batches do not show it."""
    templates: set[str] = field(default_factory=set)
    """The shapes with the sequence length written L: one template means only L varies."""
    stopped: str | None = None
    """Why the walk ended before `planned`: a budget, or the error the batches raised."""
    seconds: float = 0.0

    @property
    def lower_bound(self) -> bool:
        """The walk ended early: the run may meet more shapes than these."""
        return self.stopped is not None

    @property
    def growing(self) -> bool:
        """A walk cut short still met new shapes in its second half."""
        return self.lower_bound and any(i >= self.batches // 2 for i in self.first_at[1:])

    @property
    def padding(self) -> str:
        """"fixed" (one shape), "longest row" (each batch to its own), "other" (buckets,
        multiples), or "unknown" (the batches show no row lengths)."""
        if len(self.shapes) <= 1:
            return "fixed"
        if self.to_longest is None:
            return "unknown"
        return "longest row" if self.to_longest else "other"

    @property
    def bounded(self) -> bool:
        """See the module's rule."""
        return not self.reasons()

    def reasons(self) -> list[str]:
        """Why the shapes are not a bounded set (empty when they are)."""
        found = []
        if len(self.shapes) > MAX_SHAPES:
            found.append(f"more than {MAX_SHAPES} shapes")
        if self.padding == "longest row" and len(self.row_lengths) > MAX_SHAPES:
            found.append(f"each batch is padded to its own longest row, and the rows come in "
                         f"{len(self.row_lengths)} lengths ({min(self.row_lengths)} to "
                         f"{max(self.row_lengths)} tokens): more data meets more of them")
        if self.growing:
            found.append(f"new shapes still came in the second half of the walk, which stopped "
                         f"at {self.stopped}")
        return found

    def listing(self, most: int = 12) -> str:
        """The shapes, compactly: "[4, L], L = 13, 17-48" when only the sequence length varies."""
        if len(self.templates) == 1 and len(self.shapes) > 1:
            return f"{next(iter(self.templates))}, L = {_ranges(sorted(self.widths))}"
        more = f", and {len(self.shapes) - most} more" if len(self.shapes) > most else ""
        return ", ".join(self.shapes[:most]) + more

    def multiple_for(self, at_most: int = 4) -> tuple[int, int] | None:
        """(M, n): the smallest power of two M >= 8 that pads the widths seen to at most `at_most`
        lengths, and how many; None when the batches show no sequence length."""
        if not self.widths:
            return None
        multiple = 8
        while len({-(-w // multiple) for w in self.widths}) > at_most:
            multiple *= 2
        return multiple, len({-(-w // multiple) for w in self.widths})

    def as_dict(self) -> dict:
        return {"count": len(self.shapes), "lower_bound": self.lower_bound, "bounded": self.bounded,
                "padding": self.padding, "micro_batches": self.batches, "planned": self.planned,
                "stopped": self.stopped, "seconds": round(self.seconds, 3), "listing": self.listing(),
                "distinct": self.shapes, "new_at_micro_batches": self.first_at,
                "sequence_lengths": sorted(self.widths), "row_lengths": sorted(self.row_lengths),
                "reasons": self.reasons()}


def _ranges(values: list[int]) -> str:
    """1, 2, 3, 5, 7, 8 -> "1-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def take_census(batches: Iterable, planned: int, seconds: float = SECONDS,
                max_batches: int = MAX_BATCHES) -> ShapeCensus:
    """Walk `planned` micro-batches of `batches` (fewer if it ends), within `seconds` and
    `max_batches`, and count their shapes. An error raised by the batches (a collator's) ends the
    walk and is recorded in `stopped`, as a budget is."""
    census = ShapeCensus(planned=planned)
    start = time.perf_counter()
    iterator = iter(batches)
    while census.batches < planned:
        if census.batches >= max_batches:
            census.stopped = f"the budget of {max_batches} micro-batches"
            break
        if time.perf_counter() - start > seconds:
            census.stopped = f"the time budget of {seconds:g} s"
            break
        try:
            batch = next(iterator)
        except StopIteration:
            break
        except Exception as error:  # the run would meet it too; the count stops here
            census.stopped = f"an error of the batches: {type(error).__name__}: {error}"
            break
        _count(census, batch)
    census.seconds = time.perf_counter() - start
    return census


def _count(census: ShapeCensus, batch) -> None:
    """Add one micro-batch to the census."""
    shapes = batch_shapes(batch)
    text = shape_text(shapes)
    if text not in census.shapes:
        census.shapes.append(text)
        census.first_at.append(census.batches)
    census.batches += 1
    tokens = _token_tensor(batch)
    if tokens is None:
        census.templates.add(text)
        return
    width = tokens.shape[1]
    census.widths.add(width)
    census.templates.add(shape_text({name: [("L" if i > 0 and d == width else d) for i, d in enumerate(s)]
                                     for name, s in shapes.items()}))
    lengths = _row_lengths(batch, width)
    if lengths is None:
        return
    census.row_lengths.update(lengths)
    longest = max(lengths) == width
    census.to_longest = longest if census.to_longest is None else census.to_longest and longest


def _token_tensor(batch) -> torch.Tensor | None:
    """The tensor whose dimension 1 is the sequence: input_ids (else labels, attention_mask) of a
    dict batch, else the first 2-D tensor of a list, tuple or tensor batch."""
    if isinstance(batch, Mapping):
        found = [batch.get(k) for k in ("input_ids", "labels", "attention_mask")]
    else:
        found = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    return next((t for t in found if isinstance(t, torch.Tensor) and t.dim() == 2), None)


def _row_lengths(batch, width: int) -> list[int] | None:
    """Each row's real length: its attention_mask's ones, else up to its last label that is not
    IGNORE_INDEX (a prompt's -100 labels come before the real ones). None when the batch has
    neither as a [rows, width] tensor."""
    if not isinstance(batch, Mapping):
        return None
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == width:
        return (mask != 0).sum(dim=1).tolist()
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and labels.shape[1] == width:
        real = labels != IGNORE_INDEX
        last = width - real.flip(1).int().argmax(dim=1)  # one past the last real label
        return torch.where(real.any(dim=1), last, 0).tolist()
    return None
