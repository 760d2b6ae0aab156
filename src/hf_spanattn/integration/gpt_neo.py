"""GPT-Neo's adapter: its eager attention bypasses Transformers' attention registry, so each attention module of a
patched GPT-Neo gets `_attn` through span_attention (`neo_attn`), with the stock code's window and masks."""

from __future__ import annotations

import functools
import weakref

import torch
from transformers import PretrainedConfig, PreTrainedModel

from hf_spanattn.integration import packing, registry
from hf_spanattn.integration.registry import PROBE_ATTR, call_settings, documents_of, keeps_sdpa, splits_documents
from hf_spanattn.integration.stored import CONFIG_KEY
from hf_spanattn.ops.attention import span_attention
from hf_spanattn.ops.backward import with_scaled_grads
from hf_spanattn.ops.inputs import attended


def attentions(model: PreTrainedModel) -> list[torch.nn.Module]:
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    return [m for m in model.modules() if isinstance(m, GPTNeoSelfAttention)]


# The configs of the GPT-Neo models patch_model gave its adapter (by id, held weakly), until unpatch_model.
_CONFIGS: weakref.WeakValueDictionary[int, PretrainedConfig] = weakref.WeakValueDictionary()


def _install_class() -> None:
    """GPT-Neo's `_attn` through the adapter for a module that a patched model's config reaches but patch_model did
    not see (put into the model after it), as a registry model's module reads its config's implementation; any
    other module calls the stock code."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    stock = GPTNeoSelfAttention._attn
    if hasattr(stock, "__wrapped__"):
        return

    @functools.wraps(stock)
    def _attn(self, query, key, value, attention_mask=None, *head_mask):  # Transformers 4 passes a head_mask too
        if getattr(self.config, CONFIG_KEY, None) is not None and _CONFIGS.get(id(self.config)) is self.config:
            if _WEIGHTS_HOOK not in self.__dict__:  # its first call: whether its caller wants the weights is not known
                adapt(self.config, [self])
                self.__dict__[_WEIGHTS_WANTED] = None
            return neo_attn(self, query, key, value, attention_mask, *head_mask)
        return stock(self, query, key, value, attention_mask, *head_mask)

    GPTNeoSelfAttention._attn = _attn


# GPT-Neo's attention modules note whether their caller asked for the attention weights (output_attentions)
_WEIGHTS_HOOK, _WEIGHTS_WANTED = "_span_weights_hook", "_span_weights_wanted"


def _note_weights_wanted(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    module.__dict__[_WEIGHTS_WANTED] = bool(kwargs.get("output_attentions", False))


def _weights(self, query, key, value, attention_mask):
    """The attention weights P the stock code returns, where output_attentions asks for them (or may: the first call
    of a module put into the model after patch_model, whose caller was not heard); under attention dropout P would
    need the forward pass's dropout mask, so none are returned (with a warning), as by SDPA."""
    wanted = self.__dict__.get(_WEIGHTS_WANTED, False)
    if wanted is False or wanted is None and self.training and self.attn_dropout.p > 0:
        return None
    if self.training and self.attn_dropout.p > 0:
        registry.logger.warning_once("span_attention: GPT-Neo under attention dropout returns no attention weights "
                                     "with span gradients (output_attentions=True), as SDPA attention")
        return None
    return _stock_attn(self, query, key, value, attention_mask)[1]


def _stock_attn(self, query, key, value, attention_mask=None, *head_mask):
    attn = type(self)._attn
    return getattr(attn, "__wrapped__", attn)(self, query, key, value, attention_mask, *head_mask)


def adapt(model_config: PretrainedConfig, modules: list[torch.nn.Module]) -> None:
    """Give GPT-Neo attention `modules` of the model of `model_config` the adapter (their class too, for modules put
    into the model later)."""
    _install_class()
    _CONFIGS[id(model_config)] = model_config
    for module in modules:
        module._attn = functools.partial(neo_attn, module)  # pickles by name, unlike a bound method
        if _WEIGHTS_HOOK not in module.__dict__:  # `_attn` is not told whether the weights are wanted
            module.__dict__[_WEIGHTS_HOOK] = module.register_forward_pre_hook(_note_weights_wanted, with_kwargs=True)


def restore(model_config: PretrainedConfig, modules: list[torch.nn.Module]) -> None:
    """Take the adapter off `modules` (and off the model of `model_config`)."""
    for module in modules:
        module.__dict__.pop("_attn", None)
        if _WEIGHTS_HOOK in module.__dict__:
            module.__dict__.pop(_WEIGHTS_HOOK).remove()
    _CONFIGS.pop(id(model_config), None)


def neo_attn(self, query, key, value, attention_mask=None, head_mask=None):
    """GPTNeoSelfAttention._attn through span_attention: unscaled scores, the layer's global or
    local causal window, the padding mask added on top, as in the stock eager code. `head_mask` is
    Transformers 4's argument (which passes it, None or not): a mask of heads, which scales P, runs the
    stock code with the standard gradient."""
    if head_mask is not None:
        registry.logger.warning_once("span_attention: GPT-Neo was given a head_mask, which scales the attention "
                                     "probabilities: its attention runs the stock code, with the standard gradient")
        return _stock_attn(self, query, key, value, attention_mask, head_mask)
    if attention_mask is not None:  # Transformers 4 builds it a key wider than the keys, and the stock code cuts it so
        attention_mask = attention_mask[..., : key.shape[-2]]
    config = call_settings(self, (query, key, value), self.attn_dropout.p if self.training else 0.0)
    if config is None:
        return _stock_attn(self, query, key, value, attention_mask)
    q_len, k_len = query.shape[-2], key.shape[-2]
    probe = getattr(self, PROBE_ATTR, None) if q_len == k_len else None
    if keeps_sdpa(config, q_len, k_len):
        return _stock_attn(self, query, key, value, attention_mask)
    if config.method == "standard" and probe is None:  # the stock code bit for bit, each gradient times its α
        return _stock_attn(self, *with_scaled_grads((query, key, value), config.qkv_alphas), attention_mask)
    # as the stock code: the window's mask value float32's minimum, the padding mask added in its own dtype (float64's
    # minimum stays finite), scores in float32 for half precision; in float64 for a float64 model (where the stock code
    # rounds Q and K to float32 first: within float32's rounding of it)
    dtype = torch.promote_types(value.dtype, torch.float32)
    window = self.bias[:, :, k_len - q_len : k_len, :k_len]
    mask = torch.zeros(window.shape, dtype=dtype, device=query.device).masked_fill_(~window,
                                                                                     torch.finfo(torch.float32).min)
    if attention_mask is not None:
        mask = mask + attention_mask.to(dtype)
    run = functools.partial(span_attention, scale=1.0, dropout_p=self.attn_dropout.p if self.training else 0.0,
                            config=config, probe=probe)
    packed = attention_mask is not None and splits_documents(config, probe, q_len, k_len)  # packing comes with a mask
    docs = documents_of(query, mask, True, {}) if packed else None
    if docs is not None:
        with packing.rows_dropout(query, docs, run.keywords["dropout_p"]):
            out = run(*(packing.unpack(x.to(dtype), docs) for x in (query, key, value)), attn_mask=docs.mask)
        out = packing.repack(out, docs, query.shape[0], q_len).transpose(1, 2)
        return out.to(value.dtype), _weights(self, query, key, value, attention_mask)
    out = run(query.to(dtype), key.to(dtype), value.to(dtype), attn_mask=mask)
    # rows that attend no key (left padding) get the stock code's softmax over the mask-rounded scores, and so its
    # gradient into Q and K (span_attention would pass them gradient to V only): where the loss reads them (the last
    # pad predicts the first token), the gradient is stock's, and score:1111 stays the standard gradient
    # (the causal mask alone leaves none: only a padding mask does, and only one there to read)
    if attention_mask is not None and run.keywords["dropout_p"] == 0 and mask.device.type != "meta" and \
            not torch.compiler.is_compiling() and not packing.capturing(mask):
        idle = ~attended(mask).any(-1, keepdim=True)
        if idle.any():
            out = torch.where(idle, _stock_attn(self, query, key, value, attention_mask)[0].to(out.dtype), out)
    return out.to(value.dtype), _weights(self, query, key, value, attention_mask)
