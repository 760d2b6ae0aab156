"""SDPA masks in the form the kernels take: causal or not, plus an additive bias per key.

A mask that is the same for every query (its query dimension 1 or broadcast, its head dimension
too) is a bias per key by construction: it reduces on the device with no host synchronisation,
bool (True → 0, False → −inf) or float (taken as is). A mask with a query dimension, as
Transformers builds for padded batches (causal ∧ key padding, (B, 1, T, S)), is compared on the
device against both patterns built from its last query row (which, under the causal pattern, sees
every key); reading that verdict is one host synchronisation, remembered for the mask tensor
while it is unchanged (the last one compared), so the layers of a model that share one mask pay it once.
While a CUDA graph is captured such a mask is not read (`inputs.LastMaskRead`): the call runs on the
fallback, and only masks without a query dimension (or is_causal=True without a mask) reach the kernels.

A float mask's entries at or below `MASKED_AT` count as masked only where the row keeps an attended
entry (their weight is 0 then, as in the kernels); a row with none reduces only where it equals the
pattern exactly (SDPA gives it the softmax over its finite entries, the kernels over the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_spanattn.ops.inputs import LastMaskRead, attended


@dataclass(frozen=True)
class KeyMask:
    """The kernels' mask: `bias` (B or 1, S) float32 added to scale·QKᵀ per key (None: no bias),
    and `causal` (key j masked for query i < j)."""

    bias: torch.Tensor | None
    causal: bool


NOT_A_KEY_MASK = "attn_mask is neither causal nor a key-padding mask (one bias per key for every query)"
CAPTURED = ("attn_mask has a query dimension, and telling whether it is causal + key padding reads it on the host, "
            "which CUDA graph capture does not allow (under capture the kernels take is_causal=True without a mask, "
            "or a key-padding mask broadcast over the queries, (B, 1, 1, S))")
_last_read = LastMaskRead(while_capturing=CAPTURED)  # the last full mask compared


def key_mask(attn_mask: torch.Tensor | None, is_causal: bool = False) -> KeyMask | str:
    """The KeyMask equal to SDPA's (`attn_mask`, `is_causal`) for every (batch, head, query), or why
    the kernels cannot run the mask (it has no such form, or it cannot be read under CUDA graph
    capture). `attn_mask` is bool (True = attend) or additive float, broadcastable to (B, H, T, S)."""
    if attn_mask is None:
        return KeyMask(None, is_causal)
    if is_causal:  # SDPA takes one or the other
        return NOT_A_KEY_MASK
    mask = attn_mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    mask = mask.flatten(0, -4)
    if _constant(mask, 1) and _constant(mask, 2):
        return KeyMask(_bias(mask[:, 0, 0, :]), False)
    return _last_read(attn_mask, lambda: _compare(mask))


def _constant(mask: torch.Tensor, dim: int) -> bool:
    return mask.shape[dim] == 1 or mask.stride(dim) == 0


def _bias(row: torch.Tensor) -> torch.Tensor:
    if row.dtype == torch.bool:
        return torch.zeros(row.shape, device=row.device).masked_fill_(~row, float("-inf"))
    return row.float()


def _compare(mask: torch.Tensor) -> KeyMask | str:
    """Compare `mask` (M, H, T, S) with the non-causal and the causal pattern of its last row."""
    t, s = mask.shape[-2:]
    last = mask[:, :1, -1:, :]
    past = torch.ones(t, s, dtype=torch.bool, device=mask.device).tril()
    plain = last.expand_as(mask)
    causal = torch.where(past, last, _masked(mask))
    verdict = torch.stack([_same(mask, plain), _same(mask, causal)]).tolist()  # the one host synchronisation
    if verdict[0]:
        return KeyMask(_bias(last[:, 0, 0, :]), False)
    if verdict[1]:
        return KeyMask(_bias(last[:, 0, 0, :]), True)
    return NOT_A_KEY_MASK


def _masked(mask: torch.Tensor) -> torch.Tensor:
    return torch.tensor(False if mask.dtype == torch.bool else float("-inf"), dtype=mask.dtype, device=mask.device)


def _same(mask: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """Whether SDPA gives `mask` and `pattern` the same softmax in every row (a device bool)."""
    if mask.dtype == torch.bool:
        return (mask == pattern).all()
    att, att_pattern = attended(mask), attended(pattern)
    entries = (att == att_pattern) & (~att | (mask == pattern))
    rows = att.any(-1) | (mask == pattern).all(-1)
    return entries.all() & rows.all()
