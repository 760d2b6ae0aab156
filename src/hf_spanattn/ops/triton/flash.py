"""Launchers of the kernels in `kernels.py` (imported on first use, so that this module imports
without Triton).

Shapes: Q (B, H_q, T, D), K (B, H_kv, S, D), V (B, H_kv, S, D_v), H_q a multiple of H_kv. Q and K
may carry a leading block axis N (N, B, H, ·, D): N attention calls on the same V and ∂L/∂O, run
in one launch (the per-block reading: block B is attention on (Q_ab, K_δ, V)). `key_bias` (B or 1, S)
is an additive mask per key (0 or −inf for key padding; `masks.key_mask` makes one from an SDPA
mask); `causal` masks key j for query i < j as SDPA's is_causal. Dropout draws its mask from
`seed` (a one-element int64 tensor on the device, `new_seed`), the same in every call given it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

LOG2E = 1.4426950408889634
_LARGEST_BIAS = 2.0**125  # a key bias past it is shifted down (float32 holds 2¹²⁸ in log2 units, scores beside it)
MAX_WIDTH = 256  # the widest operand group one launch multiplies G by; wider lists take several launches
_INTERPRETER = threading.Lock()  # Triton's interpreter swaps module globals during a launch: one launch at a time


@dataclass
class Products:
    """The backward's results: dV, G·X_i per key-side operand X_i ((N,) B, H_q, T, ·) and Gᵀ·Y_j per
    query-side operand Y_j ((N,) B, H_kv, S, ·), summed over the query heads of a key/value head.
    G = ∂L/∂S carries the factor `scale`; products are float32."""

    dv: torch.Tensor | None
    key_side: list[torch.Tensor]
    query_side: list[torch.Tensor]


def new_seed(device: torch.device) -> torch.Tensor:
    """A dropout seed drawn on `device` from torch's generator (no host synchronisation; under CUDA
    graphs a fresh draw per replay)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = False,
            key_bias: torch.Tensor | None = None, dropout_p: float = 0.0,
            seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale·QKᵀ + mask)·V and its log-sum-exp per row in log2 units as two parts, ((N,) B, H_q, T, 2)
    float32: the row's largest score m (−inf for a row that attends nothing, whose output is 0) and
    log2 Σ 2^(s − m) (`logsumexp` adds them up); the backward pass takes it as it is."""
    from hf_spanattn.ops.triton import kernels

    call = _Call(q, k, v, scale, causal, key_bias, dropout_p, seed)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(*q.shape[:-1], 2, dtype=torch.float32)
    _launch(kernels.forward_kernel, call.grid(call.t, call.h_q, "BLOCK_M"),
        call.q, call.k, call.v, out, lse, call.bias, call.seed, call.b, call.h_q, call.h_kv, call.t, call.s,
        call.scale_log2, dropout_p, W=0, **call.meta)
    return out, lse


def logsumexp(lse: torch.Tensor) -> torch.Tensor:
    """The natural log-sum-exp per row from `forward`'s two parts."""
    return lse.sum(-1) / LOG2E


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             d_out: torch.Tensor, *, scale: float, causal: bool = False, key_bias: torch.Tensor | None = None,
             dropout_p: float = 0.0, seed: torch.Tensor | None = None, key_operands: Sequence[torch.Tensor] = (),
             query_operands: Sequence[torch.Tensor] = (), want_dv: bool = True) -> Products:
    """From the forward's `out` and `lse` and ∂L/∂O (B, H_q, T, D_v): dV (if `want_dv`; with a block
    axis, the sum over the blocks is not formed: pass want_dv=False), G·X for every X in
    `key_operands` (key-side: ((N,) B, H_kv, S, ·), or H_q heads for an X per query head) and Gᵀ·Y
    for every Y in `query_operands` ((N,) B, H_q, T, ·). The standard backward is key_operands=[k],
    query_operands=[q] (dQ = G K, dK = Gᵀ Q); passing k or q itself reuses the tile already loaded."""
    from hf_spanattn.ops.triton import kernels

    call = _Call(q, k, v, scale, causal, key_bias, dropout_p, seed)
    if want_dv and call.blocked:
        raise ValueError("flash.backward: want_dv=True needs Q and K without a block axis")
    d_out = d_out.contiguous()
    delta = torch.linalg.vecdot(out.float(), d_out.float())  # Δ = rowsum(dO∘O), broadcast over blocks
    args = (call.q, call.k, call.v, d_out, lse.contiguous(), delta.contiguous(), call.bias, call.seed)
    # G = scale·P∘(dP − Δ) is rounded to the operands' dtype for the tile products: a scale past 1 multiplies the
    # float32 products instead, so that float16's range holds G where it holds P∘(dP − Δ) (as in SDPA)
    before, after = (scale, 1.0) if abs(scale) <= 1 else (1.0, scale)
    sizes = (call.b, call.h_q, call.h_kv, call.t, call.s, before, after, call.scale_log2, dropout_p)

    dv = torch.empty_like(call.v) if want_dv else None
    query_side = []
    groups = _groups(query_operands)
    if want_dv and not groups:  # dV alone
        groups = [[call.q]]
    for i, group in enumerate(groups):
        y, width, is_q = _stack(group, call.q, call.q.shape[:-2] + (call.t,), q.dtype)
        gy = torch.empty(*call.k.shape[:-1], width, device=q.device, dtype=torch.float32)
        _launch(kernels.keys_kernel, call.grid(call.s, call.h_kv, "BLOCK_N"),
            *args, y, dv if dv is not None else gy, gy, *sizes, W=width, BLOCK_W=_pow2(width), Y_IS_Q=is_q,
            WANT_DV=want_dv and i == 0, WANT_GY=bool(query_operands), **call.meta)
        if query_operands:
            query_side += _split(gy, group, call.blocked)
    key_side = []
    for group in _groups(key_operands):
        per_query_head = group[0].shape[-3] != call.h_kv
        heads = call.h_q if per_query_head else call.h_kv
        x, width, is_k = _stack(group, call.k, (call.n, call.b, heads, call.s), q.dtype)
        gx = torch.empty(*call.q.shape[:-1], width, device=q.device, dtype=torch.float32)
        _launch(kernels.queries_kernel, call.grid(call.t, call.h_q, "BLOCK_M"),
            *args, x, gx, *sizes, W=width, BLOCK_W=_pow2(width), X_IS_K=is_k, X_PER_QUERY_HEAD=per_query_head,
            **call.meta)
        key_side += _split(gx, group, call.blocked)
    return Products(dv, key_side, query_side)


def _launch(kernel, grid: Callable, *args, **meta) -> None:
    from hf_spanattn.ops.triton import kernels

    with _INTERPRETER if kernels.INTERPRET else contextlib.nullcontext():
        kernel[grid](*args, **meta)


class _Call:
    """The inputs as the kernels take them: contiguous, a block axis on Q and K, the key bias in log2 units."""

    def __init__(self, q, k, v, scale, causal, key_bias, dropout_p, seed):
        from hf_spanattn.ops.triton import kernels

        self.blocked = q.dim() == 5
        if k.dim() != q.dim() or v.dim() != 4:
            raise ValueError(f"flash: Q and K must both carry the block axis or neither, V none; got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        self.q = (q if self.blocked else q.unsqueeze(0)).contiguous()
        self.k = (k if self.blocked else k.unsqueeze(0)).contiguous()
        self.v = v.contiguous()
        n, self.b, self.h_q, self.t, d = self.q.shape
        self.h_kv, self.s, dv = self.k.shape[2], self.k.shape[3], v.shape[-1]
        if self.h_q % self.h_kv or self.k.shape[0] != n or self.k.shape[1] != self.b or self.k.shape[-1] != d:
            raise ValueError(f"flash: Q {tuple(q.shape)} and K {tuple(k.shape)} do not fit (batch, heads, head dim)")
        self.n = n
        self.scale_log2 = scale * LOG2E
        if dropout_p > 0 and seed is None:
            raise ValueError("flash: dropout_p > 0 needs the seed of the call's dropout mask (new_seed)")
        if self.t * self.s >= 2**31:
            raise ValueError(f"flash: T·S must stay below 2³¹ for the dropout counters, got {self.t}·{self.s}")
        self.seed = seed if seed is not None else self.q
        self.bias = self.q
        if key_bias is not None:
            bias = key_bias.to(device=q.device, dtype=torch.float32).expand(self.b, self.s)
            # a row's softmax is the same under a shift of its bias: one whose largest finite entry would pass the
            # float32 range in log2 units (or beside the scores) is shifted down to 2¹²⁵ (SDPA takes it as it is)
            top = torch.where(bias.isfinite(), bias, 0.0).amax(-1, keepdim=True) if self.s else 0.0
            bias = bias - (top - _LARGEST_BIAS).clamp_min(0.0)
            # log2 units; a finite minimum stays finite (SDPA's uniform average over an all-minimum row)
            finite = (bias * LOG2E).clamp_min(torch.finfo(torch.float32).min)
            self.bias = torch.where(bias == float("-inf"), bias, finite).contiguous()
        half = q.dtype in (torch.float16, torch.bfloat16)
        self.meta = dict(D=d, DV=dv, BLOCK_D=_pow2(d), BLOCK_DV=_pow2(dv), CAUSAL=causal,
                         HAS_BIAS=key_bias is not None, DROPOUT=dropout_p > 0, UPCAST=kernels.INTERPRET and half,
                         PRECISION="tf32" if half else "ieee")

    def grid(self, length: int, heads: int, block: str):
        """Programs: blocks of `length` rows `block` long, per (batch, head), per block of the block axis."""
        n, b = self.n, self.b
        return lambda meta: (-(-length // meta[block]), b * heads, n)


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _groups(operands: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The operands in launch groups of at most MAX_WIDTH columns and one head count."""
    groups: list[list[torch.Tensor]] = []
    width = MAX_WIDTH
    for x in operands:
        if groups and width + x.shape[-1] <= MAX_WIDTH and x.shape[-3] == groups[-1][0].shape[-3]:
            groups[-1].append(x)
            width += x.shape[-1]
        else:
            groups.append([x])
            width = x.shape[-1]
    return groups


def _stack(group: Sequence[torch.Tensor], own: torch.Tensor, shape: tuple[int, ...],
           dtype: torch.dtype) -> tuple[torch.Tensor, int, bool]:
    """The group's operands side by side, (N, B, H, L, width) in the inputs' dtype; or `own` itself
    (the Q or K already loaded by the kernel) when the group is just that."""
    x = group[0]
    if (len(group) == 1 and x.data_ptr() == own.data_ptr() and x.is_contiguous() and x.numel() == own.numel()
            and x.dtype == own.dtype):
        return own, own.shape[-1], True
    parts = [(x if x.dim() == len(shape) + 1 else x.unsqueeze(0)).to(dtype).expand(*shape, x.shape[-1])
             for x in group]
    return torch.cat(parts, dim=-1).contiguous(), sum(x.shape[-1] for x in group), False


def _split(result: torch.Tensor, group: Sequence[torch.Tensor], blocked: bool) -> list[torch.Tensor]:
    parts = list(result.split([x.shape[-1] for x in group], dim=-1))
    return parts if blocked else [x.squeeze(0) for x in parts]
