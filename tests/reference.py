"""A float64 reference for the gradient rules, written straight from the paper's formulas with
explicit T×T projectors (Π_X = X X⁺ from torch.linalg.pinv), one (batch, head) at a time.
Slow and independent of the package's algebra: no spans, no regrouping of terms."""

from __future__ import annotations

import itertools
import math

import torch

from hf_spanattn import SpanAttentionConfig
from hf_spanattn.ops.inputs import MASKED_AT


def projector(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.linalg.pinv(x)


def _attend(attn_mask, is_causal, t, s):
    """(bool attend, additive) broadcast to 4-D."""
    if is_causal:
        attn_mask = torch.ones(t, s, dtype=torch.bool).tril()
    if attn_mask is None:
        attn_mask = torch.ones(t, s, dtype=torch.bool)
    if attn_mask.dtype == torch.bool:
        attend = attn_mask
        additive = torch.zeros(attn_mask.shape, dtype=torch.float64).masked_fill(~attend, -math.inf)
    else:
        attend = attn_mask > MASKED_AT  # the package's documented rule: at or below it is masked
        additive = attn_mask.double()
    while attend.dim() < 4:
        attend, additive = attend[None], additive[None]
    return attend, additive


def _alive(additive):
    """Rows with a finite mask entry; the others give 0, as in SDPA."""
    return (additive > -math.inf).any(-1, keepdim=True)


def _head_output(scores, additive, attend, keep, p, v):
    alive = _alive(additive)
    probs = torch.softmax(scores + torch.where(alive, additive, 0.0), dim=-1) * alive
    weights = probs if keep is None else probs * keep / (1 - p)
    return weights @ v


def _score_grad(scores, additive, attend, keep, p, v, d_out):
    """∂⟨dO, dropout(softmax(mask(S)))·V⟩/∂S by autograd."""
    scores = scores.detach().requires_grad_(True)
    out = _head_output(scores, additive, attend, keep, p, v)
    (g,) = torch.autograd.grad(out, scores, d_out)
    return g * attend.any(-1, keepdim=True)  # a row that attends no key passes no gradient to Q and K


def reference(q, k, v, d_out, config: SpanAttentionConfig, attn_mask=None, is_causal=False, scale=None,
              keep=None, dropout_p=0.0):
    """Output and (dQ, dK, dV) of span attention for (B, H, T, D) inputs, in float64.

    `keep` is the dropout keep-mask (B, H_q, T, S) or None.
    """
    q, k, v, d_out = (x.detach().double() for x in (q, k, v, d_out))
    b, h_q, t, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    groups = h_q // h_kv
    scale = 1 / math.sqrt(d) if scale is None else scale
    attend, additive = _attend(attn_mask, is_causal, t, s)
    out = torch.zeros(b, h_q, t, v.shape[-1], dtype=torch.float64)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    alpha = config.alphas
    for bi, hq in itertools.product(range(b), range(h_q)):
        hk = hq // groups
        att = attend[bi % attend.shape[0], hq % attend.shape[1]].expand(t, s)
        add = additive[bi % additive.shape[0], hq % additive.shape[1]].expand(t, s)
        kp = None if keep is None else keep[bi, hq].double()
        Q, K, V, dO = q[bi, hq], k[bi, hk], v[bi, hk], d_out[bi, hq]
        valid = att.any(0).double()[:, None]
        Kt, Vt = K * valid, V * valid
        PK, PV, eye = projector(Kt), projector(Vt), torch.eye(t, dtype=torch.float64)
        S = scale * Q @ K.T
        out[bi, hq] = _head_output(S, add, att, kp, dropout_p, V)
        alive = _alive(add)
        probs = torch.softmax(S + torch.where(alive, add, 0.0), -1) * alive
        weights = probs if kp is None else probs * kp / (1 - dropout_p)
        dv[bi, hk] += weights.T @ dO
        G = _score_grad(S, add, att, kp, dropout_p, V, dO)
        dQ_std, dK_std = scale * G @ K, scale * G.T @ Q
        if config.method == "standard":
            dQ, dK = dQ_std, dK_std
        elif config.method in ("simple", "reductionistic"):
            if config.method == "simple":
                op = alpha[0] * PK + alpha[1] * (eye - PK)
            else:
                pk, pv = (PK, eye - PK), (PV, eye - PV)
                projs = [pk[0] @ pv[0] @ pk[0], pk[0] @ pv[1] @ pk[0], pk[1] @ pv[0] @ pk[1], pk[1] @ pv[1] @ pk[1]]
                op = sum(a * P for a, P in zip(alpha, projs))
            dQ, dK = op @ dQ_std, op @ dK_std
        else:
            dQ, dK = _score(config, Q, K, Kt, valid, V, dO, S, G, add, att, kp, dropout_p, PK, PV, eye, scale)
        dq[bi, hq] += dQ * config.qkv_alphas[0]
        dk[bi, hk] += dK * config.qkv_alphas[1]
    dv *= config.qkv_alphas[2]
    return out, (dq, dk, dv)


def score_blocks(Q, K, PK, PV, eye, scale):
    """{(a, b, δ): S^B} for the 8 non-zero blocks, 0 = ∥ and 1 = ⊥."""
    pk, pv = (PK, eye - PK), (PV, eye - PV)
    return {
        (a, b_, dl): scale * pv[a] @ pk[b_] @ Q @ K.T @ PK @ pv[dl]
        for a, b_, dl in itertools.product((0, 1), repeat=3)
    }


def _score(config, Q, K, Kt, valid, V, dO, S, G, add, att, kp, p, PK, PV, eye, scale):
    alpha = config.alphas
    pk, pv = (PK, eye - PK), (PV, eye - PV)
    blocks = score_blocks(Q, K, PK, PV, eye, scale)
    if config.score_grad == "exact":
        grads = dict.fromkeys(blocks, G)
    else:
        grads = {key: _score_grad(SB, add, att, kp, p, V, dO) for key, SB in blocks.items()}
    dQ = torch.zeros_like(Q)
    dK = torch.zeros_like(K)
    for (a, b_, dl), GB in grads.items():
        order = a + b_ + dl
        dQ += alpha[order] * scale * (pv[a] @ pk[b_]).T @ GB @ (pv[dl] @ K)
        dK += alpha[order] * scale * pv[dl].T @ GB.T @ pv[a] @ pk[b_] @ Q
    # Π_K is the span of K̃ = valid ⊙ K, so ∂Π_K/∂K reaches valid rows only
    dK += valid * cross_terms(grads, Q, Kt, PK, PV, eye, scale, alpha)
    return dQ, dK


def cross_terms(grads, Q, K, PK, PV, eye, scale, alpha):
    """The paper's K cross terms, section "K Gradient", for the pairs (S^{a∥δ}, S^{a⊥δ})."""
    pv = (PV, eye - PV)
    K_pinv = torch.linalg.pinv(K)
    PKp = eye - PK
    total = torch.zeros_like(K)
    for a, dl in itertools.product((0, 1), repeat=2):
        D = grads[a, 0, dl] - grads[a, 1, dl]
        weight = alpha[a + dl + 1]
        total += weight * scale * (PKp @ Q @ K.T @ pv[dl] @ D.T @ pv[a] @ K_pinv.T
                                   + PKp @ pv[a] @ D @ pv[dl] @ K @ Q.T @ K_pinv.T)
    return total
