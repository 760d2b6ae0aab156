"""The Transformers side: attention registry, patching, loading."""

from hf_spanattn.integration.patch import load_pretrained, patch_model, unpatch_model
from hf_spanattn.integration.registry import ATTN_IMPLEMENTATION, register

__all__ = ["ATTN_IMPLEMENTATION", "load_pretrained", "patch_model", "register", "unpatch_model"]
