"""Triton kernels for span attention: a FlashAttention-2 forward with the log-sum-exp saved, and a
backward that recomputes P and G = ∂L/∂S per tile and returns dV with the products G·X_i and Gᵀ·Y_j
a rule asks for (`flash.py`), on a block axis for the per-block reading; the key-mask form they
take (`masks.py`). Triton is imported on first use: `missing()` says why it cannot run here.
"""

from __future__ import annotations

import importlib.util
import os

from hf_spanattn.ops.triton.masks import KeyMask, key_mask


def missing() -> str | None:
    """None where Triton is installed; else the reason, for a fallback's warning."""
    return None if importlib.util.find_spec("triton") is not None else "Triton is not installed"


def interpreting() -> bool:
    """Whether Triton runs the kernels in its interpreter: TRITON_INTERPRET read as Triton reads it (1, true, on,
    yes or y, in any case), so that what this package expects is what Triton does."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")


__all__ = ["KeyMask", "interpreting", "key_mask", "missing"]
