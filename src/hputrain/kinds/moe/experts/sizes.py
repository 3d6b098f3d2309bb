"""The sizes of the static experts and of expert parallelism's exchange, from the layout alone
(T tokens a rank, top-k, E experts, N expert-parallel ranks): what the forward allocates, what
`hputrain plan` prints and docs/moe.md derives. Pure arithmetic, no torch.

- The exchange: each rank sends each peer C = min(⌈f·T·k/N⌉, T·min(k, E/N)) rows, f the
  capacity factor (1.25 unless `expert_capacity_factor` says otherwise; the second bound: a token
  meets at most min(k, E/N) experts on one peer, so no peer can be sent more), and receives as
  many: N·C ≤ f·T·k rows, f times the T·k pairs a rank receives on average. Pairs past a peer's
  C go in a second exchange, taken only when some rank has them (kinds/moe/experts/parallel.py),
  so nothing is dropped. At f ≥ N·min(k, E/N)/k, C is the second bound: no routing overflows.
- The fixed-shape grouped product (grouped.py) on R rows sorted by E experts: tiles of
  t = min(256, ⌈R/(4E)⌉) rows (a multiple of 8 above 8), each holding one expert's rows; an
  expert with n rows fills ⌈n/t⌉ of them, so ⌊(R + E·(t-1))/t⌋ tiles hold any routing, and
  their rows are at most R + E·t (≤ 1.25·R + E where t is not capped).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: The first exchange's rows per peer, over the average a peer gets (T·k/N), by default.
CAPACITY_FACTOR = 1.25
#: The largest tile of the fixed-shape grouped product.
TILE_ROWS = 256


def peer_capacity(tokens: int, top_k: int, experts: int, ranks: int,
                  factor: float = CAPACITY_FACTOR) -> int:
    """Rows each rank sends each peer (and receives from each) in the first exchange."""
    if ranks == 1:
        return tokens * top_k
    worst = worst_per_peer(tokens, top_k, experts, ranks)
    return min(worst, math.ceil(round(factor * tokens * top_k / ranks, 6)))


def holds_any_routing(top_k: int, experts: int, ranks: int, factor: float = CAPACITY_FACTOR) -> bool:
    """Whether C is T·min(k, E/N) at every T (f ≥ N·min(k, E/N)/k): no routing can overflow."""
    return factor * top_k / ranks >= min(top_k, experts // ranks)


def worst_per_peer(tokens: int, top_k: int, experts: int, ranks: int) -> int:
    """T·min(k, E/N): the most pairs one rank can send one peer, whatever the routing."""
    return tokens * min(top_k, experts // ranks)


def tile_rows(rows: int, experts: int) -> int:
    """The fixed-shape product's tile for `rows` sorted rows of `experts` experts."""
    tile = -(-rows // (4 * experts))
    if tile > 8:
        tile = -(-tile // 8) * 8
    return max(1, min(TILE_ROWS, tile))


def tile_count(rows: int, experts: int, tile: int) -> int:
    """Tiles that hold any routing of `rows` rows over `experts` experts: Σ_e ⌈n_e/t⌉ ≤
    ⌊(rows + E·(t-1))/t⌋."""
    return (rows + experts * (tile - 1)) // tile


@dataclass(frozen=True)
class ExpertSizes:
    """One MoE layer's rows on one rank (T tokens, top-k, E experts over N ranks)."""

    tokens: int
    top_k: int
    experts: int
    ranks: int = 1
    capacity_factor: float = CAPACITY_FACTOR

    @property
    def pairs(self) -> int:
        """T·k: the dropless minimum, the rows a grouped kernel runs on without expert parallelism
        (and a rank receives on average with it)."""
        return self.tokens * self.top_k

    @property
    def local_experts(self) -> int:
        return self.experts // self.ranks

    @property
    def capacity(self) -> int:
        """C: rows sent to (and received from) each peer in the first exchange."""
        return peer_capacity(self.tokens, self.top_k, self.experts, self.ranks, self.capacity_factor)

    @property
    def exchange_rows(self) -> int:
        """N·C: one all-to-all buffer's rows (0 without expert parallelism)."""
        return 0 if self.ranks == 1 else self.ranks * self.capacity

    @property
    def worst_rows_per_peer(self) -> int:
        """T·min(k, E/N): what one peer can be sent at most (the second exchange's bound)."""
        return worst_per_peer(self.tokens, self.top_k, self.experts, self.ranks)

    @property
    def expert_rows(self) -> int:
        """R: the rows this rank's experts run on (the received buffer, or the T·k pairs)."""
        return self.exchange_rows if self.ranks > 1 else self.pairs

    @property
    def tile(self) -> int:
        return tile_rows(self.expert_rows, self.local_experts)

    @property
    def tiles(self) -> int:
        return tile_count(self.expert_rows, self.local_experts, self.tile)

    @property
    def tiled_rows(self) -> int:
        """The fixed-shape form's rows (tiles × tile): what it multiplies and keeps for backward."""
        return self.tiles * self.tile

    def saved(self, hidden: int, intermediate: int, tiled: bool = True) -> int:
        """Elements one layer keeps for backward, in the compute dtype: the up product's input
        (tiled rows × hidden: the tiles, or R rows for a grouped kernel), the gate's input and
        output (R × 2I and R × I, a gated SiLU's), the down product's input (tiled rows × I),
        and each pair's expert output, for the router weights' gradient (T·k × hidden)."""
        rows = self.tiled_rows if tiled else self.expert_rows
        return rows * (hidden + intermediate) + self.expert_rows * 3 * intermediate + self.pairs * hidden

    def minimum_saved(self, hidden: int, intermediate: int) -> int:
        """The same with T·k rows throughout: a dropless grouped kernel without padding
        (transformers' grouped_mm in one process)."""
        return self.pairs * (2 * hidden + 4 * intermediate)


def expert_sizes(tokens: int, top_k: int, experts: int, ranks: int = 1,
                 capacity_factor: float = CAPACITY_FACTOR) -> ExpertSizes:
    return ExpertSizes(tokens, top_k, experts, ranks, capacity_factor)
