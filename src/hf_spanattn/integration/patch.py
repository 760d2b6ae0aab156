"""Turn span gradients on and off for a Transformers model, and load patched models.

Models whose attention goes through Transformers' attention registry, and whose class declares
attention-backend support, are switched to the registered `span_attention` implementation. GPT-Neo,
whose eager attention bypasses the registry, gets a small adapter on its attention modules.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import os
import sys
import warnings
import weakref
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_spanattn.config import CONFIG_NAME, SpanAttentionConfig, _looks_local, _path_argument, as_config
from hf_spanattn.integration import adapters, card, gpt_neo, registry, structure, train_checks
from hf_spanattn.integration.adapters import is_patched
from hf_spanattn.integration.gpt_neo import neo_attn as _neo_attn  # noqa: F401 (models pickled before name it here)
from hf_spanattn.integration.model_layers import (
    LAYER_ATTR,
    attention_modules,
    calls_the_registry,
    layer_count,
    layer_index,
    passes_argument,
)
from hf_spanattn.integration.registry import (
    ATTN_IMPLEMENTATION,
    CROSS_ATTR,
    OVERRIDE_ATTR,
    OWNER_ATTR,
    PROBE_ATTR,
    REGISTERS_ATTR,
    SETTINGS_FROM_ATTR,
    register,
)
from hf_spanattn.integration.stored import CONFIG_KEY, config_of, stored_source
from hf_spanattn.ops.inputs import shown, user_stacklevel

SUPPORTED = "models whose attention goes through Transformers' AttentionInterface (GPT-2, GPT-NeoX, Llama, " \
            "Qwen2, Mistral, ...) and GPT-Neo"
_ORIGINAL = "_hf_spanattn_original"  # model attribute: what patch_model changed, for unpatch_model
_PATCHED: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()  # the models patch_model was given (or found inside)


def base_model(model: torch.nn.Module, caller: str = "patch_model") -> PreTrainedModel:
    """The Transformers model under a DistributedDataParallel (or DataParallel), DeepSpeedEngine, `torch.compile` or
    PEFT wrapper, or the one Transformers model inside another module (a sentence-transformers SentenceTransformer or
    CrossEncoder, a module of one's own around a Transformers backbone), or the model itself."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)  # as Accelerate's `prepare` gives
    deepspeed = sys.modules.get("deepspeed")  # imported wherever an engine was made
    if deepspeed is not None and isinstance(getattr(deepspeed, "DeepSpeedEngine", None), type):
        parallel += (deepspeed.DeepSpeedEngine,)
    while isinstance(model, (*parallel, torch._dynamo.eval_frame.OptimizedModule)):
        model = model.module if isinstance(model, parallel) else model._orig_mod
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if isinstance(base, PreTrainedModel):
        return base
    inside = _outermost_models(base) if isinstance(base, torch.nn.Module) else []
    if len(inside) == 1:
        return base_model(inside[0][1], caller)
    held = f"; it holds {len(inside)} of them ({', '.join(name for name, _ in inside)}), and {caller} takes one: " \
        "give it each one alone" if inside else ""
    if not isinstance(base, torch.nn.Module) and isinstance(getattr(base, "model", None), torch.nn.Module):
        held = f"; give it the model the {type(base).__name__} holds, its .model"  # a pipeline's, a Trainer's
    raise TypeError(f"{caller} needs a transformers PreTrainedModel (or a PEFT model, torch.compile module, "
                    f"DistributedDataParallel, DeepSpeedEngine or other module around one), got "
                    f"{type(model).__name__}{held}")


def _outermost_models(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The Transformers (or PEFT) models inside `module` that are not inside another one, with their paths."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, inner in module.named_modules():
        if (isinstance(inner, PreTrainedModel) or hasattr(inner, "get_base_model")) and inner is not module \
                and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, inner))
    return found


def patch_model(model: torch.nn.Module, config: SpanAttentionConfig | str | None = None,
                layers: list[int] | None = None) -> torch.nn.Module:
    """Give `model` span-decomposed attention gradients; the forward pass is unchanged.

    Args:
        model: a Transformers model, or a PEFT model, `torch.compile` module, DistributedDataParallel or
            DeepSpeedEngine around one (patched through the model inside; the wrapper then trains with the span
            gradients).
        config: a SpanAttentionConfig or a label such as `"score:1000"`; None keeps the settings
            already on the model config, or takes the default.
        layers: decoder layer indices that use span gradients (the others keep stock ones), at
            least one and each inside the model; overrides `config.layers`.

    The settings are written to `model.config.span_attention`, so `save_pretrained` and
    `push_to_hub` carry them, and the model's tags name them for the Hub page (`card.py`).
    Patching again replaces them, and a setting that a schedule left on a layer (`SpanAttentionCallback`, in a
    training run stopped midway). A module reads one model's settings: an attention module that is also
    another patched model's (a layer shared) is refused under other settings, and one that reads another
    model's config (a layer taken from it) is named in a warning. A layer reads its settings when its forward pass
    runs and that call's backward pass applies them: patching or unpatching between the two changes later calls
    only. Returns `model`.
    """
    register()
    adapters.install()
    base = base_model(model)
    _rejoin_copies(base)
    config = as_config(config, "patch_model", "keep the model's settings")
    towers = structure.towers(base)
    saved = {key: getattr(tower.config, CONFIG_KEY, None) for key, tower in towers.items()}
    as_saved = config is None and layers is None and any(section is not None for section in saved.values())
    if as_saved and getattr(base.config, CONFIG_KEY, None) is None:  # towers patched alone, saved with the model
        _patch_towers_alone(base, towers, saved)
        return model
    keep = config is None and layers is None and config_of(base.config) is not None  # the section as it is stored
    if config is None:
        config = config_of(base.config) or _default_settings(base.config)
    if layers is not None:
        config = config.replace(layers=layers)
    neo = gpt_neo.attentions(base)
    _refuse_unpatchable(base, config, neo)
    _record_original(base, neo)
    _mark_modules(base)
    _write_settings(base, config, towers, keep)
    card.set_tags(base, config)
    train_checks.install()
    if neo:
        gpt_neo.adapt(base.config, neo)
        _warn_neo_of_other_models(base, neo)
    else:
        base.set_attn_implementation(ATTN_IMPLEMENTATION)
        _repatch_copied_configs(base)
        structure.warn_modules_left_stock(base)
    if config.layers is not None:
        structure.warn_layers_moved(base, config.layers, "patch_model")
    if as_saved:
        _patch_towers_as_saved(base, config, towers, saved)
    return model


def _patch_towers_alone(base: PreTrainedModel, towers: dict[str, PreTrainedModel], saved: dict[str, Any]) -> None:
    """Patch the towers of a composite model saved with settings of their own but none of the model's (towers
    patched alone), each with its settings; the others keep stock gradients."""
    named = [key for key in towers if saved[key] is not None]
    one = len(named) == 1
    warnings.warn(f"{stored_source(base.config)}: not given, but {', '.join(f'{k}.{CONFIG_KEY}' for k in named)} "
                  f"{'is' if one else 'are'}: patching {'that tower' if one else 'those towers'} of "
                  f"{type(base).__name__} with {'its' if one else 'their'} settings, the others keep stock "
                  "gradients (pass settings to patch_model to patch every tower)", stacklevel=user_stacklevel())
    for key in named:
        patch_model(towers[key])


def _lacks_sdpa(model: PreTrainedModel) -> bool:
    # Transformers 4 marks Gemma 2 as supporting SDPA, whose path there drops the logit soft-capping
    return model._supports_sdpa is False or getattr(model.config, "attn_logit_softcapping", None) is not None


def _refuse_unpatchable(base: PreTrainedModel, config: SpanAttentionConfig, neo: list[torch.nn.Module]) -> None:
    """Refuse a model whose attention span_attention cannot take (no attention-backend support, no SDPA), a layer
    selection it cannot apply, and modules that another patched model runs under other settings."""
    if not neo and not _declares_backend(base):
        raise ValueError(_not_a_backend(base))
    # a composite's tower that does not declare it and whose attention adds a position bias (BLIP-2 around T5), which
    # span_attention does not take: refused here, not at the first training step
    lacking = next((m for m in base.modules() if isinstance(m, PreTrainedModel) and not _declares_backend(m) and
                    _position_bias(m) is not None), None)
    if lacking is not None:
        raise ValueError(_not_a_backend(lacking, holder=base))
    if not neo and getattr(base.config, "output_attentions", False) is True:
        # Transformers gives such a config eager attention, the one that returns the weights, and refuses to save it
        # under any other
        raise ValueError(f"patch_model: the config of {type(base).__name__} sets output_attentions=True, which "
                         f"Transformers allows with eager attention only (it refuses to save the config under "
                         f"another); {ATTN_IMPLEMENTATION!r}, whose forward pass is SDPA's, returns no attention "
                         "weights. Set model.config.output_attentions = False first (load_pretrained(..., "
                         "output_attentions=False)), and pass output_attentions=True to a call of the unpatched model "
                         "for the weights")
    # the model, or a model inside it (a composite model's language model: PaliGemma 2 around Gemma 2)
    no_sdpa = next((m for m in base.modules() if isinstance(m, PreTrainedModel) and _lacks_sdpa(m)), None)
    if not neo and no_sdpa is not None:
        what = type(base).__name__ + (f" holds {type(no_sdpa).__name__}, which" if no_sdpa is not base else "")
        raise ValueError(f"{what} does not support SDPA attention in Transformers (its attention has parts SDPA "
                         "lacks, such as attention sinks or logit soft-capping), and span_attention's forward pass is "
                         f"SDPA's, so it would change the model's outputs. Supported: {SUPPORTED}.")
    if config.layers is not None:
        if not attention_modules(base):  # numbered here where the modules carry no index
            raise ValueError(f"layers={shown(list(config.layers))}: the attention modules of {type(base).__name__} "
                             "carry no layer index and its layers could not be found, so a selection cannot be "
                             "applied; patch every layer (layers=None)")
        n_layers = layer_count(base)
        where = f"{stored_source(base.config)}: " if config_of(base.config) == config else ""
        if max(config.layers, default=-1) >= n_layers:
            raise ValueError(f"{where}layers={shown(list(config.layers))}: {type(base).__name__} has layers "
                             f"0..{n_layers - 1}")
        structure.refuse_layers_without_attention(base, config.layers, f"{where}layers={shown(list(config.layers))}")
    structure.refuse_modules_of_other_models(base, config, neo)


def _record_original(base: PreTrainedModel, neo: list[torch.nn.Module]) -> None:
    """Keep what patch_model changes (the attention implementation, GPT-2's reorder_and_upcast_attn) on the model and
    every model sharing its config, for unpatch_model; a model patched again keeps the record of its first patch."""
    original = _original(base)
    if not is_patched(base) or original is None:
        switched_off = original["reorder_and_upcast_attn"] if original else None  # by a patch_model before
        original = _Original(attn_implementation=_implementation_of(base.config), reorder_and_upcast_attn=switched_off)
        if not neo:
            _warn_attention_of_ones_own(base, original["attn_implementation"])
        if getattr(base.config, "reorder_and_upcast_attn", False):
            warnings.warn("GPT-2's reorder_and_upcast_attn bypasses the attention registry; it is switched off "
                          "while patched (span_attention already takes the softmax in float32 for half "
                          "precision). unpatch_model restores it.", stacklevel=user_stacklevel())
            original["reorder_and_upcast_attn"] = True
            _set_reorder(base, False)
    for part in _sharing_config(base):
        setattr(part, _ORIGINAL, original)
        registry.add_all(_PATCHED, [part])
    registry.PATCHED_CONFIGS[id(base.config)] = base.config
    registry.add_all(registry.PATCHED_MODULES, base.modules())


def _mark_modules(base: PreTrainedModel) -> None:
    """Mark each module for the registry: cross-attention keeps SDPA's gradient, a module reading a config that is not
    the model's reads the model's settings; what a training run stopped midway left on it goes."""
    for path, module in base.named_modules():
        for name in (OVERRIDE_ATTR, PROBE_ATTR, OWNER_ATTR, CROSS_ATTR):  # a schedule's setting left on it, ...
            module.__dict__.pop(name, None)
        if structure.under_cross_attention(path) and calls_the_registry(module):
            module.__dict__[CROSS_ATTR] = True  # keeps SDPA's gradient (registry.is_cross_attention)
        # a composite model's towers read their sub-config (text_config, vision_config), and a custom model's attention
        # may hold no config at all: the settings are the model's
        own = getattr(module, "config", None)
        if isinstance(own, PretrainedConfig) and own is not base.config or own is None and calls_the_registry(module):
            module.__dict__[SETTINGS_FROM_ATTR] = base.config
        else:
            module.__dict__.pop(SETTINGS_FROM_ATTR, None)


def _write_settings(base: PreTrainedModel, config: SpanAttentionConfig, towers: dict[str, PreTrainedModel],
                    keep: bool) -> None:
    """Write `config` to the model config (unless `keep`: the section stays as it was read, with the fields and
    version of a newer hf_spanattn) and to its towers' sub-configs, so that a tower saved alone keeps them."""
    other = _another_sharing(base)
    if other is not None and is_patched(other) and config_of(base.config) not in (None, config):
        warnings.warn(f"patch_model: another model that patch_model was given shares the config object of "
                      f"{type(base).__name__} (both built from one config), so its settings change with it, from "
                      f"{adapters._described(config_of(base.config))} to {adapters._described(config)}: its layers "
                      "read the same settings. Build each model from its own config (copy.deepcopy(config)) to patch "
                      "them otherwise.", stacklevel=user_stacklevel())
    if not keep:
        setattr(base.config, CONFIG_KEY, config.to_dict())
    for tower in towers.values():  # model.language_model.save_pretrained keeps them
        if config.layers is None or any(layer_index(m) is not None for m in tower.modules()):
            setattr(tower.config, CONFIG_KEY, copy.deepcopy(getattr(base.config, CONFIG_KEY)))
        elif hasattr(tower.config, CONFIG_KEY):  # attention without a layer index: `layers` leaves it stock
            delattr(tower.config, CONFIG_KEY)
    config_of(base.config)  # parsed now, so that a compiled forward only looks the settings up


def _warn_neo_of_other_models(base: PreTrainedModel, neo: list[torch.nn.Module]) -> None:
    inside = structure.own_configs(base)
    foreign = [path for path, module in base.named_modules() if module in neo and id(module.config) not in inside]
    if foreign:
        warnings.warn(f"patch_model: {', '.join(foreign)} of {type(base).__name__} hold another model's config "
                      "(a layer taken from it), so that model trains them with span gradients too, patched or "
                      "not; give this model its own copy of the layer pointing to its config (layer = "
                      "copy.deepcopy(layer), then set its attention module's .config to the model's)",
                      stacklevel=user_stacklevel())


def _patch_towers_as_saved(base: PreTrainedModel, config: SpanAttentionConfig, towers: dict[str, PreTrainedModel],
                           saved: dict[str, Any]) -> None:
    """A tower patched otherwise, or unpatched, before the model was saved, patched as it was then."""
    apart = []
    for key, tower in towers.items():
        if saved[key] is None:
            unpatch_model(tower)
            apart.append(f"{key} holds none: stock gradients")
        elif saved[key] != getattr(base.config, CONFIG_KEY):
            setattr(tower.config, CONFIG_KEY, saved[key])
            patch_model(tower)
            apart.append(f"{key}.{CONFIG_KEY} differs: {config_of(tower.config).label}")
    if apart:
        warnings.warn(f"patch_model: {type(base).__name__} has settings of its own ({config.label}), but "
                      f"{'; '.join(apart)}: those towers train so, as they did when saved (pass settings to "
                      "patch_model to patch every tower alike)", stacklevel=user_stacklevel())


def _rejoin_copies(base: PreTrainedModel) -> None:
    """PEFT's `modules_to_save` trains a deep copy of a module (beside it, as `original_module`), whose submodules
    hold a copy of the model config: they read the config of the module they copy again, so that they follow
    patch_model and unpatch_model as it does."""
    for wrapper in base.modules():
        original, copies = getattr(wrapper, "original_module", None), getattr(wrapper, "modules_to_save", None)
        if not isinstance(original, torch.nn.Module) or not isinstance(copies, torch.nn.ModuleDict):
            continue
        configs = {name: module.config for name, module in original.named_modules()
                   if isinstance(getattr(module, "config", None), PretrainedConfig)}
        for trained in copies.values():
            for name, module in trained.named_modules():
                if name in configs and isinstance(getattr(module, "config", None), PretrainedConfig):
                    module.config = configs[name]


def _warn_attention_of_ones_own(base: PreTrainedModel, implementation: str | dict[str, str]) -> None:
    """Warn where the model ran an attention function registered in Transformers' AttentionInterface outside
    Transformers (`AttentionInterface.register("my_attn", fn)`), or one registered without a mask function (for which
    Transformers builds no attention mask): span_attention replaces it, and its forward pass is SDPA's, with SDPA's
    masks, which that function need not compute."""
    names = set(implementation.values()) if isinstance(implementation, dict) else {implementation}
    for name in sorted(n for n in names if isinstance(n, str) and "/" not in n):  # "owner/repo": a Hub kernel
        function = ALL_ATTENTION_FUNCTIONS.get(name)
        if function is None:  # "eager": the model's own code
            continue
        where = getattr(inspect.unwrap(function), "__module__", None) or ""
        maskless = name not in ALL_MASK_ATTENTION_FUNCTIONS and "|" not in name  # "paged|sdpa": a cache's own
        if where.split(".")[0] not in ("transformers", "hf_spanattn") or maskless:
            how = (" with no mask function registered in AttentionMaskInterface under that name (so the model "
                   "built no attention mask for it)" if maskless else "")
            warnings.warn(f"patch_model: {type(base).__name__} ran attn_implementation={name!r}, a function of "
                          f"{where or 'your own'} registered in Transformers' AttentionInterface{how}; patch_model "
                          f"replaces it with {ATTN_IMPLEMENTATION!r}, whose forward pass is SDPA's, so the model's "
                          f"outputs change unless {name!r} computes SDPA's attention (unpatch_model gives it back). "
                          "For span gradients inside an attention function of your own, call "
                          "hf_spanattn.span_attention there and leave the model unpatched",
                          stacklevel=user_stacklevel())


def _declares_backend(base: PreTrainedModel) -> bool:
    """Whether the model's class declares Transformers' attention-backend support, or the model wraps models that each
    do and holds no attention of its own (EncoderDecoderModel and VisionEncoderDecoderModel around BERT, ViT, GPT-2),
    or its attention is plain self-attention numbered by layer (`_not_plain`), as in the hybrids (Jamba, Bamba,
    Qwen3-Next, Qwen3.5), StableLM and BioGPT, whose classes leave the flag False."""
    if getattr(base, "_supports_attention_backend", False):
        return True
    parts = [m for m in base.children() if isinstance(m, PreTrainedModel)]
    inside = {m for part in parts for m in part.modules()}
    wraps = bool(parts) and all(part._supports_attention_backend for part in parts) and \
        not any(calls_the_registry(m) for m in base.modules() if m not in inside)
    return wraps or _not_plain(base) is None


def _not_plain(base: PreTrainedModel) -> str | None:
    """What keeps the attention of `base` from plain self-attention numbered by layer, which span_attention takes
    whatever the model's class declares: a module that calls the registry as cross-attention, or without a layer
    index (Zamba's attention, shared by several layers; a vision tower's) or serving several layers, or a learned
    position bias (T5's; Inkling's, handed to the attention function); None where nothing does."""
    calling = [(path, m) for path, m in base.named_modules(remove_duplicate=False) if calls_the_registry(m)]
    if not calling:
        return "none of its modules calls Transformers' attention registry"
    seen = set()
    for path, module in calling:
        if structure.under_cross_attention(path) or registry.is_cross_attention(module):
            return f"its module {path} is cross-attention"
        if layer_index(module) is None:
            return f"its attention module {path} carries no layer index"
        if id(module) in seen:
            return f"its attention module {path} serves several layers"
        seen.add(id(module))
    return _position_bias(base)


def _position_bias(base: PreTrainedModel) -> str | None:
    """What in `base` adds a learned relative position bias to its attention, which span_attention does not take:
    T5's modules, or an attention module handing it to the attention function (Inkling's); None where nothing does."""
    if any(hasattr(m, "relative_attention_bias") for m in base.modules()):  # T5 and its kind
        return ("its attention also adds a learned relative position bias ('position_bias'), which span_attention "
                "does not take")
    biased = [path for path, m in base.named_modules() if calls_the_registry(m) and passes_argument(m, "position_bias")]
    if biased:  # Inkling's, computed in the forward; SDPA would drop it
        return (f"its attention module {biased[0]} passes the attention function a relative position bias "
                "('position_bias'), which span_attention does not take")
    return None


def _not_a_backend(base: PreTrainedModel, holder: PreTrainedModel | None = None) -> str:
    """Why a model whose class does not set `_supports_attention_backend`, and whose attention is not plain, is refused
    (it may call the registry all the same, as BART, Whisper and T5 do); `holder`: the composite model that holds it."""
    parts = [getattr(base.config, key, None) for key in getattr(base.config, "sub_configs", None) or {}]
    lacking = [type(m).__name__ for m in base.children() if isinstance(m, PreTrainedModel) and
               any(m.config is part for part in parts) and not m._supports_attention_backend]  # a composite's model
    holds = f" (it holds {', '.join(lacking)}, which does not)" if lacking else ""
    name = f"{type(holder).__name__} holds {type(base).__name__}, which" if holder is not None else type(base).__name__
    # a vision-language model whose language model is plain while its vision tower is not (Qwen3.5)
    alone = [(path, m) for path, m in structure.tower_paths(base).values() if holder is None and _declares_backend(m)]
    towers = "".join(f"; its tower {path} ({type(m).__name__}) can be patched alone: patch_model(model.{path}, ...)"
                     for path, m in alone)
    return (f"{name}{holds} does not declare Transformers' attention-backend support (its class leaves "
            "_supports_attention_backend False, the mark of models that pass every attention argument through to "
            "the registered attention function), and span gradients are attached to such a model only where its "
            f"attention is plain self-attention numbered by layer, but {_not_plain(base)}{towers}. "
            f"Supported: {SUPPORTED}.")


def _default_settings(model_config: Any) -> SpanAttentionConfig:
    """The default settings, for a model config without any; a field named almost as the settings' (a hand edit
    such as 'span_atention') warns that it is not read."""
    if CONFIG_KEY in vars(model_config):  # "span_attention": null (unpatch_model removes the field)
        warnings.warn(f"{stored_source(model_config)}: null, which gives no settings; patching with the default "
                      f"{SpanAttentionConfig().label}", stacklevel=user_stacklevel())
        return SpanAttentionConfig()
    for key in getattr(model_config, "sub_configs", None) or {}:  # a composite model's text_config, by hand
        if getattr(getattr(model_config, key, None), CONFIG_KEY, None) is not None:
            warnings.warn(f"{stored_source(model_config)}: not given, but {key}.{CONFIG_KEY} is, which is not read: "
                          f"the settings of {type(model_config).__name__} are those of its own {CONFIG_KEY!r} field, "
                          f"for all its towers; patching with the default {SpanAttentionConfig().label} (move them "
                          "there, or pass them to patch_model)", stacklevel=user_stacklevel())
    names = [name for name in vars(model_config) if isinstance(name, str)]
    for name in difflib.get_close_matches(CONFIG_KEY, names, n=1, cutoff=0.8):
        warnings.warn(f"{stored_source(model_config)}: not given, but a field {name!r} is, which is not read; "
                      f"patching with the default {SpanAttentionConfig().label} (name the field {CONFIG_KEY!r} to use "
                      "its settings)", stacklevel=user_stacklevel())
    return SpanAttentionConfig()


def unpatch_model(model: torch.nn.Module) -> torch.nn.Module:
    """Restore exactly the attention implementation the model had before `patch_model` (through the model it
    was given or one inside or around it that shares its config), and drop every span setting from it."""
    base = base_model(model, "unpatch_model")
    _rejoin_copies(base)
    original = _original(base)
    sharing = _sharing_config(base)
    for module in base.modules():
        for name in (LAYER_ATTR, OVERRIDE_ATTR, PROBE_ATTR, OWNER_ATTR, SETTINGS_FROM_ATTR, CROSS_ATTR, REGISTERS_ATTR):
            module.__dict__.pop(name, None)
    towers = structure.towers(base).values()
    for tower in towers:  # a tower patched alone, the model around it not
        if is_patched(tower) and config_of(tower.config) is not None:
            unpatch_model(tower)
    mine = set(base.modules())
    for inner in mine:  # a model inside it that keeps a patched config (model.config replaced since), no other's
        if isinstance(inner, PreTrainedModel) and inner.config is not base.config and \
                structure.is_patched_config(inner.config) and \
                not any(m.config is inner.config and m not in mine for m in registry.listed(_PATCHED)):
            unpatch_model(inner)
    if original is None and not is_patched(base):
        return model  # never patched (settings on its config, as a saved model loaded without patching, stay)
    if _another_sharing(base) is not None:
        warnings.warn(f"unpatch_model: another model that patch_model was given shares the config object of "
                      f"{type(base).__name__} (both built from one config), and is unpatched with it: its layers read "
                      "the same settings. Build each model from its own config (copy.deepcopy(config)) to unpatch one "
                      "alone.", stacklevel=user_stacklevel())
    for model_config in [base.config, *(tower.config for tower in towers)]:
        if hasattr(model_config, CONFIG_KEY):
            delattr(model_config, CONFIG_KEY)
    for part in sharing:
        card.set_tags(part, None)
    if original and original["reorder_and_upcast_attn"]:  # also where the attention was set otherwise since
        _set_reorder(base, True)
    if not is_patched(base):  # its attention set otherwise since, or unpatched through a model inside it: kept
        for part in sharing:
            part.__dict__.pop(_ORIGINAL, None)
        return model
    gpt_neo.restore(base.config, gpt_neo.attentions(base))
    implementation = original["attn_implementation"] if original else "sdpa"
    # a model inside it that is another patched model's (put in after patch_model): set_attn_implementation sets its
    # config too, which would leave that model its settings under stock attention
    theirs = {path: m.config for path, m in base.named_modules() if isinstance(m, PreTrainedModel) and
              m.config is not base.config and structure.is_patched_config(m.config) and
              any(o.config is m.config and o not in mine for o in registry.listed(_PATCHED))}
    if base.config._attn_implementation == ATTN_IMPLEMENTATION or _implementation_of(base.config) != implementation:
        base.set_attn_implementation(implementation)
    for other in theirs.values():
        other._attn_implementation = ATTN_IMPLEMENTATION
    if theirs:
        warnings.warn(f"unpatch_model: {', '.join(theirs)} of {type(base).__name__} is also a part of another patched "
                      "model (put in after patch_model), which keeps its span gradients: a module reads one model's "
                      "config, so it trains with them in both models. Give this model its own copy (copy.deepcopy) "
                      "to unpatch it alone", stacklevel=user_stacklevel())
    _unpatch_copied_configs(base, implementation)
    for part in sharing:
        part.__dict__.pop(_ORIGINAL, None)
    return model


# id(config) → a copy of a patched model's config that unpatch_model set back (`_unpatch_copied_configs`), which
# patch_model sets to span_attention again (held weakly)
_COPIES_UNPATCHED: weakref.WeakValueDictionary[int, PretrainedConfig] = weakref.WeakValueDictionary()


def _unpatch_copied_configs(base: PreTrainedModel, implementation: str | dict[str, str]) -> None:
    """Give stock attention to the modules of `base` that read a config of their own set to span_attention, which no
    other patched model reads: a layer copied after patch_model (`copy.deepcopy(layer)` copies its config too) or
    built on a copy of the model's config, which kept span gradients after unpatch_model. patch_model sets them to
    span_attention again (`_repatch_copied_configs`)."""
    inside = structure.own_configs(base)
    for module in base.modules():
        other = getattr(module, "config", None)
        theirs = registry.PATCHED_CONFIGS.get(id(other)) is other  # another patched model's: left to it
        if isinstance(other, PretrainedConfig) and id(other) not in inside and not theirs and \
                calls_the_registry(module) and other._attn_implementation == ATTN_IMPLEMENTATION:
            other._attn_implementation = implementation if isinstance(implementation, str) else implementation[""]
            if hasattr(other, CONFIG_KEY):
                delattr(other, CONFIG_KEY)
            _COPIES_UNPATCHED[id(other)] = other


def _repatch_copied_configs(base: PreTrainedModel) -> None:
    """The configs `_unpatch_copied_configs` set back, read by modules of `base`, set to span_attention again (the
    modules read the model's settings, `SETTINGS_FROM_ATTR`)."""
    for module in base.modules():
        other = getattr(module, "config", None)
        if other is not None and _COPIES_UNPATCHED.get(id(other)) is other:
            other._attn_implementation = ATTN_IMPLEMENTATION
            del _COPIES_UNPATCHED[id(other)]


def _another_sharing(base: PreTrainedModel) -> PreTrainedModel | None:
    """A model that patch_model was given, neither inside `base` nor around it, that shares its config object (a
    module taken out of `base`, kept by the user, is none)."""
    inside = {m for part in _sharing_config(base) if any(m is base for m in part.modules()) for m in part.modules()}
    return next((m for m in registry.listed(registry.PATCHED_MODULES) if isinstance(m, PreTrainedModel)
                 and m not in inside and m.config is base.config), None)


def _sharing_config(model: PreTrainedModel) -> list[PreTrainedModel]:
    """The model and the models inside or around it that share its config (GPT2LMHeadModel and its GPT2Model),
    which patch_model and unpatch_model may each be given: those inside it, and those patched before."""
    inside = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.config is model.config]
    return inside + [m for m in registry.listed(_PATCHED)
                     if m.config is model.config and all(m is not n for n in inside)]


def _implementation_of(model_config: Any) -> str | dict[str, str]:
    """The model's attention implementation, as `set_attn_implementation` takes it: a name, or where a composite
    model's towers differ from it (a vision tower kept eager), a dict of the name of each sub-config ("" the
    model's own). `span_attention` set without patch_model reads as SDPA, its forward pass."""
    def name(config: Any) -> str:
        implementation = config._attn_implementation
        return "sdpa" if implementation == ATTN_IMPLEMENTATION else implementation

    names = {key: name(sub) for key in getattr(model_config, "sub_configs", None) or {}
             if isinstance(sub := getattr(model_config, key, None), PretrainedConfig) and sub._attn_implementation}
    own = name(model_config)
    return own if all(value == own for value in names.values()) else {"": own, **names}


class _Original(dict):
    """What the first patch_model changed, kept on the model for unpatch_model. Saved with the model (torch.save),
    it loads through `_restored`, so that unpickling the model in a process that has not imported hf_spanattn
    imports it and registers `span_attention` in Transformers' attention registry: the model trains as it did."""

    def __reduce__(self) -> tuple:
        return _restored, (dict(self),)


def _restored(data: dict) -> _Original:
    register()
    return _Original(data)


def _original(model: PreTrainedModel) -> dict | None:
    """What the first patch_model changed, as recorded on the model or a model inside it that shares its config."""
    return next((part.__dict__[_ORIGINAL] for part in _sharing_config(model) if _ORIGINAL in part.__dict__), None)

def _set_reorder(model: PreTrainedModel, value: bool) -> None:
    """GPT-2's attention modules' reorder_and_upcast_attn; the config keeps the user's True, which save_pretrained
    writes (set again on the way back, for a model patched by an earlier version that switched it off there)."""
    if value:
        model.config.reorder_and_upcast_attn = True
    for module in model.modules():
        if hasattr(module, "reorder_and_upcast_attn"):
            module.reorder_and_upcast_attn = value


def load_pretrained(name_or_path: str | os.PathLike, config: SpanAttentionConfig | str | None = None,
                    model_class: Any = None, is_trainable: bool = True,
                    layers: list[int] | None = None, **kwargs: Any) -> torch.nn.Module | tuple[torch.nn.Module, Any]:
    """Load a model and patch it: with `config` if given, else with the settings saved in its config;
    `layers` as `patch_model` takes it. Saved settings that are bad fail here, naming the config.json
    and the field. `model_class` None: the Transformers class the model was saved as where it is not the causal LM
    of its type (a classifier, a question-answering or multiple-choice model, a base model), else
    AutoModelForCausalLM; for an adapter, the auto class of its `task_type` (as PEFT's AutoPeftModel classes: a
    SEQ_CLS adapter's base model is a sequence classifier). With `output_loading_info=True`, (model, loading info),
    as from_pretrained gives them.

    A local PEFT adapter folder (or a Trainer checkpoint of a PEFT model, or a folder whose `subfolder` is one)
    loads as its base model (`base_model_name_or_path`, with `kwargs`) plus the adapter (named `adapter_name=`, by
    default "default"), trainable unless `is_trainable=False`, patched with the settings saved beside the adapter
    (else those of the base model's config). A folder that holds a saved model (config.json) as well loads as
    from_pretrained loads it: that model with the adapter on top, patched with the model's settings (else the
    adapter's)."""
    name_or_path = _path_argument(name_or_path, "load_pretrained", "name_or_path",
                                  "a saved model's folder, a PEFT adapter's folder or a Hub repository id")
    if _looks_local(name_or_path) and not os.path.isdir(name_or_path):  # else Transformers takes it for a Hub id
        what = "a file" if os.path.exists(name_or_path) else "no such folder"
        raise FileNotFoundError(f"load_pretrained: {name_or_path}: {what}; expected a saved model's folder, a PEFT "
                                "adapter's folder or a Hub repository id ('owner/name')")
    config = as_config(config, "load_pretrained", "the settings saved with the model")
    if not isinstance(is_trainable, bool):
        raise TypeError(f"load_pretrained: is_trainable={shown(is_trainable)}: expected True or False")
    chosen = kwargs.get("attn_implementation")
    if isinstance(chosen, str) and chosen != ATTN_IMPLEMENTATION:  # it would be replaced by the patch without a word
        raise ValueError(f"load_pretrained: attn_implementation={shown(chosen)}: the model it loads is patched, so its "
                         f"attention is {ATTN_IMPLEMENTATION!r} (whose forward pass is SDPA's); leave the argument "
                         "out, or load the model with from_pretrained for another attention")
    if model_class is not None and not callable(getattr(model_class, "from_pretrained", None)):
        raise TypeError(f"load_pretrained: model_class={shown(model_class)}: expected a Transformers model class with "
                        "from_pretrained, such as AutoModelForCausalLM")
    subfolder = os.fspath(kwargs["subfolder"]) if isinstance(kwargs.get("subfolder"), (str, os.PathLike)) else None
    if isinstance(subfolder, str) and subfolder and adapters.is_adapter_folder(os.path.join(name_or_path, subfolder)):
        name_or_path = os.path.join(name_or_path, subfolder)  # the adapter's, not its base model's
        del kwargs["subfolder"]
        subfolder = None
    folder = os.path.join(name_or_path, subfolder) if subfolder else name_or_path
    # a model saved into a folder that holds an adapter (or the reverse) loads as Transformers loads it: the model
    # saved there, with the adapter added on top
    if adapters.is_adapter_folder(name_or_path) and not os.path.isfile(os.path.join(folder, "config.json")):
        return adapters.load_adapter(name_or_path, config, model_class, is_trainable, layers, **kwargs)
    if adapters.holds_settings_alone(name_or_path) and not subfolder:  # Transformers: "Unrecognized model"
        raise FileNotFoundError(f"load_pretrained: {name_or_path} holds {CONFIG_NAME} but neither a model "
                                f"(config.json) nor a PEFT adapter ({adapters.ADAPTER_CONFIG}): a save stopped before "
                                "it wrote them? Save the model or adapter again")
    adapters.refuse_adapters_below(folder)
    if os.path.isdir(folder) and "gguf_file" not in kwargs and not any(  # Transformers: "Unrecognized model"
            os.path.lexists(os.path.join(folder, name)) for name in ("config.json", adapters.ADAPTER_CONFIG)):
        raise FileNotFoundError(f"load_pretrained: {folder} holds no config.json (nor a PEFT adapter's "
                                f"{adapters.ADAPTER_CONFIG}): weights alone, as accelerator.save_state and save_model "
                                "write them? Build the model from its config, patch it and load the weights into it "
                                "(accelerator.load_state, load_state_dict), or save it with save_pretrained")
    beside_adapter = adapters.is_adapter_folder(folder)
    if beside_adapter:
        adapters.refuse_unfinished(folder)
    model_class = model_class or adapters.saved_class(name_or_path, kwargs)
    model, info = adapters.loaded(model_class, name_or_path, kwargs)
    if beside_adapter:  # Transformers added the adapter, frozen
        if is_trainable:
            adapters.train_adapters(model)
        if config is None:
            config = adapters.settings_beside_model(folder, base_model(model, "load_pretrained").config)
    model = patch_model(model, config, layers)
    if isinstance(chosen, dict):  # a tower given another attention ({"vision_config": "sdpa"}) keeps it
        for key, tower in structure.towers(base_model(model, "load_pretrained")).items():
            if chosen.get(key, ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION:
                unpatch_model(tower).set_attn_implementation(chosen[key])
    return model if info is None else (model, info)  # as from_pretrained with output_loading_info=True
