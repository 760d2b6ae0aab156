"""The Triton kernels (`ops/triton/`) against float64 torch products of the same operands, and the
forward against SDPA. Without CUDA they run in Triton's interpreter on CPU tensors; with CUDA (and
TRITON_INTERPRET unset) the same tests run compiled on the GPU."""

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from hf_spanattn.ops.triton import flash, key_mask  # noqa: E402

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
    _close(lse, torch.logsumexp(s, dim=-1), 1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_products_are_torch_products(causal):
    """dV, G·X_i for key-side X (K and two others) and Gᵀ·Y_j for query-side Y (Q and another),
    summed over the query heads of a key/value head, padded keys, T not a multiple of the tile."""
    q, k, v, d_out = _inputs(t=40, d=32)
    bias = _padding(2, 40, [40, 27])
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 2, 40, 32, generator=gen).to(DEVICE), torch.randn(2, 2, 40, 16, generator=gen).to(DEVICE)]
    ys = [torch.randn(2, 4, 40, 32, generator=gen).to(DEVICE)]
    out, lse = flash.forward(q, k, v, scale=0.2, causal=causal, key_bias=bias)
    got = flash.backward(q, k, v, out, lse, d_out, scale=0.2, causal=causal, key_bias=bias,
                         key_operands=[k, *xs], query_operands=[q, *ys])
    ref_out, _, grad = _reference(q, k, v, d_out, 0.2, causal, bias)
    _close(out, ref_out, 1e-5)
    p = _reference(q, k, v, d_out, 0.2, causal, bias)[1]
    _close(got.dv, _group_sum(p.transpose(-1, -2) @ d_out.double(), 2), 1e-5)
    for x, product in zip([k, *xs], got.key_side, strict=True):
        _close(product, grad @ x.double().repeat_interleave(2, 1), 1e-5)
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
    dtype's minimum instead: SDPA's uniform average."""
    q, k, v, d_out = _inputs(b=2, h_q=2, h_kv=2, t=16, d=16)
    bias = _padding(2, 16, [16, 0])
    out, lse = flash.forward(q, k, v, scale=0.25, key_bias=bias)
    got = flash.backward(q, k, v, out, lse, d_out, scale=0.25, key_bias=bias, key_operands=[k], query_operands=[q])
    assert out[1].abs().max() == 0 and torch.isneginf(lse[1]).all()
    for x in (got.dv[1], got.key_side[0][1], got.query_side[0][1]):
        assert x.abs().max() == 0
    lowest = bias.clamp_min(torch.finfo(torch.float32).min)
    out, _ = flash.forward(q, k, v, scale=0.25, key_bias=lowest)
    _close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=lowest[:, None, None, :], scale=0.25), 1e-6)


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
    assert (form is not None) == reducible
    if form is not None:
        q, k, v, _ = _inputs(h_q=2, h_kv=2, t=12, d=16)
        out, _ = flash.forward(q, k, v, scale=0.25, causal=form.causal, key_bias=form.bias)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        _close(out, expected.nan_to_num(0.0), 1e-5)
        if mask.shape[-2] > 1 and mask.stride(-2):  # compared once, then remembered for the tensor
            assert key_mask(mask) is form


def test_key_mask_of_causal_call():
    assert key_mask(None, is_causal=True).causal and key_mask(None).bias is None
