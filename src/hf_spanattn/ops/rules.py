"""The backward rules for dQ and dK, per (batch, key/value head).

Shapes: query-side tensors are (B, H_kv, g, T, ·) with g query heads per key/value head,
key-side tensors (B, H_kv, 1, T, ·); spans are per key/value head and broadcast over g.
G = ∂L/∂S is (B, H_kv, g, T, T) with S = scale·QKᵀ, and already carries the factor `scale`,
so every rule returns dQ = Σ … G K and dK = Σ … Gᵀ Q directly. Π_K and Π_V are the spans of
the masked K̃ and Ṽ (padded key positions zeroed), Π_X^⊥ = I − Π_X.

The order of a score block S^B = scale·Π_V^a Π_K^b Q Kᵀ Π_K Π_V^δ is its count of ⊥ among
(a, b, δ); block B is weighted by α_order(B). Terms whose weight is zero are never computed.

A rule states what it asks of G by name: `Operands` (products G·X and Gᵀ·Y) or, under the
per-block reading, `Blocks` (the blocks Q_i, K_δ and their weights); a backend answers with
`Products` or `BlockProducts` (see `backward.py`), and the rule's finish gives dQ and dK.
`RULES` is the registry: one `Rule` per (method, score reading), which is all a new rule needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hf_spanattn.ops.spans import Span

Alphas = Sequence[float]
Part = torch.Tensor | None  # None: a part whose weight is zero


@dataclass
class Spans:
    """Π_K and Π_V of the masked K̃ and Ṽ (None where the rule does not need one), and the key
    positions they are taken over, (B, H_kv, 1, T, 1) bool (None: all)."""

    k: Span | None
    v: Span | None
    key_valid: torch.Tensor | None = None


@dataclass
class Operands:
    """What a rule asks of G = ∂L/∂S, by name: `query[name] = X` (…, 1 or g, T, ·) asks for G·X per
    query head, `key[name] = Y` (…, g, T, ·) for Gᵀ·Y summed over the g query heads of a key/value
    head. The names "k" (X = K̃) and "q" (Y = Q) are the standard backward's products."""

    query: dict[str, torch.Tensor] = field(default_factory=dict)
    key: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Products:
    """The products an `Operands` asked for, under its names: G·X (…, g, T, ·), Σ_g Gᵀ·Y (…, 1, T, ·)."""

    query: dict[str, torch.Tensor]
    key: dict[str, torch.Tensor]


@dataclass
class Blocks:
    """What the per-block reading asks for. Block (i, δ) is attention softmax(mask(S_iδ))·V with
    S_iδ = scale·Q_i K_δᵀ and the real ∂L/∂O; G_iδ is its ∂L/∂S. `sums[name] = (i, c)` asks for
    Σ_δ c_δ G_iδ K_δ (…, g, T, d); `key_weights[i][δ] = w` for Σ_i w G_iδᵀ Q_i per δ, summed over
    the query heads of a key/value head (…, 1, T, d). Only blocks with a non-zero weight are run."""

    q: list[torch.Tensor]  # Q_i (…, g, T, d)
    k: list[torch.Tensor]  # K_δ (…, 1, T, d)
    sums: dict[str, tuple[int, tuple[float, ...]]]
    key_weights: list[list[float]]

    def meets(self, i: int) -> list[int]:
        """The key blocks δ that query block i meets with a non-zero weight."""
        return [delta for delta in range(len(self.k))
                if self.key_weights[i][delta] or any(c[delta] for block, c in self.sums.values() if block == i)]

    def pairs(self) -> list[tuple[int, int]]:
        """The blocks (i, δ) to run: every query block with the key blocks it meets."""
        return [(i, delta) for i in range(len(self.q)) for delta in self.meets(i)]

    def answer(self, gk: dict[tuple[int, int], torch.Tensor],
               gq: dict[tuple[int, int], torch.Tensor]) -> BlockProducts:
        """The `BlockProducts` from each run block's G_iδ K_δ (`gk`) and Σ_g G_iδᵀ Q_i (`gq`), keyed by (i, δ)."""
        deltas, queries = range(len(self.k)), range(len(self.q))
        sums = {name: lincomb(*((c[delta], gk.get((i, delta))) for delta in deltas))
                for name, (i, c) in self.sums.items()}
        key = [lincomb(*((self.key_weights[i][delta], gq.get((i, delta))) for i in queries)) for delta in deltas]
        return BlockProducts(sums, key)


@dataclass
class BlockProducts:
    """What a `Blocks` asked for: `sums` under its names, `key` per δ (None where no weight is non-zero)."""

    sums: dict[str, torch.Tensor]
    key: list[torch.Tensor | None]


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
    return Operands(query={"k": k}, key={"q": q})


def standard_finish(products: Products, q: torch.Tensor, k: torch.Tensor, spans: Spans,
                    alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
    return products.query["k"], products.key["q"]


def _transform(operator: Callable[[Spans, Alphas], Callable[[torch.Tensor], torch.Tensor]]):
    """The finish of a rule that applies `operator` to the standard dQ and dK."""

    def finish(products: Products, q: torch.Tensor, k: torch.Tensor, spans: Spans,
               alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
        op = operator(spans, alphas)
        return op(products.query["k"]), op(products.key["q"])

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
    span_k, span_v = spans.k, spans.v

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
    if par is None:
        return torch.zeros_like(like) if perp is None else span.reject(perp)
    if perp is None:
        return span.project(par)
    diff = torch.sub(par, perp)
    return span.project(diff, out=diff).add_(perp)


def score_exact_operands(q: torch.Tensor, k: torch.Tensor, spans: Spans, alphas: Alphas) -> Operands:
    """Score rule with ∂L/∂S^B = G for every block (no cross terms: G_∥ − G_⊥ = 0).

    dQ = Σ_B α (Π_V^aΠ_K^b)ᵀ G (Π_V^δ K) = Π_K Y_∥ + Π_K^⊥ Y_⊥ from G·Π_V K and G·Π_V^⊥ K = G·K − G·Π_V K;
    dK = Σ_B α Π_V^δ Gᵀ Π_V^a Π_K^b Q = Π_V Gᵀ R_∥ + Π_V^⊥ Gᵀ R_⊥.
    Two T×T·d products beyond the standard backward, none for [1000].
    """
    use_par, use_perp = any(alphas[:3]), any(alphas[1:])  # weights of the ∥ and ⊥ parts of a mix
    q_par = spans.k.project(q)
    r_par, r_perp = _order_mix(spans.v, q_par, q - q_par, alphas)
    query = {"k": k} if use_perp else {}
    if use_par or use_perp:
        query["k_par"] = spans.v.project(k)
    key = {name: y for name, y in (("r_par", r_par), ("r_perp", r_perp)) if y is not None}
    return Operands(query, key)


def score_exact_finish(products: Products, q: torch.Tensor, k: torch.Tensor, spans: Spans,
                       alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
    g_k, g_par = products.query.get("k"), products.query.get("k_par")
    g_perp = g_k - g_par if g_k is not None and g_par is not None else None
    dq = _split(spans.k, *_order_mix(spans.v, g_par, g_perp, alphas), like=q)
    return dq, _split(spans.v, products.key.get("r_par"), products.key.get("r_perp"), like=k)


def _block_weights(alphas: Alphas) -> tuple[list[list[float]], list[list[float]]]:
    """(α of block (2a + b, δ); α of the ⊥ member of the pair (a, δ), which weights both members
    in the cross terms of `score_per_block_finish`)."""
    weights = [[alphas[i // 2 + i % 2 + delta] for delta in range(2)] for i in range(4)]
    return weights, [[alphas[a + delta + 1] for delta in range(2)] for a in range(2)]


def score_per_block_needs(q: torch.Tensor, k: torch.Tensor, spans: Spans, alphas: Alphas) -> Blocks:
    """Score rule with the paper's hook reading: G_B is the gradient of softmax(mask(S^B))·V at
    S^B = scale·Q_ab K_δᵀ, Q_ab = Π_V^a Π_K^b Q (query block 2a + b), K_δ = Π_V^δ K.
    Asks for "q{i}" = Σ_δ α G_(i,δ) K_δ per query block i, "cross{a}" = the same sum for block 2a
    with the weights of the cross terms (see the finish) where they differ, and per δ
    Σ_ab α G_(ab,δ)ᵀ Q_ab.
    """
    span_k, span_v = spans.k, spans.v
    q_par = span_k.project(q)
    q_perp = q - q_par
    vq_par, vq_perp = span_v.project(q_par), span_v.project(q_perp)
    # Π_V^a Π_K^b Q at index 2a + b; Π_V^⊥ Π_K^b Q in the buffers of Π_K^b Q, not needed any more
    q_blocks = [vq_par, vq_perp, q_par.sub_(vq_par), q_perp.sub_(vq_perp)]
    k_par = span_v.project(k)
    weights, cross_weights = _block_weights(alphas)
    sums = {f"q{i}": (i, tuple(weights[i])) for i in range(4)}
    # E_a = Σ_δ α (G_(a∥, δ) − G_(a⊥, δ)) K_δ; the ⊥ members' sum is the one above
    sums.update({f"cross{a}": (2 * a, tuple(cross_weights[a])) for a in range(2) if cross_weights[a] != weights[2 * a]})
    return Blocks(q_blocks, [k_par, k - k_par], {name: s for name, s in sums.items() if any(s[1])}, weights)


def score_per_block_finish(products: BlockProducts, q: torch.Tensor, k: torch.Tensor, spans: Spans,
                           alphas: Alphas) -> tuple[torch.Tensor, torch.Tensor]:
    """dQ, dK direct as in `score_exact` with G_B in place of G, plus for each pair (b=∥, b=⊥) of
    equal (a, δ), with E = (G_∥ − G_⊥) K_δ and α of the ⊥ member's order, the K cross terms
    Π_K^⊥ (Q Eᵀ Π_V^a (K⁺)ᵀ + Π_V^a E Qᵀ (K⁺)ᵀ)   (from ∂Π_K/∂K).
    Summed over the pairs, with E_a = Σ_δ α E and Ẽ = Σ_a Π_V^a E_a (Π_V is symmetric), they are
    Π_K^⊥ (Q Ẽᵀ + Ẽ Qᵀ) (K⁺)ᵀ. E comes from the products G_B K_δ that dQ needs anyway, so the
    cross terms cost O(T·d²).
    """
    span_k, span_v = spans.k, spans.v
    _, cross_weights = _block_weights(alphas)
    acc_q: list[Part] = [products.sums.get(f"q{i}") for i in range(4)]
    cross_e: list[Part] = [None, None]
    for a in range(2):
        if any(cross_weights[a]):
            cross_e[a] = lincomb((1.0, products.sums.get(f"cross{a}", acc_q[2 * a])), (-1.0, acc_q[2 * a + 1]))

    # the T×d temporaries are dropped as soon as they are used: at a small batch they set the peak
    y_par = _split(span_v, acc_q[0], acc_q[2], like=q)
    y_perp = _split(span_v, acc_q[1], acc_q[3], like=q)
    dq = _split(span_k, y_par, y_perp, like=q)
    del y_par, y_perp
    cross = None
    if cross_e[0] is not None or cross_e[1] is not None:
        e_mix = _split(span_v, cross_e[0], cross_e[1], like=q)  # Ẽ
        del cross_e
        cross = span_k.left_pinv_t(q, e_mix)
        cross = span_k.reject(group_sum(cross.add_(span_k.left_pinv_t(e_mix, q))))
        del e_mix
    dk = _split(span_v, *products.key, like=k)
    if cross is not None:
        dk = dk.add_(cross.mul_(spans.key_valid) if spans.key_valid is not None else cross)
    return dq, dk


def _one_hot(alphas: Alphas) -> list[tuple[float, ...]]:
    """Each α alone: the order split of a rule (order o's component uses α_o, the others 0)."""
    return [tuple(a if i == o else 0.0 for i, a in enumerate(alphas)) for o in range(len(alphas))]


@dataclass(frozen=True)
class Rule:
    """One backward rule for dQ and dK: a registry entry.

    `alpha_names` and `default_alphas`: what its α are and the paper's best setting; `spans`: the
    spans it reads ("k", "v"), `pinv`: whether it reads (K⁺)ᵀ too. `needs(q, k, spans, α)` says
    what it asks of G (`Operands`, or `Blocks` under the per-block reading) and
    `finish(products, q, k, spans, α)` gives (dQ, dK) from the answer (`Products`,
    `BlockProducts`). `split` is the rule and the α whose components give the orders of span
    violation for diagnostics.
    """

    method: str
    score_grad: str
    alpha_names: tuple[str, ...]
    default_alphas: tuple[float, ...]
    needs: Callable[..., Operands | Blocks]
    finish: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    spans: str = ""
    pinv: bool = False

    @property
    def per_block(self) -> bool:
        """Whether it asks for `Blocks` (the per-block reading) rather than `Operands`."""
        return self.score_grad == "per_block"

    def split(self, alphas: Alphas) -> tuple[Rule, list[tuple[float, ...]]]:
        """(the rule, α per order): their results sum to this rule's. The standard gradient is
        split into the exact score rule's orders at α = (1, 1, 1, 1)."""
        if self.method == "standard":
            return RULES["score", "exact"], _one_hot((1.0, 1.0, 1.0, 1.0))
        return self, _one_hot(alphas)


ORDER_ALPHAS = ("α0", "α1", "α2", "α3")
RULES: dict[tuple[str, str], Rule] = {
    ("standard", "exact"): Rule("standard", "exact", (), (), standard_operands, standard_finish),
    ("simple", "exact"): Rule("simple", "exact", ("α∥", "α⊥"), (1.0, 0.0), standard_operands,
                              _transform(simple_operator), spans="k"),
    ("reductionistic", "exact"): Rule("reductionistic", "exact", ORDER_ALPHAS, (1.0, 0.0, 0.0, 0.0),
                                      standard_operands, _transform(reductionistic_operator), spans="kv"),
    ("score", "exact"): Rule("score", "exact", ORDER_ALPHAS, (1.0, 0.0, 0.0, 0.0), score_exact_operands,
                             score_exact_finish, spans="kv"),
    ("score", "per_block"): Rule("score", "per_block", ORDER_ALPHAS, (1.0, 0.0, 0.0, 0.0), score_per_block_needs,
                                 score_per_block_finish, spans="kv", pinv=True),
}
