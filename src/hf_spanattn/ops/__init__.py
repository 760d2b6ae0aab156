"""The maths of span-decomposed attention gradients: plain PyTorch, no Transformers."""

from hf_spanattn.ops.attention import backend_for, span_attention
from hf_spanattn.ops.spans import Span, span_of

__all__ = ["Span", "backend_for", "span_attention", "span_of"]
