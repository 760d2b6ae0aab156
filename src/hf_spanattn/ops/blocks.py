"""The T×T work of the per-block score rule.

For query blocks Q_B and one K_δ, `BlockProducts` forms S^B = scale·Q_B K_δᵀ, G_B = ∂L/∂S^B of
softmax(mask(S^B))·V, and from it the only two products the rule needs: G_B K_δ and
Σ_B α_B G_Bᵀ Q_B. Nothing T×T is allocated per block: the buffers live in a `Workspace`.
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)
_TILE_ROWS, _MAX_TILES = 64, 8  # rows per tile: at least 64, and at most 8 tiles


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


def row_tiles(additive: torch.Tensor | None, t: int) -> list[tuple[int, int, int]]:
    """(first row, end row, columns) per tile of query rows, from an additive mask (…, T, S): the
    tile's rows attend only keys < columns. Neighbouring tiles that reach as far merge."""
    if additive is None:
        return [(0, t, t)]
    attend = (additive > torch.finfo(additive.dtype).min).reshape(-1, *additive.shape[-2:]).any(dim=0)
    reach = (attend * torch.arange(1, attend.shape[-1] + 1, device=attend.device)).amax(dim=-1).tolist()
    rows = max(_TILE_ROWS, -(-t // _MAX_TILES))
    tiles: list[tuple[int, int, int]] = []
    for start in range(0, t, rows):
        end = min(start + rows, t)
        cols = max(reach[start:end])
        if tiles and tiles[-1][2] == cols:
            tiles[-1] = (tiles[-1][0], end, cols)
        else:
            tiles.append((start, end, cols))
    return tiles


class BlockProducts:
    """G_B K_δ and Σ_B α_B G_Bᵀ Q_B for the per-block rule, tile by tile of query rows.

    d_out, v, keep: this chunk's (b, h, g, T, d) gradient of the output, (b, h, 1, T, d) values
    and dropout mask; additive (…, T, T) and dead_rows (…, T, 1) as in the forward pass; `tiles`
    from `row_tiles`. A tile's rows meet only the key columns one of them may attend: the others
    have probability 0 and gradient 0, so leaving them out is exact (a causal mask skips about a
    third of the work). Up to `max_blocks` blocks go through one batched product, stacked as
    (b, h, n, g, rows, ·): one K_δ serves them all and the dK product sums over them. T×T work
    runs in the dtype of d_out (the forward's).
    """

    def __init__(self, d_out: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, dropout_p: float,
                 scale: float, additive: torch.Tensor | None, dead_rows: torch.Tensor | None,
                 tiles: list[tuple[int, int, int]], max_blocks: int, workspace: Workspace) -> None:
        self.scale, self.max_blocks, self.workspace, self.dtype = scale, max_blocks, workspace, d_out.dtype
        self.additive = additive.unsqueeze(2) if additive is not None else None  # (…, 1, g, T, T): over the blocks
        self.dead_rows = dead_rows.unsqueeze(2) if dead_rows is not None else None
        self.tiles = [tile for tile in tiles if tile[2] > 0]  # rows that attend nothing get G = 0
        self.d_probs = []  # scale·∂L/∂P per tile: G then carries the factor of S = scale·QKᵀ
        for i, (start, end, cols) in enumerate(self.tiles):
            rows = d_out[..., start:end, :]
            tile = torch.matmul(rows * scale, v[..., :cols, :].mT,
                                out=workspace(f"d_probs{i}", (*rows.shape[:-1], cols), d_out))
            if keep is not None:
                tile.mul_(keep[..., start:end, :cols]).mul_(1 / (1 - dropout_p))
            self.d_probs.append(tile.unsqueeze(2))

    def __call__(self, q_blocks: list[torch.Tensor], weights: list[float],
                 k_block: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([G_B K_δ], Σ_B α_B G_Bᵀ Q_B summed over query heads) for Q_B (b, h, g, T, d), K_δ (b, h, 1, T, d).
        G_B K_δ is in a buffer that the next call reuses."""
        b, h, g, t, d = q_blocks[0].shape
        keys = k_block.to(self.dtype).reshape(b * h, t, d)
        scaled_keys = torch.mul(keys, self.scale, out=self.workspace("scaled_keys", keys.shape, keys))
        gk = self.workspace("gk", (b, h, len(q_blocks), g, t, d), k_block)
        if sum(end - start for start, end, _ in self.tiles) < t:
            gk.zero_()  # some rows attend nothing
        gq = k_block.new_zeros(b * h, t, d)
        for first in range(0, len(q_blocks), self.max_blocks):
            part = range(first, min(first + self.max_blocks, len(q_blocks)))
            n = len(part)
            for i, (start, end, cols) in enumerate(self.tiles):
                r = end - start
                stack = torch.stack([q_blocks[j][..., start:end, :].to(self.dtype) for j in part], dim=2,
                                    out=self.workspace("q_blocks", (b, h, n, g, r, d), keys))
                grads = self._grads(stack.view(b * h, n * g * r, d), scaled_keys[:, :cols], i, n)
                grads = grads.view(b * h, n * g * r, cols)
                gk[:, :, part.start:part.stop, :, start:end] = (grads @ keys[:, :cols]).view(b, h, n, g, r, d)
                if any(weights[j] != 1 for j in part):
                    alphas = torch.tensor([weights[j] for j in part], dtype=stack.dtype, device=stack.device)
                    stack.mul_(alphas.view(n, 1, 1, 1))
                gq[:, :cols] += grads.mT @ stack.view(b * h, n * g * r, d)  # sums over blocks and query heads
        return list(gk.unbind(2)), gq.view(b, h, 1, t, d)

    def _grads(self, stack: torch.Tensor, scaled_keys: torch.Tensor, i: int, n: int) -> torch.Tensor:
        """G_B on tile i for n stacked blocks, (b·h, n·g·rows, d), as (b, h, n, g, rows, cols) in a reused buffer."""
        d_probs = self._stacked_d_probs(i, n)
        start, end, cols = self.tiles[i]
        scores = self.workspace("scores", d_probs.shape, d_probs)
        torch.bmm(stack, scaled_keys.mT, out=scores.view(stack.shape[0], -1, cols))
        if self.additive is not None:
            scores.add_(self.additive[..., start:end, :cols])
        probs = self.workspace("probs", scores.shape, scores)
        if self.dtype in _HALF:  # as the forward pass: softmax in float32, probabilities in the input dtype
            probs.copy_(torch.softmax(scores, dim=-1, dtype=torch.float32))
        else:
            torch.ops.aten._softmax.out(scores, -1, False, out=probs)
        if self.dead_rows is not None:
            probs.masked_fill_(self.dead_rows[..., start:end, :], 0.0)
        # the scores are spent: G_B takes their buffer
        return torch.ops.aten._softmax_backward_data.out(d_probs, probs, -1, self.dtype, grad_input=scores)

    def _stacked_d_probs(self, i: int, n: int) -> torch.Tensor:
        """Tile i of ∂L/∂P once per block (b, h, n, g, rows, cols): one fused softmax backward takes the stack."""
        if self.d_probs[i].shape[2] < n:
            b, h, _, g, r, cols = self.d_probs[i].shape
            stacked = self.workspace(f"d_probs_stacked{i}", (b, h, n, g, r, cols), self.d_probs[i])
            self.d_probs[i] = stacked.copy_(self.d_probs[i].expand_as(stacked))
        return self.d_probs[i][:, :, :n]
