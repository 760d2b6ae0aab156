"""The tile backend of `span_attention`: the T×T work (scores, probabilities, ∂L/∂S and their
products) as explicit matrices in row tiles of queries that meet only the keys their rows may
attend (`tiles.py`; the per-block rule's blocks in `blocks.py`). Any dtype, rank-safe spans from
`span_of`; the faster way on a CPU. The forward pass keeps the probabilities' tiles for the backward
pass within a budget of O(d) elements per query head, from the first tile on; the others are
recomputed there, one at a time (memory O(T·d), as SDPA's, at any T). The backward pass forms each
tile of ∂L/∂P once, takes dV, G and all the products the rule asks for from it, and takes at most
an eighth or a quarter of the (batch entry, key/value head) pairs at a time, spans included. It
answers the rules' `Operands` and `Blocks` from them (the contract in `backward.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hf_spanattn.ops import backward, blocks, rules
from hf_spanattn.ops.backward import Probe, Rows, pick
from hf_spanattn.ops.blocks import TileBlocks, Workspace
from hf_spanattn.ops.inputs import attended
from hf_spanattn.ops.spans import Span, span_of
from hf_spanattn.ops.tiles import (
    Recomputed,
    Tile,
    Tiled,
    masked_softmax,
    reach_tiles,
    row_range,
    row_tiles,
    softmax_backward,
)

if TYPE_CHECKING:
    from hf_spanattn.config import SpanAttentionConfig

# The backward pass takes the batch in _BACKWARD_CHUNKS parts, which bounds the rules' O(T·d)
# temporaries to that share of the batch's; in half as many where the kept probabilities are few
# beside them (at most _FEW_KEPT·T·d per query head: T ≤ 512 under a causal mask at d = 64, whose
# tiles hold 4.5·T·d, and T ≤ 320 without) and the rule is not per-block, whose stacks are larger:
# fewer, larger products run faster on a few cores. No part holds fewer than _MIN_PART elements of Q
# (256 KiB in float32): below that a part's own work (its spans, a call per product) costs more time
# than its share saves memory (a few MiB at most).
_BACKWARD_CHUNKS, _FEW_KEPT, _MIN_PART = 8, 5, 2**16

# Who draws the dropout mask of the calls made under `drawn_by` (packed rows: SDPA's draw over the rows, not one over
# the padded batch of documents that runs here); None: the engine itself.
_KEEP_DRAW: contextvars.ContextVar[Callable[[], torch.Tensor] | None] = contextvars.ContextVar("keep", default=None)


@contextlib.contextmanager
def drawn_by(draw: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Calls in this context take their dropout mask (the kept weights, (B, H_q, T, S) bool) from `draw()`, called
    once per call in its forward pass, instead of drawing it themselves."""
    token = _KEEP_DRAW.set(draw)
    try:
        yield
    finally:
        _KEEP_DRAW.reset(token)


# The forward pass keeps for the backward pass at most as many probabilities per query head as
# min(_KEPT_ROWS, _KEPT_PER_ROW·T) rows of Q hold numbers (less twice the per-block rule's stacks): all
# of them up to 1024 keys under a causal mask at d = 64 (9·T·d there), where keeping them is faster,
# and up to 576 keys without one. The tiles past that are recomputed there, one at a time, for one
# more product QKᵀ each: what is kept stays O(d) per head at any T, at most 9 times Q, and the peak
# within 4× SDPA's. The recomputed tiles then have at most _RECOMPUTED_ROWS head dims of query rows (at
# least 16), which bounds the one in memory; the kept ones merge where they reach as far, as without a
# budget (fewer, larger products).
_KEPT_ROWS, _KEPT_PER_ROW, _RECOMPUTED_ROWS = 9216, 9, 2
# The one-pass backward takes each tile _BACKWARD_ROWS head dims of query rows at a time (at least 16), so
# that its T×T temporaries (∂L/∂P, G) are O(T·d) per head beside the kept P; fewer rows cost speed.
_BACKWARD_ROWS = 4


@dataclass
class _Mask:
    """A mask in the (B, H_kv, g, T, S) layout: the row tiles (see `row_tiles`) that the T×S work is
    cut into, what is added to each tile's scores from its first key column where the mask is not
    zero (under a causal mask, its first row), the key positions some query may attend to (the
    spans' support, see `MASKED_AT`), the query rows with no finite mask entry (output 0, as SDPA) and
    those whose entries are finite but all masked (output SDPA's, no gradient into Q and K)."""

    tiles: list[Tile]
    first_masked: list[int]
    additive: list[torch.Tensor | None]  # per tile: (b, h, g, rows, columns from first_masked), None where all 0
    key_valid: torch.Tensor | None  # (b, h, 1, S, 1) bool
    dead_rows: torch.Tensor | None  # (b, h, g, T, 1) bool
    idle_rows: torch.Tensor | None = None  # (b, h, g, T, 1) bool: finite, but no key above MASKED_AT

    def select(self, rows: Rows) -> _Mask:
        """The mask of batch entries (and key/value heads) `rows` (see `pick`)."""
        return _Mask(self.tiles, self.first_masked, [pick(a, rows) for a in self.additive],
                     *(pick(x, rows) for x in (self.key_valid, self.dead_rows, self.idle_rows)))

    def tensors(self) -> list[torch.Tensor | None]:
        """The tensors of the mask, as `of` takes them back."""
        return [*self.additive, self.key_valid, self.dead_rows, self.idle_rows]

    @staticmethod
    def of(tiles: list[Tile], first_masked: list[int], tensors: list[torch.Tensor | None]) -> _Mask:
        return _Mask(tiles, first_masked, tensors[:len(tiles)], *tensors[len(tiles):])

    def tile(self, i: int) -> tuple[torch.Tensor | None, int, torch.Tensor | None]:
        """(additive, lo, dead_rows) on the rows of tile i: the additive mask on the keys [lo, its
        columns), None where it is zero on all of them."""
        start, end, _ = self.tiles[i]
        return self.additive[i], self.first_masked[i], row_range(self.dead_rows, start, end)


def _attend(attn_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(attend: bool, True where the key counts for the spans; the additive mask in `dtype`)."""
    if attn_mask.dtype == torch.bool:  # adding a float mask is twice as fast as masked_fill_ with a broadcast bool mask
        return attn_mask, _additive(~attn_mask, dtype)
    return attended(attn_mask), attn_mask.to(dtype)


def _additive(masked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """−inf where `masked`, else 0, in `dtype`: one new tensor, nothing written in place (which selective activation
    checkpointing refuses of a kept output)."""
    return torch.where(masked, torch.full((), -math.inf, dtype=dtype, device=masked.device),
                       torch.zeros((), dtype=dtype, device=masked.device))


def _prepare_mask(attn_mask: torch.Tensor | None, is_causal: bool, shape: tuple[int, ...],
                  dtype: torch.dtype, device: torch.device, rows: int | None = None, merged: int = 0) -> _Mask:
    """The mask of a call with q (B, H_kv, g, T, ·) for keys (…, S, ·) as `shape` = (B, H_kv, g, T, S);
    `rows`: the rows per tile, if fixed (but merged up to row `merged`, see `row_tiles`)."""
    _, h_kv, groups, t, s = shape
    if is_causal:
        return _causal_mask(t, s, dtype, device, rows, merged)
    if attn_mask is None:
        tiles = row_tiles(None, t, s, rows, merged)
        return _Mask(tiles, [cols for *_, cols in tiles], [None] * len(tiles), None, None)
    attend, additive = _attend(attn_mask, dtype)
    while attend.dim() < 4:
        attend, additive = attend.unsqueeze(0), additive.unsqueeze(0)
    b, h = attend.shape[:2]
    layout = (b, h_kv, groups) if h > 1 else (b, 1, 1)
    attend = attend.reshape(*layout, *attend.shape[-2:])
    additive = additive.reshape(*layout, *additive.shape[-2:])
    key_valid = attend.any(dim=-2).any(dim=2, keepdim=True).unsqueeze(-1)
    # SDPA's rows: a row whose entries are all −inf gives 0; one whose entries are all at or below
    # MASKED_AT but finite gives the softmax over all of them (uniform for the dtype's minimum); a
    # NaN anywhere in a row makes it NaN
    defined = ((additive > -math.inf) | additive.isnan()).any(dim=-1, keepdim=True)
    dead_rows, idle_rows = ~defined, defined & ~attend.any(dim=-1, keepdim=True)
    reach = attend | idle_rows
    tiles = row_tiles(reach, t, s, rows, merged) or [(0, t, s)]  # no row attends: one tile of rows that give 0
    masked = (additive != 0).reshape(-1, *additive.shape[-2:]).any(dim=0).expand(t, s)
    first_masked, parts = [], []
    for start, end, cols in tiles:
        columns = masked[start:end, :cols].any(dim=0)
        lo = int(columns.int().argmax()) if columns.any() else cols
        first_masked.append(lo)
        parts.append(row_range(additive, start, end)[..., lo:cols] if lo < cols else None)
    return _Mask(tiles, first_masked, parts, None if key_valid.all() else key_valid,
                 dead_rows if dead_rows.any() else None, idle_rows if idle_rows.any() else None)


_CAUSAL_MASKS: dict[tuple, _Mask] = {}  # a dict, not lru_cache: Dynamo traces it without a warning


def _causal_mask(t: int, s: int, dtype: torch.dtype, device: torch.device, rows: int | None, merged: int) -> _Mask:
    """The causal mask (row i attends keys ≤ i), built once per shape (the last few kept) from the
    tiles alone: only their parts that are not zero, the squares on the diagonal (T × rows per tile
    numbers rather than T·S); nothing reads them but to add them."""
    # under a Python dispatch mode (FakeTensorMode's) the tensors made here are that mode's, not for later calls
    key = (t, s, dtype, device, rows, merged) if _get_current_dispatch_mode() is None else None
    mask = None if key is None else _CAUSAL_MASKS.get(key)
    if mask is None:
        tiles = reach_tiles([min(i + 1, s) for i in range(t)], rows, merged)
        first_masked, additive = [], []
        for start, end, cols in tiles:
            lo = min(start + 1, cols)  # row `start` attends no key past itself
            above = torch.arange(lo, cols, device=device) > torch.arange(start, end, device=device)[:, None]
            first_masked.append(lo)
            additive.append(_additive(above, dtype).view(1, 1, 1, *above.shape) if lo < cols else None)
        key_valid = (torch.arange(s, device=device) < t).view(1, 1, 1, s, 1) if s > t else None  # keys no row reaches
        mask = _Mask(tiles, first_masked, additive, key_valid, None)
        if key is not None:  # list() and pop(·, None): threads building other shapes may evict the same entries
            for old in list(_CAUSAL_MASKS)[:-3]:
                _CAUSAL_MASKS.pop(old, None)
            _CAUSAL_MASKS[key] = mask
    return mask


def _probs(q: torch.Tensor, k: torch.Tensor, mask: _Mask, scale: float,
           kept: list[torch.Tensor | None] | None = None, keep: list[bool] | None = None) -> Tiled:
    """softmax(scale·Q Kᵀ + mask) in q's dtype, tile by tile: all formed now, or with `kept` the tiles
    there and the others `Recomputed` when read (and put in `kept` where `keep` marks them). Rows
    with no finite mask entry give 0 (as SDPA).
    Scores and softmax are in the work dtype: float32 for half inputs, whose scores may pass the half
    range (65504 in float16), as SDPA's."""
    work = backward.work_dtype(q.dtype)

    def tile(i: int) -> torch.Tensor:
        start, end, cols = mask.tiles[i]
        additive, lo, dead_rows = mask.tile(i)
        scores = (q[..., start:end, :].to(work) * scale) @ k[..., :cols, :].to(work).mT
        # in place: a tile whose neighbours reach as far (every row without a mask) holds all of P; not under a
        # Python dispatch mode, as selective checkpointing's, which may keep the product for the recomputation
        in_place = _get_current_dispatch_mode() is None
        if additive is not None and in_place:
            scores[..., lo:].add_(additive)
        elif additive is not None:
            scores = torch.cat([scores[..., :lo], scores[..., lo:] + additive], dim=-1)
        return masked_softmax(scores, dead_rows, out=scores if in_place else None).to(q.dtype)

    if kept is None:
        return Tiled(mask.tiles, [tile(i) for i in range(len(mask.tiles))], q.shape[-2], k.shape[-2])

    def select(rows: Rows) -> Recomputed:
        return _probs(q[rows], k[rows], mask.select(rows), scale, [p if p is None else p[rows] for p in kept]).parts

    def part(i: int) -> torch.Tensor:
        if kept[i] is None:
            formed = tile(i)
            if keep is not None and keep[i]:
                kept[i] = formed
            return formed
        return kept[i]

    return Tiled(mask.tiles, Recomputed(part, len(mask.tiles), select), q.shape[-2], k.shape[-2], q.dtype)


def _rows(head_dims: float, d: int) -> int:
    """`head_dims` head dims d of query rows, at least 16."""
    return max(16, int(head_dims * d))


def _kept_tiles(mask: _Mask, shape: tuple[int, ...], budget: int) -> list[bool]:
    """Which tiles of P the forward pass keeps, from the first, within `budget` elements; `shape`:
    (B, H_kv, g, T, S)."""
    per_row, kept, total = math.prod(shape[:3]), [], 0
    for start, end, cols in mask.tiles:
        total += per_row * (end - start) * cols
        kept.append(total <= budget)
    return kept


def _dropped(probs: Tiled, keep: torch.Tensor | None, dropout_p: float) -> Tiled:
    """The attention weights: probabilities times the dropout mask over (1 − p)."""
    if keep is None:
        return probs
    return probs.map(lambda p, start, end, cols: p * keep[..., start:end, :cols] * _keep_scale(dropout_p))


def _keep_scale(dropout_p: float) -> float:
    """1 / (1 − p), the scale of the weights that dropout keeps; 0 for p = 1, where it keeps none (as SDPA)."""
    return 0.0 if dropout_p == 1 else 1 / (1 - dropout_p)


class SpanAttentionFunction(torch.autograd.Function):
    """Attention on (B, H_kv, g, T, d) queries and (B, H_kv, 1, S, d) keys/values."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, mask: _Mask, dropout_p: float, scale: float, config: SpanAttentionConfig,
                probe: Probe | None, kept_tiles: list[bool]):
        if all(kept_tiles):
            probs = _probs(q, k, mask, scale)
            kept = probs.parts
        else:  # each tile formed once, for the output, and kept if marked
            kept = [None] * len(kept_tiles)
            probs = _probs(q, k, mask, scale, kept, kept_tiles)
        keep, draw, shape = None, _KEEP_DRAW.get(), (*q.shape[:-1], k.shape[-2])
        if dropout_p == 1:  # nothing kept, nothing drawn (as SDPA)
            keep = q.new_zeros(shape, dtype=torch.bool)
        elif dropout_p > 0 and draw is not None:
            keep = draw().reshape(shape)
        elif dropout_p > 0:
            # The draw is torch.empty(B, H_kv, g, T, S).bernoulli_(1 - p), reproducible under a seed: SDPA's on the CPU.
            keep = q.new_empty(shape).bernoulli_(1 - dropout_p).bool()
        out = _dropped(probs, keep, dropout_p) @ v
        learnable = attn_mask if ctx.needs_input_grad[3] else None
        # the mask's tensors saved as the others, so that autograd lets them go after the backward pass
        ctx.save_for_backward(q, k, v, keep, learnable, *kept, *mask.tensors())
        ctx.tiles, ctx.first_masked = mask.tiles, mask.first_masked
        ctx.dropout_p, ctx.scale, ctx.config, ctx.probe = dropout_p, scale, config, probe
        return out

    @staticmethod
    @backward.first_order_only
    def backward(ctx, d_out):
        q, k, v, keep, learnable, *kept = ctx.saved_tensors
        kept, mask = kept[:len(ctx.tiles)], _Mask.of(ctx.tiles, ctx.first_masked, kept[len(ctx.tiles):])
        probs = (Tiled(mask.tiles, kept, q.shape[-2], k.shape[-2]) if all(p is not None for p in kept)
                 else _probs(q, k, mask, ctx.scale, kept))
        d_mask = None
        if learnable is not None:
            d_mask = backward.mask_grad(_mask_free_grads(probs, v, keep, ctx.dropout_p, d_out), learnable)
        batch = _Batch(q, k, v, keep, d_out.contiguous(), probs, mask)
        grads = [torch.empty_like(x) for x in (q, k, v)]
        workspace = Workspace(q.numel())
        records: list[tuple[Rows, dict]] = []
        for rows in _backward_chunks(q.shape, _backward_parts(q.shape, probs, ctx.config.rule.per_block)):
            probe = (lambda record, rows=rows: records.append((rows, record))) if ctx.probe is not None else None
            chunk = _backward(batch.select(rows), ctx.dropout_p, ctx.scale, ctx.config, probe, workspace)
            for grad, part in zip(grads, chunk):
                grad[rows] = part
        if records:
            ctx.probe(_whole_batch(records, q.shape[:2]))
        return (*grads, d_mask, None, None, None, None, None, None)


def _backward_parts(shape: torch.Size, probs: Tiled, per_block: bool) -> int:
    """How many parts the backward pass takes the batch of q (B, H_kv, g, T, d) in, given the
    probabilities (all kept, or partly recomputed; see _BACKWARD_CHUNKS)."""
    few = (not per_block and not isinstance(probs.parts, Recomputed)
           and sum(p.shape[-2] * p.shape[-1] for p in probs.parts) <= _FEW_KEPT * shape[-2] * shape[-1])
    parts = _BACKWARD_CHUNKS // 2 if few else _BACKWARD_CHUNKS
    return max(1, min(parts, math.prod(shape) // _MIN_PART))


def _backward_chunks(shape: torch.Size, parts: int) -> list[Rows]:
    """The `parts` of the (B, H_kv, …) batch that the backward pass takes one at a time: batch entries
    and key/value heads are independent, and a part bounds the rule's O(T·d) temporaries to at most
    1/parts of the batch's. Whole batch entries where there are as many (B // parts each, so that
    at B = 10 it takes 10 parts of one entry, not 5 of two); else parts of each entry's key/value
    heads, (B·H_kv) // parts heads each and at least one (at B = 3, H_kv = 4 in eighths: 12 parts of
    one head, not 6 of two)."""
    b, h_kv = shape[:2]
    if b >= parts:
        step = b // parts
        return [slice(start, start + step) for start in range(0, b, step)]
    heads = max(1, h_kv * b // parts)
    return [(slice(i, i + 1), slice(j, j + heads)) for i in range(b) for j in range(0, h_kv, heads)]


def _whole_batch(records: list[tuple[Rows, dict]], batch: torch.Size) -> dict:
    """The probe's records of the backward chunks (`rows`, record) as one record of the whole
    (B, H_kv) batch, so that a probe sees every head in its place whatever the chunks."""
    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        whole = parts[0].new_empty(*batch, *parts[0].shape[2:])
        for (rows, _), part in zip(records, parts):
            whole[rows] = part
        return whole

    first = records[0][1]
    return {key: [joined(list(p)) for p in zip(*(r[key] for _, r in records))] if isinstance(first[key], list)
            else joined([r[key] for _, r in records]) if isinstance(first[key], torch.Tensor) else first[key]
            for key in first}


def _mask_free_grads(probs: Tiled, v: torch.Tensor, keep: torch.Tensor | None, dropout_p: float,
                     d_out: torch.Tensor):
    """∂L/∂S without the factor scale, P ⊙ (dP − rowsum(dP ⊙ P)) for dP = ∂L/∂P, tile by tile with
    (first row, end row, columns), in the work dtype: the standard one in every row (also in rows
    that attend no key by MASKED_AT), as SDPA gives the mask."""
    work = backward.work_dtype(v.dtype)
    for i, (start, end, cols) in enumerate(probs.tiles):  # by index: zip would hold the last tile too
        p = probs.parts[i]
        d_probs = d_out[..., start:end, :].to(work) @ v[..., :cols, :].to(work).mT
        if keep is not None:
            d_probs = d_probs * keep[..., start:end, :cols] * _keep_scale(dropout_p)
        g = torch.ops.aten._softmax_backward_data(d_probs, p.to(work), -1, work)
        del p, d_probs  # before the next tile is recomputed: one in memory, not two
        yield g, start, end, cols


def _spans_of(k: torch.Tensor, v: torch.Tensor | None, pinv: bool) -> tuple[Span, Span | None]:
    """Rank-safe spans (`span_of`)."""
    return span_of(k, pinv=pinv), span_of(v) if v is not None else None


@dataclass
class _Batch:
    """What the backward pass reads, for the whole batch or a chunk of it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    keep: torch.Tensor | None
    d_out: torch.Tensor
    probs: Tiled
    mask: _Mask

    def rule_inputs(self, config: SpanAttentionConfig, probing: bool) -> backward.RuleInputs:
        """The rule's inputs, spans included: taken per chunk, so that they too are a chunk's size."""
        return backward.prepare(self.q, self.k, self.v, self.mask.key_valid, config.rule, _spans_of, probing)

    def select(self, rows: Rows) -> _Batch:
        """The batch entries (and key/value heads) `rows`."""
        pick = lambda x: x.select(rows) if isinstance(x, (Tiled, _Mask)) else x[rows]  # noqa: E731
        return _Batch(*(None if x is None else pick(x) for x in (getattr(self, f.name) for f in fields(self))))


def _backward(batch: _Batch, dropout_p: float, scale: float, config: SpanAttentionConfig, probe: Probe | None,
              workspace: Workspace):
    """One chunk of the batch: (dQ, dK, dV)."""
    v, keep, d_out, probs, mask = batch.v, batch.keep, batch.d_out, batch.probs, batch.mask
    recomputed = isinstance(probs.parts, Recomputed)
    if not config.rule.per_block and (recomputed or probe is None):
        return _backward_in_one_pass(batch, dropout_p, scale, config, probe)
    dv = rules.group_sum(_dropped(probs, keep, dropout_p).mT @ d_out)
    scaled_d_out = d_out * scale
    tiles = probs.tiles

    def tile_d_probs(i: int, name: str) -> torch.Tensor:
        start, end, cols = tiles[i]
        out = workspace(name, (*scaled_d_out.shape[:-2], end - start, cols), d_out.dtype, d_out.device)
        return _d_probs(scaled_d_out, v, keep, mask, dropout_p, tiles[i], out)

    if config.rule.per_block:  # the blocks read each tile of dP once, and not P: one tile at a time
        d_probs = Tiled(tiles, Recomputed(lambda i: tile_d_probs(i, "d_probs_tile"), len(tiles)), probs.t, probs.s,
                        d_out.dtype)
    else:  # the probe's calls of `products` share G
        d_probs = Tiled(tiles, [tile_d_probs(i, f"d_probs{i}") for i in range(len(tiles))], probs.t, probs.s)
    block_products = TileBlocks(d_probs, scale, mask.tile, workspace)

    @functools.cache
    def softmax_grad() -> Tiled:
        """G = P ⊙ (dP − rowsum(dP ⊙ P)), one fused pass per tile, in dP's buffers."""
        return d_probs.combine(probs, lambda dp, p, *_: softmax_backward(dp, p, out=dp))

    def products(needs: rules.Operands | rules.Blocks) -> rules.Products | rules.BlockProducts:
        if isinstance(needs, rules.Blocks):
            return block_products(needs)
        g = softmax_grad()
        return rules.Products(_side(g, needs.query),
                              {name: rules.group_sum(y) for name, y in _side(g.mT, needs.key).items()})

    dq, dk = backward.rule_grads(config, batch.rule_inputs(config, probe is not None), products, probe)
    return backward.scaled((dq, dk, dv), config.qkv_alphas)


def _d_probs(scaled_d_out: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, mask: _Mask, dropout_p: float,
             tile: Tile, out: torch.Tensor | None = None) -> torch.Tensor:
    """scale·∂L/∂P on a tile (into `out` if given): G = ∂L/∂S then carries the factor of S = scale·QKᵀ."""
    start, end, cols = tile
    d_probs = torch.matmul(scaled_d_out[..., start:end, :], v[..., :cols, :].mT, out=out)
    if mask.idle_rows is not None:  # rows that attend no key (by MASKED_AT): no gradient into Q and K
        d_probs.masked_fill_(row_range(mask.idle_rows, start, end), 0.0)
    if keep is not None:
        d_probs.mul_(keep[..., start:end, :cols]).mul_(_keep_scale(dropout_p))
    return d_probs


def _backward_in_one_pass(batch: _Batch, dropout_p: float, scale: float, config: SpanAttentionConfig,
                          probe: Probe | None):
    """`_backward` for the rules that ask for `Operands`: each tile of P is read (or recomputed)
    once per call of `products`, and dV, scale·∂L/∂P, G and all the products the rule asks for are
    taken from it while it is in memory (the first call also gives dV): no T×T buffer but one tile."""
    v, keep, d_out, probs, mask = batch.v, batch.keep, batch.d_out, batch.probs, batch.mask
    scaled_d_out = d_out * scale
    rows = _rows(_BACKWARD_ROWS, batch.q.shape[-1])
    dv: list[torch.Tensor] = []

    def products(needs: rules.Operands) -> rules.Products:
        x, y = _joined(needs.query), _joined(needs.key)
        gx = None if x is None else x.new_zeros(*d_out.shape[:-1], x.shape[-1])
        gy = None if y is None else y.new_zeros(*y.shape[:-2], probs.s, y.shape[-1])
        d_v = None if dv else d_out.new_zeros(*d_out.shape[:-2], probs.s, d_out.shape[-1])
        for i, (tile_start, tile_end, cols) in enumerate(probs.tiles):  # by index: zip would hold the last tile too
            tile = probs.parts[i]
            for start in range(tile_start, tile_end, rows):  # rows at a time (see _BACKWARD_ROWS)
                end = min(start + rows, tile_end)
                p = tile[..., start - tile_start:end - tile_start, :]
                kept = p * keep[..., start:end, :cols] * _keep_scale(dropout_p) if keep is not None else p
                if d_v is not None:
                    d_v[..., :cols, :] += kept.mT @ d_out[..., start:end, :]
                g = _d_probs(scaled_d_out, v, keep, mask, dropout_p, (start, end, cols))
                g = softmax_backward(g, p, out=g)
                if gx is not None:
                    gx[..., start:end, :] = rules.matmul(g, x[..., :cols, :])
                if gy is not None:
                    gy[..., :cols, :] += rules.matmul(g.mT, y[..., start:end, :])
                del p, kept, g
            del tile  # before the next tile is recomputed: one in memory, not two
        if d_v is not None:
            dv.append(rules.group_sum(d_v))
        return rules.Products(_named(gx, needs.query) if gx is not None else {},
                              {name: rules.group_sum(part) for name, part in _named(gy, needs.key).items()}
                              if gy is not None else {})

    dq, dk = backward.rule_grads(config, batch.rule_inputs(config, probe is not None), products, probe)
    if not dv:  # the rule asked for no product of G
        dv.append(rules.group_sum(_dropped(probs, keep, dropout_p).mT @ d_out))
    return backward.scaled((dq, dk, dv[0]), config.qkv_alphas)


def _side(g, rights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: g @ r} for the `rights`, as one product."""
    return _named(rules.matmul(g, _joined(rights)), rights) if rights else {}


def _joined(operands: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The operands side by side (…, n₁ + n₂ + …), so that one product takes them all; None if none."""
    used = list(operands.values())
    return torch.cat(used, dim=-1) if len(used) > 1 else (used[0] if used else None)


def _named(product: torch.Tensor, operands: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A product with `_joined(operands)` cut back into one part per operand, under its name."""
    return dict(zip(operands, product.split([x.shape[-1] for x in operands.values()], dim=-1)))


_BREAK = {"msg": "span_attention: the tiles backend (the default on the CPU) takes span gradients outside the "
                 "compiled graph, which breaks it here (fullgraph=True fails): for evaluation, run under "
                 "torch.no_grad() (SDPA itself); to train without a break, use the fused kernels "
                 "(HF_SPANATTN_BACKEND=fused)"}
if "msg" not in inspect.signature(torch._dynamo.graph_break).parameters:  # torch before 2.7 says no more than the break
    _BREAK = {}


def tile_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                   dropout_p: float, is_causal: bool, scale: float, config: SpanAttentionConfig,
                   probe: Probe | None = None) -> torch.Tensor:
    """`span_attention` on the tiles; (B, H, T, D) inputs as checked and broadcast by it."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace the autograd.Function below: it breaks there anyway
        torch._dynamo.graph_break(**_BREAK)
    if query.dtype == torch.float16 and abs(scale) > 1:
        # the backward forms G = scale·∂L/∂S in float16, where a scale past 1 can take it out of range
        # (scale ≥ 65504 always): fold √|scale| into Q and K as SDPA's math kernel does; autograd takes it to dQ, dK
        root = math.sqrt(abs(scale))
        query, key, scale = query * (scale / root), key * root, 1.0
    q, k = backward.grouped(query, key)
    detached = attn_mask.detach() if attn_mask is not None else None
    shape = (*q.shape[:-1], k.shape[-2])
    work = backward.work_dtype(query.dtype)
    budget = min(_KEPT_ROWS, _KEPT_PER_ROW * query.shape[-2]) * math.prod(query.shape[:-2]) * query.shape[-1]
    budget -= 2 * blocks.workspace_elements(q.numel()) if config.rule.per_block else 0  # stacks, their products
    mask = _prepare_mask(detached, is_causal, shape, work, query.device)
    kept_tiles = _kept_tiles(mask, shape, budget)
    if not all(kept_tiles):  # tiles small enough that the one in memory is O(T·d)
        rows = _rows(_RECOMPUTED_ROWS, query.shape[-1])
        if any(end - start > rows for start, end, _ in mask.tiles):
            mask = _prepare_mask(detached, is_causal, shape, work, query.device, rows)
            kept = [end for (_, end, _), keep in zip(mask.tiles, _kept_tiles(mask, shape, budget)) if keep]
            if kept and not config.rule.per_block:  # the kept rows in tiles as large as without a budget
                # (not for the per-block rule: it forms ∂L/∂P a tile at a time beside its stacks)
                mask = _prepare_mask(detached, is_causal, shape, work, query.device, rows, kept[-1])
            kept_tiles = _kept_tiles(mask, shape, budget)
    learnable = attn_mask if attn_mask is not None and attn_mask.requires_grad else None
    out = SpanAttentionFunction.apply(q, k, value.unsqueeze(2), learnable, mask, dropout_p, scale, config, probe,
                                      kept_tiles)
    return out.reshape(*query.shape[:-1], value.shape[-1])
