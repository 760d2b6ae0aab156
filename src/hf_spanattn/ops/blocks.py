"""The T×T work of the per-block score rule.

For query blocks Q_B and one K_δ, `BlockProducts` forms S^B = scale·Q_B K_δᵀ, G_B = ∂L/∂S^B of
softmax(mask(S^B))·V, and from it the only two products the rule needs: G_B K_δ and
Σ_B α_B G_Bᵀ Q_B. Nothing T×T is allocated per block: the buffers live in a `Workspace`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_spanattn.ops.tiles import Tiled, masked_softmax

MaskTile = Callable[[int, int, int], tuple[torch.Tensor | None, torch.Tensor | None]]


class Workspace:
    """Scratch buffers reused by every backward chunk and tile: CPU tensors are not cached by an
    allocator, so every fresh buffer would pay its page faults again."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer of `shape` and like's dtype and device, valid until the next call with `name`."""
        size = torch.Size(shape).numel()
        flat = self._flat.get(name)
        if flat is None or flat.numel() < size or flat.dtype != like.dtype:
            flat = self._flat[name] = like.new_empty(size)
        return flat[:size].view(shape)


class BlockProducts:
    """G_B K_δ and Σ_B α_B G_Bᵀ Q_B for the per-block rule, tile by tile of query rows.

    `d_probs` is this chunk's scale·∂L/∂P (b, h, g, T, T) as row tiles (see `tiles.py`);
    `mask_tile(first row, end row, columns)` gives a tile's additive mask and dead rows. Up to
    `max_blocks` blocks go through one batched product, stacked as (b, h, n, g, rows, ·): one K_δ
    serves them all and the dK product sums over them. T×T work runs in the dtype of d_probs
    (the forward's).
    """

    def __init__(self, d_probs: Tiled, scale: float, mask_tile: MaskTile, max_blocks: int,
                 workspace: Workspace) -> None:
        self.scale, self.mask_tile, self.max_blocks, self.workspace = scale, mask_tile, max_blocks, workspace
        self.tiles, self.dtype = d_probs.tiles, d_probs.dtype
        self.rows_covered = sum(end - start for start, end, _ in self.tiles) == d_probs.t  # else some attend nothing
        self.d_probs = [part.unsqueeze(2) for part in d_probs.parts]  # (b, h, 1, g, rows, cols): over the blocks

    def __call__(self, q_blocks: list[torch.Tensor], weights: list[float],
                 k_block: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([G_B K_δ], Σ_B α_B G_Bᵀ Q_B summed over query heads) for Q_B (b, h, g, T, d), K_δ (b, h, 1, T, d).
        G_B K_δ is in a buffer that the next call reuses."""
        b, h, g, t, d = q_blocks[0].shape
        keys = k_block.to(self.dtype).reshape(b * h, t, d)
        gk = self.workspace("gk", (b, h, len(q_blocks), g, t, d), k_block)
        if not self.rows_covered:
            gk.zero_()
        gq = k_block.new_zeros(b * h, t, d)
        for first in range(0, len(q_blocks), self.max_blocks):
            part = range(first, min(first + self.max_blocks, len(q_blocks)))
            n = len(part)
            for i, (start, end, cols) in enumerate(self.tiles):
                r = end - start
                stack = torch.stack([q_blocks[j][..., start:end, :].to(self.dtype) for j in part], dim=2,
                                    out=self.workspace("q_blocks", (b, h, n, g, r, d), keys))
                grads = self._grads(stack.view(b * h, n * g * r, d), keys[:, :cols], i, n)
                grads = grads.view(b * h, n * g * r, cols)
                tile_gk = torch.bmm(grads, keys[:, :cols], out=self.workspace("tile_gk", (b * h, n * g * r, d), keys))
                gk[:, :, part.start:part.stop, :, start:end] = tile_gk.view(b, h, n, g, r, d)
                if any(weights[j] != 1 for j in part):
                    alphas = torch.tensor([weights[j] for j in part], dtype=stack.dtype, device=stack.device)
                    stack.mul_(alphas.view(n, 1, 1, 1))
                # Σ over the blocks and query heads
                tile_gq = torch.bmm(grads.mT, stack.view(b * h, n * g * r, d),
                                    out=self.workspace("tile_gq", (b * h, cols, d), keys))
                gq[:, :cols] += tile_gq
        return list(gk.unbind(2)), gq.view(b, h, 1, t, d)

    def _grads(self, stack: torch.Tensor, keys: torch.Tensor, i: int, n: int) -> torch.Tensor:
        """G_B on tile i for n stacked blocks, (b·h, n·g·rows, d), as (b, h, n, g, rows, cols) in a reused buffer."""
        d_probs = self._stacked_d_probs(i, n)
        additive, dead_rows = self.mask_tile(*self.tiles[i])
        scores = self.workspace("scores", d_probs.shape, d_probs)
        flat = scores.view(stack.shape[0], -1, scores.shape[-1])
        torch.baddbmm(flat, stack, keys.mT, beta=0, alpha=self.scale, out=flat)  # scale·Q_B K_δᵀ
        if additive is not None:
            scores.add_(additive.unsqueeze(2))
        probs = masked_softmax(scores, dead_rows.unsqueeze(2) if dead_rows is not None else None,
                               out=self.workspace("probs", scores.shape, scores))  # as the forward pass
        # the scores are spent: G_B takes their buffer
        return torch.ops.aten._softmax_backward_data.out(d_probs, probs, -1, self.dtype, grad_input=scores)

    def _stacked_d_probs(self, i: int, n: int) -> torch.Tensor:
        """Tile i of ∂L/∂P once per block (b, h, n, g, rows, cols): one fused softmax backward takes the stack."""
        if self.d_probs[i].shape[2] < n:
            b, h, _, g, r, cols = self.d_probs[i].shape
            stacked = self.workspace(f"d_probs_stacked{i}", (b, h, n, g, r, cols), self.d_probs[i])
            self.d_probs[i] = stacked.copy_(self.d_probs[i].expand_as(stacked))
        return self.d_probs[i][:, :, :n]
