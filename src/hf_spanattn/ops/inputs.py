"""The inputs of `span_attention`, checked and broadcast once for every backend: what SDPA
accepts (at least 2-D inputs that broadcast over their batch dimensions, grouped-query heads, a
bool or float mask that broadcasts to (batch…, H_q, T, S), 0 ≤ dropout_p ≤ 1), with an error
that names the argument and what is allowed where SDPA gives no result."""

from __future__ import annotations

import math
import numbers
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# An additive float mask entry at or below this counts as masked: the key is left out of the
# spans (as with a bool mask's False) and of its row's tile, where its weight exp(≤ −1e4) is 0 to
# float64 precision. Transformers' and older models' masks (−1e4, −1e9, the dtype's minimum, −inf)
# all fall below it; a bias such as ALiBi's (−m·distance) stays above it while m·distance < 10⁴.
MASKED_AT = -1e4


def shown(value: Any, limit: int = 200) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters (a value read from a file may be huge;
    an int past Python's digit limit, whose repr raises, is shown by its size)."""
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # repr raises past 4300 digits, is slow before
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # an entry past the digit limit, or a broken __repr__
        text = f"<{type(value).__name__}>" if not isinstance(value, (list, tuple)) else \
            f"[{', '.join(shown(v, 20) for v in value[:8])}{', ...' if len(value) > 8 else ''}]"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def user_stacklevel() -> int:
    """The `stacklevel` that makes a warning, given by the function that calls this, name the first caller outside
    hf_spanattn and the libraries it runs under (Transformers, PEFT, Accelerate, torch) and of the import
    machinery (a warning while a module of the package is imported): the user's line, however deep the call that
    warns (as Python 3.12's `skip_file_prefixes`)."""
    folders = tuple(os.path.dirname(module.__file__) + os.sep
                    for name in ("hf_spanattn", "transformers", "peft", "accelerate", "torch")
                    if (module := sys.modules.get(name)) is not None and getattr(module, "__file__", None))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith((*folders, "<frozen importlib")):
        frame = frame.f_back
        # warnings.warn passes over the import machinery's frames itself, uncounted
        level += not frame.f_code.co_filename.startswith("<frozen importlib._bootstrap")
    return level


def capturing(x: torch.Tensor) -> bool:
    """Whether the current stream of x's device is capturing a graph (a CUDA graph; XPU's alike). Then a host
    read of x raises, and whatever it gave would be frozen into the graph, whose replays see new values."""
    device_module = getattr(torch, x.device.type, None)  # torch.cuda, torch.xpu; a CPU has no graphs to capture
    check = getattr(device_module, "is_current_stream_capturing", None)
    return check is not None and check()


class LastMaskRead:
    """What was read from the last mask tensor seen (a weak reference to it, its version and `extra`),
    so that the layers sharing one mask pay the read's host synchronisation once per forward.

    While a graph is captured (`capturing`) nothing is read and nothing remembered is used: the call
    gives `while_capturing`. A read during capture would fail, and one remembered from before it would
    be frozen into the graph while each replay fills the captured mask tensor anew.

    A CPU mask is compared with a copy of the one read, where a comparison costs no synchronisation: a
    write the version counter does not see (through `.data`, or a NumPy array sharing its memory)
    changes it too. On an accelerator only the version counter is checked."""

    def __init__(self, while_capturing: Any) -> None:
        # (key, value, copy), read and written as one object: threads sharing it (nn.DataParallel's replicas) never
        # pair one call's key with another's value
        self._last: tuple[tuple, Any, torch.Tensor | None] | None = None
        self._while_capturing = while_capturing

    def __call__(self, mask: torch.Tensor, read: Callable[[], Any], *extra: Any) -> Any:
        if capturing(mask):
            return self._while_capturing
        if mask.is_inference():  # no version counter: changed in place under inference_mode, it would look the same
            return read()
        last = self._last
        if last is None or last[0][0]() is not mask or last[0][1:] != (mask._version, *extra) or \
                (last[2] is not None and not torch.equal(last[2], mask)):
            copy = mask.detach().clone() if mask.device.type == "cpu" else None
            last = self._last = ((weakref.ref(mask), mask._version, *extra), read(), copy)
        return last[1]


def attended(attn_mask: torch.Tensor) -> torch.Tensor:
    """Where a key counts as attended for the spans: a bool mask's True, a float mask above MASKED_AT."""
    return attn_mask if attn_mask.dtype == torch.bool else attn_mask > MASKED_AT


def as_float(value: Any, bools: bool = False) -> float | None:
    """A real number as SDPA's float arguments take it (Python, NumPy, or a 0-d tensor that needs no
    gradient; a 0-d NumPy array too), as a Python float; None for anything else, for an int too large
    for a float, and for bools unless `bools` (SDPA takes Python, NumPy and 0-d tensor bools as 0 and 1
    for dropout_p and scale)."""
    if isinstance(value, torch.Tensor):
        ok = value.dim() == 0 and not value.requires_grad and not value.is_complex() and value.device.type != "meta"
        return float(value) if ok and (bools or value.dtype != torch.bool) else None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        value = value.item()  # a 0-d array; also how torch.compile passes a NumPy number
    if numpy is not None and isinstance(value, numpy.bool_):
        value = bool(value)
    if not isinstance(value, numbers.Real) or (isinstance(value, bool) and not bools):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def as_int(value: Any) -> int | None:
    """An integer as Python, NumPy or a 0-d integer tensor holds it (a 0-d NumPy array too), as a Python int;
    None for anything else: bools, and floats even when whole."""
    if isinstance(value, torch.Tensor):
        ok = value.dim() == 0 and not value.is_floating_point() and not value.is_complex() \
            and value.dtype != torch.bool and value.device.type != "meta"
        return int(value) if ok else None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        value = value.item()
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        return None
    return int(value)


def run_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype SDPA runs x in: under autocast on x's device the autocast dtype, except for float64, which
    autocast leaves as it is; else x's own."""
    device = x.device.type
    if device != "meta" and torch.is_autocast_enabled(device) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype


@dataclass(frozen=True)
class Layout:
    """How the inputs broadcast, as in SDPA: the batch dimensions (all before the heads, dim −3), the
    query heads after broadcasting, the key/value heads, and the output's shape; `dropout_p` and
    `scale` as Python floats; the dtype the attention runs in (`run_dtype`)."""

    batch: tuple[int, ...]
    h_q: int
    h_kv: int
    out_shape: tuple[int, ...]
    dropout_p: float
    scale: float | None
    dtype: torch.dtype


def check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                 dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool = False) -> Layout:
    """What every backend of `span_attention` accepts: SDPA's inputs, with an error that names the
    argument and what is allowed where SDPA gives no result. Returns the layout they broadcast to."""
    named = {"query": query, "key": key, "value": value}
    for name, x in named.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"span_attention: {name} must be a tensor, got {type(x).__name__}")
        if x.layout != torch.strided:
            raise TypeError(f"span_attention: {name} must be a dense tensor (as in SDPA), got layout {x.layout}")
        if not x.is_floating_point():
            raise ValueError(f"span_attention: {name} must be a floating-point tensor, got {x.dtype}")
        if x.dim() < 2:
            raise ValueError(f"span_attention: {name} must have at least 2 dimensions (…, sequence, head dim), "
                             f"got shape {tuple(x.shape)}")
    if len({x.device for x in named.values()}) > 1:
        raise ValueError(f"span_attention: query, key and value must be on one device, got {query.device}, "
                         f"{key.device}, {value.device}")
    dtypes = [run_dtype(x) for x in named.values()]
    if len(set(dtypes)) > 1:
        cast = [x.dtype for x in named.values()] != dtypes
        raise ValueError(f"span_attention: query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}" + (f" (under autocast {', '.join(map(str, dtypes))})" if cast else ""))
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"span_attention: query and key must have the same head dim (last dimension), got "
                         f"{query.shape[-1]} and {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"span_attention: key and value must have the same sequence length (dimension −2), "
                         f"got {key.shape[-2]} and {value.shape[-2]}")
    numbers_as = "a Python or NumPy number within a float's range or bool, or a 0-d tensor that needs no gradient"
    p = as_float(dropout_p, bools=True)
    if p is None:
        raise TypeError(f"span_attention: dropout_p must be a float ({numbers_as}), got {_kind(dropout_p)}")
    if not 0 <= p <= 1:
        raise ValueError(f"span_attention: dropout_p must be a probability in [0, 1], got {shown(dropout_p)}")
    scale_f = None if scale is None else as_float(scale, bools=True)
    if scale is not None:
        if scale_f is None:
            raise TypeError(f"span_attention: scale must be a float ({numbers_as}) or None, got {_kind(scale)}")
        if not math.isfinite(scale_f):  # rows of 0 on the CPU's flash kernel, NaN on the math kernel; NaN gradients
            raise ValueError(f"span_attention: scale must be a finite number or None (1/√head dim), got {scale_f}: "
                             f"SDPA's kernels give different outputs for it and NaN gradients")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"span_attention: {name} must be True or False (as in SDPA), got {_kind(flag)}")
    heads = lambda x: x.shape[-3] if x.dim() > 2 else 1  # noqa: E731
    try:
        batch = tuple(torch.broadcast_shapes(*(x.shape[:-3] for x in named.values())))
        h_kv = torch.broadcast_shapes((heads(key),), (heads(value),))[0]
    except RuntimeError:
        raise ValueError(f"span_attention: query, key and value must broadcast in their batch dimensions (all "
                         f"before dimension −3), and key and value in their heads (dimension −3), got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}") from None
    h_q = heads(query) if heads(query) != 1 else h_kv  # one query head broadcasts over the key/value heads
    if (h_kv == 0 and h_q > 0) or (h_kv > 0 and h_q % h_kv):
        raise ValueError(f"span_attention: query heads ({h_q}) must be a multiple of key/value heads ({h_kv})")
    t, s = query.shape[-2], key.shape[-2]
    full = (*batch, h_q, t, s)
    if max(x.dim() for x in named.values()) > 2:
        out_shape = (*batch, h_q, t, value.shape[-1])
    else:
        out_shape = (t, value.shape[-1])
    if attn_mask is not None:
        if is_causal:
            raise ValueError("span_attention: pass either attn_mask or is_causal=True, not both (as in SDPA)")
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"span_attention: attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.layout != torch.strided:
            raise TypeError(f"span_attention: attn_mask must be a dense tensor (as in SDPA), got layout "
                            f"{attn_mask.layout}")
        allowed = {torch.bool, torch.float32, query.dtype, dtypes[0]}
        cast = attn_mask.is_floating_point() and run_dtype(attn_mask) == dtypes[0]  # by autocast, as for SDPA
        if attn_mask.dtype not in allowed and not cast:
            raise ValueError(f"span_attention: attn_mask must be bool (True = attend) or an additive float mask in "
                             f"{' or '.join(sorted({str(d) for d in allowed - {torch.bool}}))}, "
                             f"got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"span_attention: attn_mask must be on the query's device ({query.device}), "
                             f"got {attn_mask.device}")
        if attn_mask.dim() < 2 or not _broadcasts_to(tuple(attn_mask.shape), full):
            raise ValueError(f"span_attention: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(batch…, heads, T, S) = {full}")
    return Layout(batch, h_q, h_kv, out_shape, p, scale_f, dtypes[0])


def _kind(value: Any) -> str:
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    return f"{shown(value, 60)} ({name})"


def _broadcasts_to(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    return len(shape) <= len(full) and all(a in (1, b) for a, b in zip(reversed(shape), reversed(full)))


def broadcast_inputs(layout: Layout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """query (B, H_q, T, d), key and value (B, H_kv, S, ·) and the mask in at most 4 dimensions, the
    batch dimensions broadcast and flattened into B. Expanded before the autograd function, so that
    the gradients of a broadcast input sum over what it was broadcast to."""
    b = math.prod(layout.batch)

    def flat(x: torch.Tensor, heads: int) -> torch.Tensor:
        x = x.reshape((1,) * max(0, 3 - x.dim()) + tuple(x.shape))
        return x.expand(*layout.batch, heads, *x.shape[-2:]).reshape(b, heads, *x.shape[-2:])

    if attn_mask is not None and len(layout.batch) != 1:
        mask = attn_mask.reshape((1,) * (len(layout.batch) + 3 - attn_mask.dim()) + tuple(attn_mask.shape))
        attn_mask = mask.expand(*layout.batch, *mask.shape[-3:]).reshape(b, *mask.shape[-3:])
    return flat(query, layout.h_q), flat(key, layout.h_kv), flat(value, layout.h_kv), attn_mask
