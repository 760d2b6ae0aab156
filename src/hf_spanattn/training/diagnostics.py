"""Per-order diagnostics of dQ and dK, gathered by the engine's probe during the backward pass.

For one attention layer over one optimizer step (all micro-batches and batch chunks):
the norm of each order's component of dQ and dK (α-weighted, so they sum to the applied
gradient), each order's share of their summed norms, the cosine between the applied and the
standard gradient, and the mean ranks of K̃ and Ṽ (the dimensions of Π_K and Π_V).

Everything a recorder holds is a sum over the batch (of squares, inner products, ranks and their
count), so the figures of a batch split over ranks follow from the sums over ranks
(`reduce_over_ranks`); norms, shares and cosines are not linear and are taken only after that.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hf_spanattn.ops.inputs import shown

# a record whose largest entry passes 2**_WIDE is divided by a power of two before squaring, so that the sums of
# squares stay within float64's range (an α past about 1e154 on float64 inputs)
_WIDE = 480

RECORD_KEYS = ("dq", "dk", "dq_orders", "dk_orders", "dq_standard", "dk_standard", "rank_k", "rank_v")


def _layout(x: object) -> object:
    """A record entry as an error shows it: a tensor's shape, else its type's name."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """Σ over batch, positions and features of x (B, H_kv, g, T, d): one value per head."""
    return x.double().sum(dim=(0, 3, 4)).flatten()


class OrderRecorder:
    """The probe for one layer: accumulates sums of squares and inner products per head."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.rank_k = self.rank_v = 0.0
        self.rank_count = 0
        self.reduced = False  # holds the sums over the ranks (`reduce_over_ranks`): a second reduction would add them
        self.rule: str | None = None  # the rule of the records added ('score@exact'), where they name it
        self.exponent = 0  # the sums are in units of 4**exponent: the records were divided by 2**exponent

    def _rescale(self, exponent: int) -> None:
        """Hold the sums in units of 4**exponent, where that is larger than their units now."""
        if exponent > self.exponent:
            factor = 2.0 ** (self.exponent - exponent)  # squared in two steps: its square may be below float64's range
            self.sums = {name: value * factor * factor for name, value in self.sums.items()}
            self.exponent = exponent

    def _add(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = self.sums[name] + value if name in self.sums else value

    def __call__(self, record: dict) -> None:
        missing = [k for k in RECORD_KEYS if k not in record] if isinstance(record, Mapping) else None
        if missing != []:
            lacks = f" lacks {', '.join(missing)}" if missing else ""
            raise TypeError(f"OrderRecorder: record={shown(record, 80)}{lacks}: expected the dict that "
                            f"span_attention's backward pass gives its probe, with keys {', '.join(RECORD_KEYS)}")
        for side in ("dq", "dk"):
            whole, standard, orders = record[side], record[f"{side}_standard"], record[f"{side}_orders"]
            parts = [standard, *orders] if isinstance(orders, (list, tuple)) else None
            if not (isinstance(whole, torch.Tensor) and whole.dim() == 5 and parts is not None
                    and all(isinstance(p, torch.Tensor) and p.shape == whole.shape for p in parts)):
                got = [_layout(p) for p in orders] if parts is not None else _layout(orders)
                raise TypeError(f"OrderRecorder: record[{side!r}], record['{side}_standard'] and each of "
                                f"record['{side}_orders'] (a list): expected tensors of one shape (B, H_kv, g, T, d) "
                                f"as span_attention's probe gets them, got {shown(_layout(whole))}, "
                                f"{shown(_layout(standard))} and {shown(got)}")
        if not all(isinstance(record[k], torch.Tensor) for k in ("rank_k", "rank_v")):
            raise TypeError(f"OrderRecorder: record['rank_k'], record['rank_v']: expected tensors, got "
                            f"{type(record['rank_k']).__name__}, {type(record['rank_v']).__name__}")
        held, got = self._shape(), (record["dq"].shape[1] * record["dq"].shape[2], len(record["dq_orders"]))
        if held is not None and held != got:  # sums of other heads or orders cannot be added up
            raise ValueError(f"OrderRecorder: a recorder gathers one layer's figures under one rule; it holds "
                             f"{held[0]} heads and {held[1]} orders, and this call has {got[0]} heads and {got[1]} "
                             "orders: give each attention layer (and rule) a recorder of its own")
        rule = record.get("rule")
        if rule is not None and self.rule is not None and rule != self.rule:  # orders of other rules, as many
            raise ValueError(f"OrderRecorder: a recorder gathers one layer's figures under one rule; it holds those of "
                             f"{self.rule} and this call is {shown(rule)}: give each attention layer (and rule) a "
                             "recorder of its own")
        if self.reduced:
            raise ValueError("OrderRecorder: this recorder holds the sums over the ranks (reduce_over_ranks was called "
                             "on it); give the next step a new recorder")
        parts = [p for side in ("dq", "dk") for p in (record[side], record[f"{side}_standard"],
                                                      *record[f"{side}_orders"])]
        peaks = [p.detach().abs().amax().double() for p in parts if p.numel()]
        peak = torch.stack(peaks).max().item() if peaks else 0.0  # one synchronisation
        self._rescale(math.frexp(peak)[1] - _WIDE)
        unit = 2.0 ** -self.exponent
        for side in ("dq", "dk"):
            # squared in float64: a float16 record past 256 (a loss scale's), or a float32 one past 1.8e19 (a huge α),
            # squares past its dtype's range
            for order, part in enumerate(record[f"{side}_orders"]):
                self._add(f"{side}_sq{order}", _per_head((part.double() * unit).pow(2)))
            applied, standard = record[side].double() * unit, record[f"{side}_standard"].double() * unit
            self._add(f"{side}_dot", _per_head(applied * standard))
            self._add(f"{side}_sq", _per_head(applied.pow(2)))
            self._add(f"{side}_std_sq", _per_head(standard.pow(2)))
        self.rank_k += record["rank_k"].double().sum().item()
        self.rank_v += record["rank_v"].double().sum().item()
        self.rank_count += record["rank_k"].numel()
        self.rule = self.rule or rule

    def _shape(self) -> tuple[int, int] | None:
        """(heads, orders) of the sums held, or None before the first call."""
        if not self.sums:
            return None
        orders = sum(1 for k in self.sums if k.startswith("dq_sq") and k[5:].isdigit())
        return self.sums["dq_sq"].numel(), orders

    def summary(self, per_head: bool = False) -> dict:
        """Norms, shares and cosines over all heads (and per head if asked)."""
        if not isinstance(per_head, bool):  # a string such as 'no' would ask for them
            raise TypeError(f"OrderRecorder.summary: per_head={shown(per_head)}: expected True or False")
        if not self.sums:
            return {}
        out = {"rank_k": self.rank_k / self.rank_count, "rank_v": self.rank_v / self.rank_count}
        for side in ("dq", "dk"):
            orders = sorted(int(k[len(side) + 3:]) for k in self.sums if k.startswith(f"{side}_sq") and
                            k[len(side) + 3:].isdigit())
            norms = [self.sums[f"{side}_sq{o}"].sum().sqrt().item() for o in orders]  # in units of 2**exponent
            total = sum(norms)
            out[f"{side}_norm"] = [n * 2.0 ** self.exponent for n in norms]
            out[f"{side}_share"] = [n / total if total else math.nan for n in norms]
            dot, sq, std = (self.sums[f"{side}_{k}"].sum().item() for k in ("dot", "sq", "std_sq"))
            out[f"cos_{side[1]}"] = dot / (math.sqrt(sq) * math.sqrt(std)) if sq and std else math.nan
            if per_head:
                heads = torch.stack([self.sums[f"{side}_sq{o}"].sqrt() for o in orders], dim=1) * 2.0 ** self.exponent
                out[f"{side}_norm_per_head"] = heads.tolist()
        return out


def reduce_over_ranks(recorders: list[OrderRecorder]) -> None:
    """Make each recorder hold the sums over the global batch of all ranks (DDP, FSDP), in place.

    A no-op unless torch.distributed is initialised with more than one rank. Data-parallel training
    averages the parameter gradients over the W ranks, so a rank's dQ, dK (the gradient of its own
    loss) enter the gradient that is applied divided by W: the quadratic sums are summed over the
    ranks and divided by W², which makes the norms those of one process over the same global batch
    (shares and cosines do not depend on that factor). Every rank must call this with recorders of
    the same layers and rules, as the callback does at every recorded step.
    """
    if not isinstance(recorders, (list, tuple)) or not all(isinstance(r, OrderRecorder) for r in recorders):
        got = type(recorders).__name__ if not isinstance(recorders, (list, tuple)) else \
            f"a {type(recorders).__name__} holding {shown([type(r).__name__ for r in recorders])}"
        raise TypeError(f"reduce_over_ranks: recorders={got}: expected a list of OrderRecorder")
    if any(r.reduced for r in recorders):  # its sums are those of every rank already: a second call would add them
        raise ValueError("reduce_over_ranks: a recorder given already holds the sums over the ranks (it was reduced "
                         "before); reduce each step's recorders once")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    keys = [sorted(r.sums) for r in recorders]
    # the layout of the sums (layers, names, heads): ranks whose sums have other layouts of one size are refused too
    layout = zlib.crc32(repr([[(k, tuple(r.sums[k].shape)) for k in names] for r, names in zip(recorders, keys)])
                        .encode())
    held = [r.sums[k] for r, names in zip(recorders, keys) for k in names]
    # the gradients' device, which the process group serves; a rank that recorded no sums only sends counts
    device = held[0].device if held else torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    numel = sum(x.numel() for x in held) + 3 * len(recorders)
    # the largest unit of the sums goes with the sizes: the sums of every rank are added in one unit
    size = torch.tensor([numel, -numel, layout, -layout, max((r.exponent for r in recorders), default=0)],
                        device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    if size[0] != -size[1] or size[2] != -size[3]:  # a collective over other sizes would hang or fail obscurely
        raise RuntimeError(f"span diagnostics: the ranks recorded different layers, heads or orders this step "
                           f"(between {-size[1].item()} and {size[0].item()} sums); every rank must train the same "
                           "model with the same settings")
    for recorder in recorders:
        recorder._rescale(size[4].item())
    parts = [r.sums[k].reshape(-1) for r, names in zip(recorders, keys) for k in names]
    counts = torch.tensor([[r.rank_k, r.rank_v, r.rank_count] for r in recorders], dtype=torch.float64,
                          device=device).reshape(-1)
    flat = torch.cat([p.to(device, torch.float64) for p in parts] + [counts])
    dist.all_reduce(flat)
    sums, counts = flat[:-counts.numel()], flat[-counts.numel():].reshape(-1, 3)
    offset = 0
    for recorder, names, (rank_k, rank_v, rank_count) in zip(recorders, keys, counts.tolist()):
        for name in names:
            value = recorder.sums[name]
            recorder.sums[name] = sums[offset:offset + value.numel()].reshape(value.shape) / world**2
            offset += value.numel()
        recorder.rank_k, recorder.rank_v, recorder.rank_count = rank_k, rank_v, round(rank_count)
        recorder.reduced = True
