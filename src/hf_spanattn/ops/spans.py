"""Column spans of T×d matrices, without ever forming a T×T projector.

For X (T×d, one per batch and head), Π_X = X X⁺ projects onto span(X) ⊂ R^T. `span_of`
finds an orthonormal basis U of span(X) (T×d, a zero column for each direction X lacks) and
C (d×d) with (X⁺)ᵀ = U C, so that

    Π_X W = U (Uᵀ W)     O(T·d·n) for W of width n, as accurate as W whatever X's conditioning
    (X⁺)ᵀ = U C          (for the paper's ∂Π_K/∂K cross terms)

U = X L⁻ᵀ with C = L⁻¹, from the Cholesky factor XᵀX = LLᵀ. The Gram matrix squares X's
condition number, so U is taken in X's dtype only where L⁻¹(XᵀX)L⁻ᵀ = I holds there to 1e-5
(well-conditioned X, the common case), and otherwise in float64, followed by one
Newton–Schulz step U ← U (3I − UᵀU)/2. Where X has at most d non-zero rows (always for T ≤ d;
a padded short sequence otherwise) and they are linearly independent, span(X) is theirs and U
holds their unit vectors, exactly. Where X is
rank-deficient at its own precision (repeated rows, or fewer independent rows than columns:
eigenvalues of XᵀX at or below max((d·eps)², d·eps₆₄)·λ_max) U comes from the
eigendecomposition XᵀX = W Λ Wᵀ over the eigenvalues above that, U = X W Λ^-½: the
pseudo-inverse projector, never NaN or Inf. Where X holds NaN or inf, its span is all NaN, so
that the gradients show it (as SDPA's do) rather than the factorizations failing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# how far from I the Cholesky route may leave L⁻¹(XᵀX)L⁻ᵀ: in float32 (no further step), and in
# float64 (one Newton–Schulz step squares it)
_ORTHONORMAL_32, _ORTHONORMAL_64 = 1e-5, 1e-6
_RIDGE = 1e-8  # span_without_sync: ε = _RIDGE·tr(XᵀX), far above float32's rounding (eps² ≈ 1.4e-14)


@dataclass
class Span:
    """The span of the columns of X (…, T, d): an orthonormal `basis` U (…, T, d) with a zero column
    for each direction X lacks, and `coef` C (…, d, d) with (X⁺)ᵀ = U C (None unless asked for), in
    float64: C grows as 1/σ(X), past float32's range for X below ~1e-38 (subnormal)."""

    basis: torch.Tensor
    coef: torch.Tensor | None

    def project(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Π_X W for W (…, T, n); batch dimensions broadcast. `out` may be W itself."""
        return torch.matmul(self.basis, self.basis.mT @ w, out=out)

    def reject(self, w: torch.Tensor) -> torch.Tensor:
        """Π_X^⊥ W = W − Π_X W."""
        projected = self.project(w)
        return torch.sub(w, projected, out=projected)

    def pinv_t(self) -> torch.Tensor:
        """(X⁺)ᵀ = X (XᵀX)⁺, shape (…, T, d), in U's dtype."""
        return self.basis @ self._coef().to(self.basis.dtype)

    def left_pinv_t(self, left: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A Wᵀ (X⁺)ᵀ = A ((Wᵀ U) C) for A (…, T, n) and W (…, T, n), in A's dtype. The product is taken in
        C's dtype (float64), so the result is finite wherever it is in A's dtype, also where C and
        Wᵀ (X⁺)ᵀ are not (X at the bottom of A's range: (X⁺)ᵀ is huge where A Wᵀ U is tiny)."""
        coef = self._coef()
        return (left.to(coef.dtype) @ ((w.mT @ self.basis).to(coef.dtype) @ coef)).to(left.dtype)

    def _coef(self) -> torch.Tensor:
        if self.coef is None:
            raise ValueError("this span was built without (X⁺)ᵀ: use span_of(x, pinv=True)")
        return self.coef


def span_of(x: torch.Tensor, pinv: bool = False) -> Span:
    """The span of x's columns per leading index; x is (…, T, d) in float32 or float64. With `pinv`
    it also holds C for (X⁺)ᵀ, which costs extra only where X has at most d non-zero rows."""
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"span_of needs float32 or float64 input, got {x.dtype}")
    t, d = x.shape[-2:]
    flat = x.reshape(-1, t, d)
    finite = torch.isfinite(flat).all(dim=-1).all(dim=-1)
    if not finite.all():  # NaN or inf: the factorizations run on zeros there, and the span is NaN
        flat = torch.where(finite[:, None, None], flat, 0)
    # eigenvalues of XᵀX at or below this fraction of the largest are X's rounding, or float64's
    cutoff = max((d * torch.finfo(x.dtype).eps) ** 2, d * torch.finfo(torch.float64).eps)
    if t <= d:
        basis, coef, done = _unit_rows(flat, cutoff, pinv)
    elif x.dtype == torch.float32:
        basis, coef, done = _cholesky(flat, cutoff, _ORTHONORMAL_32)
    else:  # float64: all of it below
        basis, coef = torch.empty_like(flat), flat.new_empty(len(flat), d, d) if pinv else None
        done = torch.zeros(len(flat), dtype=torch.bool, device=x.device)
    coef = coef.double() if pinv else None  # the Cholesky route gives C for free; kept only when asked for
    if not done.all() and t > d:  # padded short sequences, with at most d non-zero rows
        idx = (~done).nonzero(as_tuple=True)[0]
        idx = idx[(flat[idx] != 0).any(dim=-1).sum(dim=-1) <= d]
        if len(idx):
            basis[idx], rows_coef, done[idx] = _unit_rows(flat[idx], cutoff, pinv)
            if coef is not None:
                coef[idx] = rows_coef
    if not done.all():
        idx = (~done).nonzero(as_tuple=True)[0]
        wide = flat[idx].double()
        wide_basis, wide_coef, wide_done = _cholesky(wide, cutoff, _ORTHONORMAL_64)
        if not wide_done.all():
            bad = (~wide_done).nonzero(as_tuple=True)[0]
            wide_basis[bad], wide_coef[bad] = _eigen(wide[bad], cutoff)
        wide_basis, wide_coef = _newton_schulz(wide_basis, wide_coef)
        basis[idx] = wide_basis.to(x.dtype)
        if coef is not None:
            coef[idx] = wide_coef
    if not finite.all():
        basis[~finite] = torch.nan
        if coef is not None:
            coef[~finite] = torch.nan
    return Span(basis.view(x.shape), None if coef is None else coef.view(*x.shape[:-2], d, d))


def _cholesky(x: torch.Tensor, cutoff: float, tolerance: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U = X L⁻ᵀ, C = L⁻¹, where they hold) in x's dtype, from XᵀX = LLᵀ (see `_inverse_factor`)."""
    chol_inv, holds = _inverse_factor(x.mT @ x, cutoff, tolerance)
    return x @ chol_inv.mT, chol_inv, holds


def _inverse_factor(gram: torch.Tensor, cutoff: float,
                    tolerance: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(L⁻¹ for gram = LLᵀ, where it holds): where the factor exists, leaves L⁻¹ gram L⁻ᵀ within
    `tolerance` of I (not checked for None), and gram is not within `cutoff` of rank-deficient."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    chol, info = torch.linalg.cholesky_ex(gram)
    chol_inv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    spread = chol.square().sum(dim=(-2, -1)) * chol_inv.square().sum(dim=(-2, -1))  # ≥ λ_max/λ_min
    holds = (info == 0) & (spread * cutoff < 1)
    if tolerance is not None:
        holds &= (chol_inv @ gram @ chol_inv.mT - eye).abs().amax(dim=(-2, -1)) <= tolerance
    return chol_inv, holds


def _unit_rows(x: torch.Tensor, cutoff: float, pinv: bool,
               always_pack: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Where X has at most d non-zero rows and they are linearly independent, span(X) is spanned by
    their unit vectors: (U, the i-th non-zero row's unit vector in column i, C = Uᵀ (X⁺)ᵀ if `pinv`
    else None, where that holds), in x's dtype. Independence is read from the Cholesky factor of XXᵀ
    over the non-zero rows (float64), with a zero row's diagonal set to the largest. Rows are packed
    (non-zero first, at most d) where some row is zero, or always with `always_pack` (no host sync)."""
    t, d = x.shape[-2:]
    zero = (x == 0).all(dim=-1)
    if always_pack or zero.any():
        order = torch.argsort(zero.to(torch.int8), dim=-1, stable=True)[..., :min(t, d)]  # non-zero rows first
        take = order[..., None].expand(-1, -1, d)
        packed, packed_zero = x.gather(-2, take), zero.gather(-1, order)
    else:  # no padding: the rows as they are
        take, packed, packed_zero = None, x, zero
    packed = packed.double()
    rows = packed @ packed.mT
    largest = rows.diagonal(dim1=-2, dim2=-1).amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    # Only the rank is needed unless C is: in float64, spread·cutoff < 1 already makes the factor
    # accurate to far better than that decision needs.
    chol_inv, holds = _inverse_factor(rows + torch.diag_embed(packed_zero * largest), cutoff,
                                      _ORTHONORMAL_64 if pinv else None)
    holds &= (~zero).sum(dim=-1) <= d
    if take is None:
        packed_basis = torch.eye(t, d, dtype=x.dtype, device=x.device).expand(len(x), t, d)
        basis = packed_basis.clone()
    else:
        column = ((~packed_zero).cumsum(dim=-1) - 1).clamp_min(0)
        packed_basis = (F.one_hot(column, d) * (~packed_zero)[..., None]).to(x.dtype)
        basis = x.new_zeros(x.shape).scatter_(-2, take, packed_basis)
    if not pinv:
        return basis, None, holds
    pinv_t = chol_inv.mT @ (chol_inv @ packed)  # (XXᵀ)⁻¹X on the non-zero rows, 0 on the others
    return basis, packed_basis.double().mT @ pinv_t, holds


def _eigen(x: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U = X W Λ^-½, C = Λ^-½ Wᵀ) over the eigenvalues of XᵀX = W Λ Wᵀ above cutoff·λ_max,
    zero columns for the others."""
    lam, vec = torch.linalg.eigh(x.mT @ x)
    kept = lam > cutoff * lam[..., -1:].clamp_min(0)
    inv_sqrt = torch.where(kept, lam.clamp_min(torch.finfo(lam.dtype).tiny).rsqrt(), torch.zeros_like(lam))
    return x @ (vec * inv_sqrt[..., None, :]), inv_sqrt[..., :, None] * vec.mT


def _newton_schulz(basis: torch.Tensor, coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step U ← U N, N = (3I − UᵀU)/2, which squares UᵀU − I; C ← N C keeps (X⁺)ᵀ = U C to
    second order. Zero columns stay zero."""
    eye = torch.eye(basis.shape[-1], dtype=basis.dtype, device=basis.device)
    step = (3 * eye - basis.mT @ basis) / 2
    return basis @ step, step @ coef


def span_without_sync(x: torch.Tensor, pinv: bool = False, padded: bool = True) -> Span:
    """The span of x's columns as `span_of`, by one route that needs no decision on the host, so
    that it never waits for the device (and runs inside a CUDA graph); for float32 and half inputs.

    U = X L⁻ᵀ, C = L⁻¹ from the float64 factor XᵀX + εI = LLᵀ with ε = 10⁻⁸·tr(XᵀX), then one
    Newton–Schulz step. A direction of X with λ ≥ 10⁻⁴·tr(XᵀX) comes out orthonormal to 10⁻⁸; one
    at float32's rounding level (λ ≲ eps²·tr: a rank deficiency) keeps less than 10⁻⁵ of its
    share of Π_X, and (X⁺)ᵀ = U (UᵀU) C weights it by σ³/(σ² + ε)², next to nothing. Directions in
    between are taken in part. Where X has at most d non-zero rows and they are linearly
    independent (T ≤ d, or a padded short sequence), U holds their unit vectors, as in `span_of`;
    for T > d that is looked for only if `padded` (X may have zero rows).
    """
    if x.dtype == torch.float64:
        raise TypeError("span_without_sync is for float32 and half inputs; float64 goes through span_of")
    t, d = x.shape[-2:]
    wide = x.reshape(-1, t, d).double()
    gram = wide.mT @ wide
    ridge = _RIDGE * gram.diagonal(dim1=-2, dim2=-1).sum(dim=-1) + torch.finfo(torch.float64).tiny
    eye = torch.eye(d, dtype=torch.float64, device=x.device)
    chol, _ = torch.linalg.cholesky_ex(gram + ridge[:, None, None] * eye)
    coef = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    basis, coef = _newton_schulz(wide @ coef.mT, coef)
    if pinv:
        coef = basis.mT @ basis @ coef
    if t <= d or padded:
        cutoff = (d * torch.finfo(torch.float32).eps) ** 2
        rows_basis, rows_coef, independent = _unit_rows(wide, cutoff, pinv, always_pack=True)
        basis = torch.where(independent[:, None, None], rows_basis, basis)
        if pinv:
            coef = torch.where(independent[:, None, None], rows_coef, coef)
    basis = basis.to(x.dtype).view(x.shape)
    return Span(basis, coef.view(*x.shape[:-2], d, d) if pinv else None)
