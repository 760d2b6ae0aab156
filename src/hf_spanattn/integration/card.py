"""The Hub page names the method: model tags that Transformers' own card machinery writes.

`patch_model` adds the tags with `PreTrainedModel.add_model_tags`; `push_to_hub` (the model's,
and `save_pretrained(push_to_hub=True)`) writes them into the card it creates,
`Trainer.push_to_hub` into the card `Trainer.create_model_card` writes (with `base_model` when the
model was loaded from a Hub repository), and PEFT into an adapter's card (with `base_model`).

`Trainer.create_model_card` called alone (and TRL's, which its trainers call at every checkpoint) takes its tags
only from its `tags` argument: `set_tags` wraps it, once, in the Trainer class and every subclass that defines its
own, to add the trainer's model's hf_spanattn tags to that argument (a model without them: called as it is), and
drops those of other settings (or of any, for a model not patched) that Transformers keeps from a README.md
already there.

A model set to span_attention by `from_pretrained` (no `patch_model`) is tagged by the registry at its first
forward under a Trainer (`tag_trainers_model`).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterable
from typing import Any

from huggingface_hub import metadata_load, metadata_save
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


def _as_list(held: object) -> list:
    """Tags as a list: one tag set as a string is one tag, as `add_model_tags` takes it; so are bytes and a
    number; an array of tags is a list of them; None is none."""
    if held is None:  # an array of tags has no truth value
        return []
    return list(held) if isinstance(held, Iterable) and not isinstance(held, (str, bytes)) else [held]


def tag_trainers_model(trainer: Any) -> None:
    """Tag `trainer`'s model as `patch_model` does where it trains with span_attention but has no hf_spanattn tags
    (set to it by `from_pretrained(..., attn_implementation="span_attention")`), so that the cards of its training
    (`create_model_card`, `Trainer.push_to_hub`, `push_to_hub` after) name the method."""
    from hf_spanattn.integration.adapters import is_patched
    from hf_spanattn.integration.patch import base_model
    from hf_spanattn.integration.stored import config_of

    try:
        base = base_model(trainer.model, "Trainer.train")
        settings = (config_of(base.config) or SpanAttentionConfig()) if is_patched(base) else None
    except (TypeError, ValueError):  # not a Transformers model; bad settings, which the forward names
        return
    if settings is not None and not any(ours(tag) for tag in _as_list(base.model_tags)):
        set_tags(base, settings)


def set_tags(model: PreTrainedModel, config: SpanAttentionConfig | None) -> None:
    """Replace the model's hf_spanattn tags by those of `config` (none for None), keeping the others."""
    if model.model_tags is not None:
        model.model_tags = [tag for tag in _as_list(model.model_tags) if not ours(tag)] or None
    if config is not None:
        model.add_model_tags(tags(config))
        _tag_trainer_cards()


_WRAPPED = "_hf_spanattn_tags"  # marks a create_model_card that adds the model's tags


def _with_model_tags(create_model_card):
    signature = inspect.signature(create_model_card)

    @functools.wraps(create_model_card)
    def create(self, *args, **kwargs):
        mine = [tag for tag in _as_list(getattr(getattr(self, "model", None), "model_tags", None)) if ours(tag)]
        if not mine:  # not patched (now): called as it is, but no earlier settings' tags kept
            result = create_model_card(self, *args, **kwargs)
            _drop_stale_tags(self, mine)
            return result
        bound = signature.bind(self, *args, **kwargs)
        given = [str(tag) if isinstance(tag, str) else tag for tag in _as_list(bound.arguments.get("tags"))]
        bound.arguments["tags"] = given + [tag for tag in mine if tag not in given]  # numpy's str_: plain str
        result = create_model_card(*bound.args, **bound.kwargs)
        _drop_stale_tags(self, mine)
        return result

    setattr(create, _WRAPPED, True)
    return create


def _drop_stale_tags(trainer: Any, mine: list[str]) -> None:
    """Transformers' card keeps the tags of a README.md already in the output dir when given tags: those of
    settings the model had before (patched again since) are dropped."""
    path = os.path.join(trainer.args.output_dir, "README.md")
    if not trainer.is_world_process_zero() or not os.path.isfile(path):
        return
    metadata = metadata_load(path) or {}
    held = _as_list(metadata.get("tags"))
    if any(ours(tag) and tag not in mine for tag in held):
        metadata_save(path, {**metadata, "tags": [tag for tag in held if not ours(tag) or tag in mine]})


def _wrap_card(cls: type) -> None:
    method = cls.__dict__.get("create_model_card")
    if (inspect.isfunction(method) and not getattr(method, _WRAPPED, False)
            and "tags" in inspect.signature(method).parameters):
        cls.create_model_card = _with_model_tags(method)


def _tag_trainer_cards() -> None:
    """Wrap `create_model_card` of the Trainer and of its subclasses, those defined so far and (through
    `__init_subclass__`) those defined later, such as TRL's trainers imported after the model was patched."""
    from transformers import Trainer

    if getattr(Trainer.__dict__.get("__init_subclass__"), _WRAPPED, False):
        return
    classes = [Trainer]
    while classes:
        cls = classes.pop()
        _wrap_card(cls)
        classes.extend(cls.__subclasses__())

    def init_subclass(cls, **kwargs):
        super(Trainer, cls).__init_subclass__(**kwargs)
        _wrap_card(cls)

    setattr(init_subclass, _WRAPPED, True)
    Trainer.__init_subclass__ = classmethod(init_subclass)
