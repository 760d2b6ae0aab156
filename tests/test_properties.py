"""Properties of span_attention over random shapes, masks, dtypes and alphas (hypothesis):
the forward pass is SDPA's, the gradients at alphas 1111 are SDPA's, and every rule matches the
float64 reference of tests/reference.py. Settings of every JSON type in every field, on a model
config or in a file, give a valid config or an error that names the field (or the file)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference
from test_engine import LABELS, rel
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_spanattn import SpanAttentionConfig, span_attention
from hf_spanattn.config import VERSION_KEY
from hf_spanattn.integration.stored import config_of
from hf_spanattn.ops.inputs import MASKED_AT

MASKS = ["none", "causal", "bool", "-inf", "min", "threshold"]
FILLS = {"-inf": lambda dtype: float("-inf"), "min": lambda dtype: torch.finfo(dtype).min,
         "threshold": lambda dtype: MASKED_AT}
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}
FAST = settings(max_examples=25, deadline=None, derandomize=True)


@st.composite
def problems(draw):
    """Inputs (float64), d_out, the mask's kind and its bool form (None: no mask)."""
    b, h_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([1, 2, 4, 8]))
    t = draw(st.one_of(st.integers(1, d), st.integers(1, 12)))  # T ≤ d (T = 1 included) and T > d
    kind = draw(st.sampled_from(MASKS))
    pad = [draw(st.integers(0, t - 1)) for _ in range(b)]  # left padding; padded rows attend nothing
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(b, h_kv * groups, t, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, h_kv, t, d, generator=gen, dtype=torch.float64) for _ in range(2))
    d_out = torch.randn(b, h_kv * groups, t, d, generator=gen, dtype=torch.float64)
    attend = None
    if kind not in ("none", "causal"):
        valid = torch.arange(t)[None, :] >= torch.tensor(pad)[:, None]
        attend = valid[:, None, None, :] & torch.ones(t, t, dtype=torch.bool).tril()
    return (q, k, v), d_out, kind, attend


def mask_kwargs(kind: str, attend: torch.Tensor | None, dtype: torch.dtype) -> dict:
    if kind == "none":
        return {}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        return {"attn_mask": attend}
    return {"attn_mask": torch.zeros(attend.shape, dtype=dtype).masked_fill_(~attend, FILLS[kind](dtype))}


def live_rows(attend: torch.Tensor | None) -> torch.Tensor | float:
    """1 on the query rows that attend some key: padded rows carry no loss (their gradients into Q
    and K follow the bool mask, not SDPA's)."""
    return 1.0 if attend is None else attend.any(-1, keepdim=True).double()


def sdpa(inputs, **kwargs) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*inputs, enable_gqa=inputs[0].shape[1] != inputs[1].shape[1], **kwargs)


def run(inputs, d_out, config, **kwargs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = span_attention(*leaves, config=config, **kwargs)
    return out, torch.autograd.grad(out, leaves, d_out)


@FAST
@given(problems(), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), st.sampled_from(LABELS))
def test_forward_is_sdpa(problem, dtype, label):
    inputs, _, kind, attend = problem
    kwargs = mask_kwargs(kind, attend, dtype)
    leaves = [x.to(dtype).requires_grad_(True) for x in inputs]
    out = span_attention(*leaves, config=SpanAttentionConfig.from_label(label), **kwargs)
    wide = {k: (m.double() if torch.is_tensor(m) and m.is_floating_point() else m) for k, m in kwargs.items()}
    expected = sdpa([x.detach().double() for x in leaves], **wide)  # SDPA on the same (rounded) inputs
    assert out.dtype == dtype
    # bf16 keeps 8 significant bits: its scores and weights round to 2^-9 relative
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    assert (out.double() - expected).abs().max().item() <= tol * max(1.0, expected.abs().max().item())


@FAST
@given(problems(), st.sampled_from([torch.float32, torch.float64]), st.sampled_from(["score:1111",
                                                                                   "reductionistic:1111"]))
def test_gradients_at_1111_are_sdpa(problem, dtype, label):
    inputs, d_out, kind, attend = problem
    kwargs = mask_kwargs(kind, attend, dtype)
    inputs, d_out = [x.to(dtype) for x in inputs], (d_out * live_rows(attend)).to(dtype)
    _, grads = run(inputs, d_out, SpanAttentionConfig.from_label(label), **kwargs)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    expected = torch.autograd.grad(sdpa(leaves, **kwargs), leaves, d_out)
    for name, g, e in zip("qkv", grads, expected):
        assert rel(g, e) < TOLERANCE[dtype] / 10, name


alphas = st.tuples(*[st.sampled_from([0.0, 0.5, 1.0, 2.0])] * 4)


@FAST
@given(problems(), st.sampled_from([torch.float32, torch.float64]),
       st.one_of(st.sampled_from(LABELS).map(SpanAttentionConfig.from_label),
                 st.builds(SpanAttentionConfig, method=st.sampled_from(["score", "reductionistic"]), alphas=alphas,
                           score_grad=st.just("exact")),
                 st.builds(SpanAttentionConfig, method=st.just("score"), alphas=alphas,
                           score_grad=st.just("per_block"))))
def test_every_rule_matches_the_float64_reference(problem, dtype, config):
    inputs, d_out, kind, attend = problem
    kwargs64 = mask_kwargs(kind, attend, torch.float64)
    ref_out, ref_grads = reference(*inputs, d_out, config, **kwargs64)
    _, std_grads = reference(*inputs, d_out, SpanAttentionConfig(method="standard"), **kwargs64)
    out, grads = run([x.to(dtype) for x in inputs], d_out.to(dtype), config, **mask_kwargs(kind, attend, dtype))
    assert rel(out, ref_out) < TOLERANCE[dtype]
    for name, g, r, std in zip("qkv", grads, ref_grads, std_grads):
        assert rel(g, r, std) < TOLERANCE[dtype], name


def as_scale_types(value: float):
    """`value` as each type SDPA takes for scale: Python float, int or bool, NumPy float or bool, 0-d tensors."""
    import numpy as np

    kinds = [st.just(value), st.just(np.float32(value)), st.just(np.float64(value)),
             st.sampled_from([torch.float32, torch.float64, torch.float16]).map(lambda d: torch.tensor(value, dtype=d))]
    if value in (0.0, 1.0):
        kinds += [st.just(bool(value)), st.just(np.bool_(value)), st.just(torch.tensor(bool(value)))]
    if float(value).is_integer() and math.isfinite(value):
        kinds += [st.just(int(value)), st.just(np.int64(value)), st.just(torch.tensor(int(value)))]
    return st.one_of(kinds)


SCALES = st.one_of(st.none(), st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0]).flatmap(as_scale_types),
                   st.floats(-4, 4, allow_nan=False).flatmap(as_scale_types))


@FAST
@given(problems(), st.sampled_from([(torch.float64, "tiles"), (torch.float32, "tiles"), (torch.float32, "fused")]),
       SCALES, st.booleans())
def test_any_scale_sdpa_takes_gives_sdpas_result(problem, dtype_backend, scale, grad):
    """Negative, zero and signed-zero scales, in every type SDPA takes, with any mask: the forward pass
    (with and without autograd) and the gradients at alphas 1111 are SDPA's math kernel's."""
    (dtype, backend), (inputs, d_out, kind, attend) = dtype_backend, problem
    kwargs = dict(mask_kwargs(kind, attend, dtype), scale=scale)
    inputs, d_out = [x.to(dtype) for x in inputs], (d_out * live_rows(attend)).to(dtype)
    leaves = [x.clone().requires_grad_(grad) for x in inputs]
    out = span_attention(*leaves, config=SpanAttentionConfig.from_label("score:1111"), backend=backend, **kwargs)
    expected_leaves = [x.clone().requires_grad_(True) for x in inputs]
    expected = sdpa(expected_leaves, **kwargs)
    tol = TOLERANCE[dtype] / 10
    close = lambda a, e: (a - e).abs().max() <= tol * max(1.0, e.abs().max())  # noqa: E731
    assert close(out, expected)
    if grad:
        grads = torch.autograd.grad(out, leaves, d_out)
        for g, e in zip(grads, torch.autograd.grad(expected, expected_leaves, d_out)):
            assert close(g, e)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.sampled_from([math.nan, math.inf, -math.inf]).flatmap(as_scale_types), st.sampled_from(MASKS[:3]),
       st.sampled_from(["tiles", "fused"]), st.booleans())
def test_a_scale_that_is_not_finite_is_refused_naming_scale(scale, kind, backend, grad):
    """NaN and ±inf in any type: SDPA's kernels disagree (rows of 0 on the CPU's flash kernel, NaN on the math one)."""
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, 2, 4, 3, generator=gen).requires_grad_(grad) for _ in range(3)]
    kwargs = mask_kwargs(kind, torch.ones(4, 4, dtype=torch.bool).tril()[None, None], torch.float32)
    with pytest.raises(ValueError, match="span_attention: scale must be a finite number or None"):
        span_attention(*leaves, scale=scale, backend=backend, **kwargs)


@pytest.mark.parametrize("kind", MASKS)
def test_the_strategy_reaches_every_mask(kind):
    """The masks above are built as meant: float masks hide what the bool mask hides."""
    attend = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    kwargs = mask_kwargs(kind, attend, torch.float32)
    if "attn_mask" in kwargs:
        mask = kwargs["attn_mask"]
        hidden = ~mask if mask.dtype == torch.bool else mask <= MASKED_AT
        assert torch.equal(hidden, ~attend)


@st.composite
def learnable_masks(draw):
    """float64 q, k, v (B, H_q, T, d) with GQA, and a float bias (some entries −inf, rows of them
    included) or a bool mask, of a random shape that broadcasts to (B, H_q, T, T)."""
    b, h_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    t, d = draw(st.integers(1, 7)), draw(st.sampled_from([2, 4]))
    full = (b, h_kv * groups, t, t)
    shape = tuple(n if draw(st.booleans()) else 1 for n in full)[4 - draw(st.integers(2, 4)):]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    inputs = [torch.randn(b, heads, t, d, generator=gen, dtype=torch.float64) for heads in (h_kv * groups, h_kv, h_kv)]
    hidden = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.7]))
    if draw(st.booleans()):
        return inputs, ~hidden
    bias = draw(st.sampled_from([0.1, 1.0, 10.0])) * torch.randn(shape, generator=gen, dtype=torch.float64)
    return inputs, bias.masked_fill(hidden, float("-inf"))


@FAST
@given(learnable_masks(), st.sampled_from(LABELS), st.sampled_from(["tiles", "fused"]))
def test_learnable_masks_get_sdpas_gradient(problem, label, backend):
    """Any rule: the forward and ∂L/∂mask (float masks) are SDPA's, and at alphas 1111 dQ, dK, dV too."""
    inputs, mask = problem
    dtype, tol = (torch.float64, 1e-10) if backend == "tiles" else (torch.float32, 1e-5)
    inputs = [x.to(dtype) for x in inputs]
    mask = mask.to(dtype) if mask.is_floating_point() else mask
    learnable = mask.is_floating_point()
    d_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    results = []
    for fn in (lambda *x, **kw: span_attention(*x, config=SpanAttentionConfig.from_label(label), backend=backend,
                                               **kw),
               lambda *x, **kw: F.scaled_dot_product_attention(*x, enable_gqa=x[0].shape[1] != x[1].shape[1], **kw)):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        m = mask.clone().requires_grad_(learnable)
        out = fn(*leaves, attn_mask=m)
        results.append((out, torch.autograd.grad(out, leaves + [m] * learnable, d_out)))
    (out, grads), (expected, expected_grads) = results
    close = lambda a, e: (a - e).nan_to_num(0).abs().max() <= tol * max(1.0, e.nan_to_num(0).abs().max())  # noqa: E731
    assert torch.equal(out.isnan(), expected.isnan()) and close(out, expected)
    compared = list(zip(grads, expected_grads))[3:] if label != "score:1111" else zip(grads, expected_grads)
    for g, e in compared:
        assert g.shape == e.shape and close(g, e)


@FAST
@given(st.sampled_from([torch.float16, torch.bfloat16]), st.sampled_from([0.01, 0.1, 1.0, 4.0]),
       st.sampled_from([1.0, 30.0, 300.0, 3000.0]), st.sampled_from(["score:1111", "standard:QKV101"]),
       st.sampled_from(["tiles", "fused"]), st.integers(0, 2**16))
def test_half_extremes_are_sdpas(dtype, scale, size, label, backend, seed):
    """Half inputs with scores up to 3.6e7 at random scales: the forward is SDPA's, the gradients
    are finite where SDPA's are; output and gradients are as close to the rule's float64 ones on the
    same inputs as SDPA's half results are to SDPA's float64 ones (or within 4 ulp of the dtype).
    Rules with spans are left out: K with one column 10³× the others makes Π_K ill-conditioned in
    float32 whatever the scores' range (test_bad_input_ops covers them at moderate sizes)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    # a common part of the scores up to scale·size², and parts that differ by at most 4: not saturated
    q[..., 0], k[..., 0] = size, size + 4 / (scale * size) * torch.rand(9, generator=gen)
    inputs = [x.to(dtype) for x in (q, k, v)]
    d_out = torch.randn(1, 2, 9, 4, generator=gen).to(dtype)
    config = SpanAttentionConfig.from_label(label)

    def run_(xs, fn, **kw):
        leaves = [x.clone().requires_grad_(True) for x in xs]
        out = fn(*leaves, is_causal=True, scale=scale, **kw)
        return out, torch.autograd.grad(out, leaves, d_out.to(xs[0].dtype))

    out, grads = run_(inputs, span_attention, config=config, backend=backend)
    sdpa_out, sdpa_grads = run_(inputs, F.scaled_dot_product_attention)
    # the same (rounded) inputs in float64: how far SDPA's half results are from its own, and ours from the rule's
    wide_out, wide_grads = run_([x.double() for x in inputs], span_attention, config=config, backend="tiles")
    wide_sdpa_out, wide_sdpa = run_([x.double() for x in inputs], F.scaled_dot_product_attention)
    tol = 4 * torch.finfo(dtype).eps
    assert torch.isfinite(out).all() and rel(out, wide_out) < max(2 * rel(sdpa_out, wide_sdpa_out), tol)
    for g, e, w, we in zip(grads, sdpa_grads, wide_grads, wide_sdpa):
        if torch.isfinite(e).all():
            assert torch.isfinite(g).all()
            assert rel(g, w) < max(2 * rel(e, we), tol)


# -- settings of every JSON type -------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**70) | st.floats() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=10)
FIELDS = ["method", "alphas", "score_grad", "qkv_alphas", "layers", VERSION_KEY]
# values that are right for some field, so that valid settings come up as well as bad ones
PLAUSIBLE = st.sampled_from([None, "score", "simple", "exact", "per_block", "0.1.0", "99.0", [], [0], [1, 0],
                             [1, 0, 0, 0], [1, 0.5, 0, 1e-5], [1, 1, 1], [0, 3, 3], [True, 0, 0, 0], [[1], [0]]])


def load_or_name_the_field(load, data: dict, field: str) -> SpanAttentionConfig | None:
    """`load()` gives a config, or a ValueError/TypeError whose message names `field` (or, for a method or
    score_grad that the other fields do not fit, the field that does not fit); nothing else."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unknown fields and newer versions warn; tested in test_config.py
            config = load()
    except (ValueError, TypeError) as err:
        named = {field, "alphas", "score_grad"} if field in ("method", "score_grad") else {field}
        assert any(f"{name}=" in str(err) for name in named), (data, str(err))
        return None
    assert SpanAttentionConfig.from_dict(config.to_dict()) == config
    return config


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.sampled_from(["score:1000", "simple:10", "standard:QKV101", "score:1100@per_block"]),
       st.sampled_from(FIELDS), st.one_of(JSON, PLAUSIBLE))
def test_a_stored_field_of_any_json_type_loads_or_is_named(label, field, value):
    from transformers import GPT2Config

    data = {**SpanAttentionConfig.from_label(label).to_dict(), field: value}
    model_config = GPT2Config(n_layer=2)
    model_config.span_attention = data
    config = load_or_name_the_field(lambda: config_of(model_config), data, field)
    if config is not None and field not in (VERSION_KEY, "method", "score_grad") and value is not None:
        assert list(getattr(config, field)) == (sorted(set(value)) if field == "layers" else list(value))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.one_of(JSON, st.dictionaries(st.sampled_from(FIELDS + ["alpha", "shiny"]), st.one_of(JSON, PLAUSIBLE))))
def test_a_settings_file_of_any_json_loads_or_names_the_file(content):
    """SpanAttentionConfig.from_pretrained on any JSON document: a config, or an error naming the file."""
    import json
    import tempfile
    import warnings
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "span_attention_config.json"
        path.write_text(json.dumps(content))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                SpanAttentionConfig.from_pretrained(folder)
        except (ValueError, TypeError) as err:
            assert str(path) in str(err), str(err)


LABEL_PARTS = st.sampled_from(["score", "simple", "reductionistic", "standard", "Score", "", " ", ":", ",", "+", "@",
                               "QKV", "per_block", "exact", "1", "0", "10", "1000", "0.5", "1e-5", "1e999", "-1",
                               "nan", "inf", "e", "."])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.one_of(st.lists(LABEL_PARTS, max_size=8).map("".join), st.text(max_size=20)))
def test_any_label_parses_or_names_the_label_or_field(text):
    """from_label on any string: a config whose label reads back as it, or a ValueError naming the label or
    the field it sets."""
    try:
        config = SpanAttentionConfig.from_label(text)
    except ValueError as err:
        assert any(name in str(err) for name in ("label=", "alphas=", "qkv_alphas=", "score_grad=", "method=")), err
        return
    assert SpanAttentionConfig.from_label(config.label) == config
