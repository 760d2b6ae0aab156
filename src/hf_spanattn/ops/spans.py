"""Column spans of T×d matrices, without ever forming a T×T projector.

For X (T×d, one per batch and head), Π_X = X X⁺ projects onto span(X) ⊂ R^T. With the
d×d pseudo-inverse M = (XᵀX)⁺ of the Gram matrix,

    Π_X W = X (M (Xᵀ W))     O(T·d·n) for W of width n
    (X⁺)ᵀ = X M              (for the paper's ∂Π_K/∂K cross terms)

M is L⁻ᵀL⁻¹ from the Cholesky factor XᵀX = LLᵀ where that factor is accurate, and otherwise
W Λ⁺ Wᵀ from the eigendecomposition XᵀX = W Λ Wᵀ, dropping eigenvalues at or below
d·eps·λ_max: the pseudo-inverse projector, never NaN or Inf for T < d, zero rows or
repeated rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Span:
    """The span of the columns of `x` (…, T, d), with `inv_gram` = (xᵀx)⁺ (…, d, d)."""

    x: torch.Tensor
    inv_gram: torch.Tensor

    def project(self, w: torch.Tensor) -> torch.Tensor:
        """Π_X W for W (…, T, n); batch dimensions broadcast."""
        return self.x @ (self.inv_gram @ (self.x.mT @ w))

    def reject(self, w: torch.Tensor) -> torch.Tensor:
        """Π_X^⊥ W = W − Π_X W."""
        projected = self.project(w)
        return torch.sub(w, projected, out=projected)

    def select(self, rows: slice) -> Span:
        """The span of batch entries `rows`."""
        return Span(self.x[rows], self.inv_gram[rows])

    def pinv_t(self) -> torch.Tensor:
        """(X⁺)ᵀ = X (XᵀX)⁺, shape (…, T, d)."""
        return self.x @ self.inv_gram


def span_of(x: torch.Tensor) -> Span:
    """The span of x's columns per leading index; x is (…, T, d) in float32 or float64."""
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"span_of needs float32 or float64 input, got {x.dtype}")
    gram = x.mT @ x
    eye = torch.eye(gram.shape[-1], dtype=x.dtype, device=x.device)
    chol, info = torch.linalg.cholesky_ex(gram)
    chol_inv = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    # L⁻¹(XᵀX)L⁻ᵀ = I up to ≈ κ(XᵀX)·eps. Where that holds to √eps the Gram matrix is far from
    # rank-deficient, so the Cholesky and the eigen route agree on the span.
    error = (chol_inv @ gram @ chol_inv.mT - eye).abs().amax(dim=(-2, -1))
    bad = (info != 0) | ~(error <= torch.finfo(x.dtype).eps ** 0.5)
    inv_gram = chol_inv.mT @ chol_inv
    if bad.any():
        idx = bad.nonzero(as_tuple=True)
        inv_gram[idx] = _eigen_pinv(gram[idx])
    return Span(x, inv_gram)


def _eigen_pinv(gram: torch.Tensor) -> torch.Tensor:
    """(XᵀX)⁺ = W Λ⁺ Wᵀ, with eigenvalues at or below d·eps·λ_max treated as zero."""
    lam, vec = torch.linalg.eigh(gram)
    cutoff = gram.shape[-1] * torch.finfo(gram.dtype).eps * lam[..., -1:].clamp_min(0)
    inv = torch.where(lam > cutoff, 1 / lam.clamp_min(torch.finfo(gram.dtype).tiny), torch.zeros_like(lam))
    return (vec * inv[..., None, :]) @ vec.mT
