"""`span_attention` in Transformers' attention registry.

The attention function reads its settings from the model config (`config.span_attention`,
a dict saved in config.json) and the layer index of the calling attention module, so the
config is the single source of truth: saving, loading and pushing a model carries them.
"""

from __future__ import annotations

import copy
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.integration import packing
from hf_spanattn.integration.model_layers import layer_index
from hf_spanattn.integration.stored import CONFIG_KEY, check_once, config_of
from hf_spanattn.ops.attention import requires_grad, span_attention
from hf_spanattn.ops.inputs import attended, shown, user_stacklevel

ATTN_IMPLEMENTATION = "span_attention"
OVERRIDE_ATTR = "span_attention_override"  # module attribute: settings set at run time (schedules)
PROBE_ATTR = "span_attention_probe"  # module attribute: diagnostics probe for the backward pass
OWNER_ATTR = "span_attention_owner"  # module and callback attribute: the token of the run that set the two above
# module attribute: the model config that holds the settings, where the module's own config is a part of it (the text
# or vision tower of a composite model, whose modules read their sub-config)
SETTINGS_FROM_ATTR = "span_attention_settings_from"
# module attribute: set where the module is a cross-attention that neither a flag nor its class name tells (BLIP-2's
# Q-Former attention, which serves as both: patch_model reads it from where the module sits, under "crossattention",
# "cross_attn" or "encoder_attn")
CROSS_ATTR = "span_attention_cross"
# module attribute: set at the module's first call, so that a model set to span_attention without patch_model
# (from_pretrained(attn_implementation="span_attention")) and saved whole registers it where it is loaded
REGISTERS_ATTR = "span_attention_registers"
logger = logging.get_logger("hf_spanattn")


def register() -> None:
    """Register the attention function and its mask function (SDPA's masks: bool, or None when
    pure causal; `span_attention_mask`). Without the mask registration a padded batch would get no padding mask.
    Idempotent: an entry already registered under the name is kept, unless it is this function as an
    earlier import of this module defined it (importlib.reload): models then run the code imported now."""
    registered = ALL_ATTENTION_FUNCTIONS.get(ATTN_IMPLEMENTATION)
    earlier = getattr(registered, "__module__", None) == __name__ and not hasattr(registered, "__wrapped__") and \
        getattr(registered, "__qualname__", None) == span_attention_forward.__qualname__  # not a user's wrapper of it
    if registered is None or earlier and registered is not span_attention_forward:
        AttentionInterface.register(ATTN_IMPLEMENTATION, span_attention_forward)
    if ATTN_IMPLEMENTATION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, span_attention_mask)


def span_attention_mask(*args: Any, config: Any = None, allow_is_causal_skip: bool = True,
                        **kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask, also where it could be None (pure causal) for a model with KV-shared layers (Gemma 4): such a model
    feeds those layers only the last `logits_to_keep` queries with the rows of each mask, which it skips for SDPA
    alone where a mask is None (SDPA's causal attention without a mask would align the queries with the first
    keys); under any other attention it slices, so the mask must be there."""
    if getattr(config, "num_kv_shared_layers", None):
        allow_is_causal_skip = False
    return sdpa_mask(*args, config=config, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


class _Registers:
    """Unpickled (torch.load of a model saved whole, in a process that has not imported hf_spanattn), registers
    span_attention in Transformers' attention registry: the model trains as it did."""

    def __reduce__(self) -> tuple:
        return _registered, ()


def _registered() -> _Registers:
    register()
    return _Registers()


def settings_config(module: torch.nn.Module) -> Any:
    """The model config whose settings apply to this module: that of the model patch_model was given, also where
    the module reads a sub-config of it (a composite model's towers)."""
    model_config = getattr(module, SETTINGS_FROM_ATTR, None) or getattr(module, "config", None)
    if SETTINGS_FROM_ATTR not in module.__dict__ and getattr(model_config, CONFIG_KEY, None) is None and \
            not torch.compiler.is_compiling():
        model_config = module.__dict__[SETTINGS_FROM_ATTR] = _composite_on_stack(model_config) or model_config
    if model_config is None:  # a custom model's attention that holds no config, set to span_attention by hand
        raise TypeError(f"span_attention: {type(module).__name__} holds no model config (.config) to read the settings "
                        "from; call hf_spanattn.patch_model(model, ...) on its model, which points it to the model's")
    return model_config


def _composite_on_stack(sub_config: Any) -> Any:
    """The config of the composite model whose forward runs this call and that holds `sub_config` as a sub-config
    (a tower's text_config) and span settings: a patched composite model saved and loaded with from_pretrained
    (attn_implementation="span_attention"), whose towers read their sub-configs, which hold none. Else None."""
    frame = sys._getframe(2)
    while frame is not None and sub_config is not None:
        owner = frame.f_locals.get("self")
        model_config = getattr(owner, "config", None) if isinstance(owner, PreTrainedModel) else None
        if getattr(model_config, CONFIG_KEY, None) is not None and any(
                getattr(model_config, key, None) is sub_config for key in model_config.sub_configs or {}):
            return model_config
        frame = frame.f_back
    return None


def settings_for(module: torch.nn.Module) -> SpanAttentionConfig | None:
    """The settings that apply to this attention module; None where it keeps stock gradients.

    A run-time override on the module (set by `SpanAttentionCallback`) comes first, then the
    model config's settings restricted to their `layers`."""
    if not torch.compiler.is_compiling() and OWNER_ATTR in module.__dict__:
        _drop_if_left_by_a_stopped_run(module)
    override = getattr(module, OVERRIDE_ATTR, None)
    if override is not None:
        return override
    if not torch.compiler.is_compiling():
        _note_shared(module)
    model_config = settings_config(module)
    if not torch.compiler.is_compiling():
        _tag_trainers_model(model_config)
    config = config_of(model_config)
    if config is None:
        _note_default(model_config)
        config = SpanAttentionConfig()
    elif not torch.compiler.is_compiling():
        _follow_model_settings(module, model_config, config)
    if config.layers is not None and layer_index(module) not in config.layers:
        if layer_index(module) is None:
            logger.warning_once(
                f"span_attention: {type(module).__name__} carries no layer index, so "
                f"layers={shown(list(config.layers))} cannot select it and it keeps stock gradients; "
                "hf_spanattn.patch_model numbers the layers of a model whose attention modules all carry none, as a "
                "composite model's tower patched alone (patch_model(tower, ..., layers=...), the tower that holds "
                f"the {type(module).__name__} modules, as LLaVA's model.model.vision_tower).")
        return None
    return config


def _follow_model_settings(module: torch.nn.Module, model_config: Any, config: SpanAttentionConfig) -> None:
    """A composite model's tower holds a copy of the model's settings on its sub-config (patch_model writes it, so
    that the tower saved alone keeps them), while its layers read the model's: where those were set again by hand
    (`model.config.span_attention = ...`), the copy follows, so that a save keeps what the tower trains with."""
    tower = getattr(module, "config", None)
    if tower is None or tower is model_config or not any(getattr(model_config, key, None) is tower
                                        for key in getattr(model_config, "sub_configs", None) or {}):
        return
    section, copied = getattr(model_config, CONFIG_KEY), getattr(tower, CONFIG_KEY, None)
    if copied is None and config.layers is not None and layer_index(module) is None or copied == section:
        return
    if config.layers is not None and layer_index(module) is None:  # `layers` leaves such a tower stock: no copy
        delattr(tower, CONFIG_KEY)  # (given back by a module of the tower that carries an index, where it has one)
    else:
        setattr(tower, CONFIG_KEY, copy.deepcopy(section))


# The model configs patch_model was given (by id, held weakly), and the modules of the models it patched: a model
# built from the same config object as a patched one (two models from one config) runs span_attention too.
PATCHED_CONFIGS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
PATCHED_MODULES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_SHARED_NOTED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_WEAK_SETS = threading.Lock()


def listed(members: weakref.WeakSet) -> list:
    """The members of a WeakSet of this package, copied while no other thread adds to it (listing one that grows
    meanwhile, as patch_model in another thread makes it, raises "Set changed size during iteration")."""
    with _WEAK_SETS:
        return list(members)


def add_all(members: weakref.WeakSet, new: Iterable[Any]) -> None:
    """Add `new` to a WeakSet of this package that other threads may list at the same time (`listed`)."""
    with _WEAK_SETS:
        members.update(new)


def _note_shared(module: torch.nn.Module) -> None:
    """Warn, once per config, where a model that patch_model was not given trains with span gradients because
    it shares its config object with one that it was given."""
    model_config = getattr(module, "config", None)
    if model_config is None or PATCHED_CONFIGS.get(id(model_config)) is not model_config or \
            module in PATCHED_MODULES or _said(_SHARED_NOTED, model_config):
        return
    owner = next((m for m in listed(PATCHED_MODULES) if isinstance(m, PreTrainedModel) and m.config is model_config
                  and any(part is module for part in m.modules())), None)
    if owner is not None:  # put into the patched model after patch_model (a replaced attention module): its own
        add_all(PATCHED_MODULES, owner.modules())
        return
    _SHARED_NOTED[id(model_config)] = model_config
    warnings.warn(f"span_attention: {type(module).__name__} belongs to a model that hf_spanattn.patch_model was not "
                  f"given, but its config object ({type(model_config).__name__}) is that of a model it was given "
                  "(both built from one config), so it trains with that model's span gradients too. Build each "
                  "model from its own config (copy.deepcopy(config)) to keep one of them stock.",
                  stacklevel=user_stacklevel())


# id(model config) → the model config whose model `_tag_trainers_model` tagged (held weakly).
_TAGGED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _tag_trainers_model(model_config: Any) -> None:
    """A model set to span_attention without patch_model (`from_pretrained(..., attn_implementation=
    "span_attention")`) carries no hf_spanattn tags: the Trainer that trains it tags it, so that the cards of its
    training name the method. Looked for at its first call with span gradients only (once per model config): a
    walk up the stack on every call would cost a loop of the user's own on each layer."""
    if PATCHED_CONFIGS.get(id(model_config)) is model_config or not _first_time(_TAGGED, model_config):
        return
    trainer = trainer_on_stack(sys._getframe(2))
    if trainer is not None:
        from hf_spanattn.integration import card

        card.tag_trainers_model(trainer)


# id(model config) → the model config `_note_default` spoke of (held weakly: a new config may reuse a freed id).
_NOTED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _note_default(model_config: Any) -> None:
    """Say, once per model config, that it has no settings and its layers train with the default."""
    message = (f"attn_implementation={ATTN_IMPLEMENTATION!r} but the model config "
               f"({type(model_config).__name__}) has no {CONFIG_KEY!r} settings; using the default "
               f"{SpanAttentionConfig().label}. Set them with hf_spanattn.patch_model.")
    if torch.compiler.is_compiling():  # a traced forward keeps no Python state: said once per process
        logger.warning_once(message)
    elif _first_time(_NOTED, model_config):
        logger.warning(message)


def _said(seen: weakref.WeakValueDictionary[int, Any], model_config: Any) -> bool:
    """Whether `seen` holds this model config: the thing was said for it."""
    return seen.get(id(model_config)) is model_config


def _first_time(seen: weakref.WeakValueDictionary[int, Any], model_config: Any) -> bool:
    """Whether `seen` did not hold this model config yet (it does now): to say a thing once per config."""
    if _said(seen, model_config):
        return False
    seen[id(model_config)] = model_config
    return True


def _drop_if_left_by_a_stopped_run(module: torch.nn.Module) -> None:
    """A schedule's setting and a diagnostics probe that a training run stopped midway left on the module (the
    Trainer calls no callback event when training raises) are dropped, with a warning, when a Trainer without the
    callback that set them trains the model: that Trainer trains with the model's own settings."""
    trainer = trainer_on_stack(sys._getframe(2))
    owner = module.__dict__[OWNER_ATTR]
    if trainer is None or any(getattr(c, OWNER_ATTR, None) == owner for c in trainer.callback_handler.callbacks):
        return  # the run of the callback that set them, or a loop of the user's own (which may hold it)
    override = module.__dict__.get(OVERRIDE_ATTR)
    for name in (OVERRIDE_ATTR, PROBE_ATTR, OWNER_ATTR):
        module.__dict__.pop(name, None)
    if override is not None:
        own = settings_for(module)
        warnings.warn(f"span_attention: {type(module).__name__} (layer {layer_index(module)}) still held the setting "
                      f"{override.label} of a SpanAttentionCallback schedule from a training run that stopped midway; "
                      f"{type(trainer).__name__} trains without that callback, so the layer trains with the model's "
                      f"own settings ({own.label if own else 'stock gradients'}) from now on",
                      stacklevel=user_stacklevel())


def trainer_on_stack(frame: Any) -> Any:
    """The nearest Trainer (an object keeping a list of callbacks in its callback_handler, as a Trainer's
    CallbackHandler does) whose method runs in `frame` or a frame that called it, or None: the run that calls the
    model, or that a thread is in."""
    while frame is not None:
        handler = getattr(frame.f_locals.get("self"), "__dict__", {}).get("callback_handler")
        if isinstance(getattr(handler, "callbacks", None), list):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def call_settings(module: torch.nn.Module, tensors: tuple[torch.Tensor, ...],
                  dropout: float) -> SpanAttentionConfig | None:
    """The settings a call of the module runs span_attention with; None for the stock attention itself, as in
    evaluation and generation (no autograd). Under dropout without autograd (the first pass of a reentrant
    checkpoint, whose output the loss sees) it is span_attention too: its kernels draw their own dropout masks,
    and the pass that recomputes it with autograd must draw the same."""
    if torch.is_grad_enabled() and any(map(requires_grad, tensors)):  # also under vmap, whose wrappers say no
        if not (torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()):
            return settings_for(module)
        logger.warning_once("span_attention: torch.export and torch.onnx.export record the forward pass, which is "
                            "SDPA's; the exported program carries no span gradients (train the model itself, or "
                            "compiled)")
    check_once(settings_config(module))
    return settings_for(module) if dropout > 0 else None


def span_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registry's call: (B, H, T, D) in, (B, T, H, D) out. Without autograd (and dropout), or in a
    layer that keeps stock gradients, this is Transformers' SDPA attention itself."""
    if not torch.compiler.is_compiling() and REGISTERS_ATTR not in module.__dict__:
        module.__dict__[REGISTERS_ATTR] = _Registers()
    if kwargs.get("s_aux") is not None:  # SDPA would drop the sinks silently
        raise NotImplementedError(f"span_attention does not support attention sinks ('s_aux', attention of "
                                  f"{type(module).__name__}); its forward pass is SDPA's, which has none")
    if kwargs.get("indices") is not None:  # DeepSeek sparse attention: SDPA's call would drop the selection
        attention_mask = selected_keys(attention_mask, kwargs.pop("indices"), query, key.shape[2], is_causal, module)
    if kwargs.get("block_indices") is not None:  # and block-sparse attention (MiniMax-M3)
        attention_mask = selected_blocks(module, attention_mask, kwargs.pop("block_indices"), query, key, kwargs)
    config = call_settings(module, (query, key, value), dropout)
    if config is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"span_attention does not support {unsupported!r} "
                                      f"(attention of {type(module).__name__})")
    q_length, k_length = query.shape[2], key.shape[2]
    probe = getattr(module, PROBE_ATTR, None) if q_length == k_length else None  # diagnostics: self-attention
    if config.method == "standard" and config.qkv_alphas == (1.0, 1.0, 1.0) and probe is None:
        # the stock call itself: Transformers repeats grouped-query heads under a mask, where SDPA's enable_gqa
        # would sum dK, dV in another order (and leave CUDA's fused kernels)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if kwargs.get("output_attentions", False):  # as Transformers' SDPA attention does
        logger.warning_once(f"`{ATTN_IMPLEMENTATION}` attention does not support `output_attentions=True` "
                            "(as `sdpa`); the attention weights are not returned.")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # a StaticCache's first forward under autograd (read only there: the mask's check waits for the device)
    if q_length < k_length and torch.is_grad_enabled() and unfilled_slots_only(attention_mask, q_length, is_causal):
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        attention_mask = None if attention_mask is None else attention_mask[..., :q_length]
        k_length = q_length
    if keeps_sdpa(config, q_length, k_length, is_cross_attention(module)):
        # SDPA's causal flag only without a mask (Transformers 4 passes a flag it is given to SDPA as it is)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=bool(q_length > 1 and attention_mask is None and is_causal), **kwargs)
    docs = documents_of(query, attention_mask, is_causal, kwargs) if splits_documents(config, probe, q_length,
                                                                                      k_length) else None
    if docs is not None:  # a packed batch: each document alone, in a padded batch of documents
        with packing.rows_dropout(query, docs, dropout):
            out = span_attention(*(packing.unpack(x, docs) for x in (query, key, value)), attn_mask=docs.mask,
                                 dropout_p=dropout, scale=scaling, config=config, probe=probe)
        return packing.repack(out, docs, query.shape[0], q_length), None
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, :k_length]
    out = span_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                         scale=scaling, config=config, probe=probe)
    return out.transpose(1, 2).contiguous(), None


def selected_keys(attention_mask: torch.Tensor | None, indices: torch.Tensor, query: torch.Tensor, k_length: int,
                  is_causal: bool | None, module: torch.nn.Module) -> torch.Tensor:
    """The attention mask of DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-MoE-DSA, Mistral Large 4, ...): each
    query attends only the keys its indexer selected (`indices`, (B, T, top-k) key positions) among those
    `attention_mask` lets it attend. These models build this mask themselves for eager and SDPA attention only, and
    hand any other attention function the indices (which a sparse kernel reads), so without it the attention would be
    dense."""
    b, t = query.shape[0], query.shape[2]
    picked = torch.zeros(b, t, k_length, dtype=torch.bool, device=query.device)
    picked = picked.scatter(-1, indices.long(), True)[:, None]
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        ones = torch.ones(t, k_length, dtype=torch.bool, device=query.device)
        return picked & ones.tril(k_length - t) if causal and t > 1 else picked
    attention_mask = attention_mask[..., :k_length]
    if attention_mask.dtype == torch.bool:
        return attention_mask & picked
    return attention_mask.masked_fill(~picked, torch.finfo(query.dtype).min)


def selected_blocks(module: torch.nn.Module, attention_mask: torch.Tensor | None, block_indices: torch.Tensor,
                    query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The attention mask of block-sparse attention (MiniMax-M3): each query attends only the blocks of keys its
    indexer selected (`block_indices`), as the module's indexer builds it (`build_block_mask`) for eager and SDPA
    attention; other attention functions are handed the indices instead."""
    build = getattr(getattr(module, "indexer", None), "build_block_mask", None)
    if build is None:
        raise NotImplementedError(f"span_attention: {type(module).__name__} passes block_indices (block-sparse "
                                  "attention) but holds no indexer with build_block_mask, which gives the mask SDPA's "
                                  "attention takes; its forward pass would attend every key")
    t, s = query.shape[2], key.shape[2]
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # as the module numbers its queries
        position_ids = torch.arange(s - t, s, device=query.device)
    position_ids = (position_ids if position_ids.ndim > 1 else position_ids[None]).expand(query.shape[0], -1)
    return build(block_indices, attention_mask, s, query.dtype, query.device, position_ids)


def splits_documents(config: SpanAttentionConfig, probe: Any, q_length: int, k_length: int) -> bool:
    """Whether a packed row's documents are attended apart: spans are per document, while a standard rule without
    diagnostics is SDPA on the packed row itself, drawing the dropout mask SDPA draws there."""
    return q_length == k_length and (config.method != "standard" or probe is not None)


def unfilled_slots_only(attention_mask: torch.Tensor | None, q_length: int, is_causal: bool) -> bool:
    """Whether no query attends a key past the first `q_length`: the slots a fixed-size cache (StaticCache) has not
    filled yet, on its first forward. The keys attended are then the queries' own, as in self-attention, and SDPA's
    result is the same without the others. Without a mask, SDPA's causal attention aligns the queries with the first
    keys (as Transformers relies on there). Not read where the mask cannot be read on the host (compiled, captured)."""
    if attention_mask is None:
        return is_causal and q_length > 1
    if attention_mask.dim() != 4 or torch.compiler.is_compiling() or packing.capturing(attention_mask):
        return False
    return not attended(attention_mask[..., q_length:]).any().item()


def keeps_sdpa(config: SpanAttentionConfig, q_length: int, k_length: int, cross: bool = False) -> bool:
    """Whether a call with these lengths gets SDPA's result and standard gradient: span rules need
    self-attention (said once, where autograd records the call). Cross-attention keeps it also where its
    lengths happen to be equal, so that its gradient does not hang on the lengths of a batch."""
    if (q_length == k_length and not cross) or config.method == "standard":
        return False
    if not torch.is_grad_enabled():  # a pass without autograd under dropout (generation in train mode): no gradient
        return True
    logger.warning_once(
        f"span_attention: the {config.method!r} rule needs self-attention with as many queries as keys; calls "
        "where they differ (a forward with a cache, cache= or past_key_values=, under autograd; Gemma 4's KV-shared "
        "layers under logits_to_keep > 1) and cross-attention, "
        "whatever its lengths, get SDPA's result with the standard gradient.")
    return True


def is_cross_attention(module: torch.nn.Module) -> bool:
    """Whether the module attends from one sequence to another (its keys and values from an encoder or another
    tower): Transformers marks it `is_cross_attention` (GPT-2) or names its class so (BERT's, Mllama's, T5Gemma's,
    DETR's), or it sits under a cross-attention module (`CROSS_ATTR`, set by patch_model)."""
    return getattr(module, "is_cross_attention", False) is True or "CrossAttention" in type(module).__name__ or \
        CROSS_ATTR in module.__dict__


def documents_of(query: torch.Tensor, attention_mask: torch.Tensor | None, is_causal: bool,
                 kwargs: dict[str, Any]) -> packing.Documents | None:
    """The documents of a packed batch of self-attention (see `packing`), or None where each row is
    one sequence."""
    b, t = query.shape[0], query.shape[2]
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    marked = isinstance(cu_seq_lens, torch.Tensor) and cu_seq_lens.numel() > 2  # several documents
    if marked and b == 1 and attention_mask is not None and packing.capturing(cu_seq_lens):
        # the mask cannot be read: the documents cu_seq_lens mark; else the documents of the mask, which the forward
        # pass attends to as SDPA does (cu_seq_lens that disagree with it, or are not FlashAttention's form, would
        # change the forward)
        docs = packing.from_cu_seq_lens(cu_seq_lens.to(query.device), kwargs.get("max_length_q"), t, is_causal)
        fits = attention_mask.dim() == 4 and attention_mask.shape[-2:] == (t, t)
        return packing.within(docs, attention_mask, b) if fits else docs  # a sliding window's mask stays in force
    found = _documents_of_mask(attention_mask, b, t)
    docs = found if isinstance(found, packing.Documents) else None
    if marked and (b != 1 or found is None):  # an unreadable mask has been named already
        logger.warning_once(
            "span_attention: cu_seq_lens_q marks several documents, but "
            + (f"the batch has {b} rows (this form packs them into one)" if b != 1 else
               "no attention mask separates them (SDPA attends across them; pass position_ids restarting per "
               "document, as DataCollatorWithFlattening does, and no padding mask)")
            + ": spans follow the attention mask.")
    return docs


def _documents_of_mask(attention_mask: torch.Tensor | None, b: int, t: int) -> packing.Documents | str | None:
    """The documents a 4-D mask separates, None where it separates none, "unreadable" (said) where it cuts a row
    into blocks that are not documents."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[-2:] != (t, t):
        return None
    docs = packing.from_mask(attention_mask, b)
    if docs == "captured":
        logger.warning_once(
            "span_attention: under CUDA graph capture the attention mask is not read on the host, so documents "
            "packed into one row cannot be told apart in it: spans are taken over all the keys a row attends to "
            "(rows that hold one sequence are unaffected). For packed rows under capture, pass cu_seq_lens_q/k and "
            "max_length_q/k with the position ids (DataCollatorWithFlattening(return_flash_attn_kwargs=True), one "
            "row per batch): they are read on the device, and max_length_q is kept in the graph, so it must bound "
            "the documents of every replay.")
        return None
    if isinstance(docs, str):
        logger.warning_once(
            "span_attention: the attention mask cuts a row of the batch into several blocks but is not the "
            "block-diagonal mask of padding-free packing (bidirectional, causal, or causal within a sliding window, "
            "the same for every head), so the documents cannot be read from it: spans are taken over all the keys a "
            "row attends to. The forward pass is SDPA's.")
    return docs
