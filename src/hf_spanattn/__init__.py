"""hf_spanattn: attention with span-decomposed gradients for Hugging Face Transformers."""

from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.ops.attention import span_attention

__version__ = "0.1.0"

__all__ = ["SpanAttentionConfig", "__version__", "span_attention"]
