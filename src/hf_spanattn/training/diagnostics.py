"""Per-order diagnostics of dQ and dK, gathered by the engine's probe during the backward pass.

For one attention layer over one optimizer step (all micro-batches and batch chunks):
the norm of each order's component of dQ and dK (α-weighted, so they sum to the applied
gradient), each order's share of their summed norms, the cosine between the applied and the
standard gradient, and the mean ranks of K̃ and Ṽ (the dimensions of Π_K and Π_V).
"""

from __future__ import annotations

import math

import torch


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """Σ over batch, positions and features of x (B, H_kv, g, T, d): one value per head."""
    return x.double().sum(dim=(0, 3, 4)).flatten()


class OrderRecorder:
    """The probe for one layer: accumulates sums of squares and inner products per head."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.rank_k = self.rank_v = 0.0
        self.rank_count = 0

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def __call__(self, record: dict) -> None:
        for side in ("dq", "dk"):
            for order, part in enumerate(record[f"{side}_orders"]):
                self._add(f"{side}_sq{order}", _per_head(part.pow(2)))
            applied, standard = record[side], record[f"{side}_standard"]
            self._add(f"{side}_dot", _per_head(applied * standard))
            self._add(f"{side}_sq", _per_head(applied.pow(2)))
            self._add(f"{side}_std_sq", _per_head(standard.pow(2)))
        self.rank_k += record["rank_k"].double().sum().item()
        self.rank_v += record["rank_v"].double().sum().item()
        self.rank_count += record["rank_k"].numel()

    def summary(self, per_head: bool = False) -> dict:
        """Norms, shares and cosines over all heads (and per head if asked)."""
        if not self.sums:
            return {}
        out = {"rank_k": self.rank_k / self.rank_count, "rank_v": self.rank_v / self.rank_count}
        for side in ("dq", "dk"):
            orders = sorted(int(k[len(side) + 3:]) for k in self.sums if k.startswith(f"{side}_sq") and
                            k[len(side) + 3:].isdigit())
            norms = [self.sums[f"{side}_sq{o}"].sum().sqrt().item() for o in orders]
            total = sum(norms)
            out[f"{side}_norm"] = norms
            out[f"{side}_share"] = [n / total if total else math.nan for n in norms]
            dot, sq, std = (self.sums[f"{side}_{k}"].sum().item() for k in ("dot", "sq", "std_sq"))
            out[f"cos_{side[1]}"] = dot / math.sqrt(sq * std) if sq and std else math.nan
            if per_head:
                heads = torch.stack([self.sums[f"{side}_sq{o}"].sqrt() for o in orders], dim=1)
                out[f"{side}_norm_per_head"] = heads.tolist()
        return out
