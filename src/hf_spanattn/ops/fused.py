"""The T×T work on the stock fused attention kernels (`F.scaled_dot_product_attention`).

Nothing T×T is formed or kept: the forward pass is SDPA itself, and the backward pass is SDPA's,
on inputs that carry the rule's operands as extra head-dim columns. For any T×· matrices X (key
side) and Y (query side), [Q, 0, Y]·[K, X, 0]ᵀ = Q Kᵀ, so attention on

    Q_aug = [Q, 0, Y_1, …],  K_aug = [K, X_1, …, 0],  V_aug = [V, 0]

has SDPA's probabilities and output, and its fused backward returns G·K, G·X_i (dQ_aug) and
Gᵀ·Q, Gᵀ·Y_i (dK_aug, summed over the query heads of a key/value head), all a rule asks for
(`rules.Operands`, by name: the contract in `backward.py`; "k" and "q" are the standard
columns). The operands depend on K and V through the spans; they enter detached, and their
gradients reach Q and K through the rule only. Standard, simple and reductionistic need no extra
column; the exact score rule needs Π_V K and its mixes R_∥, R_⊥ (width 3d for [1000], 4d
at most). Dropout is SDPA's own, the same in both passes.

The per-block rule's blocks are attention calls softmax(mask(S^B))·V with S^B = scale·Q_ab K_δᵀ:
SDPA's backward of such a call with the real ∂L/∂O gives G_B K_δ and G_Bᵀ Q_ab. The blocks run
stacked on the batch axis, or, under dropout, one at a time with the forward pass's random state,
so that every block sees the forward's dropout mask (read and replayed under a lock: another call in
another thread does not draw from it in between).

Spans come from `span_without_sync` and masks are read on the device: with a causal or a padding
mask no step waits for the host.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from hf_spanattn.ops import backward, rules
from hf_spanattn.ops.backward import grouped
from hf_spanattn.ops.inputs import attended
from hf_spanattn.ops.spans import Span, span_without_sync

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
        inputs = backward.prepare(*grouped(q, k), v.unsqueeze(2), key_valid, config.rule,
                                  functools.partial(_spans, padded=key_valid is not None))
        needs = config.rule.needs(inputs.q, inputs.k, inputs.spans, config.alphas)
        # the standard columns give G·K and Gᵀ·Q: only the other operands need columns of their own
        extra_k = {name: x for name, x in needs.query.items() if name != "k"}
        extra_q = {name: y for name, y in needs.key.items() if name != "q"}
        ctx.config, ctx.dtype, ctx.v_width = config, q.dtype, v.shape[-1]
        ctx.needs = list(needs.query), list(needs.key)
        ctx.widths = ({name: x.shape[-1] for name, x in extra_k.items()},
                      {name: y.shape[-1] for name, y in extra_q.items()})
        spans = inputs.spans
        ctx.save_for_backward(*(x.basis if x is not None else None for x in (spans.k, spans.v)),
                              spans.k.coef if spans.k is not None else None, q, k, key_valid)
        if not extra_k and not extra_q:
            return q.view_as(q), k.view_as(k), v.view_as(v)
        width_k, width_q = sum(ctx.widths[0].values()), sum(ctx.widths[1].values())
        # the fused kernels want V as wide as Q and K: the narrower side gets zero columns (a value wider than the
        # augmented query and key gives them zero columns past the operands', which change no score)
        width = max(d + width_k + width_q, v.shape[-1])
        q_aug = torch.cat([q, q.new_zeros(b, h_q, t, width_k),
                           *(y.reshape(b, h_q, t, -1).to(q.dtype) for y in extra_q.values()),
                           q.new_zeros(b, h_q, t, width - d - width_k - width_q)], dim=-1)
        k_aug = torch.cat([k, *(x.squeeze(2).to(k.dtype) for x in extra_k.values()),
                           k.new_zeros(b, h_kv, t, width - d - width_k)], dim=-1)
        v_aug = torch.cat([v, v.new_zeros(*v.shape[:-1], width - v.shape[-1])], dim=-1)
        return q_aug, k_aug, v_aug

    @staticmethod
    @backward.first_order_only
    def backward(ctx, dq_aug, dk_aug, dv_aug):
        basis_k, basis_v, coef_k, q, k, key_valid = ctx.saved_tensors
        config = ctx.config
        d = q.shape[-1]
        work = backward.work_dtype(ctx.dtype)
        q5, k5 = grouped(q.to(work), k.to(work))
        if key_valid is not None:
            k5 = k5 * key_valid
        spans = rules.Spans(Span(basis_k, coef_k) if basis_k is not None else None,
                            Span(basis_v, None) if basis_v is not None else None, key_valid)
        widths_k, widths_q = ctx.widths
        query = _columns(dq_aug, d, widths_k, q5.shape[:-1])
        key = _columns(dk_aug, d + sum(widths_k.values()), widths_q, k5.shape[:-1])
        query["k"], key["q"] = grouped(dq_aug[..., :d], dk_aug[..., :d])
        asked_query, asked_key = ctx.needs
        products = rules.Products({name: query[name].to(work) for name in asked_query},
                                  {name: key[name].to(work) for name in asked_key})
        dq, dk = config.rule.finish(products, q5, k5, spans, config.alphas)
        dv = dv_aug[..., :ctx.v_width]
        dq, dk, dv = backward.scaled((dq.reshape(q.shape), dk.squeeze(2), dv), config.qkv_alphas)
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv, None, None


def _spans(k: torch.Tensor, v: torch.Tensor | None, pinv: bool, padded: bool) -> tuple[Span, Span | None]:
    """Π_K, and Π_V where v is given, from one `span_without_sync` on K and V stacked (two where
    their head dims differ)."""
    if v is None:
        return span_without_sync(k, pinv, padded), None
    if v.shape != k.shape:
        return span_without_sync(k, pinv, padded), Span(span_without_sync(v, False, padded).basis, None)
    both = span_without_sync(torch.stack([k, v]), pinv, padded)
    return Span(both.basis[0], both.coef[0] if pinv else None), Span(both.basis[1], None)


def _columns(grad: torch.Tensor, start: int, widths: dict[str, int], shape: torch.Size) -> dict[str, torch.Tensor]:
    """The column groups of `grad` from `start` on, `widths` wide, by name, each reshaped to `shape` + (width,)."""
    out = {}
    for name, width in widths.items():
        out[name] = grad[..., start:start + width].reshape(*shape, width)
        start += width
    return out


class _PerBlock(torch.autograd.Function):
    """SDPA's forward pass; in the backward pass, dV from SDPA's backward and dQ, dK from the
    per-block rule with its blocks as stacked SDPA calls."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, dropout_p: float, is_causal: bool, scale: float, key_valid,
                config: SpanAttentionConfig):
        detached = attn_mask.detach() if attn_mask is not None else None
        ctx.call = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        ctx.config = config
        # saved as the inputs are: changed in place before the backward pass, it is an error, not another mask
        ctx.save_for_backward(q, k, v, key_valid, detached)
        with _RNG_LOCK if dropout_p > 0 else contextlib.nullcontext():  # the state read is the one SDPA draws from
            ctx.rng = _rng_state(q.device) if dropout_p > 0 else None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=detached, **ctx.call)

    @staticmethod
    @backward.first_order_only
    def backward(ctx, d_out):
        q, k, v, key_valid, attn_mask = ctx.saved_tensors
        ctx.call["attn_mask"] = attn_mask
        config = ctx.config
        with _replaying(ctx.rng, q.device):  # dV and the mask's gradient are SDPA's, whatever the rule
            dv, *d_mask = _attention_grads(ctx.call, (q, k, v), d_out, wanted=(2,), mask_grad=ctx.needs_input_grad[3])
        inputs = backward.prepare(*grouped(q, k), v.unsqueeze(2), key_valid, config.rule,
                                  functools.partial(_spans, padded=key_valid is not None))
        dq, dk = backward.rule_grads(config, inputs, _SdpaBlocks(ctx.call, v, d_out, ctx.rng))
        dq, dk, dv = backward.scaled((dq.reshape(q.shape), dk.squeeze(2), dv), config.qkv_alphas)
        return dq.to(q.dtype), dk.to(k.dtype), dv, *(d_mask or [None]), None, None, None, None, None


class _SdpaBlocks:
    """`rules.Blocks` on SDPA: block (i, δ) is attention on (Q_i, K_δ, V) with the real ∂L/∂O."""

    def __init__(self, call: dict, v: torch.Tensor, d_out: torch.Tensor, rng: torch.Tensor | None) -> None:
        self.call, self.v, self.d_out, self.rng = call, v, d_out, rng

    def __call__(self, needs: rules.Blocks) -> rules.BlockProducts:
        q_blocks, k_blocks = needs.q, needs.k
        pairs = needs.pairs()
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
        return needs.answer(gk, gq)


def _attention_grads(call: dict, inputs: Sequence[torch.Tensor], d_out: torch.Tensor,
                     wanted: Sequence[int], mask_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """SDPA's forward and backward on `inputs` with the upstream gradient d_out: the gradients of
    the inputs at `wanted`, then, with `mask_grad`, the float mask's."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(i in wanted) for i, x in enumerate(inputs)]
        wrt = [leaves[i] for i in wanted]
        if mask_grad:
            call = dict(call, attn_mask=call["attn_mask"].detach().requires_grad_())
            wrt.append(call["attn_mask"])
        out = F.scaled_dot_product_attention(*leaves, **call)
        return torch.autograd.grad(out, wrt, d_out)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


# Held from reading the random state to SDPA's draw from it, in the forward pass and in each replay: the state is
# the process's (per device), so another thread's call between the two would leave the replayed mask another one
_RNG_LOCK = threading.Lock()


class _replaying:
    """Runs its block with the random state `state` (None: as it is), then puts back the one before."""

    def __init__(self, state: torch.Tensor | None, device: torch.device) -> None:
        self.state, self.device = state, device

    def __enter__(self) -> None:
        if self.state is not None:
            _RNG_LOCK.acquire()
            self.saved = _rng_state(self.device)
            self._set(self.state)

    def __exit__(self, *exc) -> None:
        if self.state is not None:
            try:
                self._set(self.saved)
            finally:
                _RNG_LOCK.release()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)


_PER_BLOCK_BREAK = {"msg": "span_attention: the per-block rule takes its blocks' gradients with torch.autograd.grad in "
                          "the backward pass, which Dynamo does not trace: the graph breaks here (fullgraph=True "
                          "fails); the rules without @per_block compile without a break on the fused kernels"}
if "msg" not in inspect.signature(torch._dynamo.graph_break).parameters:  # torch before 2.7 says no more than the break
    _PER_BLOCK_BREAK = {}


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                    dropout_p: float, is_causal: bool, scale: float, config: SpanAttentionConfig,
                    probe: None = None) -> torch.Tensor:
    """`span_attention` on SDPA's fused kernels; (B, H, T, D) inputs as checked and broadcast by it,
    T == S. `scale` must be given: the augmented width is not D. Diagnostics (a probe) run on the tiles."""
    if probe is not None:
        raise ValueError("fused_attention takes no probe: diagnostics run on backend='tiles'")
    h_q, h_kv = query.shape[1], key.shape[1]
    key_valid = key_support(attn_mask, h_kv, h_q // h_kv)
    if config.rule.per_block:
        if torch.compiler.is_compiling():  # Dynamo fails on the autograd.Function's backward: it breaks there anyway
            torch._dynamo.graph_break(**_PER_BLOCK_BREAK)
        return _PerBlock.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, key_valid, config)
    q_aug, k_aug, v_aug = _Operands.apply(query, key, value, key_valid, config)
    out = F.scaled_dot_product_attention(q_aug, k_aug, v_aug, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal, scale=scale, enable_gqa=h_q != h_kv)
    return _first_columns(out, value.shape[-1])


def _first_columns(out: torch.Tensor, width: int) -> torch.Tensor:
    """The first `width` columns of SDPA's output of the augmented operands, dense in the order of its dimensions in
    memory, as SDPA lays out its own output (contiguous on a CPU), not a strided slice: a caller may `.view` it so."""
    if out.shape[-1] == width:
        return out
    return out[..., :width].clone(memory_format=torch.preserve_format)  # a slice: dense, its strides' order kept
