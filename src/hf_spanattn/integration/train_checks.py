"""What `Trainer.train` checks before it trains, once `install` has wrapped it.

A run resumed from a checkpoint trains with the settings of the model it is given, as every other argument of
the model: `Trainer.train(resume_from_checkpoint=...)` loads the checkpoint's weights, not its config. Where those
settings are not the ones the checkpoint was saved with (the model patched otherwise, or not patched), `install`
has `Trainer.train` say so, naming both, before it trains (installed by `patch_model` and `load_pretrained`, and
at `import hf_spanattn` where the Trainer is imported already: importing it here would take a while).

Under data parallelism (torch.distributed with more than one process: DDP, FSDP, Accelerate) the gradient applied
is the average of the ranks': where the ranks train with other settings (a rank patched otherwise, or not at all) it
follows no one rule, so `Trainer.train` refuses to start, naming each rank's settings (`same_on_every_rank`).
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hf_spanattn.config import CONFIG_NAME, SpanAttentionConfig, _read_json
from hf_spanattn.integration.adapters import _described, is_adapter_folder, is_patched
from hf_spanattn.integration.stored import CONFIG_KEY, config_of
from hf_spanattn.integration.structure import check_structure, tower_paths
from hf_spanattn.ops.inputs import shown, user_stacklevel

_WRAPPED = "_hf_spanattn_resume"
_STOCK = "the standard gradient (the model is not patched)"
RANKS_TIMEOUT_S = 120.0  # how long a rank waits for the others to say their settings
_AVERAGED = "The gradient applied is the average of the ranks', which would follow no one rule"
_compared: collections.Counter = collections.Counter()  # per subject, the comparisons this process began


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
    if is_patched(base) and current is None:  # set to span_attention by from_pretrained, without settings
        current = SpanAttentionConfig()  # the default it trains with
    now = f"{_described(current)}" if current else _STOCK
    try:
        saved = saved_settings(checkpoint)
    except FileNotFoundError:  # no config.json: the Trainer's to refuse
        return
    except (OSError, ValueError, TypeError) as err:
        warnings.warn(f"resume_from_checkpoint: the span attention settings {checkpoint} was saved with cannot be "
                      f"read ({shown(str(err), 300)}); the model given to the Trainer trains with {now}.",
                      stacklevel=user_stacklevel())
        return
    if saved is not None and is_patched(base) and config_of(base.config) is None and is_adapter_folder(checkpoint):
        return  # PEFT's load_adapter, which the Trainer resumes with, patches it with the checkpoint's settings
    if saved == current:
        _check_towers(base, checkpoint, saved, current)
        return
    was = f"span attention settings {_described(saved)}" if saved else "no span attention settings"
    layers = f", layers={list(saved.layers)}" if saved and saved.layers is not None else ""
    how = f"patch the model with them first: hf_spanattn.patch_model(model, {saved.label!r}{layers})" if saved \
        else "unpatch it first: hf_spanattn.unpatch_model(model)"
    warnings.warn(f"resume_from_checkpoint: {checkpoint} was saved with {was}, but the model given to the Trainer "
                  f"trains with {now}: the model's settings win. To continue with the checkpoint's, {how}.",
                  stacklevel=user_stacklevel())


def _check_towers(base: Any, checkpoint: str, saved: SpanAttentionConfig | None,
                  current: SpanAttentionConfig | None) -> None:
    """Warn where a tower of a composite model (an encoder-decoder's decoder, a vision tower) trains with other
    settings than those it was saved with in the checkpoint's config.json: a tower patched alone holds its own
    (`patch_model(model.decoder, ...)`), else it trains with the model's."""
    path = os.path.join(checkpoint, "config.json")
    if current is None or not os.path.isfile(path):  # not patched (said by the caller), or an adapter's folder
        return
    data = _read_json(path)
    for key, (name, tower) in tower_paths(base).items():
        section = data.get(key) if isinstance(data, dict) else None
        stored = section.get(CONFIG_KEY) if isinstance(section, dict) else None
        try:
            was = saved if stored is None else SpanAttentionConfig.from_dict(stored, source=f"{path}, field {key}")
            now = config_of(tower.config) or current
        except (ValueError, TypeError) as err:
            warnings.warn(f"resume_from_checkpoint: the span attention settings {checkpoint} was saved with on the "
                          f"tower {name} cannot be read ({shown(str(err), 300)}).", stacklevel=user_stacklevel())
            continue
        if was != now:
            layers = f", layers={list(was.layers)}" if was.layers is not None else ""
            warnings.warn(f"resume_from_checkpoint: {checkpoint} was saved with span attention settings "
                          f"{_described(was)} on the tower {name} (config.json, field {key}.{CONFIG_KEY}), but the "
                          f"model given to the Trainer trains it with {_described(now)}: the model's settings win. To "
                          "continue with the checkpoint's, patch that tower with them first: hf_spanattn.patch_model("
                          f"model.{name}, {was.label!r}{layers}).", stacklevel=user_stacklevel())


def same_on_every_rank(subject: str, mine: str, absent: str, why: str = _AVERAGED,
                       timeout: float | None = None) -> None:
    """Refuse where the ranks of a data-parallel run hold other `subject` than this rank's (`mine`, a description);
    a no-op unless torch.distributed is initialised with more than one rank. Every rank says its own through the
    process group's key-value store, not through a collective, so that a rank that does not take part cannot pair
    with a collective of another kind; a rank that has not said within `timeout` seconds (RANKS_TIMEOUT_S) is taken
    to hold `absent` where that is given (as a warning), else refused. `why` says what differing ones would do."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    _compared[subject] += 1  # every rank runs the same code: the n-th comparison of one is the n-th of the others
    keys = [f"hf_spanattn/{subject}/{_compared[subject]}/{r}" for r in range(world)]
    store.set(keys[rank], mine)
    try:
        store.wait(keys, timedelta(seconds=RANKS_TIMEOUT_S if timeout is None else timeout))
    except (RuntimeError, dist.DistError):  # DistStoreError: a timeout
        pass
    said = {r: store.get(key).decode() for r, key in enumerate(keys) if store.check([key])}
    waited = RANKS_TIMEOUT_S if timeout is None else timeout
    held = {r: said.get(r, f"nothing within {waited:g} s") for r in range(world)}
    ranks: dict[str, list[int]] = {}
    for r, value in held.items():
        ranks.setdefault(value, []).append(r)
    if len(ranks) == 1:
        return
    listed = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {shown(rs, 60)[1:-1]}: {shown(v, 300)}"
                       for v, rs in ranks.items())
    message = f"the ranks of this data-parallel run ({world} processes) hold other {subject}: {listed}. {why}"
    if len(said) < world and absent:  # a rank without this check cannot refuse: it would train on alone
        warnings.warn(f"{message}, where those that said nothing (hf_spanattn not imported there?) train with "
                      f"{absent}", stacklevel=user_stacklevel())
        return
    raise ValueError(f"{message}: give every rank the same")


def from_rank_zero(subject: str, said: str) -> str:
    """What rank 0 of a data-parallel run says about `subject` (its `said`; on rank 0 itself, `said`), so that a
    refusal on rank 0 alone (where it writes a file) is a refusal on every rank, not ranks that train on waiting
    for it; "" where rank 0 said nothing within RANKS_TIMEOUT_S seconds, or without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return said
    store = dist.distributed_c10d._get_default_store()
    _compared[subject] += 1
    key = f"hf_spanattn/{subject}/{_compared[subject]}"
    if dist.get_rank() == 0:
        store.set(key, said)
        return said
    try:
        store.wait([key], timedelta(seconds=RANKS_TIMEOUT_S))
    except (RuntimeError, dist.DistError):  # DistStoreError: a timeout
        return ""
    return store.get(key).decode()


def _config_of(trainer: Any) -> SpanAttentionConfig | None:
    """The span settings `trainer`'s model trains with (None: not patched)."""
    from hf_spanattn.integration.patch import base_model

    try:
        base = base_model(trainer.model, "Trainer.train")
    except TypeError:  # not a Transformers model: nothing patched
        return None
    return config_of(base.config) if is_patched(base) else None


def _settings_of(trainer: Any) -> str:
    """The description of the span settings `trainer`'s model trains with, for `same_on_every_rank`."""
    current = _config_of(trainer)
    return _described(current) if current else _STOCK


def settings_not_in_force(trainer: Any) -> None:
    """Warn where the model config holds span settings that its attention does not apply: its attention set
    otherwise after patch_model (`set_attn_implementation`), or a saved patched model loaded without patching. It
    trains with the standard gradient, and its saves and Hub tags still name the settings."""
    from hf_spanattn.integration.patch import _original, base_model

    try:
        base = base_model(trainer.model, "Trainer.train")
        settings = None if is_patched(base) else config_of(base.config)
    except (TypeError, ValueError):  # not a Transformers model; bad settings, which patching names
        return
    check_structure(base, "Trainer.train")
    if settings is not None:
        drop = "hf_spanattn.unpatch_model(model)" if _original(base) else f"del model.config.{CONFIG_KEY}"
        warnings.warn(f"Trainer.train: the model config holds the span attention settings {_described(settings)}, but "
                      f"its attention implementation is {shown(base.config._attn_implementation)}, not "
                      "span_attention, so it trains with the standard gradient (and save_pretrained still writes "
                      f"the settings). Call hf_spanattn.patch_model(model) to train with them, or {drop} to drop "
                      "them.", stacklevel=user_stacklevel())


def watch_model_init(trainer: Any) -> Any:
    """Where the Trainer has a `model_init`, `train` replaces the model it holds by a new one from `model_init`: a
    callback (added to `trainer`, to remove after training) that warns at the start of training where the new model
    trains with other settings than the one held (patched after the Trainer was made, say); None without one."""
    from transformers import TrainerCallback

    if getattr(trainer, "model_init", None) is None:
        return None
    held = _config_of(trainer)

    class ModelInitCheck(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = _config_of(trainer)
            if now == held:
                return
            layers = f", layers={list(held.layers)}" if held and held.layers is not None else ""
            how = (f"patch it inside model_init: model_init=lambda: hf_spanattn.patch_model(make_model(), "
                   f"{held.label!r}{layers})" if held else "leave it unpatched in model_init")
            warnings.warn(f"Trainer.train: the Trainer makes its model anew with model_init at the start of "
                          f"training, and that model trains with {_described(now) if now else _STOCK}, but the "
                          f"model it held trained with {_described(held) if held else _STOCK}: the new model's "
                          f"settings win. To train with the held model's, {how}.", stacklevel=user_stacklevel())

    callback = ModelInitCheck()
    trainer.add_callback(callback)
    return callback


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
            bound = signature.bind(self, *args, **kwargs).arguments
        except TypeError:  # the Trainer's own error for its arguments
            bound = {}
        resume = bound.get("resume_from_checkpoint")
        same_on_every_rank("span attention settings", _settings_of(self), _STOCK)
        settings_not_in_force(self)
        if resume is not None and resume is not False:
            check(self, resume)
        watching = watch_model_init(self) if bound.get("trial") is None else None  # a search's trials differ
        try:
            return train(self, *args, **kwargs)
        finally:
            if watching is not None:
                self.remove_callback(watching)

    setattr(checked_train, _WRAPPED, True)
    Trainer.train = checked_train
