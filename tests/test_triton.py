"""The Triton kernels (`ops/triton/`) against float64 torch products of the same operands, and the
forward against SDPA. Without CUDA they run in Triton's interpreter on CPU tensors; with CUDA (and
TRITON_INTERPRET unset) the same tests run compiled on the GPU."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from reference import reference
from test_engine import make, random_float_mask, rel
from test_fused import case_inputs, float32
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_spanattn import SpanAttentionConfig, span_attention
from hf_spanattn.ops import attention

pytest.importorskip("triton")

from hf_spanattn.ops.triton import KeyMask, flash, key_mask  # noqa: E402
from hf_spanattn.ops.triton import backend as triton_backend  # noqa: E402

# conftest.py sets TRITON_INTERPRET=1 without CUDA
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _inputs(b=2, h_q=4, h_kv=2, t=40, d=32, dv=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, t, d, generator=gen) for h in (h_q, h_kv))
    v = torch.randn(b, h_kv, t, dv or d, generator=gen)
    d_out = torch.randn(b, h_q, t, dv or d, generator=gen)
    return tuple(x.to(DEVICE, dtype) for x in (q, k, v, d_out))


def _padding(b, s, lengths):
    bias = torch.zeros(b, s)
    for i, n in enumerate(lengths):
        bias[i, n:] = float("-inf")
    return bias.to(DEVICE)


def _reference(q, k, v, d_out, scale, causal=False, bias=None, keep=None, p_drop=0.0):
    """float64 O, P and G (G = ∂L/∂S with the factor scale), per query head; `keep` the dropout mask."""
    q, k, v, d_out = (x.double() for x in (q, k, v, d_out))
    g = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(g, dim=1) for x in (k, v))
    s = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias.double()[:, None, None, :]
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    drop = keep.double() / (1 - p_drop) if keep is not None else 1.0
    out = (p * drop) @ v
    dp = (d_out @ v.transpose(-1, -2)) * drop
    grad = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    return out, p, grad


def _group_sum(x, h_kv):
    b, h, t, w = x.shape
    return x.reshape(b, h_kv, h // h_kv, t, w).sum(2)


def _close(actual, expected, rel):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("causal,padded,h_q,h_kv", [(True, False, 2, 2), (False, True, 4, 2), (True, True, 4, 1)])
def test_forward_is_sdpa(causal, padded, h_q, h_kv):
    q, k, v, _ = _inputs(h_q=h_q, h_kv=h_kv, t=50, d=16)
    bias = _padding(2, 50, [50, 33]) if padded else None
    mask = (bias == 0)[:, None, None, :] if padded else None
    if causal and padded:
        mask = mask & torch.ones(50, 50, dtype=torch.bool, device=DEVICE).tril()
    out, lse = flash.forward(q, k, v, scale=0.25, causal=causal, key_bias=bias)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and not padded,
                                              scale=0.25, enable_gqa=True)
    _close(out, expected, 1e-5)
    s = 0.25 * q.double() @ k.double().repeat_interleave(h_q // h_kv, 1).transpose(-1, -2)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    elif causal:
        s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    _close(flash.logsumexp(lse), torch.logsumexp(s, dim=-1), 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_products_are_torch_products(causal):
    """dV, G·X_i for key-side X (K and two others) and Gᵀ·Y_j for query-side Y (Q and another),
    summed over the query heads of a key/value head, padded keys, T not a multiple of the tile."""
    q, k, v, d_out = _inputs(t=40, d=32)
    bias = _padding(2, 40, [40, 27])
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 2, 40, 32, generator=gen).to(DEVICE), torch.randn(2, 2, 40, 16, generator=gen).to(DEVICE),
          torch.randn(2, 4, 40, 16, generator=gen).to(DEVICE)]  # the last one per query head
    ys = [torch.randn(2, 4, 40, 32, generator=gen).to(DEVICE)]
    out, lse = flash.forward(q, k, v, scale=0.2, causal=causal, key_bias=bias)
    got = flash.backward(q, k, v, out, lse, d_out, scale=0.2, causal=causal, key_bias=bias,
                         key_operands=[k, *xs], query_operands=[q, *ys])
    ref_out, _, grad = _reference(q, k, v, d_out, 0.2, causal, bias)
    _close(out, ref_out, 1e-5)
    p = _reference(q, k, v, d_out, 0.2, causal, bias)[1]
    _close(got.dv, _group_sum(p.transpose(-1, -2) @ d_out.double(), 2), 1e-5)
    for x, product in zip([k, *xs], got.key_side, strict=True):
        _close(product, grad @ x.double().repeat_interleave(4 // x.shape[1], 1), 1e-5)
    for y, product in zip([q, *ys], got.query_side, strict=True):
        _close(product, _group_sum(grad.transpose(-1, -2) @ y.double(), 2), 1e-5)


def test_products_in_several_launches(monkeypatch):
    """Operand lists wider than one launch takes are cut into groups; dV comes from the first."""
    monkeypatch.setattr(flash, "MAX_WIDTH", 32)
    q, k, v, d_out = _inputs(b=1, h_q=2, h_kv=1, t=24, d=16)
    xs = [k * 2, k - 1, k.flip(-2)]
    ys = [q * 3, q.flip(-2), q + 1]
    out, lse = flash.forward(q, k, v, scale=0.3, causal=True)
    got = flash.backward(q, k, v, out, lse, d_out, scale=0.3, causal=True, key_operands=xs, query_operands=ys)
    _, p, grad = _reference(q, k, v, d_out, 0.3, causal=True)
    _close(got.dv, _group_sum(p.transpose(-1, -2) @ d_out.double(), 1), 1e-5)
    for x, product in zip(xs, got.key_side, strict=True):
        _close(product, grad @ x.double().repeat_interleave(2, 1), 1e-5)
    for y, product in zip(ys, got.query_side, strict=True):
        _close(product, _group_sum(grad.transpose(-1, -2) @ y.double(), 1), 1e-5)


def test_blocks_in_one_launch():
    """A block axis on Q and K: each block is attention on (Q_B, K_B, V) with the shared ∂L/∂O."""
    q, k, v, d_out = _inputs(b=1, h_q=4, h_kv=2, t=33, d=16)
    gen = torch.Generator().manual_seed(2)
    q_blocks = torch.randn(3, *q.shape, generator=gen).to(DEVICE)
    k_blocks = torch.randn(3, *k.shape, generator=gen).to(DEVICE)
    bias = _padding(1, 33, [30])
    out, lse = flash.forward(q_blocks, k_blocks, v, scale=0.25, causal=True, key_bias=bias)
    got = flash.backward(q_blocks, k_blocks, v, out, lse, d_out, scale=0.25, causal=True, key_bias=bias,
                         key_operands=[k_blocks], query_operands=[q_blocks], want_dv=False)
    assert got.dv is None and got.key_side[0].shape == q_blocks.shape and got.query_side[0].shape == k_blocks.shape
    for n in range(3):
        ref_out, _, grad = _reference(q_blocks[n], k_blocks[n], v, d_out, 0.25, True, bias)
        _close(out[n], ref_out, 1e-5)
        _close(got.key_side[0][n], grad @ k_blocks[n].double().repeat_interleave(2, 1), 1e-5)
        _close(got.query_side[0][n], _group_sum(grad.transpose(-1, -2) @ q_blocks[n].double(), 2), 1e-5)


@pytest.mark.parametrize("d,dv", [(24, 24), (64, 16), (128, 128)])
def test_head_dims(d, dv):
    """Head dims that are not powers of two (loads masked to the tile) and a V narrower than Q, K."""
    q, k, v, d_out = _inputs(b=1, h_q=2, h_kv=2, t=20, d=d, dv=dv)
    out, lse = flash.forward(q, k, v, scale=d**-0.5, causal=True)
    got = flash.backward(q, k, v, out, lse, d_out, scale=d**-0.5, causal=True, key_operands=[k], query_operands=[q])
    ref_out, p, grad = _reference(q, k, v, d_out, d**-0.5, True)
    _close(out, ref_out, 1e-5)
    _close(got.dv, p.transpose(-1, -2) @ d_out.double(), 1e-5)
    _close(got.key_side[0], grad @ k.double(), 1e-5)
    _close(got.query_side[0], grad.transpose(-1, -2) @ q.double(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    """Half inputs, float32 accumulation: the products against float64 on the same (rounded) inputs."""
    q, k, v, d_out = _inputs(b=1, t=48, d=32, dtype=dtype)
    x = (k * 0.5).flip(-2)
    out, lse = flash.forward(q, k, v, scale=32**-0.5, causal=True)
    got = flash.backward(q, k, v, out, lse, d_out, scale=32**-0.5, causal=True, key_operands=[k, x],
                         query_operands=[q])
    assert out.dtype == dtype and got.dv.dtype == dtype and got.key_side[0].dtype == torch.float32
    ref_out, p, grad = _reference(q, k, v, d_out, 32**-0.5, True)
    _close(out, ref_out, 1e-2)
    _close(got.dv, _group_sum(p.transpose(-1, -2) @ d_out.double(), 2), 1e-2)
    _close(got.key_side[0], grad @ k.double().repeat_interleave(2, 1), 2e-2)
    _close(got.key_side[1], grad @ x.double().repeat_interleave(2, 1), 2e-2)
    _close(got.query_side[0], _group_sum(grad.transpose(-1, -2) @ q.double(), 2), 2e-2)


def test_rows_that_attend_nothing():
    """A −inf key bias over a whole sequence: output 0 and no gradient (SDPA under a bool mask); the
    dtype's minimum instead: the softmax's true value, the uniform average. SDPA's math backend gives
    it on every device (CUDA's fused kernels give 0 there, the CPU's the average)."""
    q, k, v, d_out = _inputs(b=2, h_q=2, h_kv=2, t=16, d=16)
    bias = _padding(2, 16, [16, 0])
    out, lse = flash.forward(q, k, v, scale=0.25, key_bias=bias)
    got = flash.backward(q, k, v, out, lse, d_out, scale=0.25, key_bias=bias, key_operands=[k], query_operands=[q])
    assert out[1].abs().max() == 0 and torch.isneginf(flash.logsumexp(lse[1])).all()
    for x in (got.dv[1], got.key_side[0][1], got.query_side[0][1]):
        assert x.abs().max() == 0
    lowest = bias.clamp_min(torch.finfo(torch.float32).min)
    out, _ = flash.forward(q, k, v, scale=0.25, key_bias=lowest)
    with sdpa_kernel(SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=lowest[:, None, None, :], scale=0.25)
    _close(out, expected, 1e-6)


def test_dropout_mask_is_shared_by_forward_and_backward():
    """Dropout's kept entries, read off the forward with V = I (O = P∘M/(1 − p)), give the float64
    reference of the output and of every backward product; another seed draws another mask."""
    t, p_drop = 32, 0.25
    q, k, v, d_out = _inputs(b=1, h_q=2, h_kv=1, t=t, d=16)
    seed = flash.new_seed(q.device)
    eye = torch.eye(t, device=DEVICE).expand(1, 1, t, t)
    dropped, _ = flash.forward(q, k, eye, scale=0.25, causal=True, dropout_p=p_drop, seed=seed)
    _, p, _ = _reference(q, k, eye, torch.zeros_like(dropped), 0.25, True)
    keep = dropped.double().cpu() > 0
    assert torch.allclose(dropped.double().cpu(), torch.where(keep, p.cpu() / (1 - p_drop), 0.0), atol=1e-6)
    kept = keep[p.cpu() > 0].double().mean()
    assert 0.65 < kept < 0.85
    out, lse = flash.forward(q, k, v, scale=0.25, causal=True, dropout_p=p_drop, seed=seed)
    got = flash.backward(q, k, v, out, lse, d_out, scale=0.25, causal=True, dropout_p=p_drop, seed=seed,
                         key_operands=[k], query_operands=[q])
    keep = keep.to(DEVICE)
    ref_out, p, grad = _reference(q, k, v, d_out, 0.25, True, keep=keep, p_drop=p_drop)
    _close(out, ref_out, 1e-5)
    _close(got.dv, _group_sum((p * keep / (1 - p_drop)).transpose(-1, -2) @ d_out.double(), 1), 1e-5)
    _close(got.key_side[0], grad @ k.double().repeat_interleave(2, 1), 1e-5)
    _close(got.query_side[0], _group_sum(grad.transpose(-1, -2) @ q.double(), 1), 1e-5)
    other, _ = flash.forward(q, k, eye, scale=0.25, causal=True, dropout_p=p_drop, seed=flash.new_seed(q.device))
    assert not torch.equal(other > 0, dropped > 0)


def _masks(b, t):
    """SDPA masks: (mask, whether it has the kernels' form)."""
    lengths = torch.tensor([t, t - 5], device=DEVICE)
    valid = torch.arange(t, device=DEVICE) < lengths[:, None]  # right padding
    left = valid.flip(-1)  # left padding
    past = torch.ones(t, t, dtype=torch.bool, device=DEVICE).tril()
    lowest = torch.finfo(torch.float32).min
    distance = (torch.arange(t)[:, None] - torch.arange(t)).clamp_min(0).float().to(DEVICE)
    additive = lambda m: torch.zeros(m.shape, device=DEVICE).masked_fill(~m, lowest)
    return [
        (valid[:, None, None, :], True),
        (additive(valid[:, None, None, :]), True),
        (valid[:, None, None, :].expand(b, 2, t, t), True),
        (valid[:, None, None, :] & past, True),  # Transformers' padded causal mask
        (additive(valid[:, None, None, :] & past), True),
        (left[:, None, None, :] & past, True),
        (additive(left[:, None, None, :] & past), False),  # rows with no key: SDPA's average over all S keys
        ((valid[:, None, None, :] & past).expand(b, 2, t, t).clone(), True),
        (torch.rand(b, 1, t, t, generator=torch.Generator().manual_seed(0)).to(DEVICE) > 0.3, False),
        (past.triu(-3)[None, None], False),  # a sliding window
        (additive(valid[:, None, None, :] & past) + 0.5 * past[None, None], True),  # the same bias for every key
        (additive(valid[:, None, None, :] & past) - 0.1 * distance[None, None], False),  # ALiBi's bias
    ]


@pytest.mark.parametrize("case", range(12))
def test_key_mask(case):
    """A mask has the kernels' form exactly where the forward on it is SDPA's."""
    mask, reducible = _masks(2, 12)[case]
    form = key_mask(mask)
    assert isinstance(form, KeyMask) == reducible
    if isinstance(form, KeyMask):
        q, k, v, _ = _inputs(h_q=2, h_kv=2, t=12, d=16)
        out, _ = flash.forward(q, k, v, scale=0.25, causal=form.causal, key_bias=form.bias)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        _close(out, expected.nan_to_num(0.0), 1e-5)
        if mask.shape[-2] > 1 and mask.stride(-2):  # compared once, then remembered for the tensor
            assert key_mask(mask) is form


def test_key_mask_of_causal_call():
    assert key_mask(None, is_causal=True).causal and key_mask(None).bias is None


# ---- the backend: every rule through the kernels ---------------------------------------------------

RULE_LABELS = ["standard:QKV101", "simple:10", "reductionistic:1100", "score:1000", "score:1100", "score:1111",
               "score:0.5,2,0,1.5", "score:1000@per_block", "score:1111@per_block", "score:0.5,2,0,1.5@per_block"]
RULE_CASES = ["causal", "gqa_padded_scale", "padded_to_d", "short_rows", "gqa", "t_lt_d", "t_eq_d", "first_rows_dead",
              "repeated_rows", "zero_rows", "float_padding"]
# the default run: each rule once, the cases spread over them (causal, padded, GQA, rank-deficient T ≤ d)
QUICK = {("standard:QKV101", "gqa_padded_scale"), ("simple:10", "short_rows"), ("reductionistic:1100", "t_eq_d"),
         ("score:1000", "gqa_padded_scale"), ("score:1100", "padded_to_d"), ("score:1111", "causal"),
         ("score:0.5,2,0,1.5", "short_rows"), ("score:1000@per_block", "short_rows"),
         ("score:1111@per_block", "t_lt_d"), ("score:0.5,2,0,1.5@per_block", "float_padding")}


def run_triton(inputs, d_out, config, **kwargs):
    leaves = [x.detach().to(DEVICE).requires_grad_(True) for x in inputs]
    kwargs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="backend=.triton. runs on")  # no fallback
        out = span_attention(*leaves, config=config, backend="triton", **kwargs)
        return out, torch.autograd.grad(out, leaves, d_out.to(DEVICE))


@pytest.mark.parametrize("label,case", [(label, case) if (label, case) in QUICK else
                                        pytest.param(label, case, marks=pytest.mark.slow)
                                        for label in RULE_LABELS for case in RULE_CASES])
def test_rules_match_float64_reference(label, case):
    """Every rule and both readings in float32 against the float64 reference: causal, padded, GQA and
    rank-deficient K (T ≤ d, repeated or zero rows)."""
    config = SpanAttentionConfig.from_label(label)
    if case == "float_padding":  # Transformers' additive padding mask, (B, 1, 1, S)
        inputs, d_out = make(h_q=2, h_kv=1, t=12, d=8)
        kwargs = dict(attn_mask=torch.zeros(2, 1, 1, 12, dtype=torch.float64).masked_fill(
            torch.arange(12) >= torch.tensor([12, 7])[:, None, None, None], torch.finfo(torch.float32).min))
    else:
        inputs, d_out, kwargs = case_inputs(case)
    if config.rule.per_block and (label, case) in QUICK and "attn_mask" not in kwargs:  # the interpreter's pace
        inputs, d_out = [x[:1, :2] for x in inputs], d_out[:1, :2]
    ref_out, ref_grads = reference(*inputs, d_out, config, **kwargs)
    _, std_grads = reference(*inputs, d_out, SpanAttentionConfig(method="standard"), **kwargs)
    out, grads = run_triton([x.float() for x in inputs], d_out.float(), config, **float32(kwargs))
    assert rel(out.cpu(), ref_out) < 1e-5
    for name, g, r, std in zip("qkv", grads, ref_grads, std_grads):
        assert g.dtype == torch.float32
        assert rel(g.cpu(), r, std) < 1e-4, f"d{name}: {rel(g.cpu(), r, std):.2e}"


@pytest.mark.parametrize("label", ["score:1000", pytest.param("score:1111@per_block", marks=pytest.mark.slow),
                                   pytest.param("simple:10", marks=pytest.mark.slow)])
def test_bf16_inputs_through_the_backend(label):
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(b=1, t=32, d=16, h_q=2, h_kv=1)
    _, ref_grads = reference(*inputs, d_out, config, is_causal=True)
    out, grads = run_triton([x.bfloat16() for x in inputs], d_out.bfloat16(), config, is_causal=True)
    assert out.dtype == torch.bfloat16
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and rel(g.float().cpu(), r) < 2e-2


@pytest.mark.parametrize("label", ["score:1100", pytest.param("reductionistic:1100", marks=pytest.mark.slow),
                                   "score:1100@per_block"])
def test_dropout_through_the_backend(label):
    """The kernels' dropout mask (read off V = I under the same seed) in the float64 reference: the
    forward pass, the backward pass and every block use it."""
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(b=1, h_q=2, h_kv=1, t=16, d=8, dtype=torch.float32)
    p = 0.3
    torch.manual_seed(5)
    eye = torch.eye(16).expand(1, 1, 16, 16).to(DEVICE)
    dropped, _ = flash.forward(q.to(DEVICE), k.to(DEVICE), eye, scale=8**-0.5, causal=True, dropout_p=p,
                               seed=flash.new_seed(torch.device(DEVICE)))
    keep = (dropped != 0).cpu()
    torch.manual_seed(5)
    out, grads = run_triton((q, k, v), d_out, config, is_causal=True, dropout_p=p)
    ref_out, ref_grads = reference(q, k, v, d_out, config, is_causal=True, keep=keep, dropout_p=p)
    _, std_grads = reference(q, k, v, d_out, SpanAttentionConfig(method="standard"), is_causal=True, keep=keep,
                             dropout_p=p)
    assert rel(out.cpu(), ref_out) < 1e-5
    for g, r, std in zip(grads, ref_grads, std_grads):
        assert rel(g.cpu(), r, std) < 1e-4


def test_blocks_run_in_one_launch(monkeypatch):
    """The per-block rule: one forward and one backward launch over all its blocks, one for dV."""
    calls = []
    inputs, d_out = make(b=1, h_q=1, h_kv=1, t=16, d=8, dtype=torch.float32)
    config = SpanAttentionConfig.from_label("score:1100@per_block")
    run_triton(inputs, d_out, config, is_causal=True)  # the first call of a kernel variant checks it once
    for name in ("forward", "backward"):
        original = getattr(flash, name)
        monkeypatch.setattr(flash, name, lambda *a, _f=original, _n=name, **kw: calls.append((_n, a[0].dim())) or
                            _f(*a, **kw))
    run_triton(inputs, d_out, config, is_causal=True)
    assert sorted(calls) == [("backward", 4), ("backward", 5), ("forward", 4), ("forward", 5)]


@pytest.mark.parametrize("label", ["score:1100", "score:1100@per_block"])
def test_the_probe_runs_on_the_kernels(label):
    """The diagnostics are glue (`backward.rule_grads`): from the kernels they record what the tiles do."""
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(b=1, h_q=2, h_kv=1, t=10, dtype=torch.float32)
    records = {}
    for name in ("triton", "tiles"):
        calls = []
        leaves = [x.clone().to(DEVICE).requires_grad_(True) for x in inputs]
        out = attention.BACKENDS[name](*leaves, None, 0.0, True, 0.5, config, calls.append)
        out.backward(d_out.to(DEVICE))
        records[name] = calls
    assert len(records["triton"]) == 1
    for key in ("dq", "dk", "dq_standard", "dk_standard", "rank_k", "rank_v"):
        tiles_value = torch.cat([r[key] for r in records["tiles"]])
        assert rel(records["triton"][0][key].cpu(), tiles_value.cpu()) < 1e-5, key
    for key in ("dq_orders", "dk_orders"):
        for a, b in zip(records["triton"][0][key], records["tiles"][0][key], strict=True):
            assert rel(a.cpu(), b.cpu(), records["triton"][0][key.replace("_orders", "")].cpu()) < 1e-5, key


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(triton_backend, "_warned", set())


@pytest.mark.parametrize("why", ["mask", "head_dim", "missing", "kernel"])
def test_falls_back_to_fused_with_one_warning(why, monkeypatch, fresh_warnings):
    config = SpanAttentionConfig.from_label("score:1100")
    inputs, d_out = make(b=1, h_q=2, h_kv=2, t=12, d=160 if why == "head_dim" else 8, dtype=torch.float32)
    kwargs = dict(attn_mask=random_float_mask(1, 12).float()) if why == "mask" else dict(is_causal=True)
    if why == "missing":
        monkeypatch.setattr(triton_backend, "missing", lambda: "Triton is not installed")
    if why == "kernel":
        monkeypatch.setattr(triton_backend, "_checked", {})
        monkeypatch.setattr(flash, "forward", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no kernel image")))
    expected = {"mask": "attn_mask", "head_dim": "head dims", "missing": "not installed", "kernel": "no kernel image"}
    leaves = [x.detach().to(DEVICE).requires_grad_(True) for x in inputs]
    kwargs = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kwargs.items()}
    with pytest.warns(UserWarning, match=expected[why]) as record:
        out = span_attention(*leaves, config=config, backend="triton", **kwargs)
    assert len(record) == 1 and "backend='fused'" in str(record[0].message)
    grads = torch.autograd.grad(out, leaves, d_out.to(DEVICE))
    ref_out, ref_grads = reference(*inputs, d_out, config, **{k: v.cpu() if torch.is_tensor(v) else v
                                                               for k, v in kwargs.items()})
    assert rel(out.cpu(), ref_out) < 1e-5 and all(rel(g.cpu(), r) < 1e-4 for g, r in zip(grads, ref_grads))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="backend=.triton. runs on")  # once per reason
        span_attention(*leaves, config=config, backend="triton", **kwargs)


def test_a_learnable_key_bias_gets_sdpas_gradient_on_the_fused_kernels(fresh_warnings):
    """A key-padding-shaped float mask that needs a gradient (a learnable bias per key): the kernels take the bias as a
    constant, so the call runs on fused, saying why, and the bias gets SDPA's gradient (it got none)."""
    q, k, v, d_out = _inputs(b=1, h_q=2, h_kv=2, t=16, d=8)
    bias = (0.1 * torch.randn(1, 1, 1, 16, generator=torch.Generator().manual_seed(1))).to(DEVICE)
    leaves = [x.requires_grad_(True) for x in (q, k, v, bias)]
    with pytest.warns(UserWarning, match="backend='fused' here: attn_mask needs a gradient"):
        out = span_attention(*leaves[:3], attn_mask=leaves[3], config="score:1100", backend="triton")
    (got,) = torch.autograd.grad(out, leaves[3], d_out)
    want = F.scaled_dot_product_attention(*(x.detach().cpu().double() for x in (q, k, v)),
                                          attn_mask=(bias := leaves[3].detach().cpu().double().requires_grad_()))
    (want_grad,) = torch.autograd.grad(want, bias, d_out.cpu().double())
    assert rel(got.cpu().double(), want_grad) < 1e-5


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter's NumPy, at scores of -3e38
def test_a_key_bias_past_the_float32_range_in_log2_units_is_sdpas():
    """A float key bias above float32's largest / log2(e) (2.4e38) became +inf in the kernels' log2 units: NaN output
    and gradients where SDPA's are finite. Two such keys keep their order (3e38 wins over 2.5e38, as in SDPA)."""
    q, k, v, d_out = _inputs(b=2, h_q=2, h_kv=2, t=16, d=8)
    bias = torch.zeros(2, 1, 1, 16)
    bias[0, ..., 3], bias[0, ..., 5], bias[1, ..., 7] = 3e38, 2.5e38, -3e38
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    out = span_attention(*leaves, attn_mask=bias.to(DEVICE), config="score:1111", backend="triton")
    grads = torch.autograd.grad(out, leaves, d_out)
    ref = [x.detach().cpu().double().requires_grad_(True) for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=bias.double())
    want_grads = torch.autograd.grad(want, ref, d_out.cpu().double())
    assert rel(out.cpu().double(), want) < 1e-5 and all(rel(g.cpu(), r) < 1e-4 for g, r in zip(grads, want_grads))


@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min])
@pytest.mark.parametrize("causal", [False, True])
def test_a_sequence_with_every_key_under_a_finite_mask_gets_the_tiles_gradients(fill, causal):
    """A float mask that leaves a row no key above MASKED_AT (a sequence all padding, or the first rows of a left-padded
    one): its scores and log-sum-exp sit near the fill, where the float32 log-sum-exp lost log2 of the row's sum, so P
    summed to T (dV T times too large) or to 0 in the backward pass; and the row passed gradient to Q and K. Now the
    tiles' output and gradients: SDPA's dV, none to Q and K from that row."""
    q, k, v, d_out = _inputs(b=2, h_q=2, h_kv=1, t=16, d=8)
    attend = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    attend[0] = False  # sequence 0 all padding
    attend[1, ..., :5] = False  # sequence 1 left-padded: under the causal mask its first 5 rows attend nothing
    if causal:
        attend &= torch.ones(16, 16, dtype=torch.bool).tril()
    mask = torch.zeros(2, 1, 16, 16).masked_fill(~attend, fill)
    if causal:  # the causal entries -inf, as the kernels take it with a key bias
        mask = mask.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    else:
        mask = mask[:, :, :1]  # (B, 1, 1, S)
    results = {}
    for backend in ("triton", "tiles"):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="backend=.triton. runs on")  # no fallback
            out = span_attention(*leaves, attn_mask=mask.to(DEVICE), config="score:1111", backend=backend)
        results[backend] = (out, *torch.autograd.grad(out, leaves, d_out))
    for got, want in zip(results["triton"], results["tiles"], strict=True):
        _close(got, want, 1e-5)


def test_calls_from_threads_at_once_get_their_own_results():
    """Threads calling the kernels at once (a data loader's, nn.DataParallel's replicas): under TRITON_INTERPRET=1
    launches from two threads failed inside Triton's interpreter, which swaps module globals while a kernel runs.
    Each call gets the output and gradients it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    calls = [_inputs(b=1, h_q=2, h_kv=1, t=8, d=8, seed=seed) for seed in range(6)]

    def call(inputs):
        leaves = [x.detach().clone().requires_grad_(True) for x in inputs[:3]]
        out = span_attention(*leaves, is_causal=True, config="score:1100", backend="triton")
        return (out, *torch.autograd.grad(out, leaves, inputs[3]))

    alone = [call(inputs) for inputs in calls]
    with ThreadPoolExecutor(3) as pool:
        for got, want in zip(pool.map(call, calls), alone, strict=True):
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [3e4, -1e5])
@pytest.mark.parametrize("label", ["score:1111", "score:1100@per_block"])
def test_float16_with_a_scale_past_the_half_range_is_finite(label, scale):
    """scale·∂L/∂P passes 65504 while the scores stay O(1): G was rounded to float16 with the factor scale in it for the
    tile products, inf and NaN in dQ and dK where SDPA's are finite. Now as close to the rule's float64 gradients
    on the same inputs as SDPA's float16 math kernel is to its float64 one (or within 4 ulp)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    inputs = [(q * 2 / abs(scale) ** 0.5).half(), (k / abs(scale) ** 0.5).half(), v.half()]
    d_out = (4 * torch.randn(1, 2, 16, 8, generator=gen)).half()

    def grads(inputs, **kwargs):
        leaves = [x.detach().clone().to(DEVICE).requires_grad_(True) for x in inputs]
        with sdpa_kernel(SDPBackend.MATH):
            out = (span_attention if kwargs else F.scaled_dot_product_attention)(*leaves, is_causal=True, scale=scale,
                                                                                 **kwargs)
        return torch.autograd.grad(out, leaves, d_out.to(DEVICE, out.dtype))

    wide = [x.double() for x in inputs]
    got, sdpa, want, sdpa_wide = (grads(inputs, config=label, backend="triton"), grads(inputs),
                                  grads(wide, config=label, backend="tiles"), grads(wide))
    for g, s, w, sw in zip(got, sdpa, want, sdpa_wide, strict=True):
        assert torch.isfinite(g).all()
        assert rel(g.cpu(), w.cpu()) < max(2 * rel(s.cpu(), sw.cpu()), 4 * torch.finfo(torch.float16).eps)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter")
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_torch_compile_under_the_interpreter_runs_on_fused(fresh_warnings):
    """torch.compile traced into Triton's interpreter (TRITON_INTERPRET=1) and failed on its NumPy (KeyError:
    torch.uint64). Now the call runs on fused with a warning that says so, with the tiles' gradients."""
    with pytest.warns(UserWarning, match="runs on backend='fused' here: Triton's interpreter"):
        torch.compile(span_attention, backend="eager")(*(x.requires_grad_(True) for x in _inputs(b=1, t=8, d=8)[:3]),
                                                       is_causal=True, backend="triton")
    q, k, v, d_out = _inputs(b=1, h_q=2, h_kv=2, t=8, d=8)
    results = []
    for fn, backend in ((torch.compile(span_attention, backend="eager"), "triton"), (span_attention, "tiles")):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves, is_causal=True, config="score:1100", backend=backend)
        results.append((out, *torch.autograd.grad(out, leaves, d_out)))
    for got, want in zip(*results, strict=True):
        _close(got, want, 1e-5)


def test_float64_falls_back_to_tiles(fresh_warnings):
    inputs, d_out = make(t=12, d=8)
    with pytest.warns(UserWarning, match="backend='tiles'"):
        out = span_attention(*(x.to(DEVICE).requires_grad_(True) for x in inputs),
                             config=SpanAttentionConfig.from_label("score:1000"), backend="triton", is_causal=True)
    assert out.dtype == torch.float64


def test_backend_for_names_the_backend_that_runs(monkeypatch, fresh_warnings):
    """What a run records as its attention backend: run_clm.py wrote HF_SPANATTN_BACKEND=triton for a CPU run
    without TRITON_INTERPRET, which trained on fused."""
    monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    assert attention.backend_for("cpu") == "tiles" and attention.backend_for("cuda") == "fused"
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.backend_for("cpu") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert attention.backend_for("cpu") == "fused" and attention.backend_for("cpu", torch.float64) == "tiles"
    inputs, _ = make(t=8, d=8, dtype=torch.float32)
    with pytest.warns(UserWarning, match="runs on backend='fused' here: the kernels need CUDA"):
        span_attention(*(x.requires_grad_(True) for x in inputs), config="score:1000", is_causal=True)  # as a run
    monkeypatch.setattr(triton_backend, "missing", lambda: "Triton is not installed")
    assert attention.backend_for("cuda") == "fused"
    assert attention.backend_for("cuda", backend="tiles") == "tiles"


def test_backend_for_float64_names_the_tiles_where_the_kernels_can_run(monkeypatch, fresh_warnings):
    """backend_for said 'triton' for float64 on a device the kernels run on, where every call runs on the tiles."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    assert attention.backend_for(DEVICE, torch.float64) == "tiles"
    assert attention.backend_for(DEVICE, torch.float32) == "triton"
    inputs, _ = make(t=8, d=8)
    with pytest.warns(UserWarning, match="runs on backend='tiles' here"):
        span_attention(*(x.to(DEVICE).requires_grad_(True) for x in inputs), config="score:1000", is_causal=True)


@pytest.mark.parametrize("value, interprets", [("1", True), ("true", True), ("ON", True), ("Yes", True), ("y", True),
                                               ("0", False), ("2", False), (" 1", False), ("off", False)])
def test_triton_interpret_is_read_as_triton_reads_it(value, interprets, monkeypatch):
    """TRITON_INTERPRET=true made Triton interpret, while the kernels were told it did not (only "1" counted): CPU
    tensors ran on fused, saying the kernels need CUDA."""
    monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", value)
    from triton import knobs

    assert knobs.runtime.interpret is interprets  # Triton's own reading
    assert attention.backend_for("cpu", backend="triton") == ("triton" if interprets else "fused")


@pytest.mark.parametrize("value, tunes", [(None, True), ("1", True), (" Yes ", True), ("on", True), ("true", True),
                                          ("0", False), ("off", False), ("FALSE", False), (" no\n", False)])
def test_triton_tuning_takes_the_usual_spellings(value, tunes):
    """HF_SPANATTN_TRITON_TUNE: off, false and no turn autotuning off as 0 does (they tuned before), without a word."""
    from hf_spanattn.ops.triton import kernels

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.tuning(value) is tunes


@pytest.mark.parametrize("value", ["2", "of", "disable", "x" * 10**5])
def test_triton_tuning_warns_for_another_value_naming_the_variable(value):
    from hf_spanattn.ops.triton import kernels

    with pytest.warns(UserWarning, match=r"HF_SPANATTN_TRITON_TUNE=.* is not one of 0, off, false, no .* the kernels "
                                         r"autotune") as caught:
        assert kernels.tuning(value) is True
    assert len(str(caught[0].message)) < 500  # a huge value is cut


def test_the_tuning_warning_names_the_line_whose_call_imported_the_kernels():
    """It named kernels.py, the module whose import read the variable."""
    import subprocess
    import sys

    code = ("import warnings, torch, hf_spanattn\n"
            "q = torch.randn(1, 1, 3, 2, requires_grad=True)\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    hf_spanattn.span_attention(q, q, q, backend='triton')\n"
            "print([(w.filename, w.lineno) for w in caught if 'HF_SPANATTN_TRITON_TUNE' in str(w.message)])\n")
    env = {**os.environ, "HF_SPANATTN_TRITON_TUNE": "maybe", "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.strip().splitlines()[-1] == "[('<string>', 5)]", run.stdout + run.stderr


def test_environment_picks_triton(monkeypatch):
    """HF_SPANATTN_BACKEND=triton selects it; auto does not (fused on CUDA, tiles on the CPU)."""
    seen = []
    for name in ("triton", "tiles", "fused"):
        monkeypatch.setitem(attention.BACKENDS, name, lambda *a, _n=name, **kw: seen.append(_n) or a[0])
    inputs, _ = make(t=8, d=8, dtype=torch.float32)
    leaves = [x.to(DEVICE).requires_grad_(True) for x in inputs]
    config = SpanAttentionConfig.from_label("score:1000")
    span_attention(*leaves, config=config, is_causal=True)
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    span_attention(*leaves, config=config, is_causal=True)
    assert seen == ["tiles" if DEVICE == "cpu" else "fused", "triton"]


# ---- a model: Transformers' GPT-2 on the kernels -------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpt2(attn_pdrop: float, device: str, label: str = "score:1100"):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_spanattn import patch_model

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=97, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=attn_pdrop)
    model = patch_model(GPT2LMHeadModel(config), label).to(device)
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids


def grads_of(model, ids) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def test_gpt2_step_matches_the_tiles(monkeypatch):
    """A patched GPT-2's gradients on the kernels equal those on the tiles (the backend chosen by
    HF_SPANATTN_BACKEND, as a training script sets it)."""
    model, ids = gpt2(0.0, DEVICE)
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "tiles" if DEVICE == "cpu" else "fused")
    expected = grads_of(model, ids)
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="backend=.triton. runs on")  # no fallback
        got = grads_of(model, ids)
    for g, e in zip(got, expected, strict=True):
        assert rel(g.cpu(), e.cpu()) < 1e-4


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("label", ["score:1000", "score:1111@per_block"])
def test_cuda_train_step_never_synchronises(label, monkeypatch):
    """A bf16-autocast GPT-2 train step (attention dropout 0.1, AdamW) on the kernels with CUDA's sync
    debug mode raising on any host synchronisation, after a warm-up step (autotuning, first checks)."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    model, ids = gpt2(0.1, "cuda", label)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="backend=.triton. runs on")  # no fallback
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@cuda
@pytest.mark.gpu
def test_cuda_graph_of_a_train_step(monkeypatch):
    """Forward and backward of a GPT-2 captured in a CUDA graph: a replay gives the eager step's
    gradients. The attention runs on the kernels where Transformers passes no mask under capture, and on
    fused where it builds the causal mask then (5.17 does), which cannot be read during the capture."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    model, ids = gpt2(0.0, "cuda")
    expected = grads_of(model, ids)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            grads_of(model, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        model(input_ids=ids, labels=ids).loss.backward()
    for p in model.parameters():
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert rel(p.grad, e) < 1e-4


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("label,mask", [("score:1000", "causal"), ("score:1111@per_block", "key_padding")])
def test_cuda_graph_of_the_kernels(label, mask):
    """span_attention on the kernels (no fallback) captured in a CUDA graph, forward and backward: replayed
    on new inputs and new key lengths, it gives what an eager call on them gives."""
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(b=2, h_q=4, h_kv=2, t=64, d=16, dtype=torch.float32)
    leaves = [x.cuda().requires_grad_(True) for x in (q, k, v)]
    d_out = d_out.cuda()
    valid = torch.ones(2, 1, 1, 64, dtype=torch.bool, device="cuda")
    valid[1, ..., 40:] = False
    kwargs = dict(is_causal=True) if mask == "causal" else dict(attn_mask=valid)

    def step():
        out = span_attention(*leaves, config=config, backend="triton", **kwargs)
        return (out, *torch.autograd.grad(out, leaves, d_out))

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="backend=.triton. runs on")  # no fallback
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        (q, k, v), new_d_out = make(b=2, h_q=4, h_kv=2, t=64, d=16, dtype=torch.float32, seed=1)
        with torch.no_grad():
            for leaf, new in zip(leaves, (q, k, v)):
                leaf.copy_(new)
            d_out.copy_(new_d_out)
            valid[1, ..., 20:] = False
        graph.replay()
        torch.cuda.synchronize()
        expected = step()
    for got, want in zip(captured, expected, strict=True):
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("label,mask", [
    ("score:1100", "float_padding"), ("score:1111@per_block", "causal"),
    *(pytest.param(label, mask, marks=pytest.mark.slow)
      for label in ["score:1000", "score:1100", "score:1111@per_block", "reductionistic:1100", "simple:10"]
      for mask in ["causal", "padding", "float_padding"]
      if (label, mask) not in [("score:1100", "float_padding"), ("score:1111@per_block", "causal")])])
def test_no_host_synchronisation(label, mask, monkeypatch):
    """Nothing around the kernels reads the device on the host, forward or backward: the calls that
    would synchronise a CUDA device are recorded (the interpreter's own copies inside a launch are not
    the kernels' on a GPU, and are left out; the backward pass runs without the caller's mode, so it
    is entered again there). Masks broadcast over the queries, as Transformers' padding masks without
    causality."""
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(b=2, h_q=2, h_kv=1, t=12, d=8, dtype=torch.float32)
    kwargs = dict(is_causal=True)
    if mask != "causal":
        valid = (torch.arange(12) < torch.tensor([12, 7])[:, None])[:, None, None, :]
        kwargs = dict(attn_mask=valid if mask == "padding" else torch.zeros(valid.shape).masked_fill(
            ~valid, torch.finfo(torch.float32).min))
    run_triton((q, k, v), d_out, config, **kwargs)  # the first call of a kernel variant checks it once
    mode = _host_reads_around_the_kernels(monkeypatch)
    leaves = [x.to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    kwargs = {name: x.to(DEVICE) if torch.is_tensor(x) else x for name, x in kwargs.items()}
    with mode:
        out = span_attention(*leaves, config=config, backend="triton", **kwargs)
    out.backward(d_out.to(DEVICE))
    assert mode.calls == []


@pytest.mark.parametrize("mask", ["key_padding", "padded_causal"])
def test_under_graph_capture_nothing_reads_the_mask(mask, monkeypatch, fresh_warnings):
    """Under CUDA graph capture (simulated) nothing reads the device on the host, forward or backward. A
    key-padding mask broadcast over the queries reduces on the device and runs on the kernels; telling
    Transformers' padded causal mask (B, 1, T, T) from others needs a host read, so it runs on fused
    with a warning that names the capture, even though the same mask tensor was read before the capture
    (a graph's replays refill it)."""
    from test_fused import graph_capture

    from hf_spanattn.ops.triton import masks

    config = SpanAttentionConfig.from_label("score:1100")
    (q, k, v), d_out = make(b=2, h_q=2, h_kv=1, t=12, d=8, dtype=torch.float32)
    valid = (torch.arange(12) < torch.tensor([12, 7])[:, None])[:, None, None, :]
    attn_mask = (valid & torch.ones(12, 12, dtype=torch.bool).tril() if mask == "padded_causal" else valid).to(DEVICE)
    expected_out, expected = run_triton((q, k, v), d_out, config, attn_mask=attn_mask)  # kernels checked, mask read
    mode = _host_reads_around_the_kernels(monkeypatch)
    leaves = [x.to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    with graph_capture(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mode:
            out = span_attention(*leaves, config=config, backend="triton", attn_mask=attn_mask)
        grads = torch.autograd.grad(out, leaves, d_out.to(DEVICE))
    assert mode.calls == []
    fallbacks = [str(w.message) for w in caught if "runs on" in str(w.message)]
    assert fallbacks == ([] if mask == "key_padding" else [f"backend='triton' runs on backend='fused' here: "
                                                           f"{masks.CAPTURED}"])
    assert rel(out.cpu(), expected_out.cpu()) < 1e-5 and all(rel(g.cpu(), e.cpu()) < 1e-4
                                                              for g, e in zip(grads, expected))


def test_kernels_first_called_under_graph_capture_run_on_fused(monkeypatch, fresh_warnings):
    """A kernel variant is tried once before its first use, which a capture does not allow: under capture
    (simulated) an untried variant runs on fused, said once, and stays untried; the first call after the
    capture tries it and runs on the kernels."""
    from test_fused import graph_capture

    monkeypatch.setattr(triton_backend, "_checked", {})
    config = SpanAttentionConfig.from_label("score:1000")
    inputs, d_out = make(b=1, h_q=2, h_kv=2, t=12, d=8, dtype=torch.float32)
    leaves = [x.detach().to(DEVICE).requires_grad_(True) for x in inputs]
    with graph_capture(), pytest.warns(UserWarning, match="first called under CUDA graph capture") as record:
        span_attention(*leaves, config=config, backend="triton", is_causal=True)
    assert len(record) == 1 and "backend='fused'" in str(record[0].message) and triton_backend._checked == {}
    run_triton(inputs, d_out, config, is_causal=True)  # raises on a fallback
    assert list(triton_backend._checked.values()) == [None]


def _host_reads_around_the_kernels(monkeypatch):
    """A HostReads mode for the caller to enter around a call, entered again in the backward pass (which
    runs without the caller's mode); the kernels' launches run outside it."""
    from test_fused import HostReads

    from hf_spanattn.ops.triton import kernels

    for name in ("forward_kernel", "keys_kernel", "queries_kernel"):
        monkeypatch.setattr(kernels, name, _Unrecorded(getattr(kernels, name)))
    mode = HostReads()
    backward = triton_backend._Attention.backward

    def recorded_backward(ctx, *grads):
        with mode:
            return backward(ctx, *grads)

    monkeypatch.setattr(triton_backend._Attention, "backward", staticmethod(recorded_backward))
    return mode


class _Unrecorded:
    """A kernel whose launches run outside the recording mode."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not torch.overrides._get_current_function_mode_stack():
                return self.kernel[grid](*args, **kwargs)
            with torch.overrides._pop_mode_temporarily():
                return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype", [(90, "bf16"), (80, "fp32")])
def test_kernels_compile_for_the_gpu(arch, dtype):
    """Every kernel compiles to a cubin for sm_90 (H100, H200) and sm_80 without a GPU (Triton's ptxas)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "compile_kernels.py"
    done = subprocess.run([sys.executable, str(script), str(arch), dtype], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compiled") == 10


def test_works_without_triton():
    """Without Triton the package imports, and backend='triton' runs on fused with a warning."""
    import subprocess
    import sys

    code = """
import sys, warnings
sys.modules["triton"] = None  # as if it were not installed
import torch
from hf_spanattn import SpanAttentionConfig, span_attention
q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = span_attention(q, k, v, is_causal=True, config=SpanAttentionConfig.from_label("score:1000"), backend="triton")
out.sum().backward()
print([str(w.message) for w in caught if "triton" in str(w.message)], torch.isfinite(q.grad).all().item())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "runs on backend='fused' here: Triton is not installed" in done.stdout and "True" in done.stdout


@pytest.mark.parametrize("family", ["gpt2", "gpt_neo"])
def test_a_model_under_reentrant_checkpointing_and_dropout_gets_the_gradient_of_the_mask_its_loss_saw(family,
                                                                                                      monkeypatch):
    """A model with attention dropout under reentrant gradient checkpointing: the first pass runs without autograd,
    where the registry (and GPT-Neo's adapter) called the stock attention, whose dropout mask the Triton kernels
    of the recomputation did not draw: the loss saw one mask and the gradients another. Now the weights' gradients
    are those of the same step without checkpointing."""
    from models import VOCAB, tiny

    from hf_spanattn import patch_model

    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")
    model = tiny(family)
    for module in model.modules():  # both families read the attention's dropout from its attn_dropout
        if isinstance(getattr(module, "attn_dropout", None), torch.nn.Dropout):
            module.attn_dropout.p = 0.3
    model = patch_model(model, "score:1000").train()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for reentrant in (None, True):
        if reentrant:
            model.gradient_checkpointing_enable({"use_reentrant": True})
        torch.manual_seed(0)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        model.zero_grad()
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-6, msg=name)
