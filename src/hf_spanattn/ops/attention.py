"""`span_attention`: SDPA's forward pass, with the paper's gradient rules in the backward pass."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.ops import rules
from hf_spanattn.ops.blocks import BlockProducts, Workspace, row_tiles
from hf_spanattn.ops.spans import span_of

Probe = Callable[[dict], None]
_HALF = (torch.float16, torch.bfloat16)
_BACKWARD_CHUNKS = 4


@dataclass
class _Mask:
    """A mask in the (B, H_kv, g, T, S) layout: what is added to the scores, the key positions
    some query may attend to (the spans' support), and the query rows that attend nothing."""

    additive: torch.Tensor | None
    key_valid: torch.Tensor | None  # (b, h, 1, S, 1) bool
    dead_rows: torch.Tensor | None  # (b, h, g, T, 1) bool

    def select(self, rows: slice) -> _Mask:
        """The mask of batch entries `rows` (fields broadcast over the batch stay whole)."""
        pick = lambda x: x[rows] if x is not None and x.shape[0] > 1 else x  # noqa: E731
        return _Mask(pick(self.additive), pick(self.key_valid), pick(self.dead_rows))


def _prepare_mask(attn_mask: torch.Tensor | None, is_causal: bool, shape: tuple[int, ...],
                  dtype: torch.dtype) -> _Mask:
    _, h_kv, groups, t, s = shape
    if is_causal:
        if attn_mask is not None:
            raise ValueError("span_attention: pass either attn_mask or is_causal=True, not both (as in SDPA)")
        attn_mask = torch.ones(t, s, dtype=torch.bool).tril()
    if attn_mask is None:
        return _Mask(None, None, None)
    if attn_mask.dtype == torch.bool:
        attend = attn_mask
        # adding a float mask is twice as fast as masked_fill_ with a broadcast bool mask
        additive = torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill_(~attend, -math.inf)
    else:
        # Transformers' eager masks use the dtype's minimum rather than -inf.
        attend, additive = attn_mask > torch.finfo(attn_mask.dtype).min, attn_mask.to(dtype)
    while attend.dim() < 4:
        attend, additive = attend.unsqueeze(0), additive.unsqueeze(0)
    b, h = attend.shape[:2]
    if h not in (1, h_kv * groups):
        raise ValueError(f"attn_mask has {h} heads; expected 1 or {h_kv * groups}")
    layout = (b, h_kv, groups) if h > 1 else (b, 1, 1)
    attend = attend.reshape(*layout, *attend.shape[-2:])
    additive = additive.reshape(*layout, *additive.shape[-2:])
    key_valid = attend.any(dim=-2).any(dim=2, keepdim=True).unsqueeze(-1)
    dead_rows = ~attend.any(dim=-1, keepdim=True)
    return _Mask(additive, None if key_valid.all() else key_valid, dead_rows if dead_rows.any() else None)


def _probs(q: torch.Tensor, k: torch.Tensor, mask: _Mask, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """softmax(scale·Q Kᵀ + mask) in `dtype`; rows with nothing to attend give 0 (as SDPA)."""
    scores = (q * scale).to(dtype) @ k.to(dtype).mT
    if mask.additive is not None:
        scores.add_(mask.additive)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if dtype in _HALF else None).to(dtype)
    if mask.dead_rows is not None:
        probs.masked_fill_(mask.dead_rows, 0.0)
    return probs


class SpanAttentionFunction(torch.autograd.Function):
    """Attention on (B, H_kv, g, T, d) queries and (B, H_kv, 1, S, d) keys/values."""

    @staticmethod
    def forward(ctx, q, k, v, mask: _Mask, dropout_p: float, scale: float, config: SpanAttentionConfig,
                probe: Probe | None):
        probs = _probs(q, k, mask, scale, q.dtype)
        weights = probs
        keep = None
        if dropout_p > 0:
            # The draw is torch.empty_like(probs).bernoulli_(1 - p), reproducible under a seed.
            keep = torch.empty_like(probs).bernoulli_(1 - dropout_p).bool()
            weights = probs * keep / (1 - dropout_p)
        out = weights @ v
        ctx.save_for_backward(q, k, v, probs, keep, out)
        ctx.mask, ctx.dropout_p, ctx.scale, ctx.config, ctx.probe = mask, dropout_p, scale, config, probe
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, probs, keep, out = ctx.saved_tensors
        d_out = d_out.contiguous()
        grads = [torch.empty_like(x) for x in (q, k, v)]
        # Batch entries are independent: a few at a time bounds the O(T·d) temporaries.
        step = max(1, math.ceil(q.shape[0] / _BACKWARD_CHUNKS))
        per_block = ctx.config.method == "score" and ctx.config.score_grad == "per_block"
        tiles = row_tiles(ctx.mask.additive, q.shape[-2]) if per_block else None
        # per_block stacks score blocks: in one chunk they hold no more T×T elements than the saved probabilities
        max_blocks = q.shape[0] // step
        workspace = Workspace()
        for start in range(0, q.shape[0], step):
            rows = slice(start, start + step)
            chunk = _backward(
                *(x[rows] if x is not None else None for x in (q, k, v, probs, keep, out, d_out)),
                ctx.mask.select(rows), ctx.dropout_p, ctx.scale, ctx.config, ctx.probe, workspace, tiles,
                max_blocks,
            )
            for grad, part in zip(grads, chunk):
                grad[rows] = part
        return (*grads, None, None, None, None, None)


def _backward(q, k, v, probs, keep, out, d_out, mask: _Mask, dropout_p: float, scale: float,
              config: SpanAttentionConfig, probe: Probe | None, workspace: Workspace,
              tiles: list[tuple[int, int, int]] | None, max_blocks: int):
    """One chunk of the batch; `tiles` (per_block only) as from `row_tiles`."""
    weights = probs if keep is None else probs * keep / (1 - dropout_p)
    dv = rules.group_sum(weights.mT @ d_out)
    del weights
    d_probs = None
    if tiles is None or probe is not None:
        # scale·∂L/∂(probabilities): G = ∂L/∂S then carries the factor of S = scale·QKᵀ.
        d_probs = torch.matmul(d_out * scale, v.mT, out=workspace("d_probs", probs.shape, probs))
        if keep is not None:
            d_probs.mul_(keep).mul_(1 / (1 - dropout_p))

    work = torch.float32 if q.dtype in _HALF else q.dtype
    q_w, k_w = q.to(work), _masked(k.to(work), mask)
    needs_v = config.method in ("reductionistic", "score")
    span_k = span_of(k_w) if config.method != "standard" else None
    v_w = _masked(v.to(work), mask) if needs_v or probe is not None else None
    span_v = span_of(v_w) if needs_v else None

    def softmax_grad() -> torch.Tensor:
        """G = P ⊙ (dP − rowsum(dP ⊙ P)), with rowsum(dP ⊙ P) = rowsum(dO ⊙ O); in dP's buffer."""
        delta = (d_out.to(work) * out.to(work)).sum(dim=-1, keepdim=True).mul_(scale)
        return d_probs.sub_(delta.to(d_probs.dtype)).mul_(probs)

    if tiles is not None:
        block_products = BlockProducts(d_out, v, keep, dropout_p, scale, mask.additive, mask.dead_rows, tiles,
                                       max_blocks, workspace)

        def rule(alphas):
            return rules.score_per_block(block_products, q_w, k_w, mask.key_valid, span_k, span_v, alphas)

        dq, dk = rule(config.alphas)
        g = softmax_grad() if probe is not None else None  # the probe's standard gradient
    else:
        g = softmax_grad()

        def rule(alphas):
            return _rule(config.method, alphas, g, q_w, k_w, span_k, span_v)

        dq, dk = rule(config.alphas)
    alpha_q, alpha_k, alpha_v = config.qkv_alphas
    if probe is not None:
        alphas = config.alphas
        if config.method == "standard":  # split the standard gradient into the exact score rule's orders
            span_k, span_v, alphas = span_of(k_w), span_of(v_w), (1.0, 1.0, 1.0, 1.0)

            def rule(alphas):
                return rules.score_exact(g, q_w, k_w, span_k, span_v, alphas)

        orders = [rule(tuple(a if i == o else 0.0 for i, a in enumerate(alphas))) for o in range(len(alphas))]
        dq_std, dk_std = rules.standard(g, q_w, k_w)
        probe({
            "dq_orders": [alpha_q * x for x, _ in orders], "dk_orders": [alpha_k * x for _, x in orders],
            "dq": alpha_q * dq, "dk": alpha_k * dk, "dq_standard": dq_std, "dk_standard": dk_std,
            "rank_k": torch.linalg.matrix_rank(k_w), "rank_v": torch.linalg.matrix_rank(v_w),
        })
    return [x if a == 1 else x * a for x, a in zip((dq, dk, dv), (alpha_q, alpha_k, alpha_v))]


def _masked(x: torch.Tensor, mask: _Mask) -> torch.Tensor:
    return x * mask.key_valid if mask.key_valid is not None else x


def _rule(method: str, alphas, g, q, k, span_k, span_v):
    if method == "standard":
        return rules.standard(g, q, k)
    if method == "score":
        return rules.score_exact(g, q, k, span_k, span_v, alphas)
    if method == "simple":
        op = rules.simple_operator(span_k, alphas)
    else:
        op = rules.reductionistic_operator(span_k, span_v, alphas)
    dq, dk = rules.standard(g, q, k)
    return op(dq), op(dk)


def span_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    config: SpanAttentionConfig,
    probe: Probe | None = None,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention` whose backward pass applies
    `config`'s rule to dQ and dK (and α_V to dV). The forward output is SDPA's.

    query (B, H_q, T, D); key, value (B, H_kv, S, D) with H_q a multiple of H_kv (grouped-query
    attention always works; `enable_gqa` is accepted for SDPA compatibility). `attn_mask` is a
    bool mask (True = attend) or an additive float mask, broadcastable to (B, H_q, T, S).
    Spans are per (batch, key/value head), over the key positions that at least one query may
    attend to. Span rules need self-attention (T == S). Without autograd, or with the plain
    standard gradient (`standard:QKV111`), this is SDPA itself.

    `probe`, when given, is called in the backward pass (once per chunk of the batch) with the
    applied dQ, dK, their components per order (α_o-weighted: they sum to the applied ones; the
    standard rule is split into the exact score rule's orders, simple into Π_K and Π_K^⊥),
    the standard dQ, dK and the ranks of K̃ and Ṽ per (batch, head). Diagnostics only: it
    costs one rule evaluation per order.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    b, h_q, t, d = query.shape
    h_kv, s = key.shape[1], key.shape[2]
    if h_q % h_kv:
        raise ValueError(f"span_attention: query heads ({h_q}) must be a multiple of key/value heads ({h_kv})")
    plain = config.method == "standard" and config.qkv_alphas == (1.0, 1.0, 1.0) and probe is None
    if not needs_grad or plain:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=h_q != h_kv)
    if config.method != "standard" and t != s:
        raise ValueError(f"span_attention: method {config.method!r} needs self-attention with as many queries "
                         f"as keys, got {t} queries and {s} keys")
    groups = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as SDPA under autocast: run in the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"span_attention: query, key and value must share a dtype, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    mask = _prepare_mask(attn_mask, is_causal, (b, h_kv, groups, t, s), query.dtype)
    with torch.autocast(device, enabled=False):
        out = SpanAttentionFunction.apply(
            query.reshape(b, h_kv, groups, t, d), key.unsqueeze(2), value.unsqueeze(2), mask, dropout_p, scale, config,
            probe,
        )
    return out.reshape(b, h_q, t, value.shape[-1])
