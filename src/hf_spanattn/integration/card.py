"""The Hub page names the method: model tags that Transformers' own card machinery writes.

`patch_model` adds the tags with `PreTrainedModel.add_model_tags`; `push_to_hub` (the model's,
and `save_pretrained(push_to_hub=True)`) writes them into the card it creates,
`Trainer.push_to_hub` into the card `Trainer.create_model_card` writes (with `base_model` when the
model was loaded from a Hub repository), and PEFT into an adapter's card (with `base_model`).
"""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import Version
from transformers import PreTrainedModel

from hf_spanattn.config import SpanAttentionConfig

TAG = "hf_spanattn"
RULE_PREFIX = "span_attention:"  # span_attention:score:1000
VERSION_PREFIX = "hf_spanattn_version:"  # hf_spanattn_version:0.1.0


def tags(config: SpanAttentionConfig) -> list[str]:
    from hf_spanattn import __version__

    return [TAG, RULE_PREFIX + config.label, VERSION_PREFIX + __version__]


def ours(tag: object) -> bool:
    """A tag that `tags` writes (this version or another); a user's own tag that only begins as ours do, such as
    'span_attention:notes', is not."""
    if not isinstance(tag, str):
        return False
    try:
        if tag.startswith(RULE_PREFIX):
            return SpanAttentionConfig.from_label(tag[len(RULE_PREFIX):]) is not None
        if tag.startswith(VERSION_PREFIX):
            return Version(tag[len(VERSION_PREFIX):]) is not None
    except ValueError:
        return False
    return tag == TAG


def set_tags(model: PreTrainedModel, config: SpanAttentionConfig | None) -> None:
    """Replace the model's hf_spanattn tags by those of `config` (none for None), keeping the others
    (one tag set as a string is one tag, as `add_model_tags` takes it; so are bytes and a number; an
    array of tags is a list of them)."""
    if model.model_tags is not None:  # an array of tags has no truth value
        held = model.model_tags
        existing = held if isinstance(held, Iterable) and not isinstance(held, (str, bytes)) else [held]
        model.model_tags = [tag for tag in existing if not ours(tag)] or None
    if config is not None:
        model.add_model_tags(tags(config))
