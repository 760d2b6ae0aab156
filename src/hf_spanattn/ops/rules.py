"""The backward rules for dQ and dK, per (batch, key/value head).

Shapes: query-side tensors are (B, H_kv, g, T, ·) with g query heads per key/value head,
key-side tensors (B, H_kv, 1, T, ·); spans are per key/value head and broadcast over g.
G = ∂L/∂S is (B, H_kv, g, T, T) with S = scale·QKᵀ, and already carries the factor `scale`,
so every rule returns dQ = Σ … G K and dK = Σ … Gᵀ Q directly. Π_K and Π_V are the spans of
the masked K̃ and Ṽ (padded key positions zeroed), Π_X^⊥ = I − Π_X.

The order of a score block S^B = scale·Π_V^a Π_K^b Q Kᵀ Π_K Π_V^δ is its count of ⊥ among
(a, b, δ); block B is weighted by α_order(B). Terms whose weight is zero are never computed.

`RULES` is the registry: one `Rule` per (method, score reading), which is all a new rule needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hf_spanattn.ops.spans import Span

BlockProducts = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[tuple[int, Sequence[float]]],
                          Sequence[Sequence[float]]], tuple[list[torch.Tensor], list[torch.Tensor | None]]]

Alphas = Sequence[float]
Part = torch.Tensor | None  # None: a part whose weight is zero


class Spans(NamedTuple):
    """Π_K and Π_V of the masked K̃ and Ṽ (None where the rule does not need one)."""

    k: Span | None
    v: Span | None


# Operands: the right-hand sides of the T×T products a rule needs. ([K or None, X_1, ...],
# [Q or None, Y_1, ...]) asks for G·K, G·X_i (per query head) and Gᵀ·Q, Gᵀ·Y_i (summed over the
# query heads of a key/value head); None where a product is not needed. G·K and Gᵀ·Q are the
# standard backward's, which a fused kernel gives anyway.
Operands = tuple[list[Part], list[Part]]
Products = tuple[list[Part], list[Part]]  # the products asked for, in the same places


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in a's dtype (the T×T side), returned in b's dtype (the projector side)."""
    return (a @ b.to(a.dtype)).to(b.dtype)


def group_sum(x: Part) -> Part:
    """Sum over the g query heads that share a key/value head (GQA)."""
    return x.sum(dim=2, keepdim=True) if x is not None and x.shape[2] > 1 else x


def lincomb(*terms: tuple[float, Part]) -> Part:
    """Σ c·x over the terms with c ≠ 0 and x present; None when nothing is left.

    The result may alias an input (a single term with c = 1): never modify it in place.
    """
    terms = tuple((c, x) for c, x in terms if c and x is not None)
    if not terms:
        return None
    (c0, x0), rest = terms[0], terms[1:]
    first = x0 if c0 == 1 else x0 * c0
    if not rest:
        return first
    out = torch.add(first, rest[0][1], alpha=rest[0][0])
    for c, x in rest[1:]:
        out.add_(x, alpha=c)
    return out


def standard_operands(q: torch.Tensor, k: torch.Tensor, spans: Spans, alphas: Alphas) -> Operands:
    """dQ = G K, dK = Gᵀ Q."""
    return [k], [q]


def standard_finish(products: Products, q: torch.Tensor, k: torch.Tensor, spans: Spans,
                    alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
    (gk,), (gq,) = products
    return gk, gq


def _transform(operator: Callable[[Spans, Alphas], Callable[[torch.Tensor], torch.Tensor]]):
    """The finish of a rule that applies `operator` to the standard dQ and dK."""

    def finish(products: Products, q: torch.Tensor, k: torch.Tensor, spans: Spans,
               alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
        (gk,), (gq,) = products
        op = operator(spans, alphas)
        return op(gk), op(gq)

    return finish


def simple_operator(spans: Spans, alphas: Alphas) -> Callable[[torch.Tensor], torch.Tensor]:
    """X ↦ (α∥ Π_K + α⊥ Π_K^⊥) X = α⊥ X + (α∥ − α⊥) Π_K X."""
    a_par, a_perp = alphas
    return lambda x: _zero_if_none(lincomb((a_perp, x), (a_par - a_perp, spans.k.project(x))), x)


def reductionistic_operator(spans: Spans, alphas: Alphas) -> Callable[[torch.Tensor], torch.Tensor]:
    """X ↦ Σ_i α_i Π_i X with Π_0 = Π_KΠ_VΠ_K, Π_1 = Π_KΠ_V^⊥Π_K, Π_2 = Π_K^⊥Π_VΠ_K^⊥, Π_3 = Π_K^⊥Π_V^⊥Π_K^⊥.

    With X∥ = Π_K X and X⊥ = X − X∥:
    Σ α_i Π_i X = B + Π_K (A − B),  A = α1 X∥ + (α0−α1) Π_V X∥,  B = α3 X⊥ + (α2−α3) Π_V X⊥.
    """
    a0, a1, a2, a3 = alphas
    span_k, span_v = spans

    def apply(x: torch.Tensor) -> torch.Tensor:
        x_par = span_k.project(x)
        x_perp = x - x_par
        inside = lincomb((a1, x_par), (a0 - a1, span_v.project(x_par) if a0 != a1 else None))
        outside = lincomb((a3, x_perp), (a2 - a3, span_v.project(x_perp) if a2 != a3 else None))
        diff = lincomb((1.0, inside), (-1.0, outside))
        return _zero_if_none(lincomb((1.0, outside), (1.0, span_k.project(diff) if diff is not None else None)), x)

    return apply


def _zero_if_none(x: Part, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if x is None else x


def _order_mix(span_v: Span, par: Part, perp: Part, alphas: Alphas) -> tuple[Part, Part]:
    """Weight the four (a, b) combinations by order and return (Y_∥, Y_⊥), the sums that the
    third factor's ∥ and ⊥ receive, where `par`, `perp` are the operand's parts along the
    second factor (b, or δ for the dQ side):

    Y_∥ = Π_V X_0 + Π_V^⊥ X_1,  Y_⊥ = Π_V X_1 + Π_V^⊥ X_2,  X_n = α_n par + α_{n+1} perp.
    """
    a0, a1, a2, a3 = alphas
    v_par = span_v.project(par) if par is not None and (a0 != a1 or a1 != a2) else None
    v_perp = span_v.project(perp) if perp is not None and (a1 != a2 or a2 != a3) else None
    y_par = lincomb((a1, par), (a2, perp), (a0 - a1, v_par), (a1 - a2, v_perp))
    y_perp = lincomb((a2, par), (a3, perp), (a1 - a2, v_par), (a2 - a3, v_perp))
    return y_par, y_perp


def _split(span: Span, par: Part, perp: Part, like: torch.Tensor) -> torch.Tensor:
    """Π par + Π^⊥ perp = perp + Π (par − perp)."""
    diff = lincomb((1.0, par), (-1.0, perp))
    if diff is None:
        return _zero_if_none(perp, like)
    projected = span.project(diff)
    return projected if perp is None else projected.add_(perp)


def score_exact_operands(q: torch.Tensor, k: torch.Tensor, spans: Spans, alphas: Alphas) -> Operands:
    """Score rule with ∂L/∂S^B = G for every block (no cross terms: G_∥ − G_⊥ = 0).

    dQ = Σ_B α (Π_V^aΠ_K^b)ᵀ G (Π_V^δ K) = Π_K Y_∥ + Π_K^⊥ Y_⊥ from G·Π_V K and G·Π_V^⊥ K = G·K − G·Π_V K;
    dK = Σ_B α Π_V^δ Gᵀ Π_V^a Π_K^b Q = Π_V Gᵀ R_∥ + Π_V^⊥ Gᵀ R_⊥.
    Two T×T·d products beyond the standard backward, none for [1000].
    """
    use_par, use_perp = any(alphas[:3]), any(alphas[1:])  # weights of the ∥ and ⊥ parts of a mix
    k_par = spans.v.project(k) if use_par or use_perp else None
    q_par = spans.k.project(q)
    r_par, r_perp = _order_mix(spans.v, q_par, q - q_par, alphas)
    return [k if use_perp else None, k_par], [None, r_par, r_perp]


def score_exact_finish(products: Products, q: torch.Tensor, k: torch.Tensor, spans: Spans,
                       alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
    (g_k, g_par), (_, h_par, h_perp) = products
    g_perp = g_k - g_par if g_k is not None and g_par is not None else None
    dq = _split(spans.k, *_order_mix(spans.v, g_par, g_perp, alphas), like=q)
    return dq, _split(spans.v, h_par, h_perp, like=k)


def score_per_block(block_products: BlockProducts, q: torch.Tensor, k: torch.Tensor,
                    key_valid: torch.Tensor | None, spans: Spans, alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
    """Score rule with the paper's hook reading: G_B is the gradient of softmax(mask(S^B))·V at
    S^B = scale·Q_ab K_δᵀ, Q_ab = Π_V^a Π_K^b Q (index 2a + b), K_δ = Π_V^δ K.
    `block_products([Q_ab], [K_δ], sums, α)` returns Σ_δ c_δ G_B K_δ for each (2a + b, c) in `sums`
    and, per δ, Σ_ab α_B G_Bᵀ Q_ab summed over the query heads that share K (see `blocks.py`).

    dQ, dK direct as in `score_exact` with G_B in place of G, plus for each pair (b=∥, b=⊥) of
    equal (a, δ), with E = (G_∥ − G_⊥) K_δ and α of the ⊥ member's order, the K cross terms
    Π_K^⊥ (Q Eᵀ Π_V^a (K⁺)ᵀ + Π_V^a E Qᵀ (K⁺)ᵀ)   (from ∂Π_K/∂K).
    Summed over the pairs, with E_a = Σ_δ α E and Ẽ = Σ_a Π_V^a E_a (Π_V is symmetric), they are
    Π_K^⊥ (Q Ẽᵀ + Ẽ Qᵀ) (K⁺)ᵀ. E comes from the products G_B K_δ that dQ needs anyway, so the
    cross terms cost O(T·d²).
    """
    span_k, span_v = spans
    q_par = span_k.project(q)
    q_perp = q - q_par
    vq_par, vq_perp = span_v.project(q_par), span_v.project(q_perp)
    # Π_V^a Π_K^b Q at index 2a + b; Π_V^⊥ Π_K^b Q in the buffers of Π_K^b Q, not needed any more
    q_blocks = (vq_par, vq_perp, q_par.sub_(vq_par), q_perp.sub_(vq_perp))
    k_par = span_v.project(k)
    k_blocks = (k_par, k - k_par)  # δ

    weights = [[alphas[i // 2 + i % 2 + delta] for delta in range(2)] for i in range(4)]  # α of block (i, δ)
    # α of the ⊥ member of the pair (a, δ), which weights both members in the cross terms
    cross_weights = [[alphas[a + delta + 1] for delta in range(2)] for a in range(2)]
    sums = [(i, weights[i]) for i in range(4)]  # Σ_δ α G_B K_δ per (a, b)
    # E_a = Σ_δ α (G_(a∥, δ) − G_(a⊥, δ)) K_δ; the ⊥ members' sum is the one above
    sums += [(2 * a, cross_weights[a]) for a in range(2) if cross_weights[a] != weights[2 * a]]
    sums = [(i, c) for i, c in sums if any(c)]
    gk, acc_k = block_products(q_blocks, k_blocks, sums, weights) if sums else ([], [None, None])
    found = dict(zip(((i, tuple(c)) for i, c in sums), gk))
    acc_q: list[Part] = [found.get((i, tuple(weights[i]))) for i in range(4)]
    cross_e: list[Part] = [None, None]
    for a in range(2):
        if any(cross_weights[a]):
            cross_e[a] = lincomb((1.0, found.get((2 * a, tuple(cross_weights[a])))), (-1.0, acc_q[2 * a + 1]))

    y_par = _split(span_v, acc_q[0], acc_q[2], like=q)
    y_perp = _split(span_v, acc_q[1], acc_q[3], like=q)
    dq = _split(span_k, y_par, y_perp, like=q)
    dk = _split(span_v, acc_k[0], acc_k[1], like=k)
    if cross_e[0] is not None or cross_e[1] is not None:
        pinv = span_k.pinv_t()  # (K⁺)ᵀ
        e_mix = _split(span_v, cross_e[0], cross_e[1], like=q)  # Ẽ
        cross = span_k.reject(group_sum((q @ (e_mix.mT @ pinv)).add_(e_mix @ (q.mT @ pinv))))
        dk = dk.add_(cross.mul_(key_valid) if key_valid is not None else cross)
    return dq, dk


def _one_hot(alphas: Alphas) -> list[tuple[float, ...]]:
    """Each α alone: the order split of a rule (order o's component uses α_o, the others 0)."""
    return [tuple(a if i == o else 0.0 for i, a in enumerate(alphas)) for o in range(len(alphas))]


@dataclass(frozen=True)
class Rule:
    """One backward rule for dQ and dK: a registry entry.

    `alpha_names` and `default_alphas`: what its α are and the paper's best setting; `spans`: the
    spans it reads ("k", "v"), `pinv`: whether it reads (K⁺)ᵀ too. Either `operands` and `finish`
    (the rule from products of G = ∂L/∂S, see `Operands`) or `blocks` (the per-block reading, from
    `BlockProducts`). `split` is the rule and the α whose components give the orders of span
    violation for diagnostics.
    """

    method: str
    score_grad: str
    alpha_names: tuple[str, ...]
    default_alphas: tuple[float, ...]
    spans: str = ""
    pinv: bool = False
    operands: Callable[..., Operands] | None = None
    finish: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def split(self, alphas: Alphas) -> tuple[Rule, list[tuple[float, ...]]]:
        """(the rule, α per order): their results sum to this rule's. The standard gradient is
        split into the exact score rule's orders at α = (1, 1, 1, 1)."""
        if self.method == "standard":
            return RULES["score", "exact"], _one_hot((1.0, 1.0, 1.0, 1.0))
        return self, _one_hot(alphas)


ORDER_ALPHAS = ("α0", "α1", "α2", "α3")
RULES: dict[tuple[str, str], Rule] = {
    ("standard", "exact"): Rule("standard", "exact", (), (), operands=standard_operands, finish=standard_finish),
    ("simple", "exact"): Rule("simple", "exact", ("α∥", "α⊥"), (1.0, 0.0), spans="k", operands=standard_operands,
                              finish=_transform(simple_operator)),
    ("reductionistic", "exact"): Rule("reductionistic", "exact", ORDER_ALPHAS, (1.0, 0.0, 0.0, 0.0), spans="kv",
                                      operands=standard_operands, finish=_transform(reductionistic_operator)),
    ("score", "exact"): Rule("score", "exact", ORDER_ALPHAS, (1.0, 0.0, 0.0, 0.0), spans="kv",
                             operands=score_exact_operands, finish=score_exact_finish),
    ("score", "per_block"): Rule("score", "per_block", ORDER_ALPHAS, (1.0, 0.0, 0.0, 0.0), spans="kv", pinv=True,
                                 blocks=score_per_block),
}
