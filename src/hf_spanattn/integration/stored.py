"""The span settings stored on a model config (`config.span_attention`, the dict config.json saves): parsed once
per distinct section, checked where the forward pass does not need them, and traced to the config.json they were
loaded from, which errors name with the field."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from transformers.utils import CONFIG_NAME

from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.ops.inputs import shown, user_stacklevel

CONFIG_KEY = "span_attention"


# The settings parsed from each distinct stored section, keyed by its content (repr tells True from 1 and 1.0,
# which compare equal) and the folder it was loaded from (whose config.json is checked and named), so that the
# per-call lookup is one dict read and a changed dict, or one read from another file, is parsed afresh. Sections
# of JSON types only: their repr is exact (a section with a tensor or NumPy array is stored back as JSON at once).
_PARSED: dict[tuple[str, str], SpanAttentionConfig] = {}


def config_of(model_config: Any) -> SpanAttentionConfig | None:
    """The settings stored on a PretrainedConfig, or None. Parsed once per distinct dict; a bad one raises
    an error that names the config.json it was loaded from (where it was) and the field."""
    data = getattr(model_config, CONFIG_KEY, None)
    if data is None:
        return None
    if isinstance(data, SpanAttentionConfig):
        return _store(model_config, data)
    key = (repr(data), str(getattr(model_config, "_name_or_path", "")))  # and the file it may come from
    config = _PARSED.get(key)
    if config is None:
        config = _parse(data, model_config)
        if not _saves_as_json(data):  # never kept: a tensor's or an array's repr rounds, so it names no one value
            return _store(model_config, config)
        if len(_PARSED) >= 64:
            _PARSED.clear()
        _PARSED[key] = config
    return config


@torch.compiler.disable  # once, outside any graph
def _store(model_config: Any, config: SpanAttentionConfig) -> SpanAttentionConfig:
    """Settings set on the model config by hand as a SpanAttentionConfig, or as a dict with values JSON does not
    take (NumPy numbers and arrays), stored as the dict patch_model writes, so that the config saves as JSON
    (Transformers' `to_json_string` takes JSON types only)."""
    setattr(model_config, CONFIG_KEY, config.to_dict())
    return config


def _saves_as_json(data: Any) -> bool:
    try:
        json.dumps(data, sort_keys=True)  # as Transformers' to_json_string
    except (TypeError, ValueError):
        return False
    return True


@torch.compiler.disable  # parsed once, outside any graph (it reads files for its messages)
def _parse(data: Any, model_config: Any) -> SpanAttentionConfig:
    """A stored section parsed; layers outside the model whose config holds it warn (once per section)."""
    path, twice = _stored_file(model_config)
    source = f"{path}, field {CONFIG_KEY!r}" if path else f"model config field {CONFIG_KEY!r}"
    if twice:  # Transformers read the file keeping the last of the two; which one was meant is not known
        raise ValueError(f"{source}: the key {twice[0]!r} is given twice in one object; keep one")
    # an encoder-decoder's text config is its decoder's, and its encoder may have more layers
    counts = [getattr(c, "num_hidden_layers", None) for c in (model_config.get_text_config(),
                                                               getattr(model_config, "encoder", None))]
    n_layers = max((n for n in counts if isinstance(n, int)), default=None)
    if not isinstance(data, dict):
        raise TypeError(f"{source} = {shown(data)}: expected a dict of SpanAttentionConfig fields as patch_model "
                        f"writes it, e.g. {SpanAttentionConfig().to_dict()}; to set a label, call "
                        "hf_spanattn.patch_model(model, 'score:1000')")
    config = SpanAttentionConfig.from_dict(data, source=source)
    outside = [i for i in config.layers or () if isinstance(n_layers, int) and i >= n_layers]
    if outside:
        warnings.warn(f"{source}: layers={shown(list(config.layers))}: the model has layers 0..{n_layers - 1}, so "
                      f"layers {shown(outside)} do not exist and get no span gradients"
                      + ("; no layer does" if len(outside) == len(config.layers) else ""), stacklevel=user_stacklevel())
    return config


# id(model config) → the section last read from it by `check_once`.
_CHECKED: dict[int, Any] = {}


def check_once(model_config: Any) -> None:
    """Read the stored settings once per section where the forward pass does not need them (evaluation and
    generation run SDPA), so that bad ones fail at the first forward, naming the file and the field, rather
    than at the first training step. A compiled forward leaves it to the training step."""
    if torch.compiler.is_compiling():
        return
    data = getattr(model_config, CONFIG_KEY, None)
    if data is not None and _CHECKED.get(id(model_config)) is not data:
        config_of(model_config)
        if len(_CHECKED) >= 64:
            _CHECKED.clear()
        _CHECKED[id(model_config)] = getattr(model_config, CONFIG_KEY)


def stored_source(model_config: Any) -> str:
    """Where the stored settings came from, for messages: the config.json the model was loaded from, when
    that file holds these settings (a local folder, or the Hub's local cache), else the model config."""
    path, _ = _stored_file(model_config)
    return f"{path}, field {CONFIG_KEY!r}" if path else f"model config field {CONFIG_KEY!r}"


def _stored_file(model_config: Any) -> tuple[str | None, list[str]]:
    """The config.json the model was loaded from, when that file holds the settings on `model_config` (else None),
    and the keys given twice in its settings (the section's own name among them, if the file gives it twice)."""
    name = str(getattr(model_config, "_name_or_path", "") or "")
    path = os.path.join(name, CONFIG_NAME) if os.path.isdir(name) else None
    if path is None and name and not os.path.exists(name):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, CONFIG_NAME)
            path = cached if isinstance(cached, str) else None
        except Exception:  # not a repository id
            path = None
    if path is None or not os.path.isfile(path):  # gone, or a folder or a pipe put there since (a read would wait)
        return None, []
    twice: list[tuple[dict, str]] = []  # (object, key) for each key an object gives again

    def keep_twice(pairs: list[tuple[str, Any]]) -> dict:
        data: dict = {}
        for key, value in pairs:
            if key in data:
                twice.append((data, key))
            data[key] = value
        return data

    try:
        with open(path, "rb") as f:
            top = json.loads(f.read(), object_pairs_hook=keep_twice)
        saved = top.get(CONFIG_KEY)
        same = json.dumps(saved, sort_keys=True) == json.dumps(getattr(model_config, CONFIG_KEY, None),
                                                               sort_keys=True, default=repr)
    except Exception:  # no file, or not the file these settings came from
        return None, []
    if not same:
        return None, []
    return path, [key for data, key in twice if data is saved or (data is top and key == CONFIG_KEY)]
