"""hf_spanattn: attention with span-decomposed gradients for Hugging Face Transformers."""

__version__ = "0.1.0"

from hf_spanattn.config import SpanAttentionConfig  # noqa: E402
from hf_spanattn.integration import load_pretrained, patch_model, register, unpatch_model  # noqa: E402
from hf_spanattn.integration.adapters import install as _install_adapter_hooks  # noqa: E402
from hf_spanattn.integration.resume import install_on_import as _install_resume_check  # noqa: E402
from hf_spanattn.ops.attention import span_attention  # noqa: E402

register()
_install_adapter_hooks()  # PEFT adapters save and check the settings
_install_resume_check()  # a resumed run whose model's settings are not its checkpoint's says so

__all__ = ["SpanAttentionConfig", "__version__", "load_pretrained", "patch_model", "span_attention", "unpatch_model"]
