"""The backward pass between a rule (`rules.py`) and a backend: the glue that every backend shares.

A backend runs the T×T work and answers what a rule asks of G = ∂L/∂S (which carries `scale`):

    products(needs: rules.Operands) -> rules.Products
        G·X for each `needs.query[name] = X` (X: (B, H_kv, 1, T, ·), the result (B, H_kv, g, T, ·)
        per query head) and Gᵀ·Y for each `needs.key[name] = Y` (Y: (B, H_kv, g, T, ·), the result
        (B, H_kv, 1, T, ·) summed over the g query heads of a key/value head: GQA), under the same
        names. "k" (X = K̃) and "q" (Y = Q) are the standard backward's G·K and Gᵀ·Q.
    products(needs: rules.Blocks) -> rules.BlockProducts   (rules with `Rule.per_block`)
        for query blocks Q_i (B, H_kv, g, T, d) and key blocks K_δ (B, H_kv, 1, T, d), block (i, δ)
        is attention on (Q_i, K_δ, V) under the call's mask with the real ∂L/∂O, G_iδ its ∂L/∂S:
        Σ_δ c_δ G_iδ K_δ for each `needs.sums[name] = (i, c)` and per δ Σ_i w_iδ G_iδᵀ Q_i summed
        over the query heads (w = `needs.key_weights`; None where no w_iδ is non-zero). Only the
        blocks that `needs.meets` lists need to run, best all in one call (a block axis).

Operands and results are in the work dtype (`work_dtype`); G is zero at masked keys. The backend
also runs the forward pass and gives dV. Everything else is here: the (B, H_kv, g, T, d) layout
of GQA (`grouped`), the work dtype, the key-valid mask and the spans (`prepare`), the rule's
evaluation and the diagnostics probe (`rule_grads`), α_QKV (`scaled`). A backward pass is then

    inputs = prepare(q, k, v, key_valid, config.rule, spans_of, probing=probe is not None)
    dq, dk = rule_grads(config, inputs, products, probe)
    dq, dk, dv = scaled((dq, dk, dv), config.qkv_alphas)

(a backend that must know the operands in its forward pass, as `fused.py` does, calls
`config.rule.needs` there and `config.rule.finish` in its backward). A backend is one module with
a function of (query, key, value, attn_mask, dropout_p, is_causal, scale, config, probe) in
`attention.BACKENDS`. Its autograd function's backward is decorated `@first_order_only` (a rule's
gradient is not a derivative: it has none of its own), and a learnable float mask gets
∂L/∂mask = G/scale summed to the mask's shape (`mask_grad`), whatever the rule, as in SDPA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_spanattn.ops import rules
from hf_spanattn.ops.spans import Span

if TYPE_CHECKING:
    from hf_spanattn.config import SpanAttentionConfig

HALF = (torch.float16, torch.bfloat16)
Probe = Callable[[dict], None]
ProductsOf = Callable[[rules.Operands | rules.Blocks], rules.Products | rules.BlockProducts]
# (K̃, Ṽ or None, pinv) -> (Π_K, Π_V): a backend's way of taking spans
SpansOf = Callable[[torch.Tensor, torch.Tensor | None, bool], tuple[Span | None, Span | None]]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the projector maths: float32 for half inputs."""
    return torch.float32 if dtype in HALF else dtype


def grouped(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H_q, T, d) queries as (B, H_kv, g, T, d), (B, H_kv, S, d) keys (or values) as (B, H_kv, 1, S, d)."""
    b, h_q, t, d = query.shape
    h_kv = key.shape[1]
    return query.reshape(b, h_kv, h_q // h_kv, t, d), key.unsqueeze(2)


@dataclass
class RuleInputs:
    """What a rule reads, in the work dtype and the grouped layout: Q, the masked K̃ and Ṽ (padded
    key positions zeroed; Ṽ None where nothing reads it) and the spans."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    spans: rules.Spans


# Part of a (B, H_kv, …) batch: batch entries, or batch entries and key/value heads.
Rows = slice | tuple[slice, ...]


def pick(x: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
    """x[rows], where a dimension of size 1 (broadcast over the batch or the heads) stays whole."""
    if x is None:
        return None
    rows = rows if isinstance(rows, tuple) else (rows,)
    return x[tuple(r if size > 1 else slice(None) for r, size in zip(rows, x.shape))]


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, rule: rules.Rule,
            spans_of: SpansOf, probing: bool = False) -> RuleInputs:
    """The rule's inputs from grouped q, k, v (see `grouped`); the probe reads both spans."""
    work = work_dtype(q.dtype)
    masked = lambda x: x.to(work) * key_valid if key_valid is not None else x.to(work)  # noqa: E731
    k_w = masked(k)
    v_w = masked(v) if probing or "v" in rule.spans else None
    span_k, span_v = spans_of(k_w, v_w, rule.pinv) if probing or rule.spans else (None, None)
    return RuleInputs(q.to(work), k_w, v_w, rules.Spans(span_k, span_v, key_valid))


def evaluate(rule: rules.Rule, alphas: Sequence[float], x: RuleInputs,
             products: ProductsOf) -> tuple[torch.Tensor, torch.Tensor]:
    """(dQ, dK) of `rule` at `alphas`: its needs, the backend's products, its finish."""
    needs = rule.needs(x.q, x.k, x.spans, alphas)
    if isinstance(needs, rules.Blocks) and not needs.sums and not any(map(any, needs.key_weights)):
        answer = rules.BlockProducts({}, [None] * len(needs.k))  # every weight zero: no block to run
    else:
        answer = products(needs)
    del needs  # the per-block rule's blocks (…, T, d each), before its finish allocates
    return rule.finish(answer, x.q, x.k, x.spans, alphas)


def rule_grads(config: SpanAttentionConfig, x: RuleInputs, products: ProductsOf,
               probe: Probe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dQ, dK) of the config's rule before α_Q, α_K; with `probe`, also calls it with the
    diagnostics (see `span_attention`)."""
    rule = config.rule
    dq, dk = evaluate(rule, config.alphas, x, products)
    if probe is not None:
        alpha_q, alpha_k, _ = config.qkv_alphas
        split, order_alphas = rule.split(config.alphas)
        orders = [evaluate(split, alphas, x, products) for alphas in order_alphas]
        standard = products(rules.Operands(query={"k": x.k}, key={"q": x.q}))
        probe({
            "dq_orders": [alpha_q * o for o, _ in orders], "dk_orders": [alpha_k * o for _, o in orders],
            "dq": alpha_q * dq, "dk": alpha_k * dk, "dq_standard": standard.query["k"],
            "dk_standard": standard.key["q"], "rank_k": _rank(x.k), "rank_v": _rank(x.v),
            "rule": f"{config.method}@{config.score_grad}",
        })
    return dq, dk


def scaled(grads: Sequence[torch.Tensor], qkv_alphas: Sequence[float]) -> list[torch.Tensor]:
    """(α_Q dQ, α_K dK, α_V dV), without a copy where an α is 1."""
    return [x if a == 1 else x * a for x, a in zip(grads, qkv_alphas)]


DOUBLE_BACKWARD = (
    "span_attention: a second derivative (create_graph=True through its gradients, as torch.autograd.functional's "
    "jvp, hvp, vhp and hessian take them) is not supported: a "
    "span rule's gradient is not the derivative of a function, so it has no derivative of its own. For "
    "gradient penalties and other second derivatives use attention that has one: config standard:QKV111 "
    "(SDPA itself) or F.scaled_dot_product_attention, under torch.nn.attention.sdpa_kernel(SDPBackend.MATH) "
    "on the CPU, or the model's eager attention (hf_spanattn.unpatch_model)")


BATCHED_GRADS = (
    "span_attention: batched gradients (torch.autograd.grad(..., is_grads_batched=True), which "
    "torch.autograd.functional.jacobian and hessian use with vectorize=True) are not supported: take them one "
    "at a time (vectorize=False, or a loop of torch.autograd.grad), or use config standard:QKV111 (SDPA itself)")


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients a backward pass computed, as they are; differentiating them raises. They are made to
    depend on what they were computed from (the incoming gradients and the saved inputs), so that a second
    derivative with respect to anything upstream (`torch.autograd.grad(..., inputs=params)`) reaches this
    function, rather than passing it by as a constant."""

    @staticmethod
    def forward(ctx, n_grads, *tensors):  # the gradients, then what they depend on
        return tuple(g.view_as(g) for g in tensors[:n_grads])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(DOUBLE_BACKWARD)


def first_order_only(backward_fn: Callable) -> Callable:
    """For an autograd function's backward: under create_graph=True (grad mode on in the backward pass)
    it runs without a graph and its gradients come back marked, so that differentiating them again
    raises a RuntimeError that says what to do (`DOUBLE_BACKWARD`); a caller that only reads them
    gets them as usual. Autocast is off in it, as in the forward pass: a backward pass called inside an
    autocast region would otherwise run the rule's products in its dtype."""

    @functools.wraps(backward_fn)
    def wrapper(ctx, *grad_outputs):
        if not torch.compiler.is_compiling() and any(  # the rules' products write into buffers: vmap cannot batch them
                isinstance(g, torch.Tensor) and torch._C._functorch.is_legacy_batchedtensor(g) for g in grad_outputs):
            raise RuntimeError(BATCHED_GRADS)
        device = next(g.device.type for g in grad_outputs if isinstance(g, torch.Tensor))
        create_graph = torch.is_grad_enabled()
        with torch.autocast(device, enabled=False), torch.no_grad():
            grads = backward_fn(ctx, *grad_outputs)
        if not create_graph:
            return grads
        present = [g for g in grads if isinstance(g, torch.Tensor)]
        sources = [x for x in (*grad_outputs, *ctx.saved_tensors)  # not the function's own saved output
                   if isinstance(x, torch.Tensor) and x.requires_grad and x.grad_fn is not ctx]
        marked = iter(_NoSecondDerivative.apply(len(present), *present, torch.empty(0, requires_grad=True), *sources))
        return tuple(next(marked) if isinstance(g, torch.Tensor) else g for g in grads)

    return wrapper


class _ScaledGrad(torch.autograd.Function):
    """x itself in the forward pass; α·∂L/∂x in the backward pass."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        return grad * ctx.alpha, None


def with_scaled_grads(tensors: Sequence[torch.Tensor], alphas: Sequence[float]) -> list[torch.Tensor]:
    """The tensors, each of whose gradient is multiplied by its α in the backward pass (as `scaled`)."""
    return [x if a == 1 or not x.requires_grad else _ScaledGrad.apply(x, a) for x, a in zip(tensors, alphas)]


def mask_grad(g_parts: Iterable[tuple[torch.Tensor, int, int, int]], mask: torch.Tensor) -> torch.Tensor:
    """∂L/∂mask for an additive `mask` broadcast to (b, H_q, T, S), from ∂L/∂S without the factor
    scale (G/scale) as row tiles (b, H_kv, g, rows, columns) with their (first row, end row,
    columns): summed over what the mask broadcasts over (batch, heads, rows, keys); 0 where no
    tile reaches."""
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    out = torch.zeros(shape4, dtype=work_dtype(mask.dtype), device=mask.device)
    for g, start, end, cols in g_parts:
        x = g.reshape(g.shape[0], -1, *g.shape[-2:]).to(out.dtype)
        for dim, size in enumerate(shape4):
            if size == 1 and x.shape[dim] != 1:
                x = x.sum(dim, keepdim=True)
        rows = slice(start, end) if shape4[2] > 1 else slice(None)
        out[..., rows, :cols if shape4[3] > 1 else None] += x
        del g, x  # before the next tile is formed
    return out.reshape(mask.shape).to(mask.dtype)


def _rank(x: torch.Tensor) -> torch.Tensor:
    """The rank of x (…, T, d) per leading index, as a float: NaN where x holds NaN or inf."""
    finite = torch.isfinite(x).all(dim=-1).all(dim=-1)
    rank = torch.linalg.matrix_rank(torch.where(finite[..., None, None], x, 0)).to(x.dtype)
    return rank.masked_fill_(~finite, torch.nan)
