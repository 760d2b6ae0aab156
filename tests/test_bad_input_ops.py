"""span_attention on bad input and faults, one table: each case gives SDPA's result (forward, and
the gradients at score:1111, the exact reading, which is SDPA's gradient) or a clear error.

Rows that attend no key under a finite mask (all at or below MASKED_AT) give SDPA's forward and
dV, and the dQ, dK of the equivalent bool mask: the case names that mask as `grads_as`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_engine import LABELS
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_spanattn import SpanAttentionConfig, span_attention
from hf_spanattn.ops.inputs import MASKED_AT

SDPA = "matches SDPA"
QKV = ("query", "key", "value")
EXACT = SpanAttentionConfig.from_label("score:1111")
F64_MIN = torch.finfo(torch.float64).min


def qkv(b=2, h_q=2, h_kv=2, t=6, d=4, d_v=None, dtype=torch.float64, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h_q, t, d), (b, h_kv, t, d), (b, h_kv, t, d if d_v is None else d_v)]
    return dict(zip(("query", "key", "value"), (torch.randn(s, generator=gen, dtype=dtype) for s in shapes)))


def with_(x: dict, **changes) -> dict:
    return {**x, **changes}


def poke(name: str, index: tuple, value: float) -> dict:
    x = qkv()
    x[name][index] = value
    return x


def left_padding(fill: float | None) -> torch.Tensor:
    """Causal with sequence 0 left-padded by 2: its rows 0, 1 attend nothing. Bool for fill None."""
    attend = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    attend[0, ..., :2] = False
    if fill is None:
        return attend
    return torch.zeros(attend.shape, dtype=torch.float64).masked_fill_(~attend, fill)


def finite_padding(fill: float, dtype: torch.dtype = torch.float64) -> dict:
    """Left padding under a finite additive mask; the gradients expected are those of the bool mask."""
    return with_(qkv(), attn_mask=left_padding(fill).to(dtype), grads_as=left_padding(None))


def nan_at(mask: torch.Tensor, index: tuple) -> torch.Tensor:
    mask[index] = float("nan")
    return mask


def moved(x: dict, name: str, device: str) -> dict:
    return with_(x, **{name: x[name].to(device)})


CASES: dict[str, tuple[Callable[[], dict], object]] = {
    # faults in the data: NaN/inf gradients where SDPA has them, never an exception
    "nan_in_key": (lambda: poke("key", (0, 1, 2, 0), float("nan")), SDPA),
    "inf_in_key": (lambda: poke("key", (1, 0, 4, 3), float("inf")), SDPA),
    "nan_in_value": (lambda: poke("value", (1, 1, 0, 2), float("nan")), SDPA),
    "inf_in_value": (lambda: poke("value", (0, 0, 3, 1), float("-inf")), SDPA),
    "nan_in_query": (lambda: poke("query", (0, 0, 5, 0), float("nan")), SDPA),
    # rows that attend nothing: 0 under bool and −inf, the softmax of equal values otherwise
    "dead_rows_bool": (lambda: with_(qkv(), attn_mask=left_padding(None)), SDPA),
    "dead_rows_minus_inf": (lambda: with_(qkv(), attn_mask=left_padding(float("-inf"))), SDPA),
    "dead_rows_finfo_min": (lambda: finite_padding(F64_MIN), SDPA),
    "dead_rows_at_threshold": (lambda: finite_padding(MASKED_AT), SDPA),
    "dead_rows_minus_1e9": (lambda: finite_padding(-1e9), SDPA),
    # a NaN in the mask makes its row NaN, also where the whole row is NaN (no key counts as attended)
    "nan_row_in_mask": (lambda: with_(qkv(), attn_mask=nan_at(left_padding(0.0), (..., 3, slice(None)))), SDPA),
    "nan_in_mask": (lambda: with_(qkv(), attn_mask=nan_at(left_padding(float("-inf")), (1, 0, 4, 2))), SDPA),
    "float32_mask_on_float64": (lambda: finite_padding(-1e9, torch.float32), SDPA),
    # broadcasting as SDPA
    "key_value_batch_1": (lambda: with_(qkv(), key=qkv()["key"][:1], value=qkv()["value"][:1]), SDPA),
    "query_batch_1": (lambda: with_(qkv(), query=qkv()["query"][:1]), SDPA),
    "key_batch_1_value_batch_2": (lambda: with_(qkv(), key=qkv()["key"][:1]), SDPA),
    "query_one_head": (lambda: qkv(h_q=1, h_kv=3), SDPA),
    "inputs_3d": (lambda: {k: x[0] for k, x in qkv().items()}, SDPA),
    "inputs_2d": (lambda: {k: x[0, 0] for k, x in qkv().items()}, SDPA),
    "query_3d_key_value_4d": (lambda: with_(qkv(), query=qkv()["query"][0]), SDPA),
    "inputs_5d_broadcast": (lambda: with_({k: x[None] for k, x in qkv().items()},
                                          query=qkv()["query"][None].expand(3, -1, -1, -1, -1),
                                          attn_mask=left_padding(None)[None]), SDPA),
    "mask_5d_per_batch": (lambda: with_({k: x.expand(3, *x.shape) for k, x in qkv().items()},
                                        attn_mask=torch.rand(3, 2, 1, 6, 6, generator=torch.Generator().manual_seed(1))
                                        > 0.3), SDPA),
    "gqa": (lambda: qkv(h_q=4, h_kv=2), SDPA),
    "gqa_mask_hides_everything": (lambda: with_(qkv(h_q=4, h_kv=2), attn_mask=torch.zeros(6, 6, dtype=torch.bool)),
                                  SDPA),
    "value_head_dim_differs": (lambda: qkv(d_v=7), SDPA),
    "mask_key_padding_only": (lambda: with_(qkv(), attn_mask=left_padding(None)[:, :, -1:]), SDPA),
    # a mask that broadcasts over the keys: a bias per query row, or whole rows masked
    "mask_per_row_float": (lambda: with_(qkv(), attn_mask=torch.randn(2, 1, 6, 1, dtype=torch.float64)), SDPA),
    "mask_per_row_bool": (lambda: with_(qkv(), attn_mask=torch.tensor([True, False] * 3).view(1, 1, 6, 1)), SDPA),
    # empty sizes and no data
    "no_queries": (lambda: with_(qkv(), query=qkv()["query"][:, :, :0]), SDPA),
    "no_keys": (lambda: with_(qkv(), key=qkv()["key"][:, :, :0], value=qkv()["value"][:, :, :0]), SDPA),
    "no_queries_no_keys": (lambda: qkv(t=0), SDPA),
    "no_value_columns": (lambda: qkv(d_v=0), SDPA),
    "no_value_columns_causal": (lambda: with_(qkv(d_v=0), is_causal=True), SDPA),
    "empty_batch": (lambda: qkv(b=0), SDPA),
    "all_on_meta": (lambda: {k: x.to("meta") for k, x in qkv().items()}, SDPA),
    "dropout_one": (lambda: with_(qkv(), dropout_p=1.0), SDPA),
    # numbers of other types, as SDPA takes them
    "dropout_numpy_float32": (lambda: with_(qkv(), dropout_p=np.float32(0.0)), SDPA),
    "dropout_numpy_int": (lambda: with_(qkv(), dropout_p=np.int64(0)), SDPA),
    "dropout_0d_tensor": (lambda: with_(qkv(), dropout_p=torch.tensor(0.0)), SDPA),
    "scale_numpy_float32": (lambda: with_(qkv(), scale=np.float32(0.3)), SDPA),
    "scale_numpy_int": (lambda: with_(qkv(), scale=np.int64(2)), SDPA),
    "scale_0d_tensor": (lambda: with_(qkv(), scale=torch.tensor(0.3, dtype=torch.float64)), SDPA),
    "scale_0d_int_tensor": (lambda: with_(qkv(), scale=torch.tensor(1)), SDPA),
    # bools as SDPA takes them (0 and 1)
    "scale_a_bool": (lambda: with_(qkv(), scale=True), SDPA),
    "scale_false": (lambda: with_(qkv(), scale=False, is_causal=True), SDPA),
    "scale_numpy_bool": (lambda: with_(qkv(), scale=np.bool_(True)), SDPA),
    "scale_0d_bool_tensor": (lambda: with_(qkv(), scale=torch.tensor(True)), SDPA),
    "dropout_a_bool": (lambda: with_(qkv(), dropout_p=True), SDPA),
    "dropout_false": (lambda: with_(qkv(), dropout_p=False), SDPA),
    "dropout_numpy_bool": (lambda: with_(qkv(), dropout_p=np.bool_(False)), SDPA),
    "dropout_0d_bool_tensor": (lambda: with_(qkv(), dropout_p=torch.tensor(False)), SDPA),
    # scales that are not positive: SDPA's math kernel (the CPU's flash kernel has NaN rows under
    # is_causal with a scale ≤ 0)
    "scale_zero_causal": (lambda: with_(qkv(), scale=0.0, is_causal=True), SDPA),
    "scale_minus_zero_causal": (lambda: with_(qkv(), scale=-0.0, is_causal=True), SDPA),
    "scale_negative_causal": (lambda: with_(qkv(), scale=-0.7, is_causal=True), SDPA),
    "scale_negative_padding": (lambda: with_(qkv(), scale=-0.7, attn_mask=left_padding(None)), SDPA),
    # clear errors
    "key_on_meta": (lambda: moved(qkv(), "key", "meta"), (ValueError, "one device")),
    "query_on_meta": (lambda: moved(qkv(), "query", "meta"), (ValueError, "one device")),
    "mask_on_meta": (lambda: with_(qkv(), attn_mask=left_padding(None).to("meta")), (ValueError, "attn_mask.*device")),
    "dropout_negative": (lambda: with_(qkv(), dropout_p=-0.1), (ValueError, r"dropout_p.*\[0, 1\]")),
    "dropout_above_one": (lambda: with_(qkv(), dropout_p=1.5), (ValueError, r"dropout_p.*\[0, 1\]")),
    "dropout_nan": (lambda: with_(qkv(), dropout_p=float("nan")), (ValueError, r"dropout_p.*\[0, 1\]")),
    "int_mask": (lambda: with_(qkv(), attn_mask=torch.ones(6, 6, dtype=torch.int64)), (ValueError, "attn_mask.*bool")),
    "float16_mask_on_float64": (lambda: with_(qkv(), attn_mask=torch.zeros(6, 6, dtype=torch.float16)),
                                (ValueError, "attn_mask.*float32")),
    "mask_wrong_shape": (lambda: with_(qkv(), attn_mask=torch.ones(3, 1, 6, 6, dtype=torch.bool)),
                         (ValueError, r"attn_mask of shape \(3, 1, 6, 6\).*\(2, 2, 6, 6\)")),
    "mask_1d": (lambda: with_(qkv(), attn_mask=torch.ones(6, dtype=torch.bool)), (ValueError, "attn_mask of shape")),
    "mask_too_many_dims": (lambda: with_(qkv(), attn_mask=torch.ones(2, 2, 2, 6, 6, dtype=torch.bool)),
                           (ValueError, "attn_mask of shape")),
    "mask_and_causal": (lambda: with_(qkv(), attn_mask=left_padding(None), is_causal=True), (ValueError, "not both")),
    "head_dims_differ": (lambda: with_(qkv(), key=qkv(d=3)["key"]), (ValueError, "head dim")),
    "key_value_lengths_differ": (lambda: with_(qkv(), value=qkv(t=5)["value"]), (ValueError, "sequence length")),
    "one_dimensional": (lambda: {k: x[0, 0, 0] for k, x in qkv().items()}, (ValueError, "at least 2 dimensions")),
    "int_inputs": (lambda: {k: x.long() for k, x in qkv().items()}, (ValueError, "query must be a floating-point")),
    "sparse_key": (lambda: with_(qkv(), key=qkv()["key"].to_sparse()),
                   (TypeError, "key must be a dense tensor.*sparse_coo")),
    "sparse_mask": (lambda: with_(qkv(), attn_mask=left_padding(0.0).to_sparse()),
                    (TypeError, "attn_mask must be a dense tensor.*sparse_coo")),
    "dtypes_differ": (lambda: with_(qkv(), key=qkv()["key"].float()), (ValueError, "share a dtype")),
    "heads_not_a_multiple": (lambda: qkv(h_q=3, h_kv=2), (ValueError, "multiple")),
    "batches_do_not_broadcast": (lambda: with_(qkv(), key=qkv(b=3)["key"], value=qkv(b=3)["value"]),
                                 (ValueError, "broadcast")),
    "scale_not_a_number": (lambda: with_(qkv(), scale="0.5"), (TypeError, "scale")),
    "scale_needs_grad": (lambda: with_(qkv(), scale=torch.tensor(0.5, requires_grad=True)),
                         (TypeError, "scale must be a float.*0-d tensor that needs no gradient")),
    "scale_1d_tensor": (lambda: with_(qkv(), scale=torch.tensor([0.5])), (TypeError, "scale must be a float")),
    # scales SDPA's kernels disagree on (rows of 0 on the CPU's flash kernel, NaN on the math kernel)
    "scale_nan": (lambda: with_(qkv(), scale=float("nan")), (ValueError, "scale must be a finite number or None.*nan")),
    "scale_numpy_nan": (lambda: with_(qkv(), scale=np.float32("nan"), is_causal=True), (ValueError, "scale.*finite")),
    "scale_0d_nan_tensor": (lambda: with_(qkv(), scale=torch.tensor(float("nan"))), (ValueError, "scale.*finite")),
    "scale_inf": (lambda: with_(qkv(), scale=float("inf")), (ValueError, "scale must be a finite number.*inf")),
    "scale_minus_inf_causal": (lambda: with_(qkv(), scale=-float("inf"), is_causal=True), (ValueError, "scale.*-inf")),
    "scale_too_large_an_int": (lambda: with_(qkv(), scale=10**400),
                               (TypeError, r"scale must be a float.*range.*\(int\)")),
    "scale_1d_numpy_array": (lambda: with_(qkv(), scale=np.array([0.5])), (TypeError, "scale must.*ndarray")),
    "dropout_too_large_an_int": (lambda: with_(qkv(), dropout_p=10**400), (TypeError, r"dropout_p must be a float")),
    "dropout_a_string": (lambda: with_(qkv(), dropout_p="0.1"), (TypeError, "dropout_p must be a float")),
    "dropout_numpy_above_one": (lambda: with_(qkv(), dropout_p=np.float32(1.5)), (ValueError, r"dropout_p.*\[0, 1\]")),
    "is_causal_an_int": (lambda: with_(qkv(), is_causal=1), (TypeError, r"is_causal must be True or False.*1 \(int\)")),
    "is_causal_none": (lambda: with_(qkv(), is_causal=None), (TypeError, "is_causal must be True or False")),
    "is_causal_numpy_bool": (lambda: with_(qkv(), is_causal=np.bool_(True)),
                             (TypeError, r"is_causal must be True or False.*numpy\.bool")),
    "enable_gqa_a_string": (lambda: with_(qkv(), enable_gqa="yes"), (TypeError, "enable_gqa must be True or False")),
}


def sdpa(kwargs: dict) -> torch.Tensor:
    q, k = kwargs["query"], kwargs["key"]
    heads = lambda x: x.shape[-3] if x.dim() > 2 else 1  # noqa: E731
    gqa = heads(q) > 1 and heads(k) > 1 and heads(q) != heads(k)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(**kwargs, enable_gqa=gqa)


def blocks_not_finite(g: torch.Tensor) -> torch.Tensor:
    """Per (batch…, head): whether the block holds NaN or inf."""
    return ~torch.isfinite(g).flatten(-2).all(dim=-1) if g.dim() > 1 else ~torch.isfinite(g)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name):
    build, expected = CASES[name]
    kwargs = build()
    if expected != SDPA:
        error, match = expected
        for grad in (False, True):  # the same error with or without autograd
            if grad:
                kwargs = {k: x.requires_grad_(True) if k in ("query", "key", "value") and x.is_floating_point() else x
                          for k, x in kwargs.items()}
            with pytest.raises(error, match=match):
                span_attention(**kwargs, config=EXACT)
        return
    grads_as = kwargs.pop("grads_as", None)
    leaves = {k: x.detach().clone().requires_grad_(True) if k in ("query", "key", "value") else x
              for k, x in kwargs.items()}
    out = span_attention(**leaves, config=EXACT)
    expected_out = sdpa(leaves)
    assert out.shape == expected_out.shape and out.dtype == expected_out.dtype
    if out.device.type == "meta":
        return
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12, equal_nan=True)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    inputs = [leaves[k] for k in ("query", "key", "value")]
    grads = torch.autograd.grad(out, inputs, d_out)
    expected_grads = torch.autograd.grad(expected_out, inputs, d_out)
    if grads_as is not None:
        bool_grads = torch.autograd.grad(sdpa({**leaves, "attn_mask": grads_as}), inputs, d_out)
        expected_grads = (*bool_grads[:2], expected_grads[2])
    for g, e in zip(grads, expected_grads):
        assert g.shape == e.shape
        bad = blocks_not_finite(e)
        assert torch.equal(blocks_not_finite(g), bad)  # NaN/inf where SDPA's are, in the same (batch, head)
        keep = (~bad)[..., None, None] if g.dim() > 1 else ~bad
        torch.testing.assert_close(torch.where(keep, g, 0), torch.where(keep, e, 0), rtol=1e-9, atol=1e-11)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("label", ["score:1100@per_block", "reductionistic:1100", "score:0.5,2,0,1.5"])
@pytest.mark.parametrize("fill", [MASKED_AT, -1e9, "min", float("-inf")])
@pytest.mark.parametrize("kind", ["left_padding_causal", "key_padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float_padding_masks_give_the_bool_masks_gradients(label, fill, kind, dtype):
    """Older code's additive padding masks, with padded positions carrying no loss."""
    config = SpanAttentionConfig.from_label(label)
    x = qkv(b=3, h_q=4, h_kv=2, t=9, d=3, dtype=dtype, seed=2)
    valid = torch.arange(9)[None, :] >= torch.tensor([0, 4, 7])[:, None]  # left padding by 0, 4, 7
    attend = valid[:, None, None, :]
    if kind == "left_padding_causal":
        attend = attend & torch.ones(9, 9, dtype=torch.bool).tril()
    fill = torch.finfo(dtype).min if fill == "min" else fill
    additive = torch.zeros(attend.shape, dtype=dtype).masked_fill_(~attend, fill)
    d_out = torch.randn(3, 4, 9, 3, generator=torch.Generator().manual_seed(3), dtype=dtype)
    d_out = d_out * attend.any(-1, keepdim=True)
    results = []
    for mask in (attend, additive):
        leaves = [t.clone().requires_grad_(True) for t in x.values()]
        out = span_attention(*leaves, attn_mask=mask, config=config)
        results.append((out, torch.autograd.grad(out, leaves, d_out)))
    (out_bool, grads_bool), (out_float, grads_float) = results
    rows = attend.any(-1, keepdim=True)  # the forward differs (as SDPA's) only in rows that attend nothing
    assert rel(out_float * rows, out_bool) < 1e-6
    for name, g, e in zip("qkv", grads_float, grads_bool):
        assert rel(g, e) < 1e-5, name


def _learnable_mask_case(shape: tuple[int, ...], h_kv: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Float64 q, k, v (B = 3, 4 query heads, T = 5) and a learnable bias of `shape`, with some
    entries masked (−inf) and one query row of batch 0 masked at −1e5 (it attends no key)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(3, heads, 5, 4, generator=gen, dtype=torch.float64) for heads in (4, h_kv, h_kv)]
    bias = 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
    if shape[-1] > 1:
        bias = bias.masked_fill(torch.rand(shape, generator=gen) < 0.2, float("-inf"))
        bias[..., 0] = 0.0  # every row keeps a key
    if len(shape) == 4 and shape[-2] > 1:
        bias[0, ..., 2, :] = -1e5
    return inputs, bias


MASK_SHAPES = [(3, 1, 5, 5), (1, 4, 5, 5), (5, 5), (3, 4, 5, 5), (3, 1, 1, 5), (1, 1, 5, 1)]


@pytest.mark.parametrize("backend", ["tiles", "fused"])
@pytest.mark.parametrize("label", LABELS)
def test_learnable_mask_gets_sdpas_gradient(label, backend):
    """∂L/∂mask is SDPA's (∂L/∂S without the factor scale, summed over what the mask broadcasts
    over, query heads of a key/value head included), whatever the rule; the forward too."""
    config = SpanAttentionConfig.from_label(label)
    dtype, tol = (torch.float64, 1e-10) if backend == "tiles" else (torch.float32, 1e-5)
    index = LABELS.index(label)  # every shape, with and without GQA, over the labels
    cases = [(MASK_SHAPES[(index + i) % len(MASK_SHAPES)], 2 if (index + i) % 2 else 4) for i in range(2)]
    if label in ("score:1100", "score:1100@per_block", "standard:QKV101"):
        cases = [(shape, h_kv) for shape in MASK_SHAPES for h_kv in (4, 2)]
    for seed, (shape, h_kv) in enumerate(cases):
        inputs, bias = _learnable_mask_case(shape, h_kv, seed)
        d_out = torch.randn(3, 4, 5, 4, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        bias_leaf = bias.to(dtype).requires_grad_(True)  # SDPA in the same dtype: it rounds −1e5 + S alike
        expected = F.scaled_dot_product_attention(*(x.to(dtype) for x in inputs), attn_mask=bias_leaf,
                                                  enable_gqa=h_kv != 4)
        (expected_grad,) = torch.autograd.grad(expected, bias_leaf, d_out)
        leaves = [x.to(dtype).requires_grad_(True) for x in (*inputs, bias)]
        out = span_attention(*leaves[:3], attn_mask=leaves[3], config=config, backend=backend)
        (grad,) = torch.autograd.grad(out, leaves[3], d_out)
        assert grad.shape == bias.shape and grad.dtype == dtype
        for got, want in ((out, expected), (grad, expected_grad)):  # a bias per row has gradient 0: absolute
            assert (got - want).abs().max() <= tol * max(1.0, want.abs().max().item()), (shape, h_kv)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_learnable_mask_under_full_dropout_gets_sdpas_zero_gradient(backend):
    inputs, bias = _learnable_mask_case((3, 1, 5, 5), 4, 0)
    leaves = [x.float().requires_grad_(True) for x in (*inputs, bias)]
    out = span_attention(*leaves[:3], attn_mask=leaves[3], dropout_p=1.0, config=EXACT, backend=backend)
    out.sum().backward()
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(leaves[3].grad, torch.zeros_like(bias).float())


def half_extremes(dtype: torch.dtype, seed: int = 0, size: float = 300.0) -> list[torch.Tensor]:
    """q, k, v in `dtype` whose scores at scale 1 pass float16's range (65504) by a common part of
    size² while differing by a few units: the softmax is not saturated, the gradients are not 0."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3))
    q[..., 0], k[..., 0] = size, size
    return [x.to(dtype) for x in (q, k, v)]


@pytest.mark.parametrize(("label", "backend", "probe"), [
    ("score:1111", "tiles", False), ("score:1111", "fused", False), ("score:1000", "tiles", True),
    ("score:1000", "fused", False), ("score:1100@per_block", "tiles", False), ("score:1100@per_block", "fused", False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_scores_beyond_the_half_range_are_sdpas(dtype, label, backend, probe):
    """Scores and softmax in float32 for half inputs, as SDPA: finite, and SDPA's output. The
    gradients are finite, and as close to the rule's float32 gradients on the same inputs as SDPA's
    half gradients are to its float32 ones (or within 4 ulp of the dtype)."""
    config = SpanAttentionConfig.from_label(label)
    inputs = half_extremes(dtype)
    d_out = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
    seen = []
    kwargs = dict(is_causal=True, scale=1.0, config=config, backend=backend,
                  probe=seen.append if probe else None)
    out, grads = _run(inputs, d_out, span_attention, **kwargs)
    sdpa_out, sdpa_grads = _run(inputs, d_out, F.scaled_dot_product_attention, is_causal=True, scale=1.0)
    tol = 4 * torch.finfo(dtype).eps
    assert torch.isfinite(out).all() and rel(out, sdpa_out) < tol
    # the same inputs in float32: the rule's gradients, and how far SDPA's half gradients are from its own
    _, wide_grads = _run([x.float() for x in inputs], d_out.float(), span_attention,
                         **dict(kwargs, backend="tiles", probe=None))
    _, wide_sdpa_grads = _run([x.float() for x in inputs], d_out.float(), F.scaled_dot_product_attention,
                              is_causal=True, scale=1.0)
    for g, e, w, we in zip(grads, sdpa_grads, wide_grads, wide_sdpa_grads):
        assert torch.isfinite(g).all()
        assert rel(g, w) < max(2 * rel(e, we), tol)
    if probe:
        assert seen and all(torch.isfinite(x).all() for x in seen[0]["dq_orders"])


def _run(inputs, d_out, fn, **kwargs):
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves, **kwargs)
    return out, torch.autograd.grad(out, leaves, d_out)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
@pytest.mark.parametrize("label", ["score:1000", "simple:10", "score:1100@per_block", "standard:QKV101"])
def test_second_derivative_says_it_is_not_supported(label, backend):
    """create_graph=True gives the first-order gradients as without it; differentiating them again
    raises an error that names span_attention and what to use instead."""
    config = SpanAttentionConfig.from_label(label)
    inputs, bias = _learnable_mask_case((3, 1, 5, 5), 2, 0)
    leaves = [x.float().requires_grad_(True) for x in inputs]
    out = span_attention(*leaves, attn_mask=bias.float(), config=config, backend=backend)
    plain = torch.autograd.grad(out.square().sum(), leaves, retain_graph=True)
    grads = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    for g, p in zip(grads, plain):
        torch.testing.assert_close(g, p, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"span_attention: a second derivative.*standard:QKV111.*MATH"):
        sum(g.square().sum() for g in grads).backward()


@pytest.mark.parametrize("backend", ["tiles", "fused"])
@pytest.mark.parametrize("label", ["score:1111", "score:1000"])
def test_second_derivative_with_respect_to_what_made_the_inputs_says_it_is_not_supported(label, backend):
    """A Hessian-vector product taken with torch.autograd.grad(..., inputs=weights) of weights that make q, k
    and v (as influence functions take it over a model's parameters) raises, rather than leaving attention's
    second derivative out without a word."""
    config = SpanAttentionConfig.from_label(label)
    gen, dtype = torch.Generator().manual_seed(0), torch.float64 if backend == "tiles" else torch.float32
    x = torch.randn(2, 2, 5, 4, generator=gen, dtype=dtype)
    weights = [torch.randn(4, 4, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3)]
    out = span_attention(*(x @ w for w in weights), is_causal=True, config=config, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), weights, create_graph=True)
    with pytest.raises(RuntimeError, match=r"span_attention: a second derivative"):
        torch.autograd.grad(sum(g.square().sum() for g in grads), weights)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_batched_gradients_say_they_are_not_supported(backend):
    """is_grads_batched=True (jacobian and hessian with vectorize=True) raises, naming what to use instead,
    where vmap's "Batching rule not implemented for aten::…" named none of it."""
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    out = span_attention(q, k, v, is_causal=True, config=SpanAttentionConfig.from_label("score:1000"),
                         backend=backend)
    eye = torch.eye(out.numel()).reshape(-1, *out.shape)
    with pytest.raises(RuntimeError, match=r"span_attention: batched gradients .*is_grads_batched.*vectorize=False"):
        torch.autograd.grad(out, (q, k, v), eye, is_grads_batched=True)


SCALES = {"zero": 0.0, "minus_zero": -0.0, "negative": -0.7, "large": 1e20,
          "true": True, "false": False, "numpy_bool": np.bool_(True), "bool_tensor": torch.tensor(False),
          "half_tensor": torch.tensor(0.3, dtype=torch.float16), "int": 3, "numpy_float": np.float64(0.4),
          "tiny": 1e-30}


@pytest.mark.parametrize("backend", ["tiles", "fused"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("name", list(SCALES))
def test_every_scale_sdpa_takes_gives_sdpas_result(name, is_causal, backend):
    """On each CPU backend, with and without autograd: SDPA's math kernel's output and (at score:1111)
    gradients, NaN in the same (batch, head) blocks where they are NaN."""
    scale = SCALES[name]
    inputs = list(qkv(dtype=torch.float32).values())
    d_out = torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(7))
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=scale)
    expected_grads = torch.autograd.grad(expected, leaves, d_out)
    with torch.no_grad():
        plain = span_attention(*inputs, is_causal=is_causal, scale=scale, config=EXACT, backend=backend)
    out = span_attention(*leaves, is_causal=is_causal, scale=scale, config=EXACT, backend=backend)
    grads = torch.autograd.grad(out, leaves, d_out)
    for got, want in ((plain, expected), (out, expected), *zip(grads, expected_grads)):
        bad = blocks_not_finite(want)
        assert torch.equal(blocks_not_finite(got), bad)
        keep = (~bad)[..., None, None]
        torch.testing.assert_close(torch.where(keep, got, 0), torch.where(keep, want, 0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value", ["", " ", "TILES", " tiles\n", "Auto"])
def test_backend_variable_as_a_shell_leaves_it(monkeypatch, value):
    """HF_SPANATTN_BACKEND empty (`HF_SPANATTN_BACKEND= python ...`), in capitals or with spaces means what it says, as
    HF_SPANATTN_TRITON_TUNE does: the gradients of the tiles (it was refused as an unknown backend)."""
    q, k, v = (t.requires_grad_() for t in qkv().values())
    monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    want = torch.autograd.grad(span_attention(q, k, v, config="score:1100").sum(), (q, k, v))
    monkeypatch.setenv("HF_SPANATTN_BACKEND", value)
    got = torch.autograd.grad(span_attention(q, k, v, config="score:1100").sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unknown_backend_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "cuda")
    q, k, v = (t.requires_grad_() for t in qkv().values())
    with pytest.raises(ValueError, match=r"environment variable HF_SPANATTN_BACKEND='cuda': allowed values are auto, "
                                         "tiles, fused, triton"):
        span_attention(q, k, v).sum().backward()


def test_fused_for_float64_set_by_the_environment_names_the_variable(monkeypatch):
    """HF_SPANATTN_BACKEND=fused and float64 inputs, no backend argument: the error says where 'fused' came from (it
    spoke of a backend='fused' the caller never passed)."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "fused")
    with pytest.raises(ValueError, match=r"backend='fused' \(set by the environment variable HF_SPANATTN_BACKEND\) "
                                         "runs float32 and half inputs"):
        span_attention(*[t.requires_grad_() for t in qkv().values()])


@pytest.mark.parametrize("backend", ["TILES", "math", None, ["tiles"], "fused"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_bad_backend_is_refused_with_or_without_autograd(backend, grad):
    """As in evaluation as in training: a name that is not a backend, and fused for float64."""
    x = [t.requires_grad_(grad) for t in qkv().values()]  # float64
    with pytest.raises(ValueError, match=r"backend=.*allowed values are auto, tiles, fused|backend=.fused. runs"):
        span_attention(*x, is_causal=True, backend=backend)


def test_numpy_numbers_under_torch_compile_are_taken_as_sdpa_takes_them():
    """torch.compile passes a NumPy number as a 0-d array: scale and dropout_p take it (SDPA's result)."""
    torch._dynamo.reset()
    inputs = [x.float() for x in qkv().values()]
    call = dict(is_causal=True, scale=np.float32(0.3), dropout_p=np.bool_(False))
    fn = torch.compile(lambda *x: span_attention(*x, **call, config=EXACT), backend="eager")
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    expected_leaves = [x.clone().requires_grad_(True) for x in inputs]
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*expected_leaves, **call)
    for got, want in ((out, expected), *zip(grads, torch.autograd.grad(expected.sum(), expected_leaves))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(span_attention(*inputs, scale=np.array(0.3), config=EXACT),
                               span_attention(*inputs, scale=0.3, config=EXACT), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's vmap of SDPA's CPU kernel
@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap_of_grad", "backward_through_vmap"])
def test_torch_func_transforms_say_span_gradients_need_autograd(transform):
    """torch.func's grad, vjp, a vmapped grad and a vmap of inputs that need a gradient, taken by autograd
    outside it (the wrapper says it needs none): an error that names span_attention and what to use instead,
    not SDPA's gradient in place of the rule's; with the standard rule (SDPA itself) and without gradients
    (vmap alone), SDPA's result."""
    import torch.func as tf

    q, k, v = (x.float() for x in qkv().values())
    transforms = {"grad": lambda f: tf.grad(lambda q: f(q).sum())(q),
                  "vjp": lambda f: tf.vjp(f, q)[1](torch.ones(2, 2, 6, 4))[0],
                  "vmap_of_grad": lambda f: tf.vmap(tf.grad(lambda q: f(q[None]).sum()))(q),
                  "backward_through_vmap": lambda f: torch.autograd.grad(
                      tf.vmap(lambda q: f(q[None]))(q_leaf).sum(), q_leaf)[0]}
    q_leaf = q.detach().requires_grad_()
    run_ = transforms[transform]
    with pytest.raises(RuntimeError, match=r"span_attention: span gradients do not run under torch\.func.*autograd"):
        run_(lambda q: span_attention(q, k, v, is_causal=True))
    standard = run_(lambda q: span_attention(q, k, v, is_causal=True, config="standard:QKV111"))
    torch.testing.assert_close(standard, run_(lambda q: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
    torch.testing.assert_close(tf.vmap(lambda q: span_attention(q, k[0], v[0], is_causal=True))(q),
                               F.scaled_dot_product_attention(q, k[0], v[0], is_causal=True))


@pytest.mark.parametrize("scale", [3e4, -1e5, 1e6])
@pytest.mark.parametrize("label", ["score:1111", "score:1000", "score:1100@per_block", "standard:QKV101"])
def test_float16_with_a_scale_past_the_half_range_is_sdpas_on_the_tiles(label, scale):
    """scale·∂L/∂P passes 65504 while the scores stay O(1): output and gradients finite, and as close to
    the rule's float64 ones on the same inputs as SDPA's float16 math kernel is to its float64 one."""
    config = SpanAttentionConfig.from_label(label)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3))
    inputs = [(q * 2 / abs(scale) ** 0.5).half(), (k / abs(scale) ** 0.5).half(), v.half()]
    d_out = (4 * torch.randn(2, 2, 16, 8, generator=gen)).half()

    def math_sdpa(*x, **kwargs):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(*x, **kwargs)

    results = [_run(xs, d_out.to(xs[0].dtype), fn, is_causal=True, scale=scale, **kwargs)
               for xs in (inputs, [x.double() for x in inputs])
               for fn, kwargs in ((span_attention, dict(config=config, backend="tiles")), (math_sdpa, {}))]
    (out, grads), (sdpa_out, sdpa_grads), (wide_out, wide_grads), (wide_sdpa_out, wide_sdpa_grads) = results
    tol = 4 * torch.finfo(torch.float16).eps
    for got, sdpa_got, wide, wide_sdpa in ((out, sdpa_out, wide_out, wide_sdpa_out),
                                           *zip(grads, sdpa_grads, wide_grads, wide_sdpa_grads)):
        assert torch.isfinite(got).all()
        assert rel(got, wide) < max(2 * rel(sdpa_got, wide_sdpa), tol)


@pytest.mark.parametrize("d_v", [1, 9, 40])
@pytest.mark.parametrize("label", ["score:1111", "score:1000", "score:0,1,1,0", "score:1100@per_block", "simple:10",
                                   "reductionistic:1100"])
def test_a_value_head_dim_unlike_the_query_s_runs_on_the_fused_kernels(label, d_v):
    """Π_K and Π_V of different widths (the fused backend stacked them), and a value wider than the query and key
    with the rule's operand columns (40 > 4 + 3·4): the float64 reference's output and gradients, as on the tiles."""
    from reference import reference

    config = SpanAttentionConfig.from_label(label)
    inputs = list(qkv(d_v=d_v, seed=3).values())
    d_out = torch.randn(2, 2, 6, d_v, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref_out, ref_grads = reference(*inputs, d_out, config, is_causal=True)
    _, std_grads = reference(*inputs, d_out, SpanAttentionConfig(method="standard"), is_causal=True)
    out, grads = _run([x.float() for x in inputs], d_out.float(), span_attention, is_causal=True, config=config,
                      backend="fused")
    assert rel(out, ref_out) < 1e-5
    for g, r, std in zip(grads, ref_grads, std_grads):
        assert g.shape == r.shape  # relative to the larger of the rule's and the standard gradient
        assert (g.double() - r).norm() / max(r.norm(), std.norm()) < 1e-5


@pytest.mark.parametrize("grad", [False, True])
def test_float64_inside_autocast_runs_in_float64_as_sdpa(grad):
    """Autocast leaves float64 alone: SDPA's float64 output and (at score:1111) gradients, with or without
    autograd; float64 beside a tensor autocast casts gets SDPA's refusal, with the dtypes named."""
    inputs = list(qkv().values())
    d_out = torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _run(inputs, d_out, span_attention, is_causal=True, config=EXACT) if grad else \
            (span_attention(*inputs, is_causal=True, config=EXACT), ())
        expected, expected_grads = _run(inputs, d_out, lambda *x, **k: sdpa(dict(zip(QKV, x), **k)), is_causal=True)
        assert out.dtype == torch.float64
        for got, want in ((out, expected), *zip(grads, expected_grads)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match=r"share a dtype.*under autocast torch.float64, torch.bfloat16"):
            span_attention(inputs[0], *(x.float().requires_grad_(grad) for x in inputs[1:]), config=EXACT)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_a_mask_in_the_other_half_dtype_inside_autocast_is_cast_as_sdpa_casts_it(backend):
    """Autocast casts a float mask to its dtype for SDPA (float16 under bfloat16 autocast): the same result as the
    mask given in that dtype; a float64 mask stays float64 there, and SDPA's refusal names the dtypes."""
    inputs = [x.float() for x in qkv().values()]
    mask = left_padding(-1e4).to(torch.float16)
    d_out = torch.randn(2, 2, 6, 4, generator=torch.Generator().manual_seed(7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sdpa(dict(zip(QKV, inputs), attn_mask=mask))  # SDPA takes it
        got, want = (_run(inputs, d_out, span_attention, attn_mask=m, config="score:1000", backend=backend)
                     for m in (mask, mask.to(torch.bfloat16)))
        for a, b in zip((got[0], *got[1]), (want[0], *want[1])):
            assert torch.equal(a, b)
        with pytest.raises(ValueError, match="attn_mask must be bool.*got torch.float64"):
            span_attention(*inputs, attn_mask=mask.double(), config="score:1000")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")  # torch's, from inside SDPA
def test_nested_tensors_get_sdpas_result_or_say_span_gradients_need_dense_ones():
    """Ragged (jagged nested) batches: SDPA's output without autograd and under the standard rule (with its
    gradients, times α_Q, α_K, α_V); span gradients an error that says how to pad them."""
    gen = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 5, 8])
    ragged = [torch.nested.nested_tensor_from_jagged(torch.randn(8, 2, 8, generator=gen), offsets).transpose(1, 2)
              for _ in range(3)]
    expected = F.scaled_dot_product_attention(*ragged)
    torch.testing.assert_close(span_attention(*ragged).values(), expected.values(), rtol=0, atol=0)
    leaves = [x.detach().requires_grad_(True) for x in ragged]
    out = span_attention(*leaves, config="standard:QKV111")
    torch.testing.assert_close(out.values(), expected.values(), rtol=0, atol=0)
    out.values().sum().backward()
    assert all(x.grad is not None for x in leaves)
    scaled = [x.detach().requires_grad_(True) for x in ragged]  # any standard rule: SDPA's gradients times α
    span_attention(*scaled, config="standard:QKV0.5,0,2").values().sum().backward()
    for x, leaf, alpha in zip(scaled, leaves, (0.5, 0.0, 2.0)):
        torch.testing.assert_close(x.grad.values(), leaf.grad.values() * alpha, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"nested tensors do not take span gradients; pad them \(to_padded_tensor\)"):
        span_attention(*leaves, config="score:1000")


def test_backend_for_takes_a_device_as_a_tensor_has_it(monkeypatch):
    """backend_for('cpu:0') and backend_for(torch.device('cpu')) said 'fused' where span_attention on such a tensor
    runs on the tiles; a dtype given as a string, or a device that is none, gave an answer instead of an error."""
    from hf_spanattn.ops import backend_for

    monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    for device in ("cpu:0", torch.device("cpu"), torch.empty(0).device):
        assert backend_for(device) == "tiles"
    assert backend_for("cuda:0") == "fused" and backend_for(torch.device("cuda", 1), torch.float64) == "tiles"
    for device in ("CPU", "gpu", None):
        with pytest.raises(ValueError, match=r"backend_for: device=.*: expected a device type such as 'cpu'"):
            backend_for(device)
    with pytest.raises(TypeError, match=r"backend_for: dtype='float64': expected a torch.dtype"):
        backend_for("cuda", "float64")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_backend_for_a_dtype_span_gradients_do_not_take_is_an_error(dtype, monkeypatch):
    """backend_for answered 'tiles' or 'fused' for integer, bool, complex and float8 dtypes, in which span_attention
    refuses its inputs: an answer for a run that cannot happen."""
    from hf_spanattn.ops import backend_for

    monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=rf"backend_for: dtype={dtype}: span gradients take torch.float16, "
                                             r"torch.bfloat16, torch.float32, torch.float64$"):
            backend_for(device, dtype)
    assert backend_for("cpu", torch.bfloat16) == "tiles" and backend_for("cuda", torch.float16) == "fused"


@pytest.mark.parametrize(("label", "backend"), [("score:1000", "tiles"), ("score:1100@per_block", "tiles"),
                                                ("score:1000", "fused"), ("score:1100@per_block", "fused")])
def test_a_mask_changed_in_place_after_the_forward_pass_is_not_read_by_the_backward_pass(label, backend):
    """The fused per-block backward read the mask tensor when it ran: changed in place after the forward pass, it
    gave the gradients of the new mask for the output of the old one, without a word. Now the backward pass uses the
    forward's mask (as SDPA on the CPU) or, where it needs the tensor itself, says it was changed."""
    dtype = torch.float64 if backend == "tiles" else torch.float32
    inputs = [x.to(dtype).requires_grad_() for x in qkv().values()]
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    out = span_attention(*inputs, attn_mask=mask.clone(), config=label, backend=backend)
    expected = torch.autograd.grad(out.sum(), inputs)
    out = span_attention(*inputs, attn_mask=mask, config=label, backend=backend)
    mask[0, ..., :2] = False
    if backend == "fused" and label.endswith("per_block"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(out.sum(), inputs)
        return
    for got, want in zip(torch.autograd.grad(out.sum(), inputs), expected):
        assert torch.equal(got, want)


def test_the_last_mask_read_is_remembered_as_one_key_value_pair():
    """The key and the value were two attributes, written and read apart, so a call (a thread of nn.DataParallel) could
    answer another call's mask with the key it had checked. Here the second call runs inside the first's key check."""
    from hf_spanattn.ops.inputs import LastMaskRead

    class Extra:  # equal to any Extra; its first comparison runs `inside`
        def __init__(self, inside=None):
            self.inside = inside

        def __eq__(self, other):
            inside, self.inside = self.inside, None
            if inside is not None:
                inside()
            return isinstance(other, Extra)

    last_read = LastMaskRead(while_capturing=None)
    first, second = torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.bool)
    other_call = lambda: last_read(second, lambda: "second's", Extra())  # noqa: E731
    assert last_read(first, lambda: "first's", Extra(other_call)) == "first's"
    assert last_read(first, lambda: "first's again", Extra()) in ("first's", "first's again")  # other_call inside
    assert last_read(second, lambda: "read again", Extra()) == "second's"


@pytest.mark.parametrize(("label", "backend"), [("score:1100@per_block", "fused"), ("score:1100@per_block", "tiles"),
                                                ("score:1000", "fused")])
def test_calls_with_dropout_in_threads_at_once_each_get_their_own_mask(label, backend):
    """Threads calling with dropout at once (the random state is the process's): each backward pass uses the
    dropout mask of its own forward pass. On V = I the output is the dropped weights W, and dV = Wᵀ·1."""
    from concurrent.futures import ThreadPoolExecutor

    t = 8
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 2, 2, t, t, generator=generator) for _ in range(48)]

    def call(qk: torch.Tensor) -> float:
        q, k = qk
        v = torch.eye(t).expand(2, 2, t, t).clone().requires_grad_()
        out = span_attention(q.requires_grad_(), k, v, dropout_p=0.5, config=label, backend=backend)
        out.sum().backward()
        return (v.grad[..., 0] - out.detach().sum(-2)).abs().max().item()

    with ThreadPoolExecutor(4) as pool:
        assert max(pool.map(call, inputs)) < 1e-5


@pytest.mark.parametrize("backend", ["tiles", "fused", "triton"])
def test_a_mask_made_under_inference_mode_is_taken_as_sdpa_takes_it(backend):
    """A bool mask made under torch.inference_mode (no version counter to remember it by) gives SDPA's result; a
    float one, which every backend keeps for its backward pass, torch's own error for inference tensors saved for
    backward, as SDPA's."""
    q, k, v = (x.float().requires_grad_() for x in qkv(t=8).values())
    with torch.inference_mode():
        keep = torch.ones(8, 8, dtype=torch.bool).tril()  # causal, as the Triton kernels take it: compared in full
        additive = torch.zeros(8, 8).masked_fill(~keep, -torch.inf)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        F.scaled_dot_product_attention(q, k, v, additive)
    for mask in (keep, additive):
        try:
            out = span_attention(q, k, v, mask, config=EXACT, backend=backend)
        except RuntimeError as error:
            assert mask is additive and "Inference tensors cannot be saved" in str(error)
            continue
        expected = F.scaled_dot_product_attention(q, k, v, mask.clone())
        for got, want in ((out, expected), *zip(torch.autograd.grad(out.sum(), (q, k, v)),
                                                torch.autograd.grad(expected.sum(), (q, k, v)))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the shapes checked in Python, fixed in the trace
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
@pytest.mark.parametrize("backend", ["tiles", "fused", "triton"])
def test_torch_jit_trace_gives_sdpas_graph_or_says_span_gradients_need_autograd(backend):
    """torch.jit.trace: under torch.no_grad the graph of SDPA itself (grouped-query heads included, whose flag was a
    traced tensor); with inputs that need gradients an error that names span_attention and what to use instead."""
    q, k, v = (x.float() for x in qkv(h_q=4, h_kv=2).values())
    call = lambda q, k, v: span_attention(q, k, v, is_causal=True, backend=backend)  # noqa: E731
    with torch.no_grad():
        traced = torch.jit.trace(call, (q, k, v))
    torch.testing.assert_close(traced(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True))
    with pytest.raises(RuntimeError, match=r"span_attention: torch\.jit\.trace does not record span gradients"):
        torch.jit.trace(call, (q.requires_grad_(), k, v))


@pytest.mark.parametrize("label", ["score:1111", "score:1000", "score:1100@per_block", "simple:10"])
@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_inputs_changed_in_place_under_allow_mutation_on_saved_tensors_give_the_gradients_before(label, backend):
    """torch.autograd.graph.allow_mutation_on_saved_tensors (a Python dispatch mode) lets the inputs change in place
    after the forward pass: the gradients are those of the values the forward pass saw, as without the change."""
    q, k, v = (x.float().requires_grad_() for x in qkv().values())
    expected = torch.autograd.grad(span_attention(q, k, v, is_causal=True, config=label, backend=backend).sum(),
                                   (q, k, v))
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        inputs = [x * 1 for x in (q, k, v)]
        out = span_attention(*inputs, is_causal=True, config=label, backend=backend)
        for x in inputs:
            x.add_(1.0)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_call_under_fake_tensor_mode_leaves_later_calls_their_own_tensors():
    """A causal call under FakeTensorMode (shape and memory tools) made the tiles' causal mask of fake tensors and
    kept it for the shape, so that the next real call of that shape failed on them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (x.float().requires_grad_() for x in qkv(t=7).values())
    with FakeTensorMode():
        fake = [torch.empty(x.shape, requires_grad=True) for x in (q, k, v)]
        assert span_attention(*fake, is_causal=True, config=EXACT, backend="tiles").shape == q.shape
    out = span_attention(q, k, v, is_causal=True, config=EXACT, backend="tiles")
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for got, want in ((out, expected), *zip(torch.autograd.grad(out.sum(), (q, k, v)),
                                            torch.autograd.grad(expected.sum(), (q, k, v)))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("label", "backend"), [("score:1000", "tiles"), ("score:1100@per_block", "tiles"),
                                                ("score:1100@per_block", "fused"), ("score:1000", "triton")])
def test_a_reentrant_checkpoint_under_dropout_recomputes_the_dropout_mask_its_loss_saw(backend, label):
    """torch.utils.checkpoint(use_reentrant=True) runs the forward pass without autograd, then again with it for the
    backward pass under the same random state. The Triton kernels draw their own dropout mask, which SDPA (the call
    without autograd) did not: the loss saw one mask and the gradients another. Now output and gradients are those
    of the call without a checkpoint."""
    from torch.utils.checkpoint import checkpoint

    inputs = [x.float().requires_grad_() for x in qkv().values()]
    call = lambda *x: span_attention(*x, dropout_p=0.3, config=label, backend=backend)  # noqa: E731
    results = []
    for run_ in (lambda: checkpoint(call, *inputs, use_reentrant=True), lambda: call(*inputs)):
        torch.manual_seed(0)
        out = run_()
        (out * out).sum().backward()  # a reentrant checkpoint takes no torch.autograd.grad
        results.append((out, *(x.grad for x in inputs)))
        for x in inputs:
            x.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [4, 24])  # T ≤ d (unit rows) and T > d (factorization)
@pytest.mark.parametrize("backend", ["tiles", "fused"])
@pytest.mark.parametrize("label", ["score:1100@per_block", "score:0.5,2,0,1.5@per_block"])
def test_subnormal_keys_give_the_float64_references_key_gradient_under_per_block(label, backend, t):
    """Keys at 1e-40 (float32 subnormals): the cross terms' (K⁺)ᵀ ~ 1e40 was formed in float32, past its range, and
    dK was NaN. Their product is of order one: dK is now the float64 reference's of the same float32 inputs."""
    from reference import reference

    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 2, t, 6, generator=gen) for _ in range(4))
    k = k * 1e-40
    config = SpanAttentionConfig.from_label(label)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    dk = torch.autograd.grad(span_attention(*leaves, is_causal=True, config=config, backend=backend), leaves[1],
                             d_out)[0]
    want = reference(q, k, v, d_out, config, is_causal=True)[1][1]
    std = reference(q, k, v, d_out, SpanAttentionConfig(method="standard"), is_causal=True)[1][1]
    assert ((dk.double() - want).norm() / torch.maximum(want.norm(), std.norm())).item() < 1e-5
