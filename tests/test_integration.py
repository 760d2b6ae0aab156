"""Patching Transformers models: forward unchanged, gradients per the engine, masks, layers, errors."""

from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest
import torch
from models import FAMILIES, VOCAB, needs_attention_backend, tiny, tiny_bert2gpt2
from reference import reference
from transformers import AttentionInterface

import hf_spanattn
from hf_spanattn import SpanAttentionConfig, patch_model, unpatch_model
from hf_spanattn.integration import model_layers, registry, stored

LABELS = ["standard:QKV101", "simple:10", "reductionistic:1100", "score:1000", "score:1111", "score:1100@per_block"]


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tokens(batch=2, length=16, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def grads(model, ids, **kwargs):
    model.zero_grad()
    model(ids, labels=ids, **kwargs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_unchanged_and_uniform_alphas_give_stock_gradients(family, small_tiles):
    model, ids = tiny(family), tokens()
    model.eval()
    with torch.no_grad():
        stock_logits = model(ids).logits
    model.train()
    stock = grads(model, ids)
    for label in LABELS:
        patch_model(model, label)
        model.eval()
        assert (model(ids).logits - stock_logits).abs().max() <= 1e-6, label  # with autograd on
        with torch.no_grad():
            assert (model(ids).logits - stock_logits).abs().max() <= 1e-6, label
        model.train()
    patch_model(model, "score:1111")
    patched = grads(model, ids)
    assert patched.keys() == stock.keys()
    for name in stock:
        assert rel(patched[name], stock[name]) <= 1e-5, name
    patch_model(model, "score:1000")
    assert any(rel(g, stock[n]) > 1e-3 for n, g in grads(model, ids).items())  # the rule does act


class Recorder:
    """Wraps the registered attention function to keep each call's q, k, v, mask and dO."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        for t in (query, key, value):
            t.retain_grad()
        out, weights = registry.span_attention_forward(module, query, key, value, attention_mask, **kwargs)
        call = dict(q=query, k=key, v=value, mask=attention_mask, scale=kwargs.get("scaling"),
                    causal=attention_mask is None, module=module)
        out.register_hook(lambda g: call.__setitem__("d_out", g.transpose(1, 2)))
        self.calls.append(call)
        return out, weights


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("label", ["score:1000", "score:1100@per_block", "reductionistic:1100"])
def test_gradient_entering_q_and_k_is_the_rule(family, label, monkeypatch, small_tiles):
    """Each attention layer's dQ, dK, dV against the float64 reference on the tensors it saw."""
    recorder = Recorder()
    monkeypatch.setitem(AttentionInterface._global_mapping, "span_attention", recorder)
    model = patch_model(tiny(family), label)
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding in the second sequence
    model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    config = SpanAttentionConfig.from_label(label)
    assert len(recorder.calls) == 2
    for call in recorder.calls:
        out, (dq, dk, dv) = reference(call["q"], call["k"], call["v"], call["d_out"], config, attn_mask=call["mask"],
                                      is_causal=call["causal"], scale=call["scale"])
        assert rel(call["q"].grad.double(), dq) < 1e-4
        assert rel(call["k"].grad.double(), dk) < 1e-4
        assert rel(call["v"].grad.double(), dv) < 1e-4


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_one_layer_value_weights_get_stock_gradients_under_score_1000(family):
    model, ids = tiny(family, layers=1), tokens()
    stock = grads(model, ids)
    patch_model(model, "score:1000")
    patched = grads(model, ids)
    value_names = [n for n in stock if "v_proj" in n] or ["transformer.h.0.attn.c_attn.weight"]
    for name in value_names:
        if name.endswith("c_attn.weight"):  # GPT-2 packs Q, K, V: compare the V columns
            assert rel(patched[name][:, 64:], stock[name][:, 64:]) < 1e-5
            assert rel(patched[name][:, :64], stock[name][:, :64]) > 1e-3
        else:
            assert rel(patched[name], stock[name]) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_sequences_alone(family, small_tiles):
    model = patch_model(tiny(family), "score:1100")
    ids, lengths = tokens(length=14), [14, 9]
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    model.zero_grad()
    logits = model(ids, attention_mask=mask).logits
    loss = sum(torch.nn.functional.cross_entropy(logits[i, : n - 1], ids[i, 1:n], reduction="sum")
               for i, n in enumerate(lengths))
    loss.backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for i, n in enumerate(lengths):
        alone = model(ids[i : i + 1, :n]).logits
        assert (alone[0] - logits[i, :n]).abs().max() < 1e-5
        torch.nn.functional.cross_entropy(alone[0, :-1], ids[i, 1:n], reduction="sum").backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert rel(padded[name], p.grad) < 1e-4, name


def test_layer_selection_keeps_stock_gradients_elsewhere(monkeypatch):
    recorder = Recorder()
    monkeypatch.setitem(AttentionInterface._global_mapping, "span_attention", recorder)
    model = patch_model(tiny("gpt2", layers=3), "score:1000", layers=[1])
    assert model.config.span_attention["layers"] == [1]
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    for call in recorder.calls:
        index = call["module"].layer_idx
        label = "score:1000" if index == 1 else "standard:QKV111"
        _, (dq, dk, _) = reference(call["q"], call["k"], call["v"], call["d_out"],
                                   SpanAttentionConfig.from_label(label), is_causal=True, scale=call["scale"])
        assert rel(call["q"].grad.double(), dq) < 1e-4 and rel(call["k"].grad.double(), dk) < 1e-4, index


def test_patch_twice_replaces_and_unpatch_restores_exactly():
    model = tiny("gpt2")
    model.set_attn_implementation("eager")
    patch_model(model, "score:1000")
    patch_model(model, "reductionistic:1100", layers=[0])
    assert SpanAttentionConfig.from_dict(model.config.span_attention) == \
        SpanAttentionConfig.from_label("reductionistic:1100", layers=[0])
    assert model.config._attn_implementation == "span_attention"
    unpatch_model(model)
    assert model.config._attn_implementation == "eager"
    assert not hasattr(model.config, "span_attention")


def test_unpatch_restores_each_tower_of_a_composite_model():
    """A composite model whose towers run different attention (the vision tower kept eager) gets each back."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(text_config=dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                         intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=16),
                        vision_config=dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                           intermediate_size=32, image_size=8, patch_size=4), projection_dim=8)
    model = CLIPModel._from_config(config, attn_implementation={"": "sdpa", "text_config": "sdpa",
                                                                "vision_config": "eager"})
    patch_model(model, "score:1000")
    assert model.config.vision_config._attn_implementation == "span_attention"
    unpatch_model(model)
    implementations = [c._attn_implementation for c in (model.config, model.config.text_config,
                                                        model.config.vision_config)]
    assert implementations == ["sdpa", "sdpa", "eager"]

class _ConfiglessAttention(torch.nn.Module):
    """A custom model's attention that calls the registry but holds no config (stock SDPA needs none)."""

    def __init__(self, model_config, width: int, heads: int, layer_idx: int) -> None:
        super().__init__()
        self.qkv, self.heads, self.layer_idx, self.is_causal = torch.nn.Linear(width, 3 * width), heads, layer_idx, True
        self.implementation = lambda: model_config._attn_implementation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return ALL_ATTENTION_FUNCTIONS[self.implementation()](self, q, k, v, None)[0].reshape(b, t, -1)


def _custom_model(attention: type, heads: int) -> type:
    """A model of one's own: two layers of `attention` (heads, width 16) over an embedding."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Custom(PreTrainedModel):
        config_class = PretrainedConfig
        _supports_attention_backend = _supports_sdpa = True

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(VOCAB, 16)
            self.layers = torch.nn.ModuleList(attention(config, 16, heads, i) for i in range(2))

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = h + layer(h)
            return h

    return Custom


def test_a_custom_model_whose_attention_holds_no_config_trains_patched():
    from transformers import PretrainedConfig

    Custom = _custom_model(_ConfiglessAttention, 2)

    def model():
        torch.manual_seed(0)
        return Custom._from_config(PretrainedConfig(num_hidden_layers=2), attn_implementation="sdpa").double()

    stock, patched = model(), patch_model(model(), "score:1111")
    ids = tokens()
    stock(ids).square().sum().backward()
    patched(ids).square().sum().backward()
    for a, b in zip(stock.parameters(), patched.parameters()):
        assert rel(b.grad, a.grad) < 1e-12
    # layers=[1] selects by the layer_idx the modules carry (refused before: "carry no layer index")
    selected = patch_model(model(), "score:1000", layers=[1])
    assert [registry.settings_for(m) for m in selected.layers] == [None, SpanAttentionConfig.from_label("score:1000")
                                                                   .replace(layers=[1])]
    selected(ids).square().sum().backward()
    registry.register()
    stock.config._attn_implementation = "span_attention"  # by hand, without patch_model: no settings to reach
    with pytest.raises(TypeError, match="_ConfiglessAttention holds no model config .* call hf_spanattn.patch_model"):
        stock(ids)


def _attend(module, q, k, v):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as attention_functions

    return attention_functions[module.implementation()](module, q, k, v, None)[0]


class _HelperAttention(_ConfiglessAttention):
    """As `_ConfiglessAttention`, through a helper that imports the registry under another name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return _attend(self, q, k, v).reshape(b, t, -1)


@pytest.mark.parametrize("attention", [_ConfiglessAttention, _HelperAttention])
def test_a_custom_attention_that_reaches_the_registry_through_a_helper_trains_patched(attention):
    """Through a helper, patch_model's model failed with 'holds no model config ... call hf_spanattn.patch_model', and
    layers=[1] with 'carry no layer index', though the modules carry layer_idx."""
    from transformers import PretrainedConfig

    Custom = _custom_model(attention, 4)

    def grads(layers):
        torch.manual_seed(0)
        model = Custom._from_config(PretrainedConfig(), attn_implementation="sdpa").double()
        if layers != "stock":
            patch_model(model, "score:1000", layers=layers)
        model(tokens()).square().sum().backward()
        return model.layers[1].qkv.weight.grad, layers != "stock" and [registry.settings_for(m) is not None
                                                                          for m in model.layers]

    (stock, _), (every, _), (upper, selected) = grads("stock"), grads(None), grads([1])
    assert rel(every, stock) > 1e-3
    assert rel(upper, every) < 1e-12 and selected == [False, True]


def test_patch_model_warns_where_it_replaces_an_attention_function_of_ones_own(monkeypatch):
    """An attention function registered by the user (here SDPA's output doubled) was replaced by span_attention
    without a word, changing the model's outputs; Transformers' own implementations replace silently."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def doubled(module, *args, **kwargs):
        out, weights = sdpa_attention_forward(module, *args, **kwargs)
        return 2 * out, weights

    monkeypatch.setitem(AttentionInterface._global_mapping, "doubled", doubled)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "doubled", sdpa_mask)
    model = tiny("llama")
    model.set_attn_implementation("doubled")
    ids = tokens()
    with torch.no_grad():
        before = model(ids).logits
    with pytest.warns(UserWarning, match="ran attn_implementation='doubled', .* outputs change unless 'doubled' "
                                         "computes SDPA's attention"):
        patch_model(model, "score:1000")
    with torch.no_grad():
        assert rel(model(ids).logits, before) > 1e-3
    assert unpatch_model(model).config._attn_implementation == "doubled"
    monkeypatch.setitem(AttentionInterface._global_mapping, "maskless", sdpa_attention_forward)  # no mask function
    maskless = tiny("llama")
    maskless.set_attn_implementation("maskless")
    with pytest.warns(UserWarning, match="'maskless', .* with no mask function registered in AttentionMaskInterface"):
        patch_model(maskless, "score:1000")
    eager = tiny("llama")
    eager.set_attn_implementation("eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(eager, "score:1000")


_REMOTE_CONFIG = """from transformers import PretrainedConfig


class TinyDecConfig(PretrainedConfig):
    model_type = "tinydec"

    def __init__(self, vocab_size=97, n_embd=16, n_head=4, n_layer=2, **kwargs):
        self.vocab_size, self.n_embd, self.n_head, self.n_layer = vocab_size, n_embd, n_head, n_layer
        super().__init__(**kwargs)
"""
_REMOTE_MODEL = """import torch
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_tinydec import TinyDecConfig


class Attention(torch.nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, True
        self.qkv = torch.nn.Linear(config.n_embd, 3 * config.n_embd)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.config.n_head, -1).permute(2, 0, 3, 1, 4)
        return ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation](self, q, k, v, None)[0].reshape(b, t, -1)


class TinyDecForCausalLM(PreTrainedModel):
    config_class = TinyDecConfig
    _supports_attention_backend = _supports_sdpa = True

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = torch.nn.ModuleList(Attention(config, i) for i in range(config.n_layer))
        self.post_init()

    def forward(self, input_ids, **kwargs):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return h
"""


def remote_code_model(tmp_path):
    """A model of one's own saved with its code (auto_map in config.json, modeling and configuration files beside)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    code = tmp_path / "code"
    code.mkdir()
    (code / "configuration_tinydec.py").write_text(_REMOTE_CONFIG)
    (code / "modeling_tinydec.py").write_text(_REMOTE_MODEL)
    (code / "config.json").write_text(json.dumps({"model_type": "tinydec", "auto_map": {
        "AutoConfig": "configuration_tinydec.TinyDecConfig",
        "AutoModelForCausalLM": "modeling_tinydec.TinyDecForCausalLM"}}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(code, trust_remote_code=True),
                                             trust_remote_code=True)
    model.save_pretrained(tmp_path / "saved")
    return tmp_path / "saved"


def test_load_pretrained_names_the_auto_class_of_a_remote_code_model(tmp_path):
    """It advised model_class=TinyDecForCausalLM 'from transformers', which has no such class."""
    from transformers import AutoModel

    with pytest.raises(ValueError, match="pass an auto class that its config.json's auto_map names for its own code "
                                         r"\(model_class=AutoModelForCausalLM, from transformers"):
        hf_spanattn.load_pretrained(remote_code_model(tmp_path), model_class=AutoModel, trust_remote_code=True)


def test_gpt_neo_adapter_unpatches():
    model = tiny("gpt_neo")
    patch_model(model, "score:1000")
    attn = model.transformer.h[0].attn.attention
    assert "_attn" in attn.__dict__
    unpatch_model(model)
    assert "_attn" not in attn.__dict__



def test_gpt_neo_attention_called_as_transformers_4_calls_it_applies_the_rule():
    """Transformers 4 (which the package's requirements allow) calls GPT-Neo's `_attn` with a head_mask, None
    unless given, and a mask one key wider than the keys, which the stock code cuts: the adapter, on the patched
    modules and on one put in after patching, takes both and gives what the call as Transformers 5 makes it gives."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    model = patch_model(tiny("gpt_neo").double(), "score:1000")
    late = GPTNeoSelfAttention(model.config, "global", layer_id=0).double()
    late.load_state_dict(model.transformer.h[0].attn.attention.state_dict())
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    wide = torch.zeros(2, 1, 12, 13, dtype=torch.float64)
    wide[0, ..., :3] = torch.finfo(torch.float64).min  # left padding
    for attn in (model.transformer.h[0].attn.attention, late):
        results = []
        for extra in ((wide[..., :12],), (wide, None)):
            out = attn._attn(q, k, v, *extra)[0]
            results.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v))])
        assert all(torch.equal(a, b) for a, b in zip(*results))


def test_gpt_neo_patched_returns_the_stock_attention_weights_under_autograd():
    """Stock GPT-Neo's attention is eager and returns its weights under output_attentions=True; the patched model
    returned None in their place under autograd. They are the stock weights (to float32's rounding past the first layer,
    whose input is the patched attention's output), and a loss on the first layer's gets stock gradients."""
    stock = tiny("gpt_neo").double()
    model = patch_model(copy.deepcopy(stock), "score:1000")
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    weights = [m(ids, attention_mask=mask, output_attentions=True).attentions for m in (stock, model)]
    assert all(w is not None and torch.allclose(w, v, rtol=0, atol=1e-6) for w, v in zip(*weights))
    for w in weights:
        w[0].square().sum().backward()
    pairs = [(p.grad, q.grad) for p, q in zip(stock.parameters(), model.parameters()) if p.grad is not None]
    assert pairs and all(torch.equal(g, h) for g, h in pairs)
    assert model(ids).attentions is None  # not asked for: not computed
    unpatch_model(model)
    assert not model.transformer.h[0].attn.attention._forward_pre_hooks


def test_gpt_neo_attention_put_in_after_patching_trains_as_its_siblings():
    """As a registry model's attention module replaced after patch_model (it reads the model config's
    implementation), a GPT-Neo attention module built on the patched model's config trains with its settings;
    after unpatch_model every module is stock again."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    ids = tokens()
    patched, replaced, stock = (tiny("gpt_neo").double() for _ in range(3))
    for model in (patched, replaced):
        patch_model(model, "score:1000")
    old = replaced.transformer.h[0].attn.attention
    new = GPTNeoSelfAttention(replaced.config, "global", layer_id=0).double()
    new.load_state_dict(old.state_dict())
    replaced.transformer.h[0].attn.attention = new
    expected, got = grads(patched, ids), grads(replaced, ids)
    assert all(torch.allclose(expected[n], got[n], rtol=0, atol=1e-12) for n in expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the module taken out, still held, is no other model sharing the config
        unpatch_model(replaced)
    expected, got = grads(stock, ids), grads(replaced, ids)
    assert all(torch.allclose(expected[n], got[n], rtol=0, atol=1e-12) for n in expected)


def test_gpt_neo_attention_put_in_after_patching_returns_the_stock_attention_weights():
    """A GPT-Neo attention module put into a patched model after patch_model returned None for its attention weights
    under output_attentions=True and autograd (its siblings the stock weights); from its first call on they are the
    stock model's, and not computed where not asked for."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

    ids = tokens()
    stock = tiny("gpt_neo").double()
    model = patch_model(copy.deepcopy(stock), "score:1000")
    old = model.transformer.h[1].attn.attention
    new = GPTNeoSelfAttention(model.config, model.config.attention_layers[1], layer_id=1).double()
    new.load_state_dict(old.state_dict())
    model.transformer.h[1].attn.attention = new
    expected = stock(ids, output_attentions=True).attentions
    for _ in range(2):
        got = model(ids, output_attentions=True).attentions
        assert all(w is not None and torch.allclose(w, v, rtol=0, atol=1e-6) for w, v in zip(got, expected))
    assert model(ids).attentions is None
    unpatch_model(model)
    assert not new._forward_pre_hooks and "_attn" not in new.__dict__


def patched_gpt2_with_reorder_and_upcast_attn() -> torch.nn.Module:
    """A tiny GPT-2 with reorder_and_upcast_attn on, patched (score:1000), which warns that it is switched off."""
    model = tiny("gpt2")
    model.config.reorder_and_upcast_attn = True
    for block in model.transformer.h:
        block.attn.reorder_and_upcast_attn = True
    with pytest.warns(UserWarning, match="reorder_and_upcast_attn"):
        return patch_model(model, "score:1000")


def test_reorder_and_upcast_attn_is_switched_off_with_a_warning():
    model = patched_gpt2_with_reorder_and_upcast_attn()
    assert not model.transformer.h[0].attn.reorder_and_upcast_attn
    unpatch_model(model)
    assert model.config.reorder_and_upcast_attn and model.transformer.h[0].attn.reorder_and_upcast_attn


def test_reorder_and_upcast_attn_comes_back_where_the_attention_was_set_otherwise_since():
    """Patched, then set to SDPA by hand (or to eager and patched again): unpatch_model left GPT-2's
    reorder_and_upcast_attn switched off, so the model lost the setting it had."""
    model = patched_gpt2_with_reorder_and_upcast_attn()
    model.set_attn_implementation("sdpa")
    unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"
    assert model.config.reorder_and_upcast_attn and model.transformer.h[0].attn.reorder_and_upcast_attn
    with pytest.warns(UserWarning, match="reorder_and_upcast_attn"):
        patch_model(model, "score:1000")
    model.set_attn_implementation("eager")
    with pytest.warns(UserWarning, match="reorder_and_upcast_attn"):  # recorded afresh: eager, and the setting
        patch_model(model, "score:1100")
    unpatch_model(model)
    assert model.config._attn_implementation == "eager"
    assert model.config.reorder_and_upcast_attn and model.transformer.h[0].attn.reorder_and_upcast_attn


def test_a_patched_model_saves_reorder_and_upcast_attn_as_the_user_set_it(tmp_path):
    """Switched off on the attention modules while patched, it was saved off too: a plain from_pretrained of the
    saved model lost it."""
    import json

    model = patched_gpt2_with_reorder_and_upcast_attn()
    assert not model.transformer.h[0].attn.reorder_and_upcast_attn
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["reorder_and_upcast_attn"] is True


def test_unsupported_model_gets_a_clear_error():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                                 is_decoder=True, add_cross_attention=True))
    model._supports_attention_backend = False
    with pytest.raises(ValueError, match="BertModel does not declare Transformers' attention-backend support.*but "
                                         "its module encoder.layer.0.crossattention.self is cross-attention. "
                                         "Supported"):
        patch_model(model, "score:1000")
    with pytest.raises(ValueError, match="layers=\\[5\\]"):
        patch_model(tiny("gpt2"), "score:1000", layers=[5])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_runs_patched(family):
    model = patch_model(tiny(family), "score:1000").eval()
    out = model.generate(tokens(batch=1, length=5), max_new_tokens=4, do_sample=False)
    unpatch_model(model)
    assert torch.equal(out, model.generate(tokens(batch=1, length=5), max_new_tokens=4, do_sample=False))


def test_peft_lora_on_a_patched_gpt2_trains():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("gpt2"), LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0))
    patch_model(model, "score:1000")
    assert model.get_base_model().config._attn_implementation == "span_attention"
    ids = tokens()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_missing_settings_warn_and_use_the_default():
    model = tiny("gpt2")
    model.set_attn_implementation("span_attention")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(tokens(), labels=tokens()).loss.backward()
    assert hf_spanattn.integration.registry.settings_for(model.transformer.h[0].attn) == SpanAttentionConfig()


def test_saved_layers_outside_the_model_warn_on_load_and_bad_entries_fail(tmp_path):
    """A config.json whose span_attention.layers lie outside the model loads, and warns once it trains;
    an entry that is not a dict fails, naming the field."""
    import json

    from transformers import AutoModelForCausalLM

    model = tiny("gpt2", layers=2)
    model.config.span_attention = {**SpanAttentionConfig.from_label("score:1000").to_dict(), "layers": [7]}
    model.save_pretrained(tmp_path)
    stored._PARSED.clear()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="span_attention")
    ids = tokens()
    with pytest.warns(UserWarning, match=r"layers=\[7\]: the model has layers 0\.\.1.*no layer does"):
        loaded(ids, labels=ids).loss.backward()

    config = json.loads((tmp_path / "config.json").read_text())
    for entry in ("score:1000", ["score", [1, 0, 0, 0]]):
        (tmp_path / "config.json").write_text(json.dumps({**config, "span_attention": entry}))
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="span_attention")
        with pytest.raises(TypeError, match="'span_attention' = .*expected a dict of SpanAttentionConfig fields"):
            loaded(ids, labels=ids).loss.backward()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_output_attentions_behaves_as_stock_sdpa(family, caplog):
    """Transformers' SDPA attention returns no attention weights and logs a warning when a model passes
    output_attentions down to it; span_attention does the same, in training as in evaluation."""
    import logging

    ids = tokens()
    stock = tiny(family).train()
    patched = patch_model(tiny(family), "score:1000").train()
    registry.logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        out = patched(ids, labels=ids, output_attentions=True)
    expected = stock(ids, labels=ids, output_attentions=True)
    assert out.attentions == expected.attentions
    assert torch.allclose(out.loss, expected.loss, atol=1e-6)
    passed_down = family == "llama"  # GPT-2 does not pass output_attentions to the attention function
    for name in ("hf_spanattn", "transformers.integrations.sdpa_attention"):  # ours, and stock SDPA's
        warned = [r for r in caplog.records if r.name == name and "not support `output_attentions=True`" in r.msg]
        assert len(warned) == passed_down, name


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_keeps_the_stock_forward_in_every_row(family):
    """Rows of left padding attend nothing (GPT-Neo's float mask gives them the uniform average, as
    its eager attention does): the patched model's outputs and loss are the stock model's."""
    model, ids = tiny(family), tokens()
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :5] = 0
    labels = ids.masked_fill(attention_mask == 0, -100)
    model.train()
    stock = model(ids, attention_mask=attention_mask, labels=labels)
    patch_model(model, "score:1111")
    patched = model(ids, attention_mask=attention_mask, labels=labels)
    patched.loss.backward()
    assert (patched.logits - stock.logits).abs().max() <= 1e-5
    assert abs(patched.loss.item() - stock.loss.item()) <= 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_left_padding_in_the_loss_give_the_stock_gradients_under_uniform_alphas(family):
    """The last pad of a left-padded row predicts the first token (labels as DataCollatorForLanguageModeling makes
    them), so rows that attend no key are in the loss; an empty row's logits too: score:1111 gives the stock
    gradients (GPT-Neo's rounds Q and K to float32 there)."""
    ids = tokens(batch=3, length=20)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    stock = tiny(family).double()
    patched = patch_model(copy.deepcopy(stock), "score:1111")
    for model in (stock, patched):
        model.zero_grad()
        out = model(ids, attention_mask=mask, labels=labels)
        (out.loss + out.logits[2].square().mean()).backward()
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        if p.grad is not None:
            assert rel(q.grad, p.grad) < 1e-6, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_standard_rule_under_a_padding_mask_gives_the_stock_gradients_bit_for_bit(dtype):
    """Under a mask Transformers repeats the grouped-query heads of K and V for SDPA; the standard rule makes the
    same call, so its gradients (and a half-precision run that follows them) are the stock model's exactly."""
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    stock = tiny("llama").to(dtype)
    patched = patch_model(copy.deepcopy(stock), "standard:QKV111")
    for model in (stock, patched):
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        assert torch.equal(q.grad, p.grad), name


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neo"])
def test_a_backward_pass_inside_bf16_autocast_gives_the_gradients_of_one_outside(family):
    """The span rule's work runs in float32 whether loss.backward() is called inside the autocast region (a
    common loop) or after it (the Trainer's), as the forward pass does; with uniform α that is the stock model's
    bf16 gradient up to bf16 rounding."""
    ids = tokens()

    def autocast_grads(model, inside):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    stock = autocast_grads(tiny(family).train(), inside=True)
    model = patch_model(tiny(family), "score:1111").train()
    inside, outside = autocast_grads(model, True), autocast_grads(model, False)
    for name, grad in outside.items():
        assert torch.equal(inside[name], grad), name
        assert rel(grad, stock[name]) <= 2e-2, name
    patch_model(model, "score:1000")
    assert any(not torch.equal(a, b) for a, b in zip(autocast_grads(model, True).values(), inside.values()))


def test_gpt_neo_under_inference_mode_and_generation_is_the_stock_attention(caplog):
    """Without autograd GPT-Neo's adapter runs the stock attention, as the registry's models run SDPA: under
    torch.inference_mode (whose tensors have no version counter to read) and in generation with a cache (where
    queries and keys differ in number, which is no reason for a warning there)."""
    ids = tokens(batch=1, length=8)
    stock = tiny("gpt_neo").eval()
    model = patch_model(tiny("gpt_neo"), "score:1000").eval()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, stock(ids).logits)
    with caplog.at_level("WARNING"):
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, stock.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))
    assert "needs self-attention" not in caplog.text


def test_cross_attention_keeps_the_stock_gradient_also_where_its_lengths_are_equal():
    """Span rules need self-attention: a decoder's cross-attention to an encoder as long as itself gets SDPA's
    gradient, as it does for any other encoder length, while its self-attention gets the rule."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    stock = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=1, vocab_size=VOCAB, n_positions=64,
                                       add_cross_attention=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model = patch_model(copy.deepcopy(stock), "score:1000")
    ids = tokens(length=12)
    encoded = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(2))
    expected, got = grads(stock, ids, encoder_hidden_states=encoded), grads(model, ids, encoder_hidden_states=encoded)
    for name in ("transformer.h.0.crossattention.q_attn.weight", "transformer.h.0.crossattention.c_attn.weight"):
        assert rel(got[name], expected[name]) < 1e-5, name
    assert rel(got["transformer.h.0.attn.c_attn.weight"], expected["transformer.h.0.attn.c_attn.weight"]) > 1e-3


def test_a_cross_attention_told_by_where_it_sits_keeps_the_stock_gradient():
    """BLIP-2's Q-Former attention class serves both self- and cross-attention, with no flag: the one under
    `crossattention` gets SDPA's gradient also where the queries are as many as the image features."""
    from transformers import Blip2QFormerConfig, Blip2QFormerModel

    needs_attention_backend(Blip2QFormerModel)
    torch.manual_seed(0)
    stock = Blip2QFormerModel(Blip2QFormerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                                 intermediate_size=32, encoder_hidden_size=24,
                                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = patch_model(copy.deepcopy(stock), "score:1000")
    queries, features, weights = torch.randn(2, 9, 32), torch.randn(2, 9, 24), torch.randn(2, 9, 32)

    def grads_of(m):
        m.zero_grad()
        (m(query_embeds=queries, encoder_hidden_states=features).last_hidden_state * weights).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    expected, got = grads_of(stock), grads_of(model)
    for name in ("query", "key"):
        cross = f"encoder.layer.0.crossattention.attention.{name}.weight"
        own = f"encoder.layer.0.attention.attention.{name}.weight"
        assert rel(got[cross], expected[cross]) < 1e-5, cross
        assert rel(got[own], expected[own]) > 1e-3, own


def test_a_cross_attention_named_encoder_attn_keeps_the_stock_gradient():
    """Kosmos-2's text decoder uses one attention class for its self-attention and, under `encoder_attn`, its
    cross-attention to the image features: the latter gets SDPA's gradient at equal lengths too."""
    from transformers.models.kosmos2.configuration_kosmos2 import Kosmos2TextConfig  # Transformers 4 exports none
    from transformers.models.kosmos2.modeling_kosmos2 import Kosmos2TextForCausalLM

    torch.manual_seed(0)
    stock = Kosmos2TextForCausalLM(Kosmos2TextConfig(embed_dim=32, layers=1, attention_heads=4, ffn_dim=32,
                                                     vocab_size=VOCAB, add_cross_attention=True, dropout=0.0,
                                                     attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0))
    model = patch_model(copy.deepcopy(stock), "score:1000")
    ids, features = tokens(length=9), torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))
    expected, got = grads(stock, ids, encoder_hidden_states=features), grads(model, ids, encoder_hidden_states=features)
    cross, own = "model.layers.0.encoder_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    assert rel(got[cross], expected[cross]) < 1e-5
    assert rel(got[own], expected[own]) > 1e-3


def _encoder_decoder(kind: str):
    """A tiny BERT2BERT EncoderDecoderModel, or a VisionEncoderDecoderModel of ViT and GPT-2, without dropout."""
    import transformers

    torch.manual_seed(0)
    if kind == "text":
        needs_attention_backend(transformers.BertModel, transformers.BertLMHeadModel)
        bert = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                    max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(
            transformers.BertConfig(**bert), transformers.BertConfig(**bert, is_decoder=True, add_cross_attention=True))
        model_class, inputs = transformers.EncoderDecoderModel, {"input_ids": tokens(length=12)}
    else:
        config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
            transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                   image_size=8, patch_size=2, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0),
            transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, add_cross_attention=True,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        model_class, inputs = transformers.VisionEncoderDecoderModel, {"pixel_values": torch.randn(2, 3, 8, 8)}
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return model_class, model_class(config).double(), {**inputs, "labels": tokens(length=12, seed=2)}


@pytest.mark.parametrize("kind", ["text", "vision"])
def test_an_encoder_decoder_wrapper_is_patched_through_its_encoder_and_decoder(kind, tmp_path):
    """EncoderDecoderModel and VisionEncoderDecoderModel were refused for the flag their wrapper class lacks, though
    their encoder and decoder declare it. Patched whole, they train as their two parts patched one by one (the
    cross-attention keeping SDPA's gradient), save and load with their settings, and unpatch to stock."""
    from hf_spanattn import load_pretrained

    model_class, model, inputs = _encoder_decoder(kind)

    def grads(m):
        m.zero_grad()
        m(**{k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}).loss.backward()
        return torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])

    stock = grads(model)
    whole = patch_model(copy.deepcopy(model), "score:1000")
    parts = copy.deepcopy(model)
    patch_model(parts.encoder, "score:1000")
    patch_model(parts.decoder, "score:1000")
    assert torch.equal(grads(whole), grads(parts)) and rel(grads(whole), stock) > 1e-9
    whole.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, model_class=model_class).double()
    assert stored.config_of(loaded.config).label == "score:1000"
    assert torch.equal(grads(loaded), grads(whole))
    unpatch_model(whole)
    assert whole.config._attn_implementation == whole.decoder.config._attn_implementation == "sdpa"
    assert torch.equal(grads(whole), stock)


def test_an_encoder_decoder_built_from_towers_saved_alone_says_how_its_encoder_gets_the_rule(tmp_path):
    """EncoderDecoderModel.from_encoder_decoder_pretrained gives the encoder the model's sub-config but leaves its
    attention modules reading the config it was loaded with: they keep stock gradients, and the warning spoke of a
    layer taken from another model. Now it names this case, and its advice gives the model patched as built whole."""
    import transformers

    _, model, inputs = _encoder_decoder("text")
    model.encoder.save_pretrained(tmp_path / "encoder")
    model.decoder.save_pretrained(tmp_path / "decoder")
    built = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path / "encoder", tmp_path / "decoder")
    built.config.decoder_start_token_id, built.config.pad_token_id = 1, 0
    with pytest.warns(UserWarning, match="which EncoderDecoderModel.from_encoder_decoder_pretrained replaces on the "
                                         "tower but not on its layers"):
        patch_model(built, "score:1000")
    for module in built.encoder.modules():
        if model_layers.calls_the_registry(module):
            module.config = built.encoder.config
    patch_model(built, "score:1000")

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(**inputs).loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    want = grads(patch_model(model, "score:1000"))
    assert (grads(built) - want).norm() <= 1e-12 * want.norm()


def test_an_encoder_decoder_whose_decoder_lacks_the_flag_names_it():
    """BERT encoder, BART decoder: refused, naming the decoder's class (the message named only the wrapper)."""
    import transformers

    needs_attention_backend(transformers.BertModel)
    bart = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                   decoder_ffn_dim=32, is_decoder=True, add_cross_attention=True)
    bert = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(bert, bart)
    with pytest.raises(ValueError, match=r"EncoderDecoderModel \(it holds BartForCausalLM, which does not\) does not "
                                         "declare Transformers' attention-backend support"):
        patch_model(transformers.EncoderDecoderModel(config), "score:1000")


def test_layers_selects_a_layer_of_an_encoder_deeper_than_its_decoder():
    """An encoder of 3 layers and a decoder of 2, whose config counts the decoder's: layers=[2] was refused as
    "EncoderDecoderModel has layers 0..1"; it selects the encoder's layer 2, the only one of that index."""
    import transformers

    needs_attention_backend(transformers.BertModel, transformers.BertLMHeadModel)
    bert = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=32)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.BertConfig(**bert, num_hidden_layers=3),
        transformers.BertConfig(**bert, num_hidden_layers=2, is_decoder=True, add_cross_attention=True))
    model = patch_model(transformers.EncoderDecoderModel(config), "score:1000", layers=[2])
    selected = {name: getattr(registry.settings_for(m), "label", None) for name, m in model.named_modules()
                if type(m).__name__ == "BertSelfAttention"}
    assert selected == {f"encoder.encoder.layer.{i}.attention.self": "score:1000" if i == 2 else None
                        for i in range(3)} | {f"decoder.bert.encoder.layer.{i}.attention.self": None for i in range(2)}
    with pytest.raises(ValueError, match=r"layers=\[3\]: EncoderDecoderModel has layers 0..2"):
        patch_model(transformers.EncoderDecoderModel(config), "score:1000", layers=[3])


class _Logits(torch.nn.Module):
    """A model's logits for (input ids, attention mask): what the export tests export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _padded_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens()` and an attention mask that pads out the first row's first three: (ids, mask)."""
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids, mask


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "gpt_neo"])
def test_torch_export_with_gradients_on_records_the_stock_forward(family, strict):
    """torch.export.export of a patched model in evaluation, gradients on (its default), with a padding mask: the
    exported program is the stock model's forward, as exported from the stock model."""
    ids, mask = _padded_tokens()
    stock = tiny(family).eval()
    patched = patch_model(copy.deepcopy(stock), "score:1000")

    exported = torch.export.export(_Logits(patched), (ids, mask), strict=strict)
    with torch.no_grad():
        assert torch.equal(exported.module()(ids, mask), stock(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_legacy_onnx_export_with_gradients_on_records_the_stock_graph():
    """torch.onnx.export (the TorchScript exporter) of a patched model with gradients on: the stock model's graph."""
    onnx = pytest.importorskip("onnx")
    import io

    ids, mask = _padded_tokens()

    stock = tiny("gpt2").eval()
    patched = patch_model(copy.deepcopy(stock), "score:1000")
    graphs = []
    for model in (stock, patched):
        file = io.BytesIO()
        torch.onnx.export(_Logits(model), (ids, mask), file, dynamo=False)
        graphs.append([node.op_type for node in onnx.load_from_string(file.getvalue()).graph.node])
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("array", ["tensor", "numpy"])
def test_settings_of_arrays_that_print_alike_each_train_with_their_own_alphas(array):
    """Sections set by hand with α as a tensor or a NumPy array, two of them printing alike (a tensor prints four
    decimals, an array eight): each model trains with its own α, as patched with them, and keeps them."""
    alphas = [(1.0, 0.1234567891, 0.0, 0.0), (1.0, 0.1234567892, 0.0, 0.0)]
    if array == "tensor":
        alphas = [(1.0, 0.12341, 0.0, 0.0), (1.0, 0.12344, 0.0, 0.0)]
    array = functools.partial(torch.tensor, dtype=torch.float64) if array == "tensor" else np.array
    ids = tokens()

    def grads(model):
        model.double().train()(ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    for alpha in alphas:
        by_hand = patch_model(tiny("gpt2"), "score:1000")
        by_hand.config.span_attention = {**by_hand.config.span_attention, "alphas": array(alpha)}
        patched = patch_model(tiny("gpt2"), SpanAttentionConfig(alphas=alpha))
        for got, want in zip(grads(by_hand), grads(patched)):
            assert torch.equal(got, want)
        assert by_hand.config.span_attention == patched.config.span_attention


def test_layers_of_an_encoder_deeper_than_its_decoder_patch_without_a_warning():
    """layers=[2] selects the encoder's layer 2, yet reading the settings warned "the model has layers 0..1, so
    layers [2] do not exist and get no span gradients; no layer does" (the decoder's count). A layer past both
    towers still warns, naming the encoder's count."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*do not exist")
        model = patch_model(tiny_bert2gpt2(encoder_layers=3), "score:1000", layers=[2])
        assert registry.settings_for(model.encoder.encoder.layer[2].attention.self).label == "score:1000"
    model.config.span_attention = {**model.config.span_attention, "layers": [2, 3]}  # as edited in a config.json
    with pytest.warns(UserWarning, match=r"layers=\[2, 3\]: the model has layers 0..2, so layers \[3\] do not exist"):
        stored.config_of(model.config)
