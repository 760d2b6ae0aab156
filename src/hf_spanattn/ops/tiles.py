"""Query-row tiles that meet only the key columns their rows may attend.

Under a causal mask the upper right of every T×T matrix (scores, probabilities, ∂L/∂S) is
probability 0 and gradient 0. `row_tiles` cuts the query rows into tiles, each with the
prefix of key columns that its rows reach, and `Tiled` keeps such a matrix as its tiles and
multiplies with it. Leaving the other columns out is exact; with 4 tiles it skips 3/8 of the
T×T work of a causal mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hf_spanattn.ops.backward import HALF

Tile = tuple[int, int, int]  # (first row, end row, key columns)
_TILE_ROWS, _MAX_TILES = 64, 8  # rows per tile: at least 64, and at most 8 tiles


def row_tiles(attend: torch.Tensor | None, t: int, s: int, rows: int | None = None, merged: int = 0) -> list[Tile]:
    """The tiles of T query rows over S keys for a bool mask (…, T, S), True = attend; a tile's
    rows attend only keys < its columns. Neighbouring tiles that reach as far merge (given `rows`, the
    rows per tile, only those that end by row `merged`), and rows that attend nothing are in no tile."""
    if attend is None:  # every row reaches all S keys: the tiles directly, without a reach per row
        if not rows:
            return [(0, t, s)]
        return [(0, merged, s)] * bool(merged) + [(start, min(start + rows, t), s) for start in range(merged, t, rows)]
    attend = attend.reshape(-1, *attend.shape[-2:]).any(dim=0).expand(-1, s)  # a mask may broadcast over the keys
    last = attend.flip(-1).to(torch.uint8).argmax(dim=-1)  # from the end: the last key attended
    return reach_tiles(torch.where(attend.any(dim=-1), s - last, 0).expand(t).tolist(), rows, merged)


def reach_tiles(reach: list[int], rows: int | None = None, merged: int = 0) -> list[Tile]:
    """`row_tiles` of the query rows whose row i attends only keys < reach[i] (0: none)."""
    t, fixed = len(reach), rows is not None
    rows = rows or max(_TILE_ROWS, -(-t // _MAX_TILES))
    tiles: list[Tile] = []
    for start in range(0, t, rows):
        end = min(start + rows, t)
        cols = max(reach[start:end])
        if tiles and tiles[-1][2] == cols and tiles[-1][1] == start and (not fixed or end <= merged):
            tiles[-1] = (tiles[-1][0], end, cols)
        elif cols:
            tiles.append((start, end, cols))
    return tiles


def row_range(x: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """Rows [start, end) of a mask field (…, T, ·), which may broadcast over the rows."""
    return x[..., start:end, :] if x is not None and x.shape[-2] > 1 else x


def masked_softmax(scores: torch.Tensor, dead_rows: torch.Tensor | None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over the keys of masked scores, into `out` if given (contiguous; it may be `scores`): in
    float32 for half inputs, probabilities in the scores' dtype; rows with nothing to attend give 0
    (as SDPA)."""
    if scores.dtype in HALF:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        probs = probs if out is None else out.copy_(probs)
    elif out is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.ops.aten._softmax.out(scores, -1, False, out=out)
    if dead_rows is None:
        return probs
    return probs.masked_fill_(dead_rows, 0.0) if out is not None else probs.masked_fill(dead_rows, 0.0)


def softmax_backward(d_probs: torch.Tensor, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """G = P ⊙ (dP − rowsum(dP ⊙ P)) over the keys, into `out` (it may be `d_probs` or `probs`). Under a Python
    dispatch mode (allow_mutation_on_saved_tensors') a new tensor: such a mode looks for an out argument named
    "out", which this op's is not."""
    if _get_current_dispatch_mode() is not None:
        return torch.ops.aten._softmax_backward_data(d_probs, probs, -1, d_probs.dtype)
    return torch.ops.aten._softmax_backward_data.out(d_probs, probs, -1, d_probs.dtype, grad_input=out)


class Recomputed:
    """Tiles that are not kept: tile i is `fn(i)`, computed again each time it is read, so that
    one at a time is in memory. `select(rows)`, if given, gives the tiles of the batch entries (and
    key/value heads) `rows` (else they are cut from the whole batch's)."""

    def __init__(self, fn: Callable[[int], torch.Tensor], n: int,
                 select: Callable[[slice | tuple[slice, ...]], Recomputed] | None = None) -> None:
        self.fn, self.n, self._select = fn, n, select

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.fn(i)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self.fn(i) for i in range(self.n))

    def select(self, rows: slice | tuple[slice, ...]) -> Recomputed:
        return self._select(rows) if self._select is not None else Recomputed(lambda i: self.fn(i)[rows], self.n)


class Tiled:
    """A (…, T, S) matrix kept as its row tiles (…, rows, cols); every other entry is 0. The parts
    are a list, or `Recomputed` (then so is what `map` and `combine` give)."""

    def __init__(self, tiles: list[Tile], parts: list[torch.Tensor] | Recomputed, t: int, s: int,
                 dtype: torch.dtype | None = None) -> None:
        self.tiles, self.parts, self.t, self.s = tiles, parts, t, s
        self.dtype = dtype or (parts[0].dtype if isinstance(parts, list) and parts else None)

    def select(self, rows: slice | tuple[slice, ...]) -> Tiled:
        """The batch entries (and key/value heads) `rows`."""
        parts = self.parts.select(rows) if isinstance(self.parts, Recomputed) else [p[rows] for p in self.parts]
        return Tiled(self.tiles, parts, self.t, self.s, self.dtype)

    def map(self, fn) -> Tiled:
        """fn applied to each tile with its (first row, end row, columns)."""
        return self.combine(None, lambda p, _, *tile: fn(p, *tile))

    def combine(self, other: Tiled | None, fn) -> Tiled:
        """fn(tile of self, tile of other, first row, end row, columns) for each tile."""
        one = lambda i: fn(self.parts[i], other.parts[i] if other else None, *self.tiles[i])  # noqa: E731
        if isinstance(self.parts, Recomputed) or (other is not None and isinstance(other.parts, Recomputed)):
            return Tiled(self.tiles, Recomputed(one, len(self.tiles)), self.t, self.s, self.dtype)
        return Tiled(self.tiles, [one(i) for i in range(len(self.tiles))], self.t, self.s)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        """self @ x for x (…, S, n): (…, T, n)."""
        return self._product(x, transpose=False)

    @property
    def mT(self) -> _Transposed:
        return _Transposed(self)

    def _product(self, x: torch.Tensor, transpose: bool) -> torch.Tensor:
        if not len(self.parts):
            return x.new_zeros(*x.shape[:-2], self.s if transpose else self.t, x.shape[-1])
        if transpose:  # Σ over tiles: the widest product is the sum's buffer, the others add into its first rows
            widest = max(range(len(self.tiles)), key=lambda i: self.tiles[i][2])
            out = None
            for i in [widest, *(i for i in range(len(self.tiles)) if i != widest)]:
                start, end, cols = self.tiles[i]
                product = self.parts[i].mT @ x[..., start:end, :]
                if out is None:
                    out = _pad_rows(product, self.s - cols)
                else:
                    out[..., :cols, :] += product
            return out
        pieces, written = [], 0  # the tiles' rows in order, zeros for rows in no tile
        for i, (start, end, cols) in enumerate(self.tiles):  # by index: zip would hold the last tile too
            product = self.parts[i] @ x[..., :cols, :]  # a recomputed tile goes before the next is formed
            pieces += [_zero_rows(product, start - written), product]
            written = end
        pieces.append(_zero_rows(pieces[-1], self.t - written))
        pieces = [p for p in pieces if p.shape[-2]]
        return torch.cat(pieces, dim=-2) if len(pieces) > 1 else pieces[0]


def _zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows of zeros shaped like `like` otherwise."""
    return like.new_zeros(*like.shape[:-2], rows, like.shape[-1])


def _pad_rows(x: torch.Tensor, after: int) -> torch.Tensor:
    """x with `after` rows of zeros below it."""
    return torch.cat([x, _zero_rows(x, after)], dim=-2) if after else x


class _Transposed:
    """(…, S, T) = Tiledᵀ, for products only."""

    def __init__(self, tiled: Tiled) -> None:
        self.tiled, self.dtype = tiled, tiled.dtype

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiled._product(x, transpose=True)
