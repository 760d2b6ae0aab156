"""`span_attention`: SDPA's forward pass, with the paper's gradient rules in the backward pass.

The inputs are checked and broadcast once (`inputs.py`), then a backend runs the T×T work:
`tile_engine.py` (explicit T×T tiles, any dtype; the CPU's) or `fused.py` (SDPA's fused kernels,
nothing T×T kept and no host synchronisation; an accelerator's). A backend is a function of
(query, key, value, attn_mask, dropout_p, is_causal, scale, config, probe) in `BACKENDS`; what it
supplies to the rules, and the backward glue they share, are in `backward.py`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from hf_spanattn.ops import backward
from hf_spanattn.ops.backward import Probe
from hf_spanattn.ops.fused import fused_attention
from hf_spanattn.ops.inputs import broadcast_inputs, check_inputs, shown
from hf_spanattn.ops.tile_engine import tile_attention
from hf_spanattn.ops.triton.backend import device_missing, triton_attention

if TYPE_CHECKING:
    from hf_spanattn.config import SpanAttentionConfig

SPAN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the dtypes span gradients run in
BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"tiles": tile_attention, "fused": fused_attention,
                                                   "triton": triton_attention}


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
    config: SpanAttentionConfig | str | None = None,
    probe: Probe | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention` whose backward pass applies
    `config`'s rule to dQ and dK (and α_V to dV). The forward output is SDPA's. `config` is a
    SpanAttentionConfig or a label such as `"score:1000"`, as `patch_model` takes it; None takes the
    default (`score:1000`). `dropout_p` and `scale` take what SDPA takes: Python and NumPy numbers
    and bools (0 and 1), and 0-d tensors that need no gradient; a scale must be finite (SDPA's
    kernels disagree on NaN and ±inf), and one ≤ 0 gives SDPA's math kernel's result.

    query (B, H_q, T, D); key, value (B, H_kv, S, D) with H_q a multiple of H_kv (grouped-query
    attention always works; `enable_gqa` is accepted for SDPA compatibility). As in SDPA, inputs
    may have other numbers of batch dimensions (2-D and 3-D included) and broadcast over them;
    a broadcast input's gradient sums over its copies. `attn_mask` is a bool mask (True = attend)
    or an additive float mask (in float32 or the query's dtype; under autocast also a half dtype, cast to
    autocast's as for SDPA), broadcastable to (B, H_q, T, S).
    Spans are per (batch, key/value head), over the key positions that at least one query may
    attend to; a float mask's entry counts as masked there at or below `MASKED_AT` = −1e4 (as
    the bool mask's False). The forward output is SDPA's in every row, also where a row attends
    nothing: 0 under a bool or −inf mask, the softmax over its finite entries otherwise (the
    uniform average under the dtype's minimum); on the tiles such a row passes gradient to V only,
    not to Q and K (as under the bool mask), on the fused kernels what SDPA's backward gives it.
    Span rules need self-attention (T == S).
    Without autograd (but under dropout on the tiles and Triton kernels, which draw their own dropout
    masks: the same then as with it, for a reentrant checkpoint's recomputation), with the standard
    gradient (`standard:QKV111`; under other α_Q, α_K, α_V its gradients times them), or with nothing
    to take spans of (an empty dimension, the meta device), this is SDPA itself; so it is for nested
    (ragged) tensors, whose span gradients need them padded and masked. Forward-mode AD (dual tensors)
    meets a rule only under autograd, which it refuses: a rule has no forward-mode derivative. Bad input gets a
    ValueError or TypeError that names the argument; NaN or inf in the input gives NaN
    gradients for the (batch, head) it reaches, as in SDPA.

    `probe`, when given, is called in the backward pass (once per chunk of the batch) with the
    applied dQ, dK, their components per order (α_o-weighted: they sum to the applied ones; the
    standard rule is split into the exact score rule's orders, simple into Π_K and Π_K^⊥),
    the standard dQ, dK and the ranks of K̃ and Ṽ per (batch, head) (floats, NaN where not
    finite). Diagnostics only: it costs one rule evaluation per order, and runs on the tiles.

    `backend` says how the T×T work runs: `"fused"` on SDPA's fused kernels (`ops/fused.py`: nothing
    T×T is formed, no host synchronisation; float32 and half inputs), `"tiles"` in row tiles of
    explicit T×T matrices (`ops/tile_engine.py`; any dtype, the faster on a CPU), `"triton"` on this
    package's Triton kernels (`ops/triton/`: one FlashAttention-2-style kernel pair that returns the
    products of G each rule asks for; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; causal and
    key-padding masks, dropout, head dims up to 128; anything else runs on fused, or tiles for float64,
    with a warning naming the reason), `"auto"` (default): the environment variable HF_SPANATTN_BACKEND
    if set (any case; empty counts as unset), else fused on accelerators and tiles on the CPU or for float64.
    """
    config = _config(config)
    if probe is not None and (not callable(probe) or isinstance(probe, type)):
        got = f"the class {probe.__name__} (pass an instance)" if isinstance(probe, type) else type(probe).__name__
        raise TypeError(f"span_attention: probe must be callable (an OrderRecorder) or None, got {got}")
    needs_grad = torch.is_grad_enabled() and any(requires_grad(t) for t in (query, key, value))
    standard = config.method == "standard" and probe is None  # SDPA's gradients, times α_Q, α_K, α_V
    plain = standard and config.qkv_alphas == (1.0, 1.0, 1.0)
    if any(getattr(x, "is_nested", False) for x in (query, key, value)):  # SDPA's ragged batches
        if needs_grad and not standard:
            raise TypeError("span_attention: nested tensors do not take span gradients; pad them (to_padded_tensor) "
                            "and pass the padding as a bool attn_mask, or use a standard rule such as "
                            "config='standard:QKV111', which is SDPA itself (nested tensors included)")
        if needs_grad:
            query, key, value = backward.with_scaled_grads((query, key, value), config.qkv_alphas)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    layout = check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    device, dtype = query.device.type, layout.dtype  # as SDPA under autocast: its dtype, float64 left as it is
    backend = _backend(backend, dtype, device, probe)  # checked with or without autograd
    dropout_p, scale = layout.dropout_p, layout.scale
    if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype not in (torch.float32, dtype):
        attn_mask = attn_mask.to(dtype)  # another half dtype, which autocast casts for SDPA
    if is_causal and scale is not None and not scale > 0:
        # SDPA's CPU flash kernel gives NaN rows for is_causal under a scale ≤ 0; its math kernel, and every
        # kernel with the causal mask given explicitly, the softmax of the scaled scores
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        is_causal = False
    query, key, value, attn_mask = broadcast_inputs(layout, query, key, value, attn_mask)
    b, h_q, t, d = query.shape
    h_kv, s = key.shape[1], key.shape[2]
    # nothing to take spans of: no data (the meta device) or an empty dimension
    shape_only = query.device.type == "meta" or 0 in (b, h_q, t, s, d, value.shape[-1])
    # the tiles and the Triton kernels draw their own dropout masks: a pass without autograd (a reentrant checkpoint's
    # first, whose output the loss sees) runs them too, so that their recomputation with autograd draws the same mask
    # (not for forward-mode AD without autograd: no gradient to recompute, and SDPA's has a forward-mode derivative)
    tangent = any(_has_tangent(x) for x in (query, key, value, attn_mask) if x is not None)
    own_dropout = dropout_p > 0 and not standard and backend != "fused" and t == s and dtype in SPAN_DTYPES \
        and torch._C._functorch.peek_interpreter_stack() is None and not (tangent and not needs_grad)

    def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=bool(h_q != h_kv))
        return out.reshape(layout.out_shape)

    if (not needs_grad and not own_dropout) or plain or shape_only:
        return sdpa(query, key, value)
    if dtype not in SPAN_DTYPES:  # float8: no kernel takes them
        raise ValueError(f"span_attention: span gradients take float16, bfloat16, float32 or float64 query, key and "
                         f"value, got {dtype}")
    # torch.func transforms wrap tensors that meet our autograd.Functions; Dynamo's tracing sees an interpreter on that
    # stack too, where the check would break every compiled graph at the attention (and stop fullgraph=True)
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError("span_attention: span gradients do not run under torch.func transforms (grad, vmap of a "
                           "gradient or of inputs that need one, jacrev, …); take them with torch.autograd "
                           "(loss.backward(), torch.autograd.grad), or use config='standard:QKV111', which is SDPA "
                           "itself; for a forward pass alone (vmap of a model whose parameters need gradients), run it "
                           "under torch.no_grad()")
    if tangent:  # our autograd Functions have no jvp
        raise RuntimeError("span_attention: forward-mode AD (torch.autograd.forward_ad dual tensors) does not run "
                           "through span gradients: a rule changes the backward pass only and has no forward-mode "
                           "derivative; for the forward pass's own (SDPA's) derivative run it under torch.no_grad(), "
                           "unpatch the model (hf_spanattn.unpatch_model) or use config='standard:QKV111', which is "
                           "SDPA itself")
    if torch.jit.is_tracing():  # a Python autograd.Function: the tiles' fails to trace, the others' fail its check
        raise RuntimeError("span_attention: torch.jit.trace does not record span gradients; trace under "
                           "torch.no_grad() for inference (SDPA itself), train with torch.compile, or use "
                           "config='standard:QKV111', which is SDPA itself")
    if config.method != "standard" and t != s:
        raise ValueError(f"span_attention: method {config.method!r} needs self-attention with as many queries "
                         f"as keys, got {t} queries and {s} keys")
    if probe is not None and t != s:  # its orders are the score rule's
        raise ValueError(f"span_attention: a probe splits the gradient into the orders of span violation, which needs "
                         f"self-attention with as many queries as keys, got {t} queries and {s} keys; pass probe=None")
    if standard:  # SDPA itself, each of its gradients times its α
        return sdpa(*backward.with_scaled_grads((query, key, value), config.qkv_alphas))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    query, key, value = (x.to(dtype) for x in (query, key, value))
    with torch.autocast(device, enabled=False):
        out = BACKENDS[backend](query, key, value, attn_mask, dropout_p, is_causal, scale, config, probe)
    return out.reshape(layout.out_shape)


def requires_grad(x: object) -> bool:
    """Whether x needs a gradient, also where a torch.func transform (vmap) wraps it: the wrapper says no while
    the tensor inside it is tracked by autograd outside the transform."""
    if not isinstance(x, torch.Tensor):
        return False
    functorch = torch._C._functorch
    while not torch.compiler.is_compiling() and functorch.is_functorch_wrapped_tensor(x):
        if x.requires_grad:
            return True
        x = functorch.get_unwrapped(x)
    return x.requires_grad


def _has_tangent(x: torch.Tensor) -> bool:
    """Whether x is a dual tensor of the current forward-mode AD level (`torch.autograd.forward_ad`)."""
    return fwAD._current_level >= 0 and fwAD.unpack_dual(x).tangent is not None


def _config(config: SpanAttentionConfig | str | None) -> SpanAttentionConfig:
    from hf_spanattn.config import SpanAttentionConfig, as_config  # the config imports ops.rules

    if isinstance(config, SpanAttentionConfig):
        return config
    return as_config(config, "span_attention", "the default, score:1000") or SpanAttentionConfig()


def backend_for(device: str | torch.device, dtype: torch.dtype = torch.float32, backend: str = "auto") -> str:
    """The backend that runs calls on a `device` of this type in `dtype` for `backend`, resolved as
    `span_attention` resolves it (HF_SPANATTN_BACKEND included) and past a Triton that cannot run
    there at all: what a run records as its attention backend. A call with diagnostics runs on the
    tiles, and one whose mask or shape the Triton kernels do not take still falls back, with a warning."""
    try:  # a torch.device or its str ('cuda:0'), as a tensor's device: its type decides
        device = torch.device(device).type
    except (TypeError, RuntimeError):
        raise ValueError(f"backend_for: device={shown(device)}: expected a device type such as 'cpu' or 'cuda', or a "
                         "torch.device") from None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"backend_for: dtype={shown(dtype)}: expected a torch.dtype such as torch.float32")
    if dtype not in SPAN_DTYPES:  # no backend runs span gradients in it: span_attention refuses such inputs
        raise ValueError(f"backend_for: dtype={dtype}: span gradients take {', '.join(map(str, SPAN_DTYPES))}")
    name = _backend(backend, dtype, device, None)
    if name == "triton" and (device_missing(device) or dtype == torch.float64):  # the kernels run no float64
        return "tiles" if dtype == torch.float64 else "fused"
    return name


def _backend(name: str, dtype: torch.dtype, device: str, probe: Probe | None) -> str:
    """The backend that runs a call in `dtype` on `device`: see `span_attention`."""
    given, source, allowed = "", f"backend={shown(name)}", ""
    if name == "auto":
        value = os.environ.get("HF_SPANATTN_BACKEND", "")
        name = value.strip().lower() or "auto"  # as a shell leaves it: any case, spaces around, empty for unset
        given = " (set by the environment variable HF_SPANATTN_BACKEND)"
        source = f"the environment variable HF_SPANATTN_BACKEND={shown(value)}"
        allowed = " (any case), or empty for auto"
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        raise ValueError(f"{source}: allowed values are auto, {', '.join(BACKENDS)}{allowed}")
    if name == "fused" and dtype == torch.float64:
        raise ValueError(f"backend='fused'{given} runs float32 and half inputs; float64 runs on backend='tiles'")
    if probe is not None:
        return "tiles"
    if name == "auto":
        return "tiles" if device == "cpu" or dtype == torch.float64 else "fused"
    return name
