"""How a patched model's modules stand against its settings: the towers of a composite model, the layers a selection
names, and modules that read another model's config or settings (a layer taken from another model, a structure changed
after patch_model), which patch_model and Trainer.train refuse or name."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.integration import gpt_neo, registry
from hf_spanattn.integration.adapters import is_patched
from hf_spanattn.integration.model_layers import attention_modules, calls_the_registry, layer_index
from hf_spanattn.integration.registry import ATTN_IMPLEMENTATION, SETTINGS_FROM_ATTR
from hf_spanattn.integration.stored import config_of, stored_source
from hf_spanattn.ops.inputs import shown, user_stacklevel


def tower_paths(base: PreTrainedModel) -> dict[str, tuple[str, PreTrainedModel]]:
    """The models inside a composite model (a vision-language model's vision tower and language model, an
    encoder-decoder's encoder and decoder) that read one of its sub-configs, by the sub-config's name: the path and
    the outermost model reading it."""
    parts = {id(getattr(base.config, key, None)): key for key in getattr(base.config, "sub_configs", None) or {}}
    found: dict[str, tuple[str, PreTrainedModel]] = {}
    for path, m in base.named_modules():
        if isinstance(m, PreTrainedModel) and m is not base and id(m.config) in parts:
            found.setdefault(parts[id(m.config)], (path, m))
    return found


def towers(base: PreTrainedModel) -> dict[str, PreTrainedModel]:
    """`tower_paths` without the paths."""
    return {key: m for key, (_, m) in tower_paths(base).items()}


def check_structure(base: PreTrainedModel, caller: str) -> None:
    """Warn where the model's structure, changed after patch_model (layers dropped, reordered or duplicated, a module
    or the inner model replaced), does not train as its settings say: what `warn_modules_left_stock` and
    `warn_layers_moved` name, and `layers` that name a layer the model no longer holds; in a model not patched, its
    modules that run span_attention all the same (`model.config` replaced after patch_model)."""
    if not is_patched(base):  # a tower patched alone reads a sub-config of the model's
        keys = getattr(base.config, "sub_configs", None) or {}
        parts = [base.config, *(getattr(base.config, key, None) for key in keys)]
        left = [path for path, module in base.named_modules() if calls_the_registry(module) and
                is_patched_config(own := getattr(module, "config", None)) and all(own is not c for c in parts)]
        if left:
            warnings.warn(f"{caller}: {', '.join(left)} of {type(base).__name__} read their attention implementation "
                          f"from a config that is not the model's, set to {ATTN_IMPLEMENTATION!r}, while the model's "
                          f"config holds no span settings (model.config replaced after patch_model?): they train with "
                          "span gradients, which save_pretrained does not write. Patch the model "
                          "(hf_spanattn.patch_model(model, ...)) to train and save them, or set model.config back and "
                          "unpatch it (hf_spanattn.unpatch_model) for stock gradients", stacklevel=user_stacklevel())
        return
    warn_modules_left_stock(base, caller)
    config = config_of(base.config)
    if config is None:
        return
    theirs = _modules_of_other_models(base, config, gpt_neo.attentions(base))
    if theirs:
        warnings.warn(f"{caller}: {', '.join(f'{path} (under {other.label})' for path, _, other in theirs)} of "
                      f"{type(base).__name__} read the settings of another patched model (a module taken from it after "
                      f"patch_model), so they train under those, not under the model's {config.label}; give this model "
                      "its own copy of the module (copy.deepcopy) pointing to its config (.config = model.config), and "
                      "patch again", stacklevel=user_stacklevel())
    if config.layers is None:
        return
    try:
        refuse_layers_without_attention(base, config.layers, f"{stored_source(base.config)}: "
                                                             f"layers={shown(list(config.layers))}")
    except ValueError as error:
        warnings.warn(f"{caller}: {error}, so no layer of that index gets span gradients (the model's layers changed "
                      "since patch_model?); patch_model(model, ..., layers=[...]) with layers it holds",
                      stacklevel=user_stacklevel())
    warn_layers_moved(base, config.layers, caller)


def is_patched_config(model_config: Any) -> bool:
    """Whether `model_config` is a config that patch_model set to span_attention."""
    return registry.PATCHED_CONFIGS.get(id(model_config)) is model_config and \
        model_config._attn_implementation == ATTN_IMPLEMENTATION


def warn_layers_moved(base: PreTrainedModel, layers: Any, caller: str) -> None:
    """Warn where an entry of a list of layers holds attention of another layer's index (layers reordered, a layer
    duplicated or dropped from the front): `layers` selects by that index, while from_pretrained numbers the layers
    by their place in the list, so the saved model would train other layers with span gradients."""
    neo = gpt_neo.attentions(base)
    moved = []
    for path, block in base.named_modules():
        if not isinstance(block, torch.nn.ModuleList):
            continue
        for place, layer in enumerate(block):
            indices = {layer_index(m) for m in layer.modules() if m in neo or calls_the_registry(m)}
            index = next(iter(indices)) if len(indices) == 1 else None
            if isinstance(index, int) and index != place and (index in layers or place in layers):
                moved.append(f"{path}.{place} (layer_idx {index})")
    if moved:
        warnings.warn(f"{caller}: layers={shown(list(layers))} selects attention by its layer index, and "
                      f"{', '.join(moved)} of {type(base).__name__} hold attention of another index than their place "
                      "(layers reordered, duplicated or dropped after patch_model); from_pretrained numbers the layers "
                      "by their place, so the saved model would train other layers with span gradients. Set each "
                      "layer's attention .layer_idx to its place and patch again", stacklevel=user_stacklevel())


def warn_modules_left_stock(base: PreTrainedModel, caller: str = "patch_model") -> None:
    """Warn where an attention module of `base` reads the attention implementation from a config that is not the
    model's (a layer taken from another model keeps that model's config): it keeps its stock attention and
    gradients, and setting that config would change the other model."""
    left = {path: module.config for path, module in base.named_modules() if calls_the_registry(module) and
            getattr(getattr(module, "config", None), "_attn_implementation", None) not in (None, ATTN_IMPLEMENTATION)}
    if left:
        other = next(iter(left.values()))
        warnings.warn(f"{caller}: {', '.join(left)} of {type(base).__name__} read their attention implementation "
                      f"from a config that is not the model's ({type(other).__name__} with attn_implementation="
                      f"{other._attn_implementation!r}: a layer taken from another model, or the config a tower was "
                      "loaded with, which EncoderDecoderModel.from_encoder_decoder_pretrained replaces on the tower "
                      "but not on its layers), so they keep stock gradients. Set those modules' .config to the "
                      "config of the model (or tower) that holds them, on a copy of a layer taken from another model "
                      "(layer = copy.deepcopy(layer)), and patch again", stacklevel=user_stacklevel())


def refuse_modules_of_other_models(base: PreTrainedModel, config: SpanAttentionConfig,
                                    neo: list[torch.nn.Module]) -> None:
    """Refuses to patch `base` where one of its attention modules is also a module of another patched model (one
    module put into two models) that runs it under other settings: a module reads one model's settings, so the
    other model would train under this one's without a word. A model inside `base` or around it (a composite's
    tower, patched apart) is none."""
    for path, module, theirs in _modules_of_other_models(base, config, neo):
        raise ValueError(f"patch_model: {path} ({type(module).__name__}) is also a module of another patched "
                         f"model, which runs it under {theirs.label}; a module reads one model's settings, so "
                         f"patching this one with {config.label} would change that model's gradients. Patch both "
                         "models alike, unpatch the other first (hf_spanattn.unpatch_model), or give this model "
                         "its own copy of the module (copy.deepcopy)")


def _modules_of_other_models(base: PreTrainedModel, config: SpanAttentionConfig,
                             neo: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module, SpanAttentionConfig]]:
    """The attention modules of `base` (path, module, settings) that read another patched model's config, whose
    settings for them are not those of `config`."""
    inside = own_configs(base)
    found = []
    for path, module in base.named_modules():
        other = module.__dict__.get(SETTINGS_FROM_ATTR) or getattr(module, "config", None)
        if id(other) in inside or registry.PATCHED_CONFIGS.get(id(other)) is not other or \
                not (calls_the_registry(module) or module in neo) or config_of(other) is None:
            continue
        around = any(isinstance(m, PreTrainedModel) and m.config is other and any(x is base for x in m.modules())
                     for m in registry.listed(registry.PATCHED_MODULES))
        theirs = config_of(other)
        if not around and _runs(theirs, module) != _runs(config, module):
            found.append((path, module, theirs))
    return found


def own_configs(base: PreTrainedModel) -> set[int]:
    """The ids of the configs of `base` and the models inside it (a composite's towers)."""
    return {id(m.config) for m in base.modules() if isinstance(m, PreTrainedModel)}


def _runs(config: SpanAttentionConfig, module: torch.nn.Module) -> SpanAttentionConfig | None:
    """The settings `module` runs under `config`: None where its layers leave it stock gradients."""
    if config.layers is not None and layer_index(module) not in config.layers:
        return None
    return config.replace(layers=None)


def refuse_layers_without_attention(base: PreTrainedModel, layers: Any, what: str, every: bool = True) -> None:
    """Refuses `layers` (`what` names them in the error) where one of them has no attention module (`every`), or
    where none has one (not `every`: a range of a schedule's layer table may span a hybrid model's other layers):
    a layer removed from the model (its config still counting it), or a hybrid model's convolution or state-space
    layer, which carries a layer index too."""
    present = attention_modules(base)
    cross = {m for path, m in base.named_modules() if under_cross_attention(path) or registry.is_cross_attention(m)}
    calling = {i: [m for m in modules if calls_the_registry(m)] for i, modules in present.items()}
    crossing = {i for i in present if calling[i] and all(m in cross for m in calling[i])}  # SDPA's gradient
    absent = [i for i in layers if i not in present or i in crossing]
    if absent if every else len(absent) == len(layers):
        only_cross = [i for i in absent if i in crossing]
        if only_cross:
            raise ValueError(f"{what}: layer {shown(only_cross)[1:-1]} of {type(base).__name__} holds cross-attention "
                             "only, which keeps SDPA's gradient (span rules need self-attention); its self-attention "
                             f"modules carry the layer indices {shown(sorted(set(present) - crossing))[1:-1]}")
        raise ValueError(f"{what}: {type(base).__name__} has no attention module of layer {shown(absent)[1:-1]}; its "
                         f"attention modules carry the layer indices {shown(sorted(present))[1:-1]}")


def under_cross_attention(path: str) -> bool:
    """Whether a module's path in its model places it in a cross-attention module (BLIP-2's Q-Former attention,
    which serves as both, is told by where it sits)."""
    return any("cross" in part.lower() or part == "encoder_attn" for part in path.split("."))
