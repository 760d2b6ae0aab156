"""Random numbers and reproducibility: under dropout and the same seed, the patched model draws the random
numbers the stock model draws, and `standard:QKV111` is the stock model bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from models import VOCAB, tiny
from transformers import DataCollatorWithFlattening

from hf_spanattn import patch_model, span_attention


def with_dropout(family: str, p: float = 0.3, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model in train mode with attention (and every other) dropout at p."""
    model = tiny(family).to(dtype).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = p
    return model


def step(model: torch.nn.Module, **batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Loss, gradients and the random state after one forward and backward pass under seed 0."""
    torch.manual_seed(0)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None], torch.get_rng_state()


def assert_bit_equal(got, expected) -> None:
    (loss, grads, state), (loss_0, grads_0, state_0) = got, expected
    assert torch.equal(loss, loss_0)
    assert all(torch.equal(g, g_0) for g, g_0 in zip(grads, grads_0, strict=True))
    assert torch.equal(state, state_0)  # later dropout masks, sampling and data order as stock's


def test_gpt_neo_in_float64_under_the_standard_rule_is_the_stock_model_bit_for_bit():
    """GPT-Neo's stock attention takes its scores in float32, also in a float64 model; its adapter took them in
    float64 for the standard rule too, so logits and gradients were off the stock model's by 5e-10."""
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    stock = with_dropout("gpt_neo", dtype=torch.float64)
    patched = patch_model(copy.deepcopy(stock), "standard:QKV111")
    assert_bit_equal(step(patched, input_ids=ids, labels=ids), step(stock, input_ids=ids, labels=ids))
    scaled = patch_model(copy.deepcopy(stock), "standard:QKV221")  # the forward pass is the stock one too
    torch.manual_seed(0)
    logits = scaled(input_ids=ids).logits
    torch.manual_seed(0)
    assert torch.equal(logits, stock(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neo"])
def test_packed_rows_under_the_standard_rule_and_dropout_are_the_stock_model_bit_for_bit(family):
    """Padding-free packing under attention dropout: standard:QKV111 split the row into its documents as the span
    rules do, so SDPA drew the dropout mask over the padded documents, not the row: another loss and gradients
    than the stock model's, and another random state after (every later mask and draw changed)."""
    documents = [list(range(1, 8)), list(range(10, 15)), list(range(20, 29))]
    batch = DataCollatorWithFlattening()([{"input_ids": doc} for doc in documents])
    stock = with_dropout(family)
    patched = patch_model(copy.deepcopy(stock), "standard:QKV111")
    assert_bit_equal(step(patched, **batch, use_cache=False), step(stock, **batch, use_cache=False))


def packed(*rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows of documents packed as DataCollatorWithFlattening packs them, rows of equal length."""
    batches = [DataCollatorWithFlattening()([{"input_ids": doc} for doc in row]) for row in rows]
    return {key: torch.cat([b[key] for b in batches]) for key in ("input_ids", "position_ids", "labels")}


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gpt_neo"])
def test_packed_rows_under_span_rules_and_dropout_draw_the_stock_models_dropout_mask(family, rows):
    """Padding-free packing under attention dropout: the documents ran apart on the tiles, which drew the dropout
    mask over their padded batch, not SDPA's over the rows: score:1111 (the standard gradient as a span rule) gave
    another loss and gradients than the stock model's (off by 0.2), and another random state after."""
    documents = [[list(range(1, 8)), list(range(10, 15)), list(range(20, 29))]]
    if rows == 2:
        documents = [[list(range(1, 8)), list(range(10, 15))], [list(range(20, 26)), list(range(30, 36))]]
    batch = packed(*documents)
    stock = with_dropout(family)
    loss_0, grads_0, state_0 = step(stock, **batch, use_cache=False)
    loss, grads, state = step(patch_model(copy.deepcopy(stock), "score:1111"), **batch, use_cache=False)
    torch.testing.assert_close(loss, loss_0, rtol=1e-6, atol=0)  # float32 rounding (GPT-Neo: float32 scores)
    for g, g_0 in zip(grads, grads_0, strict=True):
        torch.testing.assert_close(g, g_0, rtol=1e-4, atol=1e-6)
    assert torch.equal(state, state_0)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_dropout_of_one_draws_no_random_numbers(backend):
    """dropout_p = 1 keeps no weight, and SDPA draws nothing for it; the tiles drew a mask of zeros all the same,
    so every later random number (dropout masks, sampling, data order) differed from the stock model's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=gen, requires_grad=True) for _ in range(3))
    torch.manual_seed(0)
    expected = torch.get_rng_state()
    out = span_attention(q, k, v, dropout_p=1.0, is_causal=True, config="score:1000", backend=backend)
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), expected)
    assert torch.equal(out, torch.zeros_like(out))
