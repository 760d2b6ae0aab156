"""A run resumed from a checkpoint trains with the settings of the model it is given, as every other argument of
the model: `Trainer.train(resume_from_checkpoint=...)` loads the checkpoint's weights, not its config. Where those
settings are not the ones the checkpoint was saved with (the model patched otherwise, or not patched), `install`
has `Trainer.train` say so, naming both, before it trains (installed by `patch_model` and `load_pretrained`, and
at `import hf_spanattn` where the Trainer is imported already: importing it here would take a while).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

from hf_spanattn.config import CONFIG_NAME, SpanAttentionConfig, _read_json
from hf_spanattn.integration.adapters import _described, is_patched
from hf_spanattn.integration.registry import CONFIG_KEY, config_of
from hf_spanattn.ops.inputs import shown

_WRAPPED = "_hf_spanattn_resume"


def saved_settings(checkpoint: str) -> SpanAttentionConfig | None:
    """The settings a checkpoint was saved with: beside a PEFT adapter, else in its config.json (None: saved
    unpatched). Unreadable settings raise: the caller cannot compare them."""
    if os.path.isfile(os.path.join(checkpoint, CONFIG_NAME)):
        return SpanAttentionConfig.from_pretrained(checkpoint)
    data = _read_json(os.path.join(checkpoint, "config.json"))
    section = data.get(CONFIG_KEY) if isinstance(data, dict) else None
    return None if section is None else SpanAttentionConfig.from_dict(section, source=checkpoint)


def check(trainer: Any, resume_from_checkpoint: Any) -> None:
    """Warn where the model's settings are not those `resume_from_checkpoint` was saved with."""
    from transformers.trainer_utils import get_last_checkpoint

    from hf_spanattn.integration.patch import base_model

    checkpoint = resume_from_checkpoint
    if isinstance(checkpoint, bool) and checkpoint:
        checkpoint = get_last_checkpoint(trainer.args.output_dir) if os.path.isdir(trainer.args.output_dir) else None
    checkpoint = os.fspath(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else None
    if not isinstance(checkpoint, str) or not os.path.isdir(checkpoint):
        return  # none, not a folder, or bytes (which Transformers cannot join to its file names): the Trainer's
    try:
        base = base_model(trainer.model, "Trainer.train")
    except TypeError:  # not a Transformers model: nothing patched
        return
    current = config_of(base.config) if is_patched(base) else None
    now = f"{_described(current)}" if current else "the standard gradient (the model is not patched)"
    try:
        saved = saved_settings(checkpoint)
    except FileNotFoundError:  # no config.json: the Trainer's to refuse
        return
    except (OSError, ValueError, TypeError) as err:
        warnings.warn(f"resume_from_checkpoint: the span attention settings {checkpoint} was saved with cannot be "
                      f"read ({shown(str(err), 300)}); the model given to the Trainer trains with {now}.", stacklevel=3)
        return
    if saved == current:
        return
    was = f"span attention settings {_described(saved)}" if saved else "no span attention settings"
    layers = f", layers={list(saved.layers)}" if saved and saved.layers is not None else ""
    how = f"patch the model with them first: hf_spanattn.patch_model(model, {saved.label!r}{layers})" if saved \
        else "unpatch it first: hf_spanattn.unpatch_model(model)"
    warnings.warn(f"resume_from_checkpoint: {checkpoint} was saved with {was}, but the model given to the Trainer "
                  f"trains with {now}: the model's settings win. To continue with the checkpoint's, {how}.",
                  stacklevel=3)


def install() -> None:
    """Wrap `Trainer.train` once, calling it through unchanged after the check."""
    from transformers import Trainer

    train = Trainer.train
    if getattr(train, _WRAPPED, False):
        return
    signature = inspect.signature(train)

    @functools.wraps(train)
    def checked_train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            resume = signature.bind(self, *args, **kwargs).arguments.get("resume_from_checkpoint")
        except TypeError:  # the Trainer's own error for its arguments
            resume = None
        if resume is not None and resume is not False:
            check(self, resume)
        return train(self, *args, **kwargs)

    setattr(checked_train, _WRAPPED, True)
    Trainer.train = checked_train
