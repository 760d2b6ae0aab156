"""The fused-SDPA backend (ops/fused.py) against the float64 reference, SDPA, and the tile engine.

On a CPU these run through torch's CPU SDPA kernels, the same code path as on a GPU; the tests
marked `gpu` need CUDA."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from reference import reference
from test_engine import CASES, LABELS, UNIFORM, make, padding_mask, rank_deficient, rel
from torch.overrides import TorchFunctionMode

from hf_spanattn import SpanAttentionConfig, span_attention
from hf_spanattn.ops import backward
from hf_spanattn.ops.fused import key_support

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(inputs, d_out, config, **kwargs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = span_attention(*leaves, config=config, backend="fused", **kwargs)
    return out, torch.autograd.grad(out, leaves, d_out)


def float32(kwargs: dict) -> dict:
    return {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()}


def case_inputs(case: str):
    if case in CASES:
        inputs, d_out = make(**CASES[case]["shape"])
        return inputs, d_out, CASES[case]["kwargs"]
    inputs, d_out = rank_deficient(case.split("_")[0])
    return inputs, d_out, dict(is_causal=True)


QUICK_CASES = ["causal", "gqa_padded_scale", "float_mask", "padded_to_d", "t_eq_d", "repeated_rows", "short_rows"]
ALL_CASES = [*CASES, "repeated_rows", "zero_rows", "short_rows"]


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("case", [c if c in QUICK_CASES else pytest.param(c, marks=pytest.mark.slow)
                                  for c in ALL_CASES])
def test_float32_matches_float64_reference(label, case):
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out, kwargs = case_inputs(case)
    ref_out, ref_grads = reference(*inputs, d_out, config, **kwargs)
    _, std_grads = reference(*inputs, d_out, SpanAttentionConfig(method="standard"), **kwargs)
    out, grads = run([x.float() for x in inputs], d_out.float(), config, **float32(kwargs))
    assert rel(out, ref_out) < 1e-5
    for name, g, r, std in zip("qkv", grads, ref_grads, std_grads):
        assert g.dtype == torch.float32
        assert rel(g, r, std) < 1e-4, f"d{name}: {rel(g, r, std):.2e}"


@pytest.mark.parametrize("label", ["score:1000", "score:1100", "score:1111@per_block", "reductionistic:1100",
                                   "simple:10", "standard:QKV101"])
def test_bf16_inputs(label):
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(t=32, d=8, h_q=4, h_kv=2)
    _, ref_grads = reference(*inputs, d_out, config, is_causal=True)
    out, grads = run([x.bfloat16() for x in inputs], d_out.bfloat16(), config, is_causal=True)
    assert out.dtype == torch.bfloat16
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
        assert rel(g, r) < 2e-2


@pytest.mark.parametrize("label", UNIFORM)
@pytest.mark.parametrize("case", ["causal", "padded", "gqa", "float_mask"])
def test_uniform_alphas_give_sdpa_gradients(label, case):
    inputs, d_out = make(dtype=torch.float32, **CASES[case]["shape"])
    kwargs = float32(CASES[case]["kwargs"])
    out, grads = run(inputs, d_out, SpanAttentionConfig.from_label(label), **kwargs)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    gqa = inputs[0].shape[1] != inputs[1].shape[1]
    expected_out = F.scaled_dot_product_attention(*leaves, enable_gqa=gqa, **kwargs)
    expected = torch.autograd.grad(expected_out, leaves, d_out)
    assert (out - expected_out).abs().max() <= 1e-6
    for g, e in zip(grads, expected):
        assert rel(g, e) < 1e-5


def sdpa_keep_mask(q, k, p, seed, **kwargs):
    """The dropout mask SDPA draws under `seed`: attention on V = I gives the dropped probabilities."""
    b, h_kv, s = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(s, dtype=q.dtype).expand(b, h_kv, s, s)
    torch.manual_seed(seed)
    dropped = F.scaled_dot_product_attention(q, k, eye, dropout_p=p, enable_gqa=q.shape[1] != h_kv, **kwargs)
    return dropped != 0


@pytest.mark.parametrize("label", ["score:1111", "score:1000", "reductionistic:1100", "score:1100@per_block",
                                   "score:1111@per_block"])
def test_dropout_uses_the_forward_mask(label):
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(h_q=4, h_kv=2, dtype=torch.float32)
    p = 0.3
    keep = sdpa_keep_mask(q, k, p, seed=11, is_causal=True)
    assert 0.5 < keep.float().sum() / torch.ones(12, 12).tril().sum() / 8 < 0.9  # a real draw
    torch.manual_seed(11)
    out, grads = run((q, k, v), d_out, config, is_causal=True, dropout_p=p)
    ref_out, ref_grads = reference(q, k, v, d_out, config, is_causal=True, keep=keep, dropout_p=p)
    _, std_grads = reference(q, k, v, d_out, SpanAttentionConfig(method="standard"), is_causal=True, keep=keep,
                             dropout_p=p)
    assert rel(out, ref_out) < 1e-5
    for g, r, std in zip(grads, ref_grads, std_grads):
        assert rel(g, r, std) < 1e-4


@pytest.mark.parametrize("label", ["score:1000", "score:1111@per_block", "simple:10"])
def test_agrees_with_the_tile_engine(label):
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(b=3, h_q=4, h_kv=2, t=40, d=8, dtype=torch.float32)
    mask = padding_mask([40, 25, 9], 40)
    _, fused = run(inputs, d_out, config, attn_mask=mask)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    tiled = torch.autograd.grad(span_attention(*leaves, attn_mask=mask, config=config, backend="tiles"), leaves, d_out)
    for f, t in zip(fused, tiled):
        assert rel(f, t) < 1e-5


def test_key_support_reads_bool_and_float_masks():
    mask = padding_mask([6, 3], 6)
    expected = mask[:, 0].any(dim=-2)[:, None, None, :, None]
    assert torch.equal(key_support(mask, 1, 1), expected)
    for masked in (-torch.inf, torch.finfo(torch.float32).min, -1e4, -1e9):
        additive = torch.zeros(mask.shape).masked_fill(~mask, masked)
        assert torch.equal(key_support(additive, 1, 1), expected), masked
    assert key_support(torch.zeros(6, 6), 2, 2).all() and key_support(None, 1, 1) is None


# ---- no host synchronisation ---------------------------------------------------------------

# What makes a CUDA tensor op wait for the device: reading values on the host, shapes that
# depend on values, and linear algebra that checks its own errors.
SYNCING = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu", "nonzero",
           "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "repeat_interleave",
           "linalg_cholesky", "linalg_eigh", "linalg_eigvalsh", "linalg_inv", "linalg_solve", "linalg_svd",
           "linalg_matrix_rank", "linalg_pinv", "linalg_lstsq", "cholesky", "inverse"}


class HostReads(TorchFunctionMode):
    """Records every call that would synchronise with a CUDA device, and boolean-mask indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        index = args[1] if name == "__getitem__" and len(args) > 1 else None
        if name in SYNCING or (torch.is_tensor(index) and index.dtype == torch.bool):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def graph_capture():
    """A CUDA graph capture as the package and Transformers see it, on CPU tensors too: torch.cuda's
    `is_current_stream_capturing` answers True, and so does one given to the CPU's module (the package
    asks the tensor's device). Nothing is captured."""
    with contextlib.ExitStack() as stack:
        for device in (torch.cpu, torch.cuda):
            stack.enter_context(mock.patch.object(device, "is_current_stream_capturing", lambda: True, create=True))
        yield


def test_the_detector_sees_host_reads():
    x = torch.ones(4)
    with HostReads() as mode:
        bool(x.any()), x[x > 0], torch.linalg.cholesky(torch.eye(2))
    assert mode.calls == ["__bool__", "__getitem__", "linalg_cholesky"]


@pytest.mark.parametrize("label", ["score:1000", "score:1100", "score:1111@per_block", "reductionistic:1100",
                                   "simple:10", "standard:QKV101"])
@pytest.mark.parametrize("mask", ["causal", "padding", "float_padding"])
def test_no_host_synchronisation(label, mask):
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(b=2, h_q=4, h_kv=2, t=20, d=8, dtype=torch.float32)
    kwargs = dict(is_causal=True)
    if mask != "causal":
        bool_mask = padding_mask([20, 11], 20)
        kwargs = dict(attn_mask=bool_mask if mask == "padding" else torch.zeros(bool_mask.shape).masked_fill(
            ~bool_mask, torch.finfo(torch.float32).min))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with HostReads() as mode:
        out = span_attention(*leaves, config=config, backend="fused", **kwargs)
        out.backward(d_out)
    assert mode.calls == []


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("label", ["score:1000", "score:1100", "score:1111@per_block", "reductionistic:1100"])
def test_cuda_train_step_never_synchronises(label):
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(b=2, h_q=4, h_kv=2, t=64, d=16, dtype=torch.float32)
    q, k, v, d_out = (x.cuda() for x in (q, k, v, d_out))
    mask = padding_mask([64, 40], 64).cuda()
    for kwargs in (dict(is_causal=True), dict(attn_mask=mask)):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        span_attention(*leaves, config=config, **kwargs).backward(d_out)  # warm-up: allocator, kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            span_attention(*leaves, config=config, **kwargs).backward(d_out)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@functools.cache
def padded_batch(label: str):
    """Left-padded causal inputs whose entry 1 has 46 rows that attend no key, ∂L/∂O zeroed on those rows,
    and the float64 reference (once per label: the slow part)."""
    inputs, d_out = make(b=2, h_q=4, h_kv=2, t=96, d=16)
    mask = padding_mask([96, 50], 96)
    attends = mask.any(-1, keepdim=True).expand(-1, 4, -1, 16)  # (B, H_q, T, D): the rows that attend a key
    d_out = d_out * attends
    return inputs, d_out, mask, attends, reference(*inputs, d_out, SpanAttentionConfig.from_label(label),
                                                   attn_mask=mask)


def check_matches_float64_reference(device: str, label: str, dtype: torch.dtype, tol: float) -> None:
    """`padded_batch` on `device` in `dtype` against what the package promises: rows that attend
    something give the float64 reference's output; rows that attend nothing give stock SDPA's on the
    same device and dtype (where SDPA gives a result, span_attention gives SDPA's: CUDA's fused kernels
    give them another value than the CPU's 0); the gradients are the reference's, ∂L/∂O being zero on
    the empty rows, so that no convention for them enters."""
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out, mask, attends, (ref_out, ref_grads) = padded_batch(label)
    leaves = [x.to(device, dtype).requires_grad_(True) for x in inputs]
    out = span_attention(*leaves, attn_mask=mask.to(device), config=config, backend="fused")
    grads = torch.autograd.grad(out, leaves, d_out.to(device, dtype))
    sdpa = F.scaled_dot_product_attention(*(x.detach() for x in leaves), attn_mask=mask.to(device), enable_gqa=True)
    out, sdpa = out.detach().cpu(), sdpa.cpu()
    assert rel(out[attends], ref_out[attends]) < tol
    assert rel(out[~attends], sdpa[~attends]) < tol
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all() and rel(g.cpu(), r) < tol, f"d{name}: {rel(g.cpu(), r):.2e}"


@pytest.mark.parametrize("label", ["score:1000", "score:1100@per_block", "reductionistic:1100"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_matches_float64_reference(label, dtype, tol):
    check_matches_float64_reference("cpu", label, dtype, tol)


@pytest.mark.parametrize("label", ["score:1000", "score:1100@per_block"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_the_reference_check_sees_a_wrong_gradient(label, dtype, tol, monkeypatch):
    """The check can fail: the rule's dQ off by a factor 1 + 3·tol."""
    scaled = backward.scaled
    monkeypatch.setattr(backward, "scaled", lambda grads, alphas: scaled((grads[0] * (1 + 3 * tol), *grads[1:]),
                                                                          alphas))
    with pytest.raises(AssertionError, match="dq"):
        check_matches_float64_reference("cpu", label, dtype, tol)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("label", ["score:1000", "score:1100@per_block", "reductionistic:1100"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_matches_float64_reference(label, dtype, tol):
    check_matches_float64_reference("cuda", label, dtype, tol)


@pytest.mark.parametrize("label", ["score:1000", "score:1111", "simple:10"])
def test_the_output_is_laid_out_as_sdpas(label):
    """At the span rules the output was a slice of the augmented output (strides of width D + extra columns), so
    `out.view(B, -1)` raised where SDPA's output, contiguous on a CPU, takes it; the values are unchanged."""
    q, k, v = (torch.randn(2, 3, 16, 8, requires_grad=True) for _ in range(3))
    stock = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = span_attention(q, k, v, None, 0.0, True, None, config=label, backend="fused")
    assert out.stride() == stock.stride()
    torch.testing.assert_close(out.view(2, -1), stock.view(2, -1))
    out.square().sum().backward()


@pytest.mark.parametrize("weak", [1e-3, 1e-4, 1e-5])
def test_the_share_of_a_weak_direction_each_span_takes_is_the_documented_one(weak):
    """docs/engine.md: `span_without_sync` (fused) takes a direction of singular value ≥ 1e-3·‖X‖_F whole to 1e-4,
    a fifth of one at 1e-4·‖X‖_F is left out, all but 2 % at 1e-5·‖X‖_F; `span_of` (tiles) takes each whole."""
    from hf_spanattn.ops.spans import span_of, span_without_sync

    gen = torch.Generator().manual_seed(0)
    t, d = 64, 16
    left, _ = torch.linalg.qr(torch.randn(t, d, generator=gen, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    sigma = torch.ones(d, dtype=torch.float64)
    sigma[-1] = weak * d ** 0.5  # ‖X‖_F ≈ √d
    x = ((left * sigma) @ right.T).float()
    weak_direction = torch.linalg.svd(x.double(), full_matrices=False).U[:, -1]
    fused, tiles = ((span(x[None]).basis[0].double().T @ weak_direction).square().sum().item()
                    for span in (span_without_sync, span_of))
    assert abs(tiles - 1) < 1e-5
    expected = {1e-3: (1 - 1e-4, 1.0), 1e-4: (0.7, 0.85), 1e-5: (0.0, 0.03)}[weak]
    assert expected[0] <= fused <= expected[1] + 1e-6
