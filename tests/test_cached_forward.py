"""A forward with past_key_values under autograd (fewer queries than keys): SDPA's result and the
standard gradient, with a one-time warning that the rule needs self-attention."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from models import VOCAB, tiny

from hf_spanattn import patch_model
from hf_spanattn.integration import registry


def decode_step_gradients(model, ids, prompt: int):
    """A hand-written decode step: the prompt cached without gradients, then the next tokens under grad."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        cache = model(ids[:, :prompt], use_cache=True).past_key_values
    out = model(ids[:, prompt:], past_key_values=cache, use_cache=True, labels=ids[:, prompt:])
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neo"])
def test_cached_forward_under_grad_is_sdpa_with_the_standard_gradient(family, caplog):
    stock = tiny(family).train()
    patched = patch_model(copy.deepcopy(stock), "score:1000").train()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    stock_logits, stock_grads = decode_step_gradients(stock, ids, prompt=7)
    registry.logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        logits, grads = decode_step_gradients(patched, ids, prompt=7)
        decode_step_gradients(patched, ids, prompt=6)
    assert torch.allclose(logits, stock_logits, atol=1e-6)
    assert grads.keys() == stock_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, stock_grads[name], rtol=1e-5, atol=1e-7), name
    warned = [r for r in caplog.records if "needs self-attention" in r.getMessage()]
    assert len(warned) == 1 and "past_key_values" in warned[0].getMessage()


@pytest.mark.parametrize("family", ["llama", "gpt_neo"])
def test_generation_in_train_mode_under_attention_dropout_says_nothing_of_gradients(family, caplog):
    """Generation in train mode under attention dropout (as TRL's online trainers generate): the cached decoding
    steps take no gradient, so the note that they get the standard gradient is not said there; the first cached
    forward under autograd says it."""
    stock = tiny(family)
    for module in stock.modules():  # Llama's attention holds the rate, GPT-Neo's a Dropout module
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.3
        if isinstance(getattr(module, "attn_dropout", None), torch.nn.Dropout):
            module.attn_dropout.p = 0.3
    patched = patch_model(copy.deepcopy(stock), "score:1000")
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    registry.logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        generated = []
        for model in (stock.train(), patched.train()):
            torch.manual_seed(0)
            generated.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                            do_sample=True))
        assert not [r for r in caplog.records if "needs self-attention" in r.getMessage()]
        decode_step_gradients(patched, ids, prompt=4)
    assert torch.equal(*generated)
    assert len([r for r in caplog.records if "needs self-attention" in r.getMessage()]) == 1


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_static_cache_s_first_forward_under_grad_gets_the_rule(family, padded, caplog):
    """A StaticCache holds more slots than the first forward fills: its keys outnumber the queries, and the forward
    got SDPA's standard gradient. No query attends an unfilled slot, so it is self-attention: the gradients are
    those of the same forward without a cache, and nothing is said."""
    from transformers import StaticCache

    model = patch_model(tiny(family), "score:1000").double().train()
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(ids)
    if padded:
        attention_mask[1, 15:] = 0

    def gradients(**kwargs):
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=attention_mask, labels=ids, **kwargs).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = gradients()
    registry.logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        got = gradients(past_key_values=StaticCache(config=model.config, max_cache_len=32), use_cache=True)
    assert "needs self-attention" not in caplog.text
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, rtol=1e-10, atol=1e-14), name
