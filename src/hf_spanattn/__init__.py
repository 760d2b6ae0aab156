"""hf_spanattn: attention with span-decomposed gradients for Hugging Face Transformers."""

__version__ = "0.1.0"

import sys  # noqa: E402

from hf_spanattn.config import SpanAttentionConfig  # noqa: E402
from hf_spanattn.integration import load_pretrained, patch_model, register, unpatch_model  # noqa: E402
from hf_spanattn.integration.adapters import install as _install_adapter_hooks  # noqa: E402
from hf_spanattn.integration.train_checks import install as _install_train_checks  # noqa: E402
from hf_spanattn.ops.attention import span_attention  # noqa: E402

register()
_install_adapter_hooks()  # PEFT adapters save and check the settings
if "transformers.trainer" in sys.modules:  # else at the first patch_model: importing the Trainer takes a while
    _install_train_checks()  # a resumed run, or ranks, whose settings differ say so

__all__ = ["SpanAttentionConfig", "__version__", "load_pretrained", "patch_model", "span_attention", "unpatch_model"]
