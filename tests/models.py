"""Tiny models of each supported family, built from configs (nothing is downloaded)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import transformers
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    GPT2Config,
    GPTNeoConfig,
    GPTNeoXConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

VOCAB = 97


def tiny_config(family: str, layers: int = 2) -> PretrainedConfig:
    """The config of a tiny `family` model without dropout, vocabulary VOCAB, token 0 for BOS and EOS."""
    if family == "gpt2":
        return GPT2Config(n_embd=32, n_head=4, n_layer=layers, vocab_size=VOCAB, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if family == "gpt_neo":
        return GPTNeoConfig(hidden_size=32, num_heads=4, num_layers=layers, vocab_size=VOCAB,
                            attention_types=[[["global", "local"], layers // 2]] if layers > 1 else [[["global"], 1]],
                            max_position_embeddings=64, window_size=6, resid_dropout=0.0, embed_dropout=0.0,
                            attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    if family == "gpt_neox":
        return GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=layers, intermediate_size=64,
                             vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                             bos_token_id=0, eos_token_id=0)
    kwargs = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    if family == "llama":
        return LlamaConfig(**kwargs)
    if family == "qwen2":
        return Qwen2Config(**kwargs)
    if family == "gpt_oss":  # attention sinks: not SDPA's attention, so not supported
        from transformers import GptOssConfig

        return GptOssConfig(**{**kwargs, "intermediate_size": 32}, head_dim=8, num_local_experts=2,
                            num_experts_per_tok=1, layer_types=["full_attention"] * layers)
    raise ValueError(family)


def tiny(family: str, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family, layers)
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)  # not from_config: under ZeRO-3 that partitions it
    if family == "gpt2":  # as recipes/run_clm.py makes it: no loss_type warning, its tied head re-tied on load
        recipes = str(pathlib.Path(__file__).parents[1] / "recipes")
        sys.path[:0] = [] if recipes in sys.path else [recipes]
        from run_clm import stock_causal_lm

        stock_causal_lm(model)
    return model


def tiny_llava(patch_size: int = 8, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A vision tower (CLIP, whose attention carries no layer index) of (16 / patch_size)² patches, beside a Llama
    text model; image token VOCAB."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=patch_size, projection_dim=32)
    text = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=64, vocab_size=VOCAB + 1, max_position_embeddings=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB, vision_feature_layer=-1)
    return LlavaForConditionalGeneration(config).to(dtype).train()


FAMILIES = ["gpt2", "gpt_neo", "gpt_neox", "llama", "qwen2"]


def tiny_bert2gpt2(encoder_layers: int = 2, decoder_layers: int = 2) -> torch.nn.Module:
    """An EncoderDecoderModel of a BERT encoder and a GPT-2 decoder with cross-attention, without dropout."""
    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderConfig, EncoderDecoderModel

    needs_attention_backend(BertModel, BertLMHeadModel)
    torch.manual_seed(0)
    encoder = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=encoder_layers, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    decoder = GPT2Config(n_embd=16, n_head=2, n_layer=decoder_layers, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, add_cross_attention=True, is_decoder=True, bos_token_id=0,
                         eos_token_id=0)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return EncoderDecoderModel(config)


def route_hub(monkeypatch, fake, *modules) -> None:
    """Hub calls of Transformers' `modules` go to `fake` (`hf_api()` in Transformers 5, the functions imported by
    name in Transformers 4)."""
    for module in modules:
        if hasattr(module, "hf_api"):
            monkeypatch.setattr(module, "hf_api", lambda: fake)
            continue
        for name in ("create_repo", "create_commit", "upload_folder", "model_info"):
            if hasattr(module, name) and hasattr(fake, name):
                monkeypatch.setattr(module, name, getattr(fake, name))


def needs_attention_backend(*classes: type) -> None:
    """Skips the test where one of `classes` does not declare attention-backend support in the installed Transformers
    (BERT and DistilBERT, for one, declare it from Transformers 4.57 on), since `patch_model` refuses such a model."""
    missing = [cls.__name__ for cls in classes if not cls._supports_attention_backend]
    if missing:
        pytest.skip(f"{', '.join(missing)}: no attention-backend support declared in Transformers "
                    f"{transformers.__version__}")
