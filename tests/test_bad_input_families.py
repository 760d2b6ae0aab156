"""Model families beyond the five of the suite (MLA, hybrids, sliding/global mixes, MoE, sparse attention): the
forward pass is stock SDPA's, and the gradients are the rule's on the attention each layer computes."""

from __future__ import annotations

import copy

import pytest
import torch
from models import VOCAB
from reference import reference
from transformers import AttentionInterface

from hf_spanattn import SpanAttentionConfig, patch_model
from hf_spanattn.integration import registry


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tokens(batch=2, length=24, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tiny_dsa():
    """DeepSeek-V3.2: MLA whose queries attend only the keys a lightning indexer selects (top 8 of 24)."""
    pytest.importorskip("transformers.models.deepseek_v32", reason="DeepSeek-V3.2 is not in this Transformers")
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV32Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, kv_lora_rank=16,
                               q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, head_dim=4,
                               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, index_topk=8,
                               index_head_dim=8, index_n_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._experts_implementation = "eager"  # the grouped matmul of the experts takes no float64
    return DeepseekV32ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64).train()


def trains_and_generates_as_stock(stock: torch.nn.Module) -> None:
    """Patched under standard:QKV111: the stock logits and gradients, and the same greedy generation."""
    ids = tokens()
    logits, expected = grads(stock, ids)
    model = patch_model(copy.deepcopy(stock), "standard:QKV111")
    patched_logits, patched = grads(model, ids)
    assert rel(patched_logits, logits) < 1e-12
    assert all(rel(patched[n], expected[n]) < 1e-10 for n in expected)
    stock.eval(), model.eval()
    prompt = ids[:, :10]
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False),
                       stock.generate(prompt, max_new_tokens=8, do_sample=False))


def test_sparse_attention_keeps_the_indexers_selection():
    """DeepSeek-V3.2 builds the mask of the keys its indexer selected for eager and SDPA attention only, and hands
    other attention functions the indices instead: span_attention took them as dense attention (logits 12 % off)."""
    trains_and_generates_as_stock(tiny_dsa())


def test_sparse_attention_rule_on_the_selected_keys(monkeypatch):
    """Under score:1000 each layer's dQ, dK, dV are the float64 reference's on the mask the model builds for SDPA
    (its causal mask without the keys the indexer left out)."""
    calls = []

    def recorder(module, query, key, value, attention_mask, **kwargs):
        for t in (query, key, value):
            t.retain_grad()
        indices = kwargs["indices"]
        left_out = torch.ones(*indices.shape[:2], key.shape[2], dtype=torch.bool).scatter(-1, indices.long(), False)
        call = dict(q=query, k=key, v=value, mask=attention_mask & ~left_out[:, None], scale=kwargs["scaling"])
        out, weights = registry.span_attention_forward(module, query, key, value, attention_mask, **kwargs)
        out.register_hook(lambda g: call.__setitem__("d_out", g.transpose(1, 2)))
        calls.append(call)
        return out, weights

    monkeypatch.setitem(AttentionInterface._global_mapping, "span_attention", recorder)
    model = patch_model(tiny_dsa(), "score:1000")
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 2
    for call in calls:
        assert not call["mask"].all()  # the indexer left keys out
        _, (dq, dk, dv) = reference(call["q"], call["k"], call["v"], call["d_out"],
                                    SpanAttentionConfig.from_label("score:1000"), attn_mask=call["mask"],
                                    scale=call["scale"])
        assert rel(call["q"].grad, dq) < 1e-10
        assert rel(call["k"].grad, dk) < 1e-10
        assert rel(call["v"].grad, dv) < 1e-10


def test_block_sparse_attention_keeps_the_indexers_blocks():
    """MiniMax-M3 builds the mask of the key blocks its indexer selected for eager and SDPA attention only, and hands
    other attention functions the block indices: span_attention took them as dense attention (logits 33 % off)."""
    pytest.importorskip("transformers.models.minimax_m3_vl", reason="MiniMax-M3 is not in this Transformers")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    torch.manual_seed(0)
    config = MiniMaxM3VLTextConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                                   num_local_experts=2, num_experts_per_tok=1, dense_intermediate_size=32,
                                   shared_intermediate_size=16, rotary_dim=4, index_n_heads=2, index_head_dim=8,
                                   index_block_size=4, index_topk_blocks=2, index_local_blocks=1, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0, layer_types=["minimax_m3_sparse"] * 2)
    config._experts_implementation = "eager"
    stock = MiniMaxM3VLForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64).train()
    trains_and_generates_as_stock(stock)


def test_a_hybrid_models_alphas_and_diagnostics_name_its_attention_layers_only(tmp_path):
    """LFM2's convolution layers carry a layer index and the config as its attention does: the callback logged α
    for them (span/layer0/alpha0, ...) as if they trained under the schedule's rule."""
    from transformers import Lfm2Config, Lfm2ForCausalLM, Trainer, TrainingArguments

    from hf_spanattn.training import Keyframe, SpanAttentionCallback

    torch.manual_seed(0)
    config = Lfm2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                        layer_types=["conv", "full_attention", "conv", "full_attention"],
                        block_auto_adjust_ff_dim=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = patch_model(Lfm2ForCausalLM(config), "score:1000")
    ids = tokens(batch=4)
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = SpanAttentionCallback([Keyframe(0, "standard:QKV111"), Keyframe(1, {"0-3": "score:1100"})],
                                     diagnostics_every=1)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    logged = {key.split("/")[1] for entry in trainer.state.log_history for key in entry if key.startswith("span/")}
    assert logged == {"layer1", "layer3"}
    last = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    assert [last[f"span/layer3/alpha{i}"] for i in range(4)] == [1, 1, 0, 0]


@pytest.mark.parametrize("grad", [False, True])
def test_kv_shared_layers_under_logits_to_keep(grad):
    """Gemma 4 feeds its KV-shared layers only the last `logits_to_keep` queries (as TRL's GRPO asks), slicing each
    mask's rows, which it skips under SDPA where a mask is None; span_attention's masks were None there, so those
    layers attended as SDPA's causal attention aligned to the first keys (logits 47 % off)."""
    pytest.importorskip("transformers.models.gemma4", reason="Gemma 4 is not in this Transformers")
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    torch.manual_seed(0)
    config = Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                              sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    stock = Gemma4ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    model = patch_model(copy.deepcopy(stock), "standard:QKV111")
    ids = tokens()
    with torch.set_grad_enabled(grad):
        assert rel(model(ids, logits_to_keep=4).logits, stock(ids, logits_to_keep=4).logits) < 1e-12


def test_selected_keys_without_a_mask_stay_causal():
    """Indices handed without a mask (SDPA's causal attention): a query attends the selected keys at or before it."""
    query = torch.zeros(1, 2, 4, 8)
    indices = torch.tensor([[[0, 3], [1, 3], [0, 2], [1, 3]]])
    mask = registry.selected_keys(None, indices, query, 4, True, torch.nn.Module())
    expected = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


def test_layers_do_not_reach_an_attention_shared_by_several_layers_and_say_so(caplog):
    """Zamba2, set up without patch_model (which refuses it): its shared attention carries layer_idx -1, so `layers`
    cannot select it. It keeps stock gradients, as a module without an index does, and now says so; it said nothing."""
    import logging

    from transformers import Zamba2Config, Zamba2ForCausalLM

    torch.manual_seed(0)
    config = Zamba2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                          intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, n_mamba_heads=4,
                          layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, chunk_size=8,
                          num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4, pad_token_id=0,
                          bos_token_id=0, eos_token_id=0)
    config.span_attention = SpanAttentionConfig.from_label("score:1000", layers=[1]).to_dict()
    registry.register()
    model = Zamba2ForCausalLM._from_config(config, attn_implementation="span_attention", dtype=torch.float64)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("sdpa")
    registry.logger.warning_once.cache_clear()
    ids = tokens()
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        _, got = grads(model.train(), ids)
    _, expected = grads(stock.train(), ids)
    assert all(rel(got[n], expected[n]) < 1e-10 for n in expected)
    assert any("carries no layer index, so layers=[1] cannot select it" in r.getMessage() for r in caplog.records)


def tiny_unflagged(family: str) -> torch.nn.Module:
    """A 4-layer model of a family whose class leaves Transformers' attention-backend flag False though its attention
    is plain self-attention numbered by layer (the hybrids' attention at layers 1 and 3; every layer elsewhere)."""
    import transformers

    common = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
    moe = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    mamba = dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=4, mamba_n_groups=1, mamba_expand=1,
                 mamba_chunk_size=8)
    configs = {
        "jamba": lambda: transformers.JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, num_experts=2,
                                                  expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4,
                                                  mamba_d_conv=2, mamba_expand=1, mamba_dt_rank=4,
                                                  use_mamba_kernels=False),
        "bamba": lambda: transformers.BambaConfig(**common, **mamba, attn_layer_indices=[1, 3]),
        "falcon_h1": lambda: transformers.FalconH1Config(**common, **mamba, mamba_d_ssm=32, head_dim=8),
        "nemotron_h": lambda: transformers.NemotronHConfig(**common, hybrid_override_pattern="M*M*", head_dim=8,
                                                           mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=4,
                                                           n_groups=1, chunk_size=8),
        "qwen3_next": lambda: transformers.Qwen3NextConfig(**common, **moe, **linear, head_dim=8,
                                                           layer_types=["linear_attention", "full_attention"] * 2),
        "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**common, **linear, head_dim=8,
                                                               layer_types=["linear_attention", "full_attention"] * 2),
        "stablelm": lambda: transformers.StableLmConfig(**common, hidden_dropout=0.0, attention_dropout=0.0),
        "biogpt": lambda: transformers.BioGptConfig(**common, hidden_dropout_prob=0.0, activation_dropout=0.0,
                                                    attention_probs_dropout_prob=0.0),
    }
    try:
        config = configs[family]()
    except AttributeError:
        pytest.skip(f"{family} is not in this Transformers")
    config._experts_implementation = "eager"  # the grouped matmul of the experts takes no float64
    cls = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    assert not cls._supports_attention_backend, f"{cls.__name__} declares the flag now: the test means one without it"
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa", dtype=torch.float64).train()


UNFLAGGED = ["jamba", "bamba", "falcon_h1", "nemotron_h", "qwen3_next", "qwen3_5_text", "stablelm", "biogpt"]


@pytest.mark.parametrize("family", UNFLAGGED)
def test_plain_self_attention_is_patched_without_the_backend_flag(family, monkeypatch):
    """Hybrids (Jamba, Bamba, Qwen3-Next, Qwen3.5, ...), StableLM and BioGPT call the registry with every argument
    but leave the attention-backend flag False, and patch_model refused them. Patched: the stock logits, gradients
    and generation; under score:1000 on the last layer, that layer's dQ, dK, dV are the float64 reference's and the
    other attention layers' are the standard gradient."""
    stock = tiny_unflagged(family)
    trains_and_generates_as_stock(stock)
    calls = []

    def recorder(module, query, key, value, attention_mask, **kwargs):
        for t in (query, key, value):
            t.retain_grad()
        call = dict(q=query, k=key, v=value, mask=attention_mask, scale=kwargs["scaling"], index=module.layer_idx)
        out, weights = registry.span_attention_forward(module, query, key, value, attention_mask, **kwargs)
        out.register_hook(lambda g: call.__setitem__("d_out", g.transpose(1, 2)))
        calls.append(call)
        return out, weights

    monkeypatch.setitem(AttentionInterface._global_mapping, "span_attention", recorder)
    model = patch_model(copy.deepcopy(stock), "score:1000", layers=[3])
    ids = tokens()
    model(ids, labels=ids).loss.backward()
    assert 3 in [call["index"] for call in calls]
    for call in calls:
        label = "score:1000" if call["index"] == 3 else "standard:QKV111"
        _, (dq, dk, dv) = reference(call["q"], call["k"], call["v"], call["d_out"],
                                    SpanAttentionConfig.from_label(label), attn_mask=call["mask"],
                                    scale=call["scale"], is_causal=call["mask"] is None)
        assert max(rel(call["q"].grad, dq), rel(call["k"].grad, dk), rel(call["v"].grad, dv)) < 1e-10


def test_a_hybrids_layers_without_attention_are_refused_by_name():
    """Jamba's layers 0 and 2 are Mamba layers: `layers=[0]` selects no attention, and the error names the layers
    that have it."""
    with pytest.raises(ValueError, match=r"layers=\[0\]: JambaForCausalLM has no attention module of layer 0; its "
                                         r"attention modules carry the layer indices 1, 3"):
        patch_model(tiny_unflagged("jamba"), "score:1000", layers=[0])


def test_an_attention_shared_by_several_layers_is_still_refused():
    """Zamba2's attention, shared by its hybrid layers, carries no layer index (-1): patch_model refuses it, naming
    the module, since `layers` could not select it."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    config = Zamba2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4,
                          intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, n_mamba_heads=4,
                          layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, chunk_size=8,
                          num_mem_blocks=2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match=r"Zamba2ForCausalLM does not declare .* plain self-attention numbered by "
                                         r"layer, but its attention module model\..*self_attn carries no layer index"):
        patch_model(Zamba2ForCausalLM(config), "score:1000")


def test_an_attention_module_serving_several_layers_is_refused():
    """One attention module placed at two depths (its layer index that of one of them) cannot be selected by layer:
    a model that does not declare the attention-backend flag is refused, naming the module."""
    stock = tiny_unflagged("stablelm")
    stock.model.layers[3].self_attn = stock.model.layers[1].self_attn
    with pytest.raises(ValueError, match=r"its attention module model\.layers\.3\.self_attn serves several layers"):
        patch_model(stock, "score:1000")


def test_an_attention_passing_a_position_bias_is_refused_by_patch_model():
    """Inkling's attention hands the attention function its learned relative position bias (`position_bias=`),
    which span_attention does not take: the model was patched and failed at its first training step; patch_model
    refuses it, naming the module and the argument."""
    pytest.importorskip("transformers.models.inkling", reason="Inkling is not in this Transformers")
    from transformers.models.inkling.configuration_inkling import InklingTextConfig
    from transformers.models.inkling.modeling_inkling import InklingForCausalLM

    config = InklingTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                               head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
                               sliding_window_size=8, d_rel=4, rel_extent=16, intermediate_size=64,
                               moe_intermediate_size=16, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
                               vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match=r"InklingForCausalLM does not declare .* its attention module "
                                         r"model\.layers\.0\.self_attn passes the attention function a relative "
                                         r"position bias \('position_bias'\)"):
        patch_model(InklingForCausalLM(config), "score:1000")


def test_a_vision_language_model_refused_for_its_vision_tower_names_the_tower_to_patch_alone():
    """Qwen3.5's vision blocks carry no layer index, so the whole model is refused; its language model is plain
    self-attention, and the error says to patch that tower alone, which then trains as stock under standard:QKV111."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
                vocab_size=VOCAB, max_position_embeddings=64, head_dim=8, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=0, eos_token_id=0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2)
    torch.manual_seed(0)
    stock = Qwen3_5ForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    model = copy.deepcopy(stock)
    with pytest.raises(ValueError, match=r"model\.visual\.blocks\.0\.attn carries no layer index; its tower "
                                         r"model\.language_model \(Qwen3_5TextModel\) can be patched alone: "
                                         r"patch_model\(model\.model\.language_model, \.\.\.\)"):
        patch_model(model, "standard:QKV111")
    patch_model(model.model.language_model, "standard:QKV111")
    ids = tokens()
    logits, expected = grads(stock, ids)
    patched_logits, got = grads(model, ids)
    assert rel(patched_logits, logits) < 1e-12
    assert all(rel(got[n], expected[n]) < 1e-10 for n in expected)
