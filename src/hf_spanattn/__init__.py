"""hf_spanattn: attention with span-decomposed gradients for Hugging Face Transformers."""

__version__ = "0.1.0"

import os  # noqa: E402
import sys  # noqa: E402

from hf_spanattn.config import SpanAttentionConfig  # noqa: E402
from hf_spanattn.integration import load_pretrained, patch_model, register, unpatch_model  # noqa: E402
from hf_spanattn.integration.adapters import install as _install_adapter_hooks  # noqa: E402
from hf_spanattn.integration.resume import install as _install_resume_check  # noqa: E402
from hf_spanattn.ops.attention import span_attention  # noqa: E402

register()
_install_adapter_hooks()  # PEFT adapters save and check the settings
# else at the first patch_model: importing the Trainer takes a while. A rank of a data-parallel run (the launchers
# set WORLD_SIZE) checks at once, so that one that patches nothing still says its settings to the others
if "transformers.trainer" in sys.modules or os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
    _install_resume_check()  # a resumed run whose model's settings are not its checkpoint's says so

__all__ = ["SpanAttentionConfig", "__version__", "load_pretrained", "patch_model", "span_attention", "unpatch_model"]
