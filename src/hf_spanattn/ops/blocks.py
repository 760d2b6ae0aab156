"""The T×T work of the per-block score rule.

Block (i, δ) pairs query block Q_i with key block K_δ. `TileBlocks` forms its scores
S = scale·Q_i K_δᵀ, G = ∂L/∂S of softmax(mask(S))·V, and from all G the only products the
rule asks for (`rules.Blocks`): weighted sums Σ_δ c_δ G_(i,δ) K_δ, and per δ
Σ_i w_(i,δ) G_(i,δ)ᵀ Q_i. Nothing T×T is allocated per block: the buffers live in a `Workspace`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_spanattn.ops import backward, rules
from hf_spanattn.ops.tiles import Tile, Tiled, masked_softmax, row_range, softmax_backward

MaskTile = Callable[[int], tuple[torch.Tensor | None, int, torch.Tensor | None]]
# Per stacked T×T buffer: about the cache of a CPU core, and small on a GPU; but at most _STACK_PER_QUERY
# times the query's elements (the whole batch's), so that at a small batch the two stacks together
# stay about SDPA's own peak.
_STACK_ELEMENTS, _STACK_PER_QUERY = 1 << 20, 2


def stack_elements(query_elements: int) -> int:
    """The most elements of one stacked T×T buffer of `TileBlocks`, for a query of that many elements."""
    return min(_STACK_ELEMENTS, _STACK_PER_QUERY * query_elements)


def workspace_elements(query_elements: int) -> int:
    """About the most elements that the stacked T×T buffers of `TileBlocks` (scores, ∂L/∂P) hold."""
    return 2 * stack_elements(query_elements)


class Workspace:
    """Scratch buffers reused by every backward chunk and tile: CPU tensors are not cached by an
    allocator, so every fresh buffer would pay its page faults again."""

    def __init__(self, query_elements: int) -> None:
        self._flat: dict[str, torch.Tensor] = {}
        self.stack = stack_elements(query_elements)  # what `TileBlocks` stacks in one buffer, at most

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of `shape`, valid until the next call with `name`."""
        size = torch.Size(shape).numel()
        flat = self._flat.get(name)
        if flat is None or flat.numel() < size or flat.dtype != dtype:
            flat = self._flat[name] = torch.empty(size, dtype=dtype, device=device)
        return flat[:size].view(shape)


class TileBlocks:
    """The per-block rule's T×T work, tile by tile of query rows (see `tiles.py`).

    `d_probs` is scale·∂L/∂P (b, h, g, T, T) as row tiles; `mask_tile(i)` gives tile i's
    additive mask on the columns [lo, columns), lo and the dead rows. Query blocks
    that meet the same key blocks are stacked as (m, b, h, n, g, rows, ·) for n query blocks and
    m key blocks: one product per key block gives all their scores, one softmax forward and
    backward takes them all. T×T work runs in the work dtype (float32 for half inputs, whose
    scores may pass the half range, as in the forward pass).
    """

    def __init__(self, d_probs: Tiled, scale: float, mask_tile: MaskTile, workspace: Workspace) -> None:
        self.d_probs, self.scale, self.mask_tile, self.workspace = d_probs, scale, mask_tile, workspace
        self.tiles = d_probs.tiles
        self.rows_covered = sum(end - start for start, end, _ in self.tiles) == d_probs.t  # else some attend nothing

    def __call__(self, needs: rules.Blocks) -> rules.BlockProducts:
        """What `needs` asks for, for Q_i (b, h, g, T, d) and K_δ (b, h, 1, T, d)."""
        q_blocks, k_blocks, k_weights = needs.q, needs.k, needs.key_weights
        sums = list(needs.sums.values())
        b, h, g, t, d = q_blocks[0].shape
        like = k_blocks[0]
        deltas = range(len(k_blocks))
        groups: dict[tuple[int, ...], list[int]] = {}  # the key blocks met → the query blocks that meet them
        for i in range(len(q_blocks)):
            met = tuple(needs.meets(i))
            if met:
                groups.setdefault(met, []).append(i)
        gk = [like.new_empty(b, h, g, t, d) if self.rows_covered and any(c) else like.new_zeros(b, h, g, t, d)
              for _, c in sums]
        dk = [like.new_zeros(b, h, 1, t, d) if any(w[delta] for w in k_weights) else None for delta in deltas]
        plans = []
        for met, members in groups.items():
            operands = [q_blocks[j] for j in members], [k_blocks[delta] for delta in met]
            # Σ_j c_j G_(·, j) K_j: the outputs of the members, by their coefficients over the key blocks met
            families: dict[tuple[float, ...], list[tuple[int, torch.Tensor]]] = {}
            for (block, c), out in zip(sums, gk):
                coefs = tuple(c[delta] for delta in met)
                if block in members and any(coefs):
                    families.setdefault(coefs, []).append((members.index(block), out))
            k_sums = [([k_weights[block][delta] for block in members], dk[delta]) for delta in met]
            plans.append((len(met) * len(members), operands, families, k_sums))
        for i, (start, end, cols) in enumerate(self.tiles):  # tiles outermost: a recomputed one is formed once
            d_probs = self.d_probs.parts[i]
            for blocks, operands, families, k_sums in plans:
                # rows at a time, so that a stack holds about workspace.stack elements
                step = max(1, self.workspace.stack // (blocks * b * h * g * cols))
                for first in range(start, end, step):
                    self._rows(i, (first, min(first + step, end), cols), d_probs, *operands, families, k_sums)
        return rules.BlockProducts(dict(zip(needs.sums, gk)), dk)

    def _rows(self, i: int, rows: Tile, tile_d_probs: torch.Tensor, q_blocks: list[torch.Tensor],
              k_blocks: list[torch.Tensor],
              families: dict[tuple[float, ...], list[tuple[int, torch.Tensor]]],
              k_sums: list[tuple[list[float], torch.Tensor | None]]) -> None:
        """The rows [start, end) of tile i, whose scale·∂L/∂P is `tile_d_probs`, for the stack of q_blocks
        against each of k_blocks: writes
        Σ_j c_j G_(member, j) K_j into out for each (member, out) of families[c], and adds
        Σ_member w G_(member, j)ᵀ Q_member to the j-th of k_sums (w, out)."""
        start, end, cols = rows
        first = start - self.tiles[i][0]  # of the tile's rows
        b, h, g, _, d = q_blocks[0].shape
        n, m, r = len(q_blocks), len(k_blocks), end - start
        dtype = backward.work_dtype(self.d_probs.dtype)
        work = lambda name, shape: self.workspace(name, shape, dtype, q_blocks[0].device)  # noqa: E731
        stack = torch.stack([q[..., start:end, :].to(dtype) for q in q_blocks], dim=2,
                            out=work("q", (b, h, n, g, r, d)))
        flat_stack = stack.view(b * h, n * g * r, d)
        keys = [k[:, :, 0, :cols].to(dtype).reshape(b * h, cols, d) for k in k_blocks]
        shape = (m, b, h, n, g, r, cols)  # key blocks outermost: each one's scores are one contiguous product
        scores = work("scores", shape)
        flat = scores.view(m, b * h, n * g * r, cols)
        for j, k in enumerate(keys):  # scale·Q_B K_δᵀ
            torch.baddbmm(flat[j], flat_stack, k.mT, beta=0, alpha=self.scale, out=flat[j])
        additive, lo, dead_rows = self.mask_tile(i)
        if additive is not None:
            scores[..., lo:].add_(row_range(additive, first, first + r).unsqueeze(2))
        if dead_rows is not None:
            dead_rows = row_range(dead_rows, first, first + r).unsqueeze(2)
        probs = masked_softmax(scores, dead_rows, out=scores)  # as the forward pass
        d_probs = tile_d_probs[..., first:first + r, :]
        d_probs = work("d_probs", shape).copy_(d_probs.unsqueeze(2).expand(shape))
        grads = softmax_backward(d_probs, probs, out=probs)
        grads = grads.view(m, b * h, n * g * r, cols)

        for coefs, outs in families.items():  # Σ_j c_j G_(·, j) K_j for all members: one product per key block
            product = work("gk", (b * h, n * g * r, d))
            terms = [(grads[j], keys[j], c) for j, c in enumerate(coefs) if c]
            for step, (grad, k, c) in enumerate(terms):
                torch.baddbmm(product, grad, k, beta=min(step, 1), alpha=c, out=product)
            product = product.view(b, h, n, g, r, d)
            for member, out in outs:
                out[..., start:end, :] = product[:, :, member]

        for j, (weights, out) in enumerate(k_sums):  # over the members and query heads
            if out is None or not any(weights):
                continue
            operand = flat_stack
            if any(w != 1 for w in weights):
                alphas = torch.tensor(weights, dtype=dtype, device=stack.device).view(n, 1, 1, 1)
                operand = torch.mul(stack, alphas, out=work("q_weighted", stack.shape)).view(b * h, n * g * r, d)
            product = torch.bmm(grads[j].mT, operand, out=work("dk", (b * h, cols, d)))
            out[:, :, 0, :cols] += product.view(b, h, cols, d)
