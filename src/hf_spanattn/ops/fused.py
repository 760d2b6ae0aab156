"""The T×T work on the stock fused attention kernels (`F.scaled_dot_product_attention`).

Nothing T×T is formed or kept: the forward pass is SDPA itself, and the backward pass is SDPA's,
on inputs that carry the rule's operands as extra head-dim columns. For any T×· matrices X (key
side) and Y (query side), [Q, 0, Y]·[K, X, 0]ᵀ = Q Kᵀ, so attention on

    Q_aug = [Q, 0, Y_1, …],  K_aug = [K, X_1, …, 0],  V_aug = [V, 0]

has SDPA's probabilities and output, and its fused backward returns G·K, G·X_i (dQ_aug) and
Gᵀ·Q, Gᵀ·Y_i (dK_aug, summed over the query heads of a key/value head), all a rule asks for
(`rules.Operands`). The operands depend on K and V through the spans; they enter detached, and
their gradients reach Q and K through the rule only. Standard, simple and reductionistic need no
extra column; the exact score rule needs Π_V K and its mixes R_∥, R_⊥ (width 3d for [1000], 4d
at most). Dropout is SDPA's own, the same in both passes.

The per-block rule's blocks are attention calls softmax(mask(S^B))·V with S^B = scale·Q_ab K_δᵀ:
SDPA's backward of such a call with the real ∂L/∂O gives G_B K_δ and G_Bᵀ Q_ab. The blocks run
stacked on the batch axis, or, under dropout, one at a time with the forward pass's random state,
so that every block sees the forward's dropout mask.

Spans come from `span_without_sync` and masks are read on the device: with a causal or a padding
mask no step waits for the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_spanattn.ops import rules
from hf_spanattn.ops.inputs import attended
from hf_spanattn.ops.spans import Span, span_without_sync
from hf_spanattn.ops.tiles import HALF

if TYPE_CHECKING:
    from hf_spanattn.config import SpanAttentionConfig

def key_support(attn_mask: torch.Tensor | None, h_kv: int, groups: int) -> torch.Tensor | None:
    """The key positions some query may attend to, (B or 1, H_kv, 1, S, 1) bool, from a mask
    broadcastable to (B, H_q, T, S) (see `inputs.MASKED_AT`); None where every key is (no mask).
    Read on the device."""
    if attn_mask is None:
        return None
    attend = attended(attn_mask)
    while attend.dim() < 4:
        attend = attend.unsqueeze(0)
    b, h, _, s = attend.shape
    attend = attend.any(dim=-2)  # (b, h, S)
    attend = attend.reshape(b, h_kv, groups, s) if h > 1 else attend.reshape(b, 1, 1, s)
    return attend.any(dim=2, keepdim=True).unsqueeze(-1)


class _Operands(torch.autograd.Function):
    """(Q, K, V) ↦ (Q_aug, K_aug, V_aug) in the forward pass; in the backward pass, the rule's
    dQ and dK from SDPA's gradients of the augmented inputs (dV: its first columns)."""

    @staticmethod
    def forward(ctx, q, k, v, key_valid, config: SpanAttentionConfig):
        b, h_q, t, d = q.shape
        h_kv = k.shape[1]
        rule = config.rule
        work = torch.float32 if q.dtype in HALF else q.dtype
        q5 = q.reshape(b, h_kv, h_q // h_kv, t, d).to(work)
        k5, v5 = (x.unsqueeze(2).to(work) for x in (k, v))
        if key_valid is not None:
            k5, v5 = k5 * key_valid, v5 * key_valid
        spans = _spans(k5, v5, rule.spans, rule.pinv, padded=key_valid is not None)
        key_side, query_side = rule.operands(q5, k5, spans, config.alphas)
        extra_k = [x for x in key_side[1:] if x is not None]
        extra_q = [y for y in query_side[1:] if y is not None]
        ctx.config, ctx.shapes, ctx.dtype = config, (q.shape, k.shape, v.shape), q.dtype
        ctx.widths = ([x.shape[-1] if x is not None else 0 for x in key_side[1:]],
                      [y.shape[-1] if y is not None else 0 for y in query_side[1:]])
        ctx.save_for_backward(*(x.basis if x is not None else None for x in spans),
                              spans.k.coef if spans.k is not None else None, q, k, key_valid)
        if not extra_k and not extra_q:
            return q.view_as(q), k.view_as(k), v.view_as(v)
        width_k, width_q = sum(x.shape[-1] for x in extra_k), sum(y.shape[-1] for y in extra_q)
        q_aug = torch.cat([q, q.new_zeros(b, h_q, t, width_k),
                           *(y.reshape(b, h_q, t, -1).to(q.dtype) for y in extra_q)], dim=-1)
        k_aug = torch.cat([k, *(x.squeeze(2).to(k.dtype) for x in extra_k), k.new_zeros(b, h_kv, t, width_q)], dim=-1)
        # the fused kernels want V as wide as Q and K
        v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], q_aug.shape[-1] - v.shape[-1])], dim=-1)
        return q_aug, k_aug, v_aug

    @staticmethod
    def backward(ctx, dq_aug, dk_aug, dv_aug):
        basis_k, basis_v, coef_k, q, k, key_valid = ctx.saved_tensors
        config, (q_shape, k_shape, v_shape) = ctx.config, ctx.shapes
        b, h_q, t, d = q_shape
        h_kv = k_shape[1]
        work = torch.float32 if ctx.dtype in HALF else ctx.dtype
        spans = rules.Spans(Span(basis_k, coef_k) if basis_k is not None else None,
                            Span(basis_v, None) if basis_v is not None else None)
        widths_k, widths_q = ctx.widths
        key_products = _columns(dq_aug, d, widths_k, (b, h_kv, h_q // h_kv, t, -1), work)
        query_products = _columns(dk_aug, d + sum(widths_k), widths_q, (b, h_kv, 1, t, -1), work)
        products = ([dq_aug[..., :d].reshape(b, h_kv, h_q // h_kv, t, d).to(work), *key_products],
                    [dk_aug[..., :d].unsqueeze(2).to(work), *query_products])
        q5 = q.reshape(b, h_kv, h_q // h_kv, t, d).to(work)
        k5 = k.unsqueeze(2).to(work)
        if key_valid is not None:
            k5 = k5 * key_valid
        dq, dk = config.rule.finish(products, q5, k5, spans, config.alphas)
        alpha_q, alpha_k, alpha_v = config.qkv_alphas
        dq, dk = (x.reshape(shape).mul(a).to(ctx.dtype) for x, shape, a in ((dq, q_shape, alpha_q),
                                                                           (dk.squeeze(2), k_shape, alpha_k)))
        dv = dv_aug[..., :v_shape[-1]]
        return dq, dk, dv if alpha_v == 1 else dv * alpha_v, None, None


def _spans(k: torch.Tensor, v: torch.Tensor, needed: str, pinv: bool, padded: bool) -> rules.Spans:
    """Π_K, and Π_V where `needed` holds "v", from one `span_without_sync` on K and V stacked."""
    if not needed:
        return rules.Spans(None, None)
    if "v" not in needed:
        return rules.Spans(span_without_sync(k, pinv, padded), None)
    both = span_without_sync(torch.stack([k, v]), pinv, padded)
    return rules.Spans(Span(both.basis[0], both.coef[0] if pinv else None), Span(both.basis[1], None))


def _columns(grad: torch.Tensor, start: int, widths: Sequence[int], shape: tuple[int, ...],
             work: torch.dtype) -> list[torch.Tensor | None]:
    """The column groups of `grad` from `start` on, `widths` wide (None where 0), reshaped to `shape`."""
    out = []
    for width in widths:
        out.append(grad[..., start:start + width].reshape(shape).to(work) if width else None)
        start += width
    return out


class _PerBlock(torch.autograd.Function):
    """SDPA's forward pass; in the backward pass, dV from SDPA's backward and dQ, dK from the
    per-block rule with its blocks as stacked SDPA calls."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale: float, key_valid,
                config: SpanAttentionConfig):
        ctx.rng = _rng_state(q.device) if dropout_p > 0 else None
        ctx.call = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=q.shape[1] != k.shape[1])
        ctx.config = config
        ctx.save_for_backward(q, k, v, key_valid)
        return F.scaled_dot_product_attention(q, k, v, **ctx.call)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, key_valid = ctx.saved_tensors
        config = ctx.config
        b, h_q, t, d = q.shape
        h_kv = k.shape[1]
        work = torch.float32 if q.dtype in HALF else q.dtype
        with _replaying(ctx.rng, q.device):
            (dv,) = _attention_grads(ctx.call, (q, k, v), d_out, wanted=(2,))
        q5 = q.reshape(b, h_kv, h_q // h_kv, t, d).to(work)
        k5, v5 = (x.unsqueeze(2).to(work) for x in (k, v))
        if key_valid is not None:
            k5, v5 = k5 * key_valid, v5 * key_valid
        spans = _spans(k5, v5, config.rule.spans, config.rule.pinv, padded=key_valid is not None)
        blocks = _SdpaBlocks(ctx.call, v, d_out, ctx.rng)
        dq, dk = config.rule.blocks(blocks, q5, k5, key_valid, spans, config.alphas)
        alpha_q, alpha_k, alpha_v = config.qkv_alphas
        dq = (dq.reshape(q.shape) * alpha_q).to(q.dtype)
        dk = (dk.squeeze(2) * alpha_k).to(k.dtype)
        return dq, dk, dv if alpha_v == 1 else dv * alpha_v, None, None, None, None, None, None


class _SdpaBlocks:
    """`rules.BlockProducts` on SDPA: block (i, δ) is attention on (Q_i, K_δ, V) with the real ∂L/∂O."""

    def __init__(self, call: dict, v: torch.Tensor, d_out: torch.Tensor, rng: torch.Tensor | None) -> None:
        self.call, self.v, self.d_out, self.rng = call, v, d_out, rng

    def __call__(self, q_blocks, k_blocks, sums, k_weights):
        pairs = [(i, delta) for i in range(len(q_blocks)) for delta in range(len(k_blocks))
                 if k_weights[i][delta] or any(c[delta] for block, c in sums if block == i)]
        b, h_kv, g, t, d = q_blocks[0].shape
        dtype, work = self.v.dtype, q_blocks[0].dtype
        queries = [q_blocks[i].reshape(b, h_kv * g, t, d).to(dtype) for i, _ in pairs]
        keys = [k_blocks[delta].squeeze(2).to(dtype) for _, delta in pairs]
        if self.rng is None:  # all blocks in one call, stacked on the batch axis
            n = len(pairs)
            call = dict(self.call)
            mask = call["attn_mask"]
            if mask is not None and mask.dim() == 4 and mask.shape[0] > 1:
                call["attn_mask"] = mask.repeat(n, 1, 1, 1)
            dq_all, dk_all = _attention_grads(call, (torch.cat(queries), torch.cat(keys), self.v.repeat(n, 1, 1, 1)),
                                              self.d_out.repeat(n, 1, 1, 1), wanted=(0, 1))
            dq_parts, dk_parts = dq_all.chunk(n), dk_all.chunk(n)
        else:  # one at a time, each with the forward's dropout mask
            dq_parts, dk_parts = [], []
            for query, key in zip(queries, keys):
                with _replaying(self.rng, query.device):
                    dq_b, dk_b = _attention_grads(self.call, (query, key, self.v), self.d_out, wanted=(0, 1))
                dq_parts.append(dq_b)
                dk_parts.append(dk_b)
        gk = {pair: x.reshape(b, h_kv, g, t, d).to(work) for pair, x in zip(pairs, dq_parts)}  # G_B K_δ
        gq = {pair: x.unsqueeze(2).to(work) for pair, x in zip(pairs, dk_parts)}  # Σ_g G_Bᵀ Q_i
        sums_out = [rules.lincomb(*((c[delta], gk.get((i, delta))) for delta in range(len(k_blocks))))
                    for i, c in sums]
        k_out = [rules.lincomb(*((k_weights[i][delta], gq.get((i, delta))) for i in range(len(q_blocks))))
                 for delta in range(len(k_blocks))]
        return sums_out, k_out


def _attention_grads(call: dict, inputs: Sequence[torch.Tensor], d_out: torch.Tensor,
                     wanted: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """SDPA's forward and backward on `inputs` with the upstream gradient d_out: the gradients of
    the inputs at `wanted`."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(i in wanted) for i, x in enumerate(inputs)]
        out = F.scaled_dot_product_attention(*leaves, **call)
        return torch.autograd.grad(out, [leaves[i] for i in wanted], d_out)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


class _replaying:
    """Runs its block with the random state `state` (None: as it is), then puts back the one before."""

    def __init__(self, state: torch.Tensor | None, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self) -> None:
        if self.state is not None:
            self.saved = _rng_state(self.device)
            self._set(self.state)

    def __exit__(self, *exc) -> None:
        if self.state is not None:
            self._set(self.saved)

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    dropout_p: float, is_causal: bool, scale: float, config: SpanAttentionConfig,
                    probe: None = None) -> torch.Tensor:
    """`span_attention` on SDPA's fused kernels; (B, H, T, D) inputs as checked and broadcast by it,
    T == S. `scale` must be given: the augmented width is not D. Diagnostics (a probe) run on the tiles."""
    if probe is not None:
        raise ValueError("fused_attention takes no probe: diagnostics run on backend='tiles'")
    h_q, h_kv = query.shape[1], key.shape[1]
    key_valid = key_support(attn_mask, h_kv, h_q // h_kv)
    if config.rule.blocks is not None:
        return _PerBlock.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, key_valid, config)
    q_aug, k_aug, v_aug = _Operands.apply(query, key, value, key_valid, config)
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=h_q != h_kv)
    return out[..., :value.shape[-1]]
