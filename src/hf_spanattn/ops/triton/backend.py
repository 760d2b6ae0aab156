"""The `triton` backend of `span_attention`: the T×T work on the kernels of `flash.py`.

The forward pass is FlashAttention-2 with the log-sum-exp saved (SDPA's output). The backward pass
recomputes P and G = ∂L/∂S per tile and multiplies each tile by the operands a rule names
(`rules.Operands`: G·X per query head, Gᵀ·Y summed over the query heads of a key/value head),
with no T×T tensor, no zero columns and no host synchronisation. Under the per-block reading every
block (Q_i, K_δ) with a non-zero weight is an attention call on the same V and ∂L/∂O, run on the
kernels' block axis in one launch. The rest (spans, the rule, α_QKV) is `backward.py`'s.

Masks: causal, and masks that reduce to a bias per key (`masks.key_mask`: key padding, as
Transformers builds for padded batches). Dropout is drawn in the kernels from a seed on the device,
the same mask in the forward pass, the backward pass and every block. Anything else (another mask,
a head dim above 128, float64, no Triton, Triton's interpreter under torch.compile, a kernel that
fails to compile or launch, under CUDA graph capture a mask with a query dimension or a kernel not
yet called before the capture) runs on `fused` (float64 on `tiles`) with a warning, once per reason.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch

from hf_spanattn.ops import backward, rules
from hf_spanattn.ops.backward import Probe, grouped
from hf_spanattn.ops.fused import _spans, fused_attention, key_support
from hf_spanattn.ops.inputs import attended, capturing, user_stacklevel
from hf_spanattn.ops.tile_engine import tile_attention
from hf_spanattn.ops.triton import flash, interpreting, masks, missing

if TYPE_CHECKING:
    from hf_spanattn.config import SpanAttentionConfig

MAX_HEAD_DIM = 128
_warned: set[str] = set()
_checked: dict[tuple, str | None] = {}  # kernel variant -> None if it ran, else why not


def triton_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                     dropout_p: float, is_causal: bool, scale: float, config: SpanAttentionConfig,
                     probe: Probe | None = None) -> torch.Tensor:
    """`span_attention` on the Triton kernels; (B, H, T, D) inputs as checked and broadcast by it.
    `probe` (diagnostics) is called from the backward pass as on any backend (`backward.rule_grads`)."""
    form = masks.key_mask(attn_mask, is_causal)
    reason = _unsupported(query, key, value, form, dropout_p)
    if reason is None and attn_mask is not None and attn_mask.requires_grad:  # the kernels take the bias as a constant
        reason = "attn_mask needs a gradient (a learnable bias), which the kernels do not give"
    if reason is None:
        reason = _check(query, value, form, dropout_p)
    if reason is not None:
        fallback = "tiles" if query.dtype == torch.float64 or probe is not None else "fused"
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"backend='triton' runs on backend='{fallback}' here: {reason}", stacklevel=user_stacklevel())
        run = tile_attention if fallback == "tiles" else fused_attention
        return run(query, key, value, attn_mask, dropout_p, is_causal, scale, config, probe)
    h_q, h_kv = query.shape[1], key.shape[1]
    key_valid = key_support(attn_mask, h_kv, h_q // h_kv)
    alive = None if attn_mask is None or attn_mask.dtype == torch.bool else _rows_attending(form, query.shape[-2])
    return _Attention.apply(query, key, value, form.bias, form.causal, dropout_p, scale, key_valid, alive, config,
                            probe)


def _rows_attending(form: masks.KeyMask, t: int) -> torch.Tensor | None:
    """(B or 1, 1, T, 1): whether a query row attends some key under a float mask (one above `MASKED_AT`). A row
    that attends none passes no gradient to Q and K, as under the bool mask (on the tiles too); the kernels give
    its P, which only dV takes. Read on the device."""
    if form.bias is None:
        return None
    attend = attended(form.bias)
    rows = attend.cummax(-1).values[:, :t] if form.causal else attend.any(-1, keepdim=True)
    return rows[:, None, :, None]


def device_missing(device: str) -> str | None:
    """Why the kernels cannot run on a device of this type at all (Triton not installed, or not CUDA
    without TRITON_INTERPRET=1), or None."""
    reason = missing()
    if reason:
        return reason
    interpret = interpreting()
    if not interpret and device != "cuda":
        return f"the kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}"
    if interpret and device != "cpu":
        return f"TRITON_INTERPRET=1 runs CPU tensors, got {device}"
    return None


def _unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, form: masks.KeyMask | str,
                 dropout_p: float) -> str | None:
    """Why the kernels cannot run this call, or None."""
    reason = device_missing(query.device.type)
    if reason:
        return reason
    if interpreting() and torch.compiler.is_compiling():  # Dynamo would trace into the interpreter's NumPy
        return "Triton's interpreter (TRITON_INTERPRET=1) does not run under torch.compile"
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernels run float32, float16 and bfloat16 inputs, got {query.dtype}"
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM}, got {query.shape[-1]} (query, key) and {value.shape[-1]} (value)"
    if isinstance(form, str):
        return form
    if dropout_p >= 1:
        return f"dropout_p={dropout_p} drops every weight"
    if query.shape[-2] * key.shape[-2] >= 2**31:
        return f"T·S = {query.shape[-2]}·{key.shape[-2]} reaches 2³¹, past the dropout counters"
    return None


def _check(query: torch.Tensor, value: torch.Tensor, form: masks.KeyMask, dropout_p: float) -> str | None:
    """Run each kernel variant once on a small problem before its first real use, so that a kernel
    that fails to compile or launch sends the call to the fallback rather than failing in the
    backward pass. Remembered per variant."""
    variant = (query.device, query.dtype, query.shape[-1], value.shape[-1], form.causal, form.bias is not None,
               dropout_p > 0)
    if variant not in _checked and capturing(query):  # a trial's copies would break the capture: not remembered
        return ("these kernels are first called under CUDA graph capture, where they cannot be tried first: "
                "run a step before capturing, as torch.cuda.graphs asks")
    if variant not in _checked:
        _checked[variant] = None
        try:
            _trial(*variant)
        except Exception as error:  # a compiler or driver error: whatever it is, the call can still run
            _checked[variant] = f"the kernels failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    return _checked[variant]


def _trial(device, dtype, d, dv, causal, has_bias, dropout) -> None:
    """Every kernel of the variant on a (1, 1, 16, ·) problem (its own random numbers: the caller's
    generator is left as it was)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 16, d, generator=gen).to(device, dtype) for _ in range(2))
    v, d_out = (torch.randn(1, 1, 16, dv, generator=gen).to(device, dtype) for _ in range(2))
    call = dict(scale=d**-0.5, causal=causal, key_bias=torch.zeros(1, 16, device=device) if has_bias else None,
                dropout_p=0.1 if dropout else 0.0, seed=torch.zeros(1, dtype=torch.int64, device=device))
    out, lse = flash.forward(q, k, v, **call)
    flash.backward(q, k, v, out, lse, d_out, key_operands=[k, v], query_operands=[q, d_out], **call)
    blocks_out, blocks_lse = flash.forward(q[None], k[None], v, **call)
    flash.backward(q[None], k[None], v, blocks_out, blocks_lse, d_out, key_operands=[k[None]],
                   query_operands=[q[None]], want_dv=False, **call)


class _Attention(torch.autograd.Function):
    """The kernels' forward pass; in the backward pass, the rule's dQ and dK from the products of G
    it asks for, and dV."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal: bool, dropout_p: float, scale: float, key_valid, alive,
                config: SpanAttentionConfig, probe: Probe | None):
        seed = flash.new_seed(q.device) if dropout_p > 0 else None
        ctx.call = dict(scale=scale, causal=causal, dropout_p=dropout_p)
        ctx.config, ctx.probe = config, probe
        out, lse = flash.forward(q, k, v, key_bias=bias, seed=seed, **ctx.call)
        ctx.save_for_backward(q, k, v, out, lse, bias, seed, key_valid, alive)
        return out

    @staticmethod
    @backward.first_order_only
    def backward(ctx, d_out):
        q, k, v, out, lse, bias, seed, key_valid, alive = ctx.saved_tensors
        config = ctx.config
        products = _Products(q, k, v, out, lse, d_out, dict(ctx.call, key_bias=bias, seed=seed), alive)
        spans_of = functools.partial(_spans, padded=key_valid is not None)
        inputs = backward.prepare(*grouped(q, k), v.unsqueeze(2), key_valid, config.rule, spans_of,
                                  probing=ctx.probe is not None)
        dq, dk = backward.rule_grads(config, inputs, products, ctx.probe)
        dv = products.dv if products.dv is not None else products.dv_alone()
        dq, dk, dv = backward.scaled((dq.reshape(q.shape), dk.squeeze(2), dv), config.qkv_alphas)
        return dq.to(q.dtype), dk.to(k.dtype), dv, None, None, None, None, None, None, None, None


class _Products:
    """The contract of `backward.py` on the kernels: `Operands` → `Products`, `Blocks` → `BlockProducts`.
    dV comes with the first call that runs the real attention's backward. Rows that attend no key (`alive`
    False, `_rows_attending`) are left out of G: of G·X's rows and of the Y that Gᵀ·Y sums over."""

    def __init__(self, q, k, v, out, lse, d_out, call: dict, alive: torch.Tensor | None = None) -> None:
        self.q, self.k, self.v, self.out, self.lse, self.d_out, self.call = q, k, v, out, lse, d_out, call
        self.alive = alive
        self.dv: torch.Tensor | None = None

    def _live(self, x: torch.Tensor) -> torch.Tensor:
        """x ((N,) B, H, T, ·) with the rows that attend no key set to 0."""
        return x if self.alive is None else x * self.alive

    def __call__(self, needs: rules.Operands | rules.Blocks) -> rules.Products | rules.BlockProducts:
        if isinstance(needs, rules.Blocks):
            return self._blocks(needs)
        b, h_q, t, _ = self.q.shape
        # G·K̃ = G·K and Gᵀ·Q: the kernels reuse the tiles they load anyway (G is 0 on masked keys)
        xs = [self.k if name == "k" else x.squeeze(2) if x.shape[2] == 1 else x.reshape(b, h_q, t, -1)
              for name, x in needs.query.items()]
        ys = [self._live(self.q if name == "q" else y.reshape(b, h_q, t, -1)) for name, y in needs.key.items()]
        got = flash.backward(self.q, self.k, self.v, self.out, self.lse, self.d_out, key_operands=xs,
                             query_operands=ys, want_dv=self.dv is None, **self.call)
        self.dv = self.dv if got.dv is None else got.dv
        h_kv = self.k.shape[1]
        return rules.Products(
            {name: self._live(x).reshape(b, h_kv, h_q // h_kv, t, -1) for name, x in zip(needs.query, got.key_side)},
            {name: y.unsqueeze(2) for name, y in zip(needs.key, got.query_side)})

    def _blocks(self, needs: rules.Blocks) -> rules.BlockProducts:
        """Block (i, δ) is attention on (Q_i, K_δ, V) with the real ∂L/∂O: G_iδ K_δ and Σ_g G_iδᵀ Q_i
        from one forward and one backward launch over all blocks."""
        pairs = needs.pairs()
        b, h_q, t, d = self.q.shape
        dtype = self.q.dtype
        q_blocks = torch.stack([needs.q[i].reshape(b, h_q, t, d) for i, _ in pairs]).to(dtype)
        k_blocks = torch.stack([needs.k[delta].squeeze(2) for _, delta in pairs]).to(dtype)
        out, lse = flash.forward(q_blocks, k_blocks, self.v, **self.call)
        got = flash.backward(q_blocks, k_blocks, self.v, out, lse, self.d_out, key_operands=[k_blocks],
                             query_operands=[self._live(q_blocks)], want_dv=False, **self.call)
        g = h_q // self.k.shape[1]
        gk = {pair: self._live(x).reshape(b, -1, g, t, d) for pair, x in zip(pairs, got.key_side[0])}  # G_iδ K_δ
        gq = {pair: x.unsqueeze(2) for pair, x in zip(pairs, got.query_side[0])}  # Σ_g G_iδᵀ Q_i
        return needs.answer(gk, gq)

    def dv_alone(self) -> torch.Tensor:
        return flash.backward(self.q, self.k, self.v, self.out, self.lse, self.d_out, **self.call).dv
