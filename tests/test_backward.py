"""The rule ↔ backend contract (ops/backward.py): a backend written against it alone, dense T×T
matrices in float64, gives the float64 reference's gradients for every rule, probe included."""

from __future__ import annotations

import pytest
import torch
from reference import reference
from test_engine import make, padding_mask, rel

from hf_spanattn import SpanAttentionConfig
from hf_spanattn.ops import attention, backward, rules, span_of
from hf_spanattn.ops.fused import key_support


def _softmax(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores + bias, dim=-1).nan_to_num(0.0)


def _softmax_grad(p: torch.Tensor, d_p: torch.Tensor) -> torch.Tensor:
    return p * (d_p - (d_p * p).sum(dim=-1, keepdim=True))


class _Dense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, key_valid, scale, config, probe):
        p = _softmax(scale * q @ k.mT, bias)
        ctx.save_for_backward(q, k, v, bias, key_valid, p)
        ctx.scale, ctx.config, ctx.probe = scale, config, probe
        return p @ v

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, bias, key_valid, p = ctx.saved_tensors
        d_p = ctx.scale * d_out @ v.mT  # scale·∂L/∂P: G then carries the factor of S
        g = _softmax_grad(p, d_p)

        def products(needs):
            if isinstance(needs, rules.Operands):
                return rules.Products({name: g @ x for name, x in needs.query.items()},
                                      {name: (g.mT @ y).sum(2, keepdim=True) for name, y in needs.key.items()})
            grads = {}  # G of block (i, δ), for the blocks with a weight
            for i, q_i in enumerate(needs.q):
                for delta in needs.meets(i):
                    grads[i, delta] = _softmax_grad(_softmax(ctx.scale * q_i @ needs.k[delta].mT, bias), d_p)
            sums = {name: sum(c[delta] * grads[i, delta] @ needs.k[delta] for delta in needs.meets(i))
                    for name, (i, c) in needs.sums.items()}
            key = [sum(w[delta] * (grads[i, delta].mT @ needs.q[i]).sum(2, keepdim=True)
                       for i, w in enumerate(needs.key_weights) if w[delta]) for delta in range(len(needs.k))]
            return rules.BlockProducts(sums, [x if torch.is_tensor(x) else None for x in key])

        spans_of = lambda k, v, pinv: (span_of(k, pinv=pinv), span_of(v) if v is not None else None)  # noqa: E731
        inputs = backward.prepare(q, k, v, key_valid, ctx.config.rule, spans_of, probing=ctx.probe is not None)
        dq, dk = backward.rule_grads(ctx.config, inputs, products, ctx.probe)
        dv = (p.mT @ d_out).sum(2, keepdim=True)
        return (*backward.scaled((dq, dk, dv), ctx.config.qkv_alphas), None, None, None, None, None)


def dense_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, config, probe=None):
    """A backend in one function: SDPA's (B, H, T, D) inputs, a bool mask or is_causal."""
    q, k = backward.grouped(query, key)
    t = query.shape[-2]
    attend = torch.ones(t, t, dtype=torch.bool).tril() if is_causal else attn_mask
    bias = torch.zeros(attend.shape, dtype=query.dtype).masked_fill(~attend, -torch.inf)
    key_valid = key_support(attend, key.shape[1], q.shape[2])
    out = _Dense.apply(q, k, value.unsqueeze(2), bias.unsqueeze(2) if bias.dim() == 4 else bias,
                       key_valid if key_valid is not None and not key_valid.all() else None, scale, config, probe)
    return out.reshape(*query.shape[:-1], value.shape[-1])


@pytest.fixture
def dense(monkeypatch):
    monkeypatch.setitem(attention.BACKENDS, "dense", dense_attention)


@pytest.mark.parametrize("label", ["standard:QKV101", "simple:0.3,1.7", "reductionistic:0.5,2,0,1.5",
                                   "score:0.5,2,0,1.5", "score:0111", "score:0.5,2,0,1.5@per_block",
                                   "score:0001@per_block", "score:1100+QKV011"])
def test_a_backend_on_the_contract_matches_the_reference(label, dense):
    """Grouped-query heads, padded keys and rows that attend nothing (left padding)."""
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(h_q=4, h_kv=2, t=10)
    kwargs = dict(attn_mask=padding_mask([10, 4], 10))
    ref_out, ref_grads = reference(*inputs, d_out, config, **kwargs)
    _, std_grads = reference(*inputs, d_out, SpanAttentionConfig(method="standard"), **kwargs)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    out = attention.span_attention(*leaves, config=config, backend="dense", **kwargs)
    assert rel(out, ref_out) < 1e-12
    for name, g, r, std in zip("qkv", torch.autograd.grad(out, leaves, d_out), ref_grads, std_grads):
        assert rel(g, r, std) < 1e-9, f"d{name}: {rel(g, r, std):.2e}"


@pytest.mark.parametrize("label", ["score:1100", "score:1100@per_block", "simple:10"])
def test_the_probe_wraps_any_backend(label, dense):
    """The probe is glue, not a backend's: called from the dense backend, it gives the tiles' record."""
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(h_q=4, h_kv=2, t=10)
    records = {}
    for name in ("dense", "tiles"):
        calls = []
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        out = attention.BACKENDS[name](*leaves, None, 0.0, True, 0.5, config, calls.append)
        out.backward(d_out)
        records[name] = calls
    assert len(records["dense"]) == len(records["tiles"]) == 1  # the tiles' chunks are put together
    dense_record = records["dense"][0]
    for key in ("dq", "dq_standard", "rank_k", "rank_v"):
        tiles_value = records["tiles"][0][key]
        assert rel(dense_record[key], tiles_value) < 1e-12, key
    assert len(dense_record["dq_orders"]) == len(config.alphas)
    assert rel(sum(dense_record["dq_orders"]), dense_record["dq"]) < 1e-12
