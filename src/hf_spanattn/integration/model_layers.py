"""A model's layers as the settings select them: the attention modules of each layer index, and how many layers a
model has."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

LAYER_ATTR = "span_attention_layer"  # module attribute: its layer's index, where the model's modules carry none


def layer_index(module: torch.nn.Module) -> int | None:
    """The index of the module's layer; None where it carries none, or a negative one (Zamba2's attention, shared by
    several layers, carries -1)."""
    for name in ("layer_idx", "layer_id", LAYER_ATTR):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value if value >= 0 else None
    return None


def attention_modules(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """The modules of each decoder layer that carry its index (where overrides and probes go). Where none
    does (DistilBERT's and ViT's attention), the modules of each entry of the model's one list of layers are
    given its index first (`LAYER_ATTR`), so that `layers` selects them."""
    layers = _indexed(model)
    if not layers:
        n_layers = _configured_layers(model)
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers]
        for index, layer in enumerate(lists[0] if len(lists) == 1 else ()):
            for module in layer.modules():
                if hasattr(module, "config"):
                    setattr(module, LAYER_ATTR, index)
        layers = _indexed(model)
    return layers


def layer_count(model: torch.nn.Module) -> int:
    """The model's number of layers: its config's `num_hidden_layers`, or one more than the highest layer index its
    attention modules carry where the config does not say (a custom model's) or says fewer (an encoder-decoder's
    counts the decoder's layers, and its encoder may have more)."""
    n_layers = _configured_layers(model)
    numbered = max(attention_modules(model), default=-1) + 1
    return numbered if n_layers is None else max(n_layers, numbered)


def _configured_layers(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None) if config is not None else None
    return n_layers if isinstance(n_layers, int) else None


def _indexed(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    layers: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        index = layer_index(module)
        # an attention module holds its config, or (a custom model's) calls the registry without one
        if index is not None and (hasattr(module, "config") or calls_the_registry(module)):
            layers.setdefault(index, []).append(module)
    # a hybrid model's convolution or state-space layers carry a layer index and the config too, but no attention
    attending = {index: modules for index, modules in layers.items() if any(map(_attends, modules))}
    return attending or layers  # else attention that reaches the registry unseen (through a helper): every layer


def _attends(module: torch.nn.Module) -> bool:
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention  # which bypasses the registry

    return isinstance(module, GPTNeoSelfAttention) or calls_the_registry(module)


def calls_the_registry(module: torch.nn.Module) -> bool:
    """Whether the module's forward looks its attention up in Transformers' registry (ALL_ATTENTION_FUNCTIONS), also
    under another name (imported `as`) or in a function or method of the module's class that the forward calls."""
    return _reaches_registry(inspect.unwrap(type(module).forward), type(module), helpers=True)


def passes_argument(module: torch.nn.Module, name: str) -> bool:
    """Whether the module's forward passes the keyword argument `name` to a call (Inkling's attention hands the
    registered attention function its relative position bias as `position_bias=`)."""
    codes = _codes(inspect.unwrap(type(module).forward))
    return any(isinstance(c, tuple) and name in c for inner in codes for c in inner.co_consts)


def _codes(function: Any) -> list:
    """The code of `function`, and of its lambdas, comprehensions and nested functions."""
    code = getattr(function, "__code__", None)
    codes = [code] if code is not None else []
    for inner in codes:
        codes += [c for c in inner.co_consts if inspect.iscode(c)]
    return codes


@functools.cache
def _reaches_registry(function: Any, owner: type, helpers: bool) -> bool:
    scope = getattr(function, "__globals__", {})
    names = {name for inner in _codes(function) for name in inner.co_names}
    if "ALL_ATTENTION_FUNCTIONS" in names or any(scope.get(name) is ALL_ATTENTION_FUNCTIONS for name in names):
        return True
    called = (scope.get(name) or inspect.getattr_static(owner, name, None) for name in names) if helpers else ()
    return any(inspect.isfunction(f) and not f.__module__.startswith("torch") and _reaches_registry(f, owner, False)
               for f in called)
