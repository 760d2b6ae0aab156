"""Autograd around a patched model and span_attention: forward-mode AD, gradients of some inputs only,
hooks, saved-tensor hooks, grad modes and hand-written training loops. Each case gives the stock
model's (SDPA's) result, the float64 reference's gradients, or a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import transformers
from models import VOCAB, tiny
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_spanattn import patch_model

IDS = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))


def patched_and_stock(family: str, label: str, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny float64 model patched with `label`, and an unpatched copy with the same weights."""
    model = tiny(family).double()
    stock = copy.deepcopy(model)
    return patch_model(model, label, **kwargs), stock


@pytest.mark.parametrize("label", ["score:1000", "standard:QKV101", "standard:QKV111"])
@pytest.mark.parametrize("grad", [True, False])
def test_forward_mode_ad_gives_sdpas_derivative_or_says_span_rules_have_none(label, grad):
    """Dual tensors (torch.autograd.forward_ad) through a model whose parameters need gradients: under a span
    rule or α an error naming span_attention and what to use instead; under the plain standard rule, and under
    torch.no_grad (SDPA itself), the stock model's tangent."""
    model, stock = patched_and_stock("gpt2", label)
    embeds = model.get_input_embeddings()(IDS).detach()
    tangent = torch.randn_like(embeds)

    def tangent_of(m: torch.nn.Module) -> torch.Tensor:
        with fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), torch.set_grad_enabled(grad):
            return fwAD.unpack_dual(m(inputs_embeds=fwAD.make_dual(embeds, tangent)).logits).tangent

    if grad and label != "standard:QKV111":
        with pytest.raises(RuntimeError, match=r"span_attention: forward-mode AD .* torch\.no_grad\(\)"):
            tangent_of(model)
    else:
        torch.testing.assert_close(tangent_of(model), tangent_of(stock), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["jvp", "hvp", "vhp"])
def test_autograd_functional_double_backward_tricks_name_themselves(name):
    """torch.autograd.functional's jvp, hvp and vhp differentiate a gradient (the double-backward trick): under a
    span rule the error names them, as the user wrote no create_graph; under standard:QKV111 the stock result."""
    import torch.autograd.functional as AF

    def run(m: torch.nn.Module) -> torch.Tensor:
        embeds = m.get_input_embeddings()(IDS[:1, :4]).detach()
        with sdpa_kernel(SDPBackend.MATH):
            return getattr(AF, name)(lambda x: m(inputs_embeds=x).logits.square().sum(), embeds,
                                     torch.ones_like(embeds))[1]

    with pytest.raises(RuntimeError, match=r"span_attention: a second derivative .*functional's jvp, hvp, vhp"):
        run(patched_and_stock("gpt2", "score:1000")[0])
    torch.testing.assert_close(*map(run, patched_and_stock("gpt2", "standard:QKV111")), rtol=1e-10, atol=1e-12)


LAYERS = {"llama": (lambda m: m.model.layers, r"model\.layers\.0\.self_attn \(LlamaAttention\)"),
          "gpt_neo": (lambda m: m.transformer.h, r"transformer\.h\.0\.attn\.attention \(GPTNeoSelfAttention\)")}


@pytest.mark.parametrize("family", LAYERS)
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_module_put_into_two_models_patched_otherwise_is_refused(first, family):
    """One attention module in two models (a layer shared): patching the second model with other settings would
    change the first one's gradients without a word (the module reads one model's settings), so it is refused,
    naming the module and both settings; with the same settings each model's gradients are its own alone."""
    layers, module = LAYERS[family]
    a, b = tiny(family).double(), tiny(family, seed=1).double()
    layers(b)[0] = layers(a)[0]
    alone = patch_model(copy.deepcopy(a), "score:1000")
    labels = {"a": "score:1000", "b": "score:1111"}
    second = "b" if first == "a" else "a"
    patch_model({"a": a, "b": b}[first], labels[first])
    with pytest.raises(ValueError, match=rf"patch_model: {module} is also a module of another patched model, which "
                                         rf"runs it under {labels[first]}.*{labels[second]}.*unpatch_model"):
        patch_model({"a": a, "b": b}[second], labels[second])
    patch_model(b, "score:1000")
    patch_model(a, "score:1000")
    for model in (a, alone):
        model(input_ids=IDS, labels=IDS).loss.backward()
    for p, q in zip(a.parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_layer_taken_from_a_stock_model_says_it_keeps_stock_gradients():
    """A decoder layer taken from another (stock) model reads that model's config, whose attn_implementation is
    'sdpa': patched, the layer kept stock gradients while the model's settings said score:1000 for every layer.
    patch_model warns, naming the module; the other model stays stock."""
    model, donor = tiny("llama").double(), tiny("llama", seed=1).double()
    model.model.layers[0] = donor.model.layers[0]
    with pytest.warns(UserWarning, match=r"patch_model: model\.layers\.0\.self_attn of LlamaForCausalLM read their "
                                         r"attention implementation from a config that is not the model's .*'sdpa'"):
        patch_model(model, "score:1000")
    assert donor.config._attn_implementation == "sdpa"
    own = copy.deepcopy(model.model.layers[0])
    own.self_attn.config = model.config
    model.model.layers[0] = own
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(model, "score:1000")


def test_forward_mode_ad_without_autograd_under_attention_dropout_is_sdpas():
    """Dual tensors under torch.no_grad in a model training with attention dropout: SDPA itself, with the stock
    model's dropout mask and tangent (the no_grad route the forward-mode error names), not that error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    stock = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
                                         attention_dropout=0.3)).double().train()
    model = patch_model(copy.deepcopy(stock), "score:1000")
    embeds = stock.get_input_embeddings()(IDS).detach()

    def tangent_of(m: torch.nn.Module) -> torch.Tensor:
        torch.manual_seed(5)
        with fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            return fwAD.unpack_dual(m(inputs_embeds=fwAD.make_dual(embeds, torch.ones_like(embeds))).logits).tangent

    torch.testing.assert_close(tangent_of(model), tangent_of(stock), rtol=1e-10, atol=1e-12)


def test_a_gpt_neo_layer_taken_from_another_model_says_that_model_trains_it_with_span_gradients():
    """GPT-Neo's adapter patches the attention module itself: a layer taken from a stock model then trained with
    span gradients in that model too, without a word. patch_model warns, naming the module; with the layer's own
    copy pointing to the model's config, no warning and the donor stays stock."""
    model, donor = tiny("gpt_neo").double(), tiny("gpt_neo", seed=1).double()
    model.transformer.h[0] = donor.transformer.h[0]
    with pytest.warns(UserWarning, match=r"patch_model: transformer\.h\.0\.attn\.attention of GPTNeoForCausalLM hold "
                                         r"another model's config .*span gradients too"):
        patch_model(model, "score:1000")
    own = copy.deepcopy(donor.transformer.h[0])
    own.attn.attention.config = model.config
    model.transformer.h[0] = own
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(model, "score:1000")


def test_forward_mode_ad_through_the_mask_alone_is_refused_under_a_span_rule():
    """A dual float mask (its tangent the only one) while q, k, v need gradients: the output came back without a
    tangent, the mask's derivative dropped without a word; now the forward-mode error, as for dual q, k, v."""
    from hf_spanattn import span_attention

    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.zeros(6, 6, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(mask, torch.randn_like(mask))
        with pytest.raises(RuntimeError, match=r"span_attention: forward-mode AD"):
            span_attention(q, k, v, attn_mask=dual, config="score:1000")


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's vmap of SDPA's CPU kernel
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_backward_through_a_vmapped_model_says_span_gradients_need_autograd(family):
    """torch.func.vmap over a patched model's forward, then loss.backward() outside it: the registry read vmap's
    wrappers (which say they need no gradient) and ran stock SDPA, so the parameters got the standard gradient in
    place of the rule's without a word. Now span_attention's torch.func error; under torch.no_grad, the stock output."""
    import torch.func as tf

    model, stock = patched_and_stock(family, "score:1000")
    embeds = model.get_input_embeddings()(IDS).detach()

    def forward(m: torch.nn.Module) -> torch.Tensor:
        return tf.vmap(lambda x: m(inputs_embeds=x[None]).logits[0])(embeds)

    with pytest.raises(RuntimeError, match=r"span_attention: span gradients do not run under torch\.func.*no_grad"):
        forward(model).square().mean().backward()
    with torch.no_grad():
        torch.testing.assert_close(forward(model), forward(stock), rtol=0, atol=0)


def _saving(ops: list | None):
    """A selective-checkpointing context keeping the outputs of `ops` (of every op for None), recomputing the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if ops is None or op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


@pytest.mark.parametrize("ops", [[torch.ops.aten.bmm.default, torch.ops.aten.mm.default], None], ids=["matmuls", "all"])
@pytest.mark.parametrize("label", ["score:1100", "score:1100@per_block"])
def test_selective_activation_checkpointing_gives_the_gradients_without_it(label, ops):
    """torch.utils.checkpoint with a context_fn that keeps the matmuls' (or every op's) outputs replays the kept
    tensors in the recomputation: the attention's forward pass must not write into them (a kept Q Kᵀ turned into P
    in place would be taken as the scores again), under a padding mask as under the causal one alone."""
    from torch.utils.checkpoint import checkpoint

    model = patch_model(tiny("llama"), label).train()
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0
    stock = tiny("llama").train()
    try:
        checkpoint(lambda ids: stock(ids, attention_mask=mask, labels=ids).loss, IDS, use_reentrant=False,
                   context_fn=_saving(ops)).backward()
    except RuntimeError as error:  # Transformers 4.56's model writes into a kept tensor
        pytest.skip(f"fails without hf_spanattn in Transformers {transformers.__version__}: {error}")

    def loss(ids):
        return model(ids, attention_mask=mask, labels=ids).loss

    loss(IDS).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    checkpoint(loss, IDS, use_reentrant=False, context_fn=_saving(ops)).backward()
    for name, p in model.named_parameters():
        assert (p.grad - expected[name]).norm() <= 1e-6 * expected[name].norm(), name
