"""Bad input gets a clear error that names the field, the file or the path, and what is allowed.

One table: (case, callable taking a scratch folder, exception type, message fragment). The
fragment `{tmp}` stands for the scratch folder, so that a message is seen to name the file.
"""

from __future__ import annotations

import copy
import decimal
import json
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from models import VOCAB, needs_attention_backend, tiny, tiny_llava
from reference import reference
from transformers import AutoModelForCausalLM, GPT2Config

from hf_spanattn import SpanAttentionConfig, load_pretrained, patch_model, span_attention, unpatch_model
from hf_spanattn.integration.stored import config_of
from hf_spanattn.training import Keyframe, OrderRecorder, Schedule, SpanAttentionCallback
from hf_spanattn.training.diagnostics import reduce_over_ranks

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "recipes"))

import report  # noqa: E402
import run_clm  # noqa: E402
import run_identity  # noqa: E402
import sweep  # noqa: E402

needs_data = pytest.mark.skipif(not (DATA / "gpt2-tokenizer").is_dir(), reason="needs ../shared/data")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def stored(value):
    config = GPT2Config()
    config.span_attention = value
    return config


SECTION = SpanAttentionConfig().to_dict()


def stored_with(**fields):
    return stored({**SECTION, **fields})


def qkv(t: int = 5):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, t, 4, generator=gen, requires_grad=True) for _ in range(3)]


def weights_alone(tmp: Path) -> Path:
    """A patched tiny GPT-2's weights saved to `tmp/weights` without its config, as Accelerate's save_model does."""
    from safetensors.torch import save_file

    (tmp / "weights").mkdir()
    save_file({k: v.contiguous() for k, v in patch_model(tiny("gpt2")).state_dict().items() if k != "lm_head.weight"},
              tmp / "weights" / "model.safetensors")
    return tmp / "weights"


def saved_model(tmp: Path, **fields) -> Path:
    """A patched tiny GPT-2 saved to `tmp/model`, its config.json's span_attention then edited by hand."""
    model = tiny("gpt2")
    patch_model(model, "score:1000")
    model.save_pretrained(tmp / "model")
    config = json.loads((tmp / "model" / "config.json").read_text())
    config["span_attention"].update(fields)
    (tmp / "model" / "config.json").write_text(json.dumps(config))
    return tmp / "model"


def adapter(tmp: Path, **fields) -> Path:
    """A LoRA adapter of a patched tiny GPT-2 saved to `tmp/adapter`, its adapter_config.json then edited by hand."""
    from peft import LoraConfig, get_peft_model

    model = patch_model(AutoModelForCausalLM.from_pretrained(saved_model(tmp)), "score:1100")
    get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"])).save_pretrained(tmp / "adapter")
    config = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    (tmp / "adapter" / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return tmp / "adapter"


def named_adapter(tmp: Path, name: str) -> Path:
    """A LoRA adapter named `name` of a patched tiny GPT-2, saved to `tmp/out` (by PEFT, into `tmp/out/<name>`)."""
    from peft import LoraConfig, get_peft_model

    model = patch_model(AutoModelForCausalLM.from_pretrained(saved_model(tmp)), "score:1100")
    get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"]), adapter_name=name).save_pretrained(tmp / "out")
    return tmp / "out"


def train_step_after_from_pretrained(folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="span_attention")
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()


def from_pretrained_in(tmp: Path, name: str, cwd_folder: str | None = None):
    """SpanAttentionConfig.from_pretrained(name), from inside `tmp` (where `cwd_folder` exists)."""
    import os

    if cwd_folder:
        (tmp / cwd_folder).mkdir()
    old = os.getcwd()
    os.chdir(tmp)
    try:
        return SpanAttentionConfig.from_pretrained(name)
    finally:
        os.chdir(old)


def sweep_file(tmp: Path, config) -> Path:
    return write(tmp / "sweep.yaml", "" if config is None else yaml.safe_dump(config))


def sweep_with(**changes):
    base = {"output_dir": "runs", "args": {"n_embd": 32}, "spans": ["score:1000"], "seeds": [0],
            "shapes": [{"n_head": 2, "n_layer": 1}]}
    return {**base, **changes}


def metrics(tmp: Path, folder: str, span: str, seed: int = 0, text: str | None = None) -> Path:
    data = {"span": span, "min_val_loss": 1.0, "final_train_loss": 1.0, "eval_history": [],
            "config": {"training": {"seed": seed}}}
    return write(tmp / "runs" / folder / f"seed{seed}" / "metrics.json", text if text is not None else json.dumps(data))


def tiny_text(tmp: Path, train_words: int, validation_words: int) -> str:
    write(tmp / "data" / "train.txt", " the cat sat" * train_words)
    write(tmp / "data" / "validation.txt", " the dog ran" * validation_words)
    return str(tmp / "data")


def link(path: Path, target: Path) -> Path:
    path.symlink_to(target)
    return path


def run_tiny(tmp: Path, data_dir: str, **flags) -> None:
    args = {"data_dir": data_dir, "tokenizer_name": str(DATA / "gpt2-tokenizer"), "n_embd": 16, "n_head": 1,
            "n_layer": 1, "block_size": 16, "output_dir": str(tmp / "out"), **flags}
    run_clm.main([f"--{k}={v}" for k, v in args.items()])


def resume_with_saved(tmp: Path, saved: dict | None, wanted: dict, checkpoint: bool = True):
    out = tmp / "out"
    if checkpoint:  # a complete checkpoint: the Trainer writes trainer_state.json last
        (out / "checkpoint-3").mkdir(parents=True)
        (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    if saved is not None:
        run_identity.write_config(out, saved)
    return run_identity.resume_point(str(out), wanted, None, overwrite=False)


def trainer_with(tmp: Path, *callbacks, model: torch.nn.Module | None = None):
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    model = patch_model(tiny("gpt2"), "score:1000") if model is None else model
    return Trainer(model=model, train_dataset=[{"input_ids": i, "labels": i}
                                                                               for i in ids],
                   args=TrainingArguments(str(tmp), max_steps=1, per_device_train_batch_size=4, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True),
                   callbacks=list(callbacks))


def beside(folder: Path, name: str, text: str) -> Path:
    """`folder` with its file `name` replaced by `text` (a hand edit)."""
    write(folder / name, text)
    return folder


def edited_text(folder: Path, old: str, new: str) -> Path:
    """`folder` with the first `old` in its config.json replaced by `new` (a hand edit that JSON tools would undo)."""
    path = folder / "config.json"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    return folder


def settings_replaced_by_a_folder(folder: Path) -> Path:
    (folder / "span_attention_config.json").unlink()
    (folder / "span_attention_config.json").mkdir()
    return folder


def set_after(callback: SpanAttentionCallback, **attributes) -> SpanAttentionCallback:
    for name, value in attributes.items():
        setattr(callback, name, value)
    return callback


def appended(callback: SpanAttentionCallback, keyframe: object) -> SpanAttentionCallback:
    """The callback's schedule changed in place after it was made: `keyframe` appended, or (None) the list emptied."""
    if keyframe is None:
        callback.schedule.keyframes.clear()
    else:
        callback.schedule.keyframes.append(keyframe)
    return callback


def sinks_forward() -> None:
    """GPT-OSS set to span_attention without patch_model (as from_pretrained(attn_implementation=...) does)."""
    from hf_spanattn.integration import register

    register()
    model = tiny("gpt_oss").eval()
    model.config._attn_implementation = "span_attention"
    model(torch.zeros(1, 4, dtype=torch.long))


def paligemma_around_gemma2() -> torch.nn.Module:
    """A composite model whose own class supports SDPA around a language model that does not (logit soft-capping)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    text = dict(model_type="gemma2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_hidden_layers=1, intermediate_size=32, vocab_size=VOCAB + 2, attn_logit_softcapping=5.0)
    vision = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32, image_size=8,
                  patch_size=4)
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=VOCAB + 1, projection_dim=32)
    return PaliGemmaForConditionalGeneration._from_config(config, attn_implementation="eager")


def blip2_around_t5() -> torch.nn.Module:
    """A composite model that declares attention-backend support around a language model that does not (T5)."""
    from transformers import Blip2Config, Blip2ForConditionalGeneration, T5Config

    vision = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32, image_size=8,
                  patch_size=4)
    qformer = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
                   encoder_hidden_size=32)
    text = T5Config(vocab_size=VOCAB + 1, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    config = Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text, num_query_tokens=4,
                         image_token_index=VOCAB)
    return Blip2ForConditionalGeneration(config)


def mllama_text_and_cross_attention() -> torch.nn.Module:
    """Mllama: text layer 0 self-attention, layer 1 cross-attention to the image."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = dict(hidden_size=32, attention_heads=4, num_hidden_layers=1, num_global_layers=1, intermediate_size=32,
                  image_size=8, patch_size=4, max_num_tiles=1, intermediate_layers_indices=[0], vision_output_dim=64,
                  supported_aspect_ratios=[[1, 1]])
    text = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32,
                vocab_size=VOCAB, cross_attention_layers=[1], pad_token_id=0)
    if not hasattr(MllamaConfig().text_config, "rope_parameters"):  # Transformers 4 builds no default rope_scaling
        text["rope_scaling"] = {"rope_type": "default"}
    return MllamaForConditionalGeneration(MllamaConfig(vision_config=vision, text_config=text, image_token_index=1))


def record_with_one_recorder(*calls) -> None:
    """Backward passes of span_attention with (heads, label) each, all probed by one OrderRecorder."""
    recorder = OrderRecorder()
    for heads, label in calls:
        leaves = [x.detach().repeat(1, heads // 2, 1, 1).requires_grad_() for x in qkv()]
        span_attention(*leaves, config=label, probe=recorder).sum().backward()


def hand_record(**changes) -> dict:
    """A probe record of one call of 2 heads and 4 orders as span_attention gives it, some entries changed."""
    part = torch.ones(1, 2, 1, 3, 4)
    return {"dq": part, "dk": part, "dq_orders": [part] * 4, "dk_orders": [part] * 4, "dq_standard": part,
            "dk_standard": part, "rank_k": torch.ones(1, 2, 1), "rank_v": torch.ones(1, 2, 1), **changes}


RUN = {"model": {"n_embd": 32}, "data": {"block_size": 32}, "span": {"span": "standard:QKV111"},
       "training": {"seed": 0, "learning_rate": 1e-3, "output_dir": "a"}}

CASES = [
    # patch_model and the settings on the model config
    ("patch_model layers=[]", lambda t: patch_model(tiny("gpt2"), "score:1000", layers=[]), ValueError,
     "layers=[] selects no layer"),
    ("config layers=()", lambda t: SpanAttentionConfig(layers=()), ValueError, "at least one layer index"),
    ("config layers=3", lambda t: SpanAttentionConfig(layers=3), ValueError, "layers=3"),
    ("patch_model layers a 0-d tensor", lambda t: patch_model(tiny("gpt2"), "score:1000", layers=torch.tensor(1)),
     ValueError, "layers=tensor(1): expected None (all layers) or a sequence of non-negative integer"),
    ("patch_model config=0", lambda t: patch_model(tiny("gpt2"), 0), TypeError,
     "config=0 (int): expected a SpanAttentionConfig, a label string"),
    ("patch_model config=123", lambda t: patch_model(tiny("gpt2"), 123), TypeError, "or None"),
    ("patch_model config=dict", lambda t: patch_model(tiny("gpt2"), {"method": "score"}), TypeError,
     "config={'method': 'score'}"),
    ("span_attention entry a string", lambda t: config_of(stored("score:1000")), TypeError,
     "'span_attention' = 'score:1000': expected a dict"),
    ("span_attention entry a list", lambda t: config_of(stored(["score", [1, 0, 0, 0]])), TypeError,
     "'span_attention' = ['score', [1, 0, 0, 0]]: expected a dict"),
    ("from_dict of a list", lambda t: SpanAttentionConfig.from_dict(["score"]), TypeError, "expected a dict"),
    # the stored section: every field of every JSON type gets an error naming the field (tests/test_properties.py)
    ("stored alphas a nested list", lambda t: config_of(stored_with(alphas=[[1], [0], [0], [0]])), ValueError,
     "model config field 'span_attention': alphas=[[1], [0], [0], [0]]: expected a sequence of 4 numbers"),
    ("stored alphas a dict", lambda t: config_of(stored_with(alphas={"a0": 1})), ValueError, "alphas={'a0': 1}"),
    ("stored layers a nested list", lambda t: config_of(stored_with(layers=[[0, 1]])), ValueError,
     "layers=[[0, 1]]: expected None (all layers) or a sequence of non-negative integer layer indices"),
    ("stored method a dict", lambda t: config_of(stored_with(method={"name": "score"})), ValueError,
     "method={'name': 'score'}: allowed values are standard, simple, reductionistic, score"),
    ("stored version a list", lambda t: config_of(stored_with(hf_spanattn_version=[0, 1, 0])), ValueError,
     "hf_spanattn_version=[0, 1, 0]: expected the version string"),
    ("stored version not a version", lambda t: config_of(stored_with(hf_spanattn_version="latest")), ValueError,
     "hf_spanattn_version='latest'"),
    ("stored layers true after layers 1 (equal keys)",
     lambda t: [config_of(stored_with(layers=[1])), config_of(stored_with(layers=[True]))], ValueError,
     "layers=[True]"),
    ("stored alpha true after alpha 1 (equal keys)",
     lambda t: [config_of(stored_with(alphas=[1, 0, 0, 0])), config_of(stored_with(alphas=[True, 0, 0, 0]))],
     ValueError, "alphas=[True, 0, 0, 0]: expected a sequence of 4 numbers"),
    ("stored alphas strings", lambda t: config_of(stored_with(alphas=["1", "0", "0", "0"])), ValueError,
     "alphas=['1', '0', '0', '0']"),
    ("load_pretrained of a hand-edited config.json", lambda t: load_pretrained(saved_model(t, alphas=[[1, 0, 0, 0]])),
     ValueError, "{tmp}/model/config.json, field 'span_attention': alphas=[[1, 0, 0, 0]]: expected a sequence"),
    ("load_pretrained of a layers dict", lambda t: load_pretrained(saved_model(t, layers={"0": True})),
     ValueError, "{tmp}/model/config.json, field 'span_attention': layers={'0': True}"),
    ("from_pretrained span_attention of a hand-edited config.json",
     lambda t: train_step_after_from_pretrained(saved_model(t, qkv_alphas={"q": 1})), ValueError,
     "{tmp}/model/config.json, field 'span_attention': qkv_alphas={'q': 1}: expected a sequence of 3 numbers"),
    ("load_pretrained of layers outside the model", lambda t: load_pretrained(saved_model(t, layers=[0, 9])),
     ValueError, "{tmp}/model/config.json, field 'span_attention': layers=[0, 9]: GPT2LMHeadModel has layers 0..1"),
    ("load_pretrained config a dict", lambda t: load_pretrained(str(t), {"method": "score"}), TypeError,
     "load_pretrained: config={'method': 'score'} (dict): expected a SpanAttentionConfig"),
    # span_attention's config, as patch_model takes it
    ("span_attention config a dict", lambda t: span_attention(*qkv(), config={"method": "score"}), TypeError,
     "span_attention: config={'method': 'score'} (dict): expected a SpanAttentionConfig, a label string such as "
     "'score:1000', or None (the default, score:1000) (for a dict of fields: SpanAttentionConfig.from_dict(...))"),
    ("span_attention config an int", lambda t: span_attention(*qkv(), config=1000), TypeError,
     "span_attention: config=1000 (int): expected a SpanAttentionConfig"),
    ("span_attention a bad label", lambda t: span_attention(*qkv(), config="score:12"), ValueError,
     "alphas=(1.0, 2.0): expected 4 values"),
    ("span_attention a label with a space", lambda t: span_attention(*qkv(), config="score: 1000"), ValueError,
     "label='score: 1000': expected '<method>:<alphas>"),
    ("alphas holding a signaling NaN Decimal", lambda t: SpanAttentionConfig(alphas=[decimal.Decimal("sNaN"), 0, 0, 0]),
     ValueError, "alphas=[Decimal('sNaN'), 0, 0, 0]: expected a sequence of 4 numbers"),
    ("OrderRecorder.summary per_head a string", lambda t: OrderRecorder().summary(per_head="no"), TypeError,
     "OrderRecorder.summary: per_head='no': expected True or False"),
    ("reduce_over_ranks given a None", lambda t: reduce_over_ranks([None]), TypeError,
     "reduce_over_ranks: recorders=a list holding ['NoneType']: expected a list of OrderRecorder"),
    ("reduce_over_ranks given one recorder", lambda t: reduce_over_ranks(OrderRecorder()), TypeError,
     "reduce_over_ranks: recorders=OrderRecorder: expected a list of OrderRecorder"),
    ("method a 0-d NumPy array", lambda t: SpanAttentionConfig(method=np.array("score")), ValueError,
     "method=array('score', dtype='<U5'): allowed values are standard, simple, reductionistic, score, as a str"),
    ("score_grad a 0-d NumPy array", lambda t: SpanAttentionConfig(score_grad=np.array("exact")), ValueError,
     "score_grad=array('exact', dtype='<U5'): allowed values are exact, per_block, as a str"),
    ("layers a range too long for a list", lambda t: SpanAttentionConfig(layers=range(10**20)), ValueError,
     "layers=range(0, 100000000000000000000): expected None (all layers) or a sequence"),
    ("layers a range too long for memory", lambda t: SpanAttentionConfig(layers=range(10**18)), ValueError,
     "layers=range(0, 1000000000000000000): expected None (all layers) or a sequence"),  # was: a bare MemoryError
    ("span_attention probe not callable", lambda t: span_attention(*qkv(), probe=1), TypeError,
     "span_attention: probe must be callable (an OrderRecorder) or None, got int"),
    ("span_attention float8 with span gradients", lambda t: span_attention(*[x.to(torch.float8_e5m2) for x in qkv()]),
     ValueError, "span gradients take float16, bfloat16, float32 or float64 query, key and value, got "
     "torch.float8_e5m2"),
    ("span_attention probe with more keys than queries",
     lambda t: span_attention(qkv(3)[0], *qkv(6)[1:], config="standard:QKV110", probe=OrderRecorder()), ValueError,
     "a probe splits the gradient into the orders of span violation, which needs self-attention with as many "
     "queries as keys, got 3 queries and 6 keys"),
    ("one OrderRecorder for layers of two head counts",
     lambda t: record_with_one_recorder((2, "score:1000"), (4, "score:1000")), ValueError,
     "OrderRecorder: a recorder gathers one layer's figures under one rule; it holds 2 heads and 4 orders, and this "
     "call has 4 heads and 4 orders"),
    ("one OrderRecorder for two rules", lambda t: record_with_one_recorder((2, "score:1000"), (2, "simple:10")),
     ValueError, "it holds 2 heads and 4 orders, and this call has 2 heads and 2 orders"),
    # orders of another rule, as many, were added to the sums silently
    ("one OrderRecorder for two rules of as many orders",
     lambda t: record_with_one_recorder((2, "score:1000"), (2, "reductionistic:1100")), ValueError,
     "OrderRecorder: a recorder gathers one layer's figures under one rule; it holds those of score@exact and this "
     "call is 'reductionistic@exact'"),
    ("one OrderRecorder for two score readings",
     lambda t: record_with_one_recorder((2, "standard:QKV111"), (2, "score:1000@per_block")), ValueError,
     "it holds those of standard@exact and this call is 'score@per_block'"),
    ("load_pretrained of a folder that is not there", lambda t: load_pretrained(t / "no-such-model"),
     FileNotFoundError, "load_pretrained: {tmp}/no-such-model: no such folder; expected a saved model's folder"),
    ("load_pretrained of a folder of weights alone (accelerator.save_model)",
     lambda t: load_pretrained(weights_alone(t)), FileNotFoundError,
     "load_pretrained: {tmp}/weights holds no config.json (nor a PEFT adapter's adapter_config.json): weights alone, "
     "as accelerator.save_state and save_model write them?"),
    ("load_pretrained of a model's config.json", lambda t: load_pretrained(saved_model(t) / "config.json"),
     FileNotFoundError, "load_pretrained: {tmp}/model/config.json: a file; expected a saved model's folder"),
    ("span_attention probe a class", lambda t: span_attention(*qkv(), probe=OrderRecorder), TypeError,
     "span_attention: probe must be callable (an OrderRecorder) or None, got the class OrderRecorder (pass an "
     "instance)"),
    ("unpatch_model of a string", lambda t: unpatch_model("model"), TypeError,
     "unpatch_model needs a transformers PreTrainedModel"),
    ("load_pretrained model_class a string", lambda t: load_pretrained(str(saved_model(t)), model_class="gpt2"),
     TypeError, "load_pretrained: model_class='gpt2': expected a Transformers model class with from_pretrained"),
    ("load_pretrained of a vision-language model by the default model_class",  # was Transformers' list of classes
     lambda t: load_pretrained(patch_model(tiny_llava()).save_pretrained(t) or t), ValueError,
     "holds a saved LlavaForConditionalGeneration, which model_class=AutoModelForCausalLM does not load; pass the "
     "class it was saved as (model_class=LlavaForConditionalGeneration, from transformers)"),
    ("save_pretrained into a file", lambda t: SpanAttentionConfig().save_pretrained(write(t / "c.json", "{}")),
     FileExistsError, "save_directory='{tmp}/c.json' is a file; expected a folder"),
    ("save_pretrained of ''", lambda t: SpanAttentionConfig().save_pretrained(""), TypeError,
     "SpanAttentionConfig.save_pretrained: save_directory='': expected a folder"),
    ("save_pretrained of None", lambda t: SpanAttentionConfig().save_pretrained(None), TypeError,
     "save_directory=None: expected a folder"),
    ("load_pretrained is_trainable a string", lambda t: load_pretrained(saved_model(t), is_trainable="no"), TypeError,
     "load_pretrained: is_trainable='no': expected True or False"),
    ("load_pretrained with attn_implementation='eager'",
     lambda t: load_pretrained(saved_model(t), attn_implementation="eager"), ValueError,
     "load_pretrained: attn_implementation='eager': the model it loads is patched, so its attention is "
     "'span_attention' (whose forward pass is SDPA's); leave the argument out"),
    ("load_pretrained of an adapter with attn_implementation='sdpa'",
     lambda t: load_pretrained(adapter(t), attn_implementation="sdpa"), ValueError,
     "load_pretrained: attn_implementation='sdpa': the model it loads is patched"),
    ("folder that holds a non-default adapter below it", lambda t: load_pretrained(named_adapter(t, "mine")),
     FileNotFoundError, "load_pretrained: {tmp}/out holds no model and no adapter, but the adapter folders ['mine'] "
     "(PEFT saves an adapter not named 'default' into a subfolder of its name): load one of them, e.g. "
     "load_pretrained('{tmp}/out/mine', adapter_name='mine')"),
    ("adapter of a base model that moved",
     lambda t: load_pretrained(adapter(t, base_model_name_or_path=str(t / "gone"))), FileNotFoundError,
     "{tmp}/adapter/adapter_config.json, field 'base_model_name_or_path' = '{tmp}/gone': no such folder"),
    ("adapter without a base model", lambda t: load_pretrained(adapter(t, base_model_name_or_path=None)), ValueError,
     "{tmp}/adapter/adapter_config.json, field 'base_model_name_or_path' = None: expected the base model's folder"),
    ("adapter of a base model ''", lambda t: load_pretrained(adapter(t, base_model_name_or_path="")), ValueError,
     "field 'base_model_name_or_path' = '': expected"),
    ("from_pretrained of None", lambda t: SpanAttentionConfig.from_pretrained(None), TypeError,
     "SpanAttentionConfig.from_pretrained: name_or_path=None: expected a folder"),
    ("from_pretrained of ''", lambda t: SpanAttentionConfig.from_pretrained(""), TypeError, "name_or_path=''"),
    # SpanAttentionConfig fields of unusual types
    ("config alphas a bool", lambda t: SpanAttentionConfig(alphas=(True, False, False, False)), ValueError,
     "alphas=(True, False, False, False): expected a sequence of 4 numbers"),
    ("config alphas inf", lambda t: SpanAttentionConfig(alphas=(1, float("inf"), 0, 0)), ValueError, "finite"),
    ("config alphas a 0-d tensor", lambda t: SpanAttentionConfig(method="simple", alphas=torch.tensor(1.0)), ValueError,
     "alphas=tensor(1.): expected a sequence of 2 numbers (α∥, α⊥)"),
    ("config qkv_alphas a 0-d array", lambda t: SpanAttentionConfig(qkv_alphas=np.array(1.0)), ValueError,
     "qkv_alphas=array(1.): expected a sequence of 3 numbers (α_Q, α_K, α_V)"),
    ("config alphas a set (no order)", lambda t: SpanAttentionConfig(method="simple", alphas={1, 0}), ValueError,
     "alphas={0, 1}: expected a sequence of 2 numbers"),
    ("config layers a string", lambda t: SpanAttentionConfig(layers="0,1"), ValueError, "layers='0,1'"),
    ("config layers floats", lambda t: SpanAttentionConfig(layers=[0.0, 1.0]), ValueError, "layers=[0.0, 1.0]"),
    ("config method in capitals", lambda t: SpanAttentionConfig(method="Score"), ValueError,
     "method='Score': allowed values are standard, simple, reductionistic, score"),
    ("label with a bad number", lambda t: SpanAttentionConfig.from_label("score:1e,0,0,0"), ValueError,
     "'1e,0,0,0' is not a list of numbers"),
    # SpanAttentionConfig.from_pretrained
    ("from_pretrained ./typo", lambda t: from_pretrained_in(t, "./no-such-recipe"), FileNotFoundError,
     "./no-such-recipe: no such file or folder"),
    ("from_pretrained absolute typo", lambda t: SpanAttentionConfig.from_pretrained(t / "no-such"),
     FileNotFoundError, "{tmp}/no-such: no such file or folder"),
    ("from_pretrained a/b/c", lambda t: from_pretrained_in(t, "runs/recipe/typo"), FileNotFoundError,
     "runs/recipe/typo: no such file"),
    ("from_pretrained in a local folder", lambda t: from_pretrained_in(t, "runs/typo", cwd_folder="runs"),
     FileNotFoundError, "runs/typo: no such file or folder"),
    ("from_pretrained folder without the file", lambda t: SpanAttentionConfig.from_pretrained(t), FileNotFoundError,
     "{tmp}: the folder has no span_attention_config.json"),
    ("from_pretrained corrupt JSON",
     lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", '{"method": "sco')), ValueError,
     "{tmp}/c.json: not valid JSON"),
    ("from_pretrained JSON list", lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", "[1]")),
     ValueError, "{tmp}/c.json: expected a JSON object"),
    ("from_pretrained empty file", lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", "")),
     ValueError, "{tmp}/c.json: not valid JSON"),
    ("from_pretrained binary file",
     lambda t: SpanAttentionConfig.from_pretrained([(t / "c.json").write_bytes(b"\x80\x81{"), t / "c.json"][1]),
     ValueError, "{tmp}/c.json: not valid JSON (UnicodeDecodeError"),
    ("from_pretrained deeply nested JSON",
     lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", "[" * 100_000 + "]" * 100_000)),
     ValueError, "{tmp}/c.json: not valid JSON (RecursionError"),
    ("from_pretrained an integer too long to read",
     lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", '{"layers": [' + "9" * 5000 + "]}")), ValueError,
     "{tmp}/c.json: not valid JSON (ValueError: Exceeds the limit (4300 digits)"),
    ("from_pretrained a field of the wrong type",
     lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", '{"alphas": "1000"}')), ValueError,
     "{tmp}/c.json: alphas='1000': expected a sequence of 4 numbers"),
    ("from_pretrained a version that is not one",
     lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", '{"hf_spanattn_version": 1}')), ValueError,
     "{tmp}/c.json: hf_spanattn_version=1: expected the version string"),
    ("from_pretrained a model folder", lambda t: SpanAttentionConfig.from_pretrained(saved_model(t)),
     FileNotFoundError, "a saved model keeps its settings in config.json: hf_spanattn.load_pretrained reads them"),
    # schedules
    ("epoch keyframe without a data length", lambda t: Keyframe("1ep", "score:1000").step(10, None), ValueError,
     "needs training data with a length"),
    ("keyframe at nan%", lambda t: Keyframe("nan%", "score:1000").step(10, 5), ValueError, "finite"),
    ("keyframe at a bool", lambda t: Keyframe(True, "score:1000").step(10, 5), ValueError, "keyframe at=True"),
    ("keyframe ramp a string", lambda t: Keyframe(5, "score:1000", ramp="false"), ValueError,
     "keyframe ramp='false': expected True or False"),
    ("keyframe span a list", lambda t: Keyframe(0, ["score:1000"]).settings(2), ValueError,
     "keyframe span=['score:1000']: expected a label or a {layers: label} table"),
    ("callback diagnostics_every a bool", lambda t: SpanAttentionCallback(diagnostics_every=True), ValueError,
     "diagnostics_every=True: expected an integer >= 0"),
    ("callback diagnostics_per_head a string", lambda t: SpanAttentionCallback(diagnostics_per_head="no"), ValueError,
     "diagnostics_per_head='no': expected True or False"),
    ("callback diagnostics_file a number", lambda t: SpanAttentionCallback(diagnostics_file=7), ValueError,
     "diagnostics_file=7: expected a file name"),
    ("schedule a label", lambda t: Schedule("score:1000"), ValueError,
     "schedule: expected a list of keyframes (Keyframe or dicts with 'at', 'span'), got 'score:1000'"),
    ("keyframe from a list", lambda t: Keyframe.from_dict(["at", "span"]), ValueError,
     "schedule keyframe ['at', 'span']: expected keys 'at', 'span'"),
    ("callback schedule a label", lambda t: SpanAttentionCallback(schedule="score:1000"), ValueError,
     "schedule='score:1000': expected a Schedule or a list of keyframes"),
    ("layer range reversed", lambda t: Keyframe(0, {"1-0": "score:1000"}).settings(2), ValueError,
     "layer spec '1-0': expected '*', 'a-b' with a <= b, or 'a,b,c'"),
    ("layer range left open", lambda t: Keyframe(0, {"0-": "score:1000"}).settings(2), ValueError,
     "layer spec '0-': expected"),
    ("keyframe at a share above 100%", lambda t: Keyframe("120%", "score:1000").step(10, None), ValueError,
     "keyframe at='120%': a share of training is at most '100%'"),
    ("callback diagnostics_file '.'", lambda t: SpanAttentionCallback(diagnostics_file="."), ValueError,
     "diagnostics_file='.': expected a file name"),
    ("callback diagnostics_file a folder path", lambda t: SpanAttentionCallback(diagnostics_file=Path("logs") / ".."),
     ValueError, "diagnostics_file=PosixPath('logs/..'): expected a file name"),
    ("callback diagnostics_file ending in /", lambda t: SpanAttentionCallback(diagnostics_file="logs/"), ValueError,
     "diagnostics_file='logs/': expected a file name"),
    ("keyframe table names a layer twice",
     lambda t: Keyframe(0, {"0-1": "score:1000", "1": "standard:QKV111"}).settings(2), ValueError,
     "keyframe span={'0-1': 'score:1000', '1': 'standard:QKV111'}: layer 1 is named by both '0-1' and '1'"),
    ("keyframe table key names a layer twice", lambda t: Keyframe(0, {"0,0": "score:1000"}).settings(2), ValueError,
     "keyframe span={'0,0': 'score:1000'}: '0,0' names layer 0 twice; name each layer once"),
    ("callback diagnostics_file with a NUL", lambda t: SpanAttentionCallback(diagnostics_file="a\0b"), ValueError,
     "diagnostics_file='a\\x00b': expected a file name"),
    ("callback add_to a model", lambda t: SpanAttentionCallback().add_to(tiny("gpt2")), TypeError,
     "SpanAttentionCallback.add_to: trainer=GPT2LMHeadModel: expected a transformers Trainer"),
    ("two span callbacks in one trainer", lambda t: trainer_with(t, SpanAttentionCallback([Keyframe(0, "score:1000")]),
                                                                 SpanAttentionCallback()).train(), ValueError,
     "SpanAttentionCallback: the trainer holds 2 of them; their schedules and diagnostics would overwrite each other"),
    # models whose attention is not SDPA's
    ("patch_model of a model with attention sinks", lambda t: patch_model(tiny("gpt_oss")), ValueError,
     "GptOssForCausalLM does not support SDPA attention in Transformers (its attention has parts SDPA lacks"),
    ("patch_model of a model holding one without SDPA", lambda t: patch_model(paligemma_around_gemma2()), ValueError,
     "PaliGemmaForConditionalGeneration holds Gemma2Model, which does not support SDPA attention in Transformers"),
    ("patch_model of a Trainer", lambda t: patch_model(trainer_with(t, model=tiny("gpt2"))), TypeError,
     "got Trainer; give it the model the Trainer holds, its .model"),
    ("patch_model of a model holding one without attention-backend support",  # was taken: T5 failed in training
     lambda t: patch_model(blip2_around_t5()), ValueError,
     "Blip2ForConditionalGeneration holds T5ForConditionalGeneration, which does not declare Transformers' "
     "attention-backend support"),
    ("patch_model layers naming a cross-attention layer only",  # was taken: no layer got span gradients
     lambda t: patch_model(mllama_text_and_cross_attention(), "score:1000", layers=[1]), ValueError,
     "layers=[1]: layer 1 of MllamaForConditionalGeneration holds cross-attention only, which keeps SDPA's gradient "
     "(span rules need self-attention); its self-attention modules carry the layer indices 0"),
    ("attention sinks under attn_implementation='span_attention'", lambda t: sinks_forward(), NotImplementedError,
     "span_attention does not support attention sinks ('s_aux', attention of GptOssAttention)"),
    # sweep.py
    ("sweep empty YAML", lambda t: sweep.main([str(sweep_file(t, None))]), SystemExit, "got an empty file"),
    ("sweep YAML a list", lambda t: sweep.main([str(sweep_file(t, ["score:1000"]))]), SystemExit,
     "expected a mapping with output_dir"),
    ("sweep invalid YAML", lambda t: sweep.main([str(write(t / "s.yaml", "spans: [a\n"))]), SystemExit,
     "{tmp}/s.yaml: not valid YAML"),
    ("sweep shapes a dict", lambda t: sweep.plan(sweep_with(shapes={"n_head": 2, "n_layer": 1})), ValueError,
     "shapes={'n_head': 2, 'n_layer': 1}: expected a list of mappings"),
    ("sweep spans a string", lambda t: sweep.plan(sweep_with(spans="score:1000")), ValueError,
     "spans='score:1000': expected a list of span labels"),
    ("sweep seeds a string", lambda t: sweep.plan(sweep_with(seeds="01")), ValueError,
     "seeds='01': expected a list of integer seeds"),
    ("sweep seeds empty", lambda t: sweep.plan(sweep_with(seeds=[])), ValueError, "seeds is empty"),
    ("sweep args a list", lambda t: sweep.plan(sweep_with(args=["--n_embd=32"])), ValueError,
     "args=['--n_embd=32']: expected a mapping"),
    ("sweep a bad label", lambda t: sweep.plan(sweep_with(spans=["score:12"])), ValueError, "expected 4 values"),
    # report.py
    ("report truncated metrics.json",
     lambda t: report.load_runs(metrics(t, "H1xL1/score-1000", "score:1000", text='{"span": "sc').parents[3]),
     ValueError, "{tmp}/runs/H1xL1/score-1000/seed0/metrics.json: not valid JSON"),
    ("report two runs of one setting",
     lambda t: [metrics(t, "H1xL1/score-1000", "score:1000"), metrics(t, "H1xL1/score-1_0_0_0", "score:1000"),
                report.load_runs(t / "runs")], ValueError, "are both span score:1000 with seed 0"),
    # run_clm.py and the run identity
    ("run_clm empty train file", lambda t: run_tiny(t, tiny_text(t, 0, 50)), ValueError,
     "{tmp}/data/train.txt is empty"),
    ("run_clm max_train_tokens=0", lambda t: run_tiny(t, tiny_text(t, 50, 50), max_train_tokens=0), ValueError,
     "--max_train_tokens 0: expected at least 2 tokens"),
    pytest.param("run_clm block_size above the data", lambda t: run_tiny(t, tiny_text(t, 50, 50), block_size=400),
                 ValueError, "{tmp}/data/train.txt: its 150 train tokens make no block of --block_size 400",
                 marks=needs_data),
    pytest.param("run_clm output_dir past the system's path length",  # was: OSError "File name too long" from a stat
                 lambda t: run_tiny(t, tiny_text(t, 50, 50), output_dir=t / "/".join(["d" * 200] * 21)), ValueError,
                 "bytes; the files a run writes in it (checkpoint-<step>/optimizer.pt, ...) need paths under",
                 marks=needs_data),
    pytest.param("run_clm output_dir a link to nothing",  # was: "--output_dir …: File exists", its target's folder made
                 lambda t: run_tiny(t, tiny_text(t, 50, 50), output_dir=link(t / "out", t / "gone" / "x")), ValueError,
                 "/out: a link to nothing (to {tmp}/gone/x); make the folder it leads to", marks=needs_data),
    pytest.param("run_clm validation shorter than a block", lambda t: run_tiny(t, tiny_text(t, 50, 3)), ValueError,
                 "{tmp}/data/validation.txt: its 9 validation tokens make no block of --block_size 16",
                 marks=needs_data),
    ("resume a run of other settings",
     lambda t: resume_with_saved(t, RUN, {**RUN, "span": {"span": "score:1000"}}), ValueError,
     "span.span: 'standard:QKV111' → 'score:1000'"),
    ("resume with another data source",
     lambda t: resume_with_saved(t, {**RUN, "data": {"data_dir": "/a"}}, {**RUN, "data": {"data_dir": "/b"}}),
     ValueError, "data.data_dir: '/a' → '/b'"),
    ("resume says how to start afresh",
     lambda t: resume_with_saved(t, RUN, {**RUN, "training": {"seed": 1}}), ValueError,
     "Start afresh with a new --output_dir, or with --overwrite_output_dir"),
    ("resume checkpoints of unknown settings", lambda t: resume_with_saved(t, None, RUN), ValueError,
     "{tmp}/out holds checkpoints but no run_config.json"),
    ("resume a run with a truncated run_config.json",
     lambda t: [write(t / "out" / "run_config.json", '{"model'), resume_with_saved(t, None, RUN, False)],
     ValueError, "{tmp}/out/run_config.json: not valid JSON"),
    # saved settings, adapters and callback state edited by hand or hostile
    ("stored version past Python's digit limit", lambda t: config_of(stored_with(hf_spanattn_version="9" * 5000)),
     ValueError, "field 'span_attention': hf_spanattn_version='9999"),
    ("from_pretrained a key given twice",
     lambda t: SpanAttentionConfig.from_pretrained(write(t / "c.json", '{"alphas": [1, 0, 0, 0], "alphas": [0]}')),
     ValueError, "{tmp}/c.json: the key 'alphas' is given twice in one object; keep one"),
    ("from_pretrained a misspelt keyword (read locally it was ignored: the folder's own settings)",
     lambda t: SpanAttentionConfig.from_pretrained(SpanAttentionConfig().save_pretrained(t), subfoldr="mine"),
     TypeError, "SpanAttentionConfig.from_pretrained: unexpected keyword argument(s) ['subfoldr']; expected those of "
     "huggingface_hub.hf_hub_download: cache_dir"),
    ("push_to_hub without a repository id", lambda t: SpanAttentionConfig().push_to_hub(None), TypeError,
     "SpanAttentionConfig.push_to_hub: repo_id=None: expected a Hub repository id"),
    ("save_pretrained pushing to an empty repository id",
     lambda t: SpanAttentionConfig().save_pretrained(t, push_to_hub=True, repo_id=" "), TypeError,
     "SpanAttentionConfig.push_to_hub: repo_id=' ': expected a Hub repository id"),
    ("push_to_hub private a string", lambda t: SpanAttentionConfig().push_to_hub("me/x", private="no"), TypeError,
     "SpanAttentionConfig.push_to_hub: private='no': expected True, False or None"),
    ("from_pretrained neither file nor folder", lambda t: SpanAttentionConfig.from_pretrained("/dev/null"),
     FileNotFoundError, "/dev/null: not a file or a folder; expected a folder or a span_attention_config.json file"),
    ("from_pretrained a name with a NUL", lambda t: SpanAttentionConfig.from_pretrained("run\0s/a"), TypeError,
     "SpanAttentionConfig.from_pretrained: name_or_path='run\\x00s/a': expected a folder"),
    ("save_pretrained a name with a NUL", lambda t: SpanAttentionConfig().save_pretrained(f"{t}/a\0b"), TypeError,
     "SpanAttentionConfig.save_pretrained: save_directory='{tmp}/a\\x00b': expected a folder"),
    ("save_pretrained push_to_hub a string", lambda t: SpanAttentionConfig().save_pretrained(t, push_to_hub="no"),
     TypeError, "SpanAttentionConfig.save_pretrained: push_to_hub='no': expected True or False"),
    ("save_pretrained into a broken link",
     lambda t: [(t / "link").symlink_to(t / "gone"), SpanAttentionConfig().save_pretrained(t / "link")],
     FileExistsError, "save_directory='{tmp}/link' is a symbolic link to nothing; expected a folder"),
    ("load_pretrained of None", lambda t: load_pretrained(None), TypeError,
     "load_pretrained: name_or_path=None: expected a saved model's folder, a PEFT adapter's folder or a Hub"),
    ("load_pretrained of a number", lambda t: load_pretrained(5), TypeError, "load_pretrained: name_or_path=5"),
    ("adapter settings whose layers are outside the base model",
     lambda t: load_pretrained(beside(adapter(t), "span_attention_config.json", '{"layers": [5]}')), ValueError,
     "{tmp}/adapter/span_attention_config.json: layers=[5]: GPT2LMHeadModel has layers 0..1"),
    ("adapter_config.json truncated", lambda t: load_pretrained(beside(adapter(t), "adapter_config.json", '{"base_mo')),
     ValueError, "{tmp}/adapter/adapter_config.json: PEFT cannot read it as an adapter config (JSONDecodeError"),
    ("adapter_config.json a list", lambda t: load_pretrained(beside(adapter(t), "adapter_config.json", "[]")),
     ValueError, "{tmp}/adapter/adapter_config.json: PEFT cannot read it as an adapter config (TypeError"),
    ("config.json whose settings give a key twice",
     lambda t: load_pretrained(edited_text(saved_model(t), '"method": "score"', '"method": "simple", "method": "score"'
                                           )),
     ValueError,
     "{tmp}/model/config.json, field 'span_attention': the key 'method' is given twice in one object; keep one"),
    ("config.json that gives the settings twice",
     lambda t: load_pretrained(edited_text(saved_model(t), '"span_attention": {',
                                           '"span_attention": {}, "span_attention": {')),
     ValueError, "{tmp}/model/config.json, field 'span_attention': the key 'span_attention' is given twice"),
    ("layer range far past the model", lambda t: Keyframe(0, {"0-99999999999": "score:1000"}).settings(2), ValueError,
     "layer spec '0-99999999999': layers 0-99999999999 are outside 0..1"),
    ("callback diagnostics_every set to a string after it was made",
     lambda t: trainer_with(t, set_after(SpanAttentionCallback(diagnostics_every=1), diagnostics_every="1")).train(),
     ValueError, "SpanAttentionCallback: diagnostics_every='1': expected an integer >= 0 (0 = off) (an attribute set "
     "after the callback was made, or restored from a checkpoint's trainer_state.json"),
    ("callback schedule set to a label after it was made",
     lambda t: trainer_with(t, set_after(SpanAttentionCallback(), schedule="score:1000")).train(), ValueError,
     "SpanAttentionCallback: schedule='score:1000': expected a Schedule or a list of keyframes"),
    ("callback schedule given an entry that is no keyframe after it was made",
     lambda t: trainer_with(t, appended(SpanAttentionCallback([Keyframe(0, "score:1000")]), "x")).train(), ValueError,
     "SpanAttentionCallback: schedule keyframe 'x': expected keys 'at', 'span' and optionally 'ramp'"),
    ("callback schedule emptied after it was made",
     lambda t: trainer_with(t, appended(SpanAttentionCallback([Keyframe(0, "score:1000")]), None)).train(), ValueError,
     "SpanAttentionCallback: schedule: needs at least one keyframe"),
    ("settings read from a model's config.json", lambda t: SpanAttentionConfig.from_pretrained(
        saved_model(t, alphas=[1, 1, 0, 0]) / "config.json"), ValueError,
     "{tmp}/model/config.json: a model's config, not a span_attention_config.json; a saved model keeps its settings in "
     "the field 'span_attention' of its config.json, which hf_spanattn.load_pretrained reads"),
    ("settings file that is a folder", lambda t: SpanAttentionConfig.from_pretrained(
        (t / "span_attention_config.json").mkdir() or t), FileNotFoundError,
     "{tmp}/span_attention_config.json: not a file (a folder, a pipe or a symbolic link to nothing)"),
    ("adapter settings file that is a folder", lambda t: load_pretrained(settings_replaced_by_a_folder(adapter(t))),
     FileNotFoundError, "{tmp}/adapter/span_attention_config.json: not a file"),
    ("settings saved through a link into a missing folder", lambda t: SpanAttentionConfig().save_pretrained(
        (t / "span_attention_config.json").symlink_to(t / "gone" / "settings.json") or t), FileNotFoundError,
     "{tmp}/span_attention_config.json (a symbolic link to {tmp}/gone/settings.json): the folder {tmp}/gone does not "
     "exist"),
    ("settings from a folder with a subfolder that is not there", lambda t: SpanAttentionConfig.from_pretrained(
        t, subfolder="mine"), FileNotFoundError, "{tmp}/mine: no such folder"),
    ("settings from a folder with a subfolder of another type", lambda t: SpanAttentionConfig.from_pretrained(
        t, subfolder=3), TypeError, "subfolder=3: expected a folder inside {tmp}"),
    ("schedule resolved for a negative number of steps",  # named the keyframe: "at='50%': must be … not negative"
     lambda t: Schedule([Keyframe(0, "score:1000"), Keyframe("50%", "score:1100")]).resolve(-4, None, 2), ValueError,
     "schedule: max_steps=-4: expected an int ≥ 0"),
    ("schedule resolved for zero steps per epoch",  # said both keyframes fall on step 0
     lambda t: Schedule([Keyframe(0, "score:1000"), Keyframe("1ep", "score:1100")]).resolve(10, 0, 2), ValueError,
     "schedule: steps_per_epoch=0: expected an int ≥ 1 or None (training data without a length)"),
    # a bad label in one keyframe of many named only the alphas it parsed to
    ("keyframe with a bad label", lambda t: Schedule([Keyframe(0, "score:1000"), Keyframe(5, "score:9")]).resolve(
        10, None, 2), ValueError, "keyframe at=5 span='score:9': label='score:9': alphas=(9.0,): expected 4"),
    ("keyframe with a bad label in its layer table", lambda t: Keyframe("50%", {"0": "score:1000", "1": "simple:1"})
     .settings(2), ValueError,
     "keyframe at='50%' span={'0': 'score:1000', '1': 'simple:1'}: label='simple:1': alphas=(1.0,)"),
    ("keyframe of a settings object", lambda t: Keyframe(0, SpanAttentionConfig.from_label("score:1100")).settings(2),
     ValueError, "expected a label (a SpanAttentionConfig: its .label, 'score:1100') or a {layers: label} table"),
    ("keyframe with a layer table naming layers outside the model",  # named the layer spec alone
     lambda t: Keyframe("50%", {"0": "score:1000", "1-3": "score:1100"}).settings(2), ValueError,
     "keyframe at='50%' span={'0': 'score:1000', '1-3': 'score:1100'}: layer spec '1-3': layers 1-3 are outside 0..1"),
    # a schedule asked for its settings as a custom training loop would: Python's "missing 'step'", or a TypeError
    # from inside the loop over the keyframes
    ("schedule asked for the settings at a step without its resolved keyframes",
     lambda t: Schedule([Keyframe(0, "score:1000")]).at_step(3), TypeError,
     "Schedule.at_step: frames=3: expected the keyframes that Schedule.resolve gives; call "
     "Schedule.at_step(schedule.resolve(max_steps, steps_per_epoch, n_layers), step)"),
    ("schedule settings at a step from frames=None", lambda t: Schedule.at_step(None, 3), TypeError,
     "Schedule.at_step: frames=None: expected the keyframes that Schedule.resolve gives"),
    ("schedule settings at a step given as a string",
     lambda t: Schedule.at_step(Schedule([Keyframe(0, "score:1000"), Keyframe(5, "score:1100")]).resolve(10, None, 2),
                                "3"), TypeError, "Schedule.at_step: step='3': expected the optimizer step (a number)"),
    # a keyframe asked directly: the counts it is given are checked as resolve checks them
    ("keyframe step for a negative max_steps", lambda t: Keyframe("50%", "score:1000").step(-4, None), ValueError,
     "keyframe: max_steps=-4: expected an int ≥ 0"),  # named at='50%'
    ("keyframe epoch for zero steps per epoch", lambda t: Keyframe("1ep", "score:1000").step(10, 0), ValueError,
     "keyframe: steps_per_epoch=0: expected an int ≥ 1 or None"),  # gave step 0
    ("keyframe settings for a negative layer count", lambda t: Keyframe(0, "score:1000").settings(-1), ValueError,
     "keyframe: n_layers=-1: expected an int ≥ 0"),  # gave {}
    ("keyframe settings for a float layer count", lambda t: Keyframe(0, "score:1000").settings(2.0), ValueError,
     "keyframe: n_layers=2.0: expected an int ≥ 0"),  # Python's "'float' object cannot be interpreted as an integer"
    ("keyframe table entries for a string layer count", lambda t: Keyframe(0, {"0": "score:1000"}).entries("2"),
     ValueError, "keyframe: n_layers='2': expected an int ≥ 0"),
    ("OrderRecorder given a record without the probe's keys",
     lambda t: OrderRecorder()({"dq": torch.zeros(1, 2, 1, 3, 4)}), TypeError,
     "lacks dk, dq_orders, dk_orders, dq_standard, dk_standard, rank_k, rank_v: expected the dict that "
     "span_attention's backward pass gives its probe"),  # was: KeyError: 'dq_orders'
    ("OrderRecorder given a record of 4-D tensors", lambda t: OrderRecorder()(hand_record(dq=torch.ones(1, 2, 3, 4))),
     TypeError, "record['dq'], record['dq_standard'] and each of record['dq_orders'] (a list): expected tensors of one "
     "shape (B, H_kv, g, T, d) as span_attention's probe gets them, got (1, 2, 3, 4)"),  # was: IndexError
    ("OrderRecorder given orders of other heads than the gradient",  # were added up silently
     lambda t: OrderRecorder()(hand_record(dq_orders=[torch.ones(1, 4, 1, 3, 4)] * 4)), TypeError,
     "and [(1, 4, 1, 3, 4), (1, 4, 1, 3, 4), (1, 4, 1, 3, 4), (1, 4, 1, 3, 4)]"),
    ("OrderRecorder given orders as one tensor",
     lambda t: OrderRecorder()(hand_record(dk_orders=torch.ones(1, 2, 1, 3, 4))), TypeError,
     "record['dk_orders'] (a list): expected tensors of one shape"),  # was: IndexError
    ("OrderRecorder given ranks as a number", lambda t: OrderRecorder()(hand_record(rank_k=1.0)), TypeError,
     "OrderRecorder: record['rank_k'], record['rank_v']: expected tensors, got float, Tensor"),
    ("OrderRecorder given no record", lambda t: OrderRecorder()(None), TypeError,
     "OrderRecorder: record=None: expected the dict that span_attention's backward pass gives its probe, with keys dq"),
    ("callback asked for the schedule's settings before training",  # gave {}, as without a schedule
     lambda t: SpanAttentionCallback([Keyframe(0, "score:1000"), Keyframe("50%", "score:1100")]).settings_at(3),
     ValueError, "SpanAttentionCallback.settings_at: the schedule's steps are known once training starts"),
]


def _id(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


@pytest.mark.parametrize("name,call,error,fragment", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_gets_a_clear_error(name, call, error, fragment, tmp_path):
    with pytest.raises(error) as err:
        call(tmp_path)
    assert fragment.replace("{tmp}", str(tmp_path)) in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("call", [
    lambda t: SpanAttentionConfig.from_pretrained(write(t / "span_attention_config.json", json.dumps([0] * 100_000))),
    lambda t: SpanAttentionConfig.from_dict({"method": "x" * 100_000}),
    lambda t: SpanAttentionConfig.from_label("score:" + "1" * 100_000),
    lambda t: SpanAttentionConfig.from_dict({"alphas": [0.5] * 100_000}),
], ids=["a settings file of a huge list", "a huge method", "a label of huge alphas", "huge alphas"])
def test_errors_cut_a_huge_value(call, tmp_path):
    """The error repeated the whole value: a message of several hundred kilobytes."""
    with pytest.raises((TypeError, ValueError)) as err:
        call(tmp_path)
    assert len(str(err.value)) < 1000 and "characters)" in str(err.value), str(err.value)[:300]


@pytest.mark.parametrize("data", [{"x" * 100_000: 1}, {"x": 1, "hf_spanattn_version": "0.1.0" + ".0" * 50_000}],
                         ids=["huge field", "huge version"])  # a version as old as this one, written long
def test_a_huge_unknown_field_is_cut_in_the_warning(data):
    with pytest.warns(UserWarning, match="ignoring unknown fields") as caught:
        assert SpanAttentionConfig.from_dict(data).label == "score:1000"
    assert len(str(caught[0].message)) < 1000


def test_huge_values_of_the_callback_and_the_backend_variable_are_cut(tmp_path, monkeypatch):
    """A diagnostics_file restored from a hand-edited trainer_state.json and HF_SPANATTN_BACKEND were repeated whole;
    100 000 keyframes past the end gave 100 000 warnings."""
    with pytest.raises(ValueError, match=r"diagnostics_file='a/a/a.*\.\.\. \(200002 characters\): expected") as err:
        SpanAttentionCallback(diagnostics_file="a/" * 100_000)
    assert len(str(err.value)) < 1000
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "x" * 100_000)
    q = torch.zeros(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"BACKEND='xxx.*\.\.\. \(100002 characters\): allowed values") as err:
        span_attention(q, q, q).sum().backward()
    assert len(str(err.value)) < 1000
    monkeypatch.delenv("HF_SPANATTN_BACKEND")
    keyframes = [Keyframe(0, "score:1100")] + [Keyframe(step, "score:1000") for step in range(2, 1002)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_with(tmp_path, SpanAttentionCallback(keyframes)).train()
    notes = [str(w.message) for w in caught if "never reached" in str(w.message)]
    assert len(notes) == 6 and notes[-1] == ("SpanAttentionCallback: 995 more keyframes are never reached: training "
                                             "ends after max_steps=1"), notes


@pytest.mark.parametrize("file", ["a" * 100_000, "a/" * 50_000 + "x", "../" * 50_000 + "x"])
def test_a_diagnostics_file_name_longer_than_any_path_is_refused_cut(file):
    """A name no system opens (as a hand-edited trainer_state.json may hold): the lock's OSError repeated it whole
    (100 000 characters), a deep one stopped the run with a RecursionError in os.makedirs naming nothing, and one
    leading outside the output dir was repeated whole in the warning."""
    with pytest.raises(ValueError, match=r"diagnostics_file='.*\.\.\. \(\d+ characters\): longer than a path may be "
                                         r"\(4096 bytes\)") as err:
        SpanAttentionCallback(diagnostics_every=1, diagnostics_file=file)
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("name", ["/x" * 100_000, "x" * 100_000])
def test_a_huge_base_model_name_in_an_adapter_config_is_cut(name, tmp_path):
    """adapter_config.json's base_model_name_or_path edited to 200 000 characters was repeated whole: by the package
    (a local path that is not there) and by huggingface_hub (a name that is no Hub id, once passed on)."""
    folder = adapter(tmp_path, base_model_name_or_path=name)
    with pytest.raises((FileNotFoundError, ValueError), match=r"adapter_config.json, field 'base_model_name_or_path' = "
                                                             r"'[/x]+\.\.\. \(\d+ characters\)") as err:
        load_pretrained(folder)
    assert len(str(err.value)) < 1500


def test_a_pipe_put_where_the_loaded_config_json_was_does_not_hang_patching(tmp_path):
    """The settings are parsed naming the config.json the model was loaded from, read again for that: a pipe put in
    its place (the folder reused) made patch_model wait for a writer for ever."""
    import os
    import threading

    folder = saved_model(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    done = threading.Thread(target=patch_model, args=(model,), daemon=True)
    done.start()
    done.join(timeout=30)
    if done.is_alive():
        with open(folder / "config.json", "w"):  # lets the read end, so that the thread ends
            pass
    assert not done.is_alive()
    assert config_of(model.config).label == "score:1000"


def test_same_settings_resume_and_a_fresh_folder_starts_afresh(tmp_path):
    """The counterpart of the table: no error where the settings agree (or nothing is there)."""
    assert resume_with_saved(tmp_path, RUN, {**RUN, "training": {**RUN["training"], "output_dir": "b"}}) \
        == str(tmp_path / "out" / "checkpoint-3")
    assert run_identity.resume_point(str(tmp_path / "new"), RUN, None, overwrite=False) is None


def test_span_attention_takes_a_label_or_none_as_patch_model_does():
    """config="score:1100" gives what the config object gives; None gives the default (score:1000)."""
    def grads(config):
        leaves = qkv(t=7)
        span_attention(*leaves, is_causal=True, config=config).square().sum().backward()
        return [x.grad for x in leaves]

    for label, same_as in (("score:1100", SpanAttentionConfig.from_label("score:1100")),
                           (None, SpanAttentionConfig())):
        for got, want in zip(grads(label), grads(same_as)):
            assert torch.equal(got, want)
    assert not torch.allclose(grads("score:1100")[0], grads(None)[0])  # the label is read, not ignored


def test_numpy_and_path_arguments_of_the_callback_save_as_json():
    """A NumPy step, a NumPy diagnostics interval and a Path file name work, and the callback's state (which
    the Trainer writes into trainer_state.json) stays JSON."""
    import numpy as np

    callback = SpanAttentionCallback(schedule=(Keyframe(np.int64(5), "score:1000"),
                                               Keyframe(6, {np.int64(0): "score:1100", torch.tensor(1): "simple:10"})),
                                     diagnostics_every=np.int64(2), diagnostics_file=Path("d.jsonl"))
    assert callback.schedule.keyframes[0].step(10, None) == 5
    assert json.loads(json.dumps(callback.state()))["args"] == {  # a layer key np.int64 failed the checkpoint save
        "schedule": [{"at": 5, "span": "score:1000", "ramp": False},
                     {"at": 6, "span": {"0": "score:1100", "1": "simple:10"}, "ramp": False}], "diagnostics_every": 2,
        "diagnostics_per_head": False, "diagnostics_file": "d.jsonl"}
    assert callback.schedule.keyframes[1].settings(2)[1].label == "simple:10"
    with pytest.raises(ValueError, match=r"keyframe span=\{Decimal\('0'\): 'score:1100'\}: layer key Decimal\('0'\) "
                                         r"\(Decimal\): expected a layer index \(int\) or a string of them"):
        Keyframe(0, {decimal.Decimal(0): "score:1100"})


def test_a_layer_table_changed_after_its_keyframe_is_made_is_checked_again():
    """A NumPy layer key put into a keyframe's table after the keyframe was made was not checked again by the callback,
    and failed the Trainer's checkpoint save (trainer_state.json) with json's TypeError."""
    import numpy as np

    keyframe = Keyframe(0, {"0": "score:1100"})
    keyframe.span[np.int64(1)] = "simple:10"
    callback = SpanAttentionCallback([keyframe])
    assert json.loads(json.dumps(callback.state()))["args"]["schedule"] == [
        {"at": 0, "span": {"0": "score:1100", "1": "simple:10"}, "ramp": False}]
    keyframe.span[decimal.Decimal(2)] = "simple:10"
    with pytest.raises(ValueError, match=r"layer key Decimal\('2'\) \(Decimal\): expected a layer index"):
        SpanAttentionCallback([keyframe])


def train_step(model) -> None:
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()


def set_on_patched(model, settings):
    patch_model(model, "score:1000")
    model.config.span_attention = settings
    train_step(model)


def set_in_config(model, settings):
    config = model.config.to_dict()
    config["span_attention"] = settings
    model = AutoModelForCausalLM.from_config(GPT2Config(**{**config, "attn_implementation": "span_attention"}))
    train_step(model)
    return model


@pytest.mark.parametrize("how", [
    lambda model, settings: [setattr(model.config, "span_attention", settings), patch_model(model)][1],
    lambda model, settings: [model.config.update({"span_attention": settings}), patch_model(model)][1],
    lambda model, settings: [set_on_patched(model, settings), model][1],
    set_in_config,
], ids=["set, then patch_model", "config.update, then patch_model", "set on a patched model, a training step",
        "GPT2Config(span_attention=...), attn_implementation, a training step"])
@pytest.mark.parametrize("kind", ["object", "numpy dict"])
def test_a_settings_object_put_on_the_model_config_saves_as_its_dict(how, kind, tmp_path):
    """A SpanAttentionConfig, or a dict of fields with NumPy values, put on model.config by hand is stored as the
    dict patch_model writes as soon as the package reads it, so that save_pretrained writes it (Transformers' JSON
    takes JSON types only) and it reloads equal."""
    settings = SpanAttentionConfig.from_label("score:1100", layers=[1])
    by_hand = settings if kind == "object" else {"method": np.str_("score"), "alphas": np.array([1.0, 1, 0, 0]),
                                                  "layers": [np.int64(1)], "qkv_alphas": np.ones(3, np.float32)}
    model = how(tiny("gpt2"), by_hand)
    assert model.config.span_attention == settings.to_dict()
    model.save_pretrained(tmp_path / "model")
    saved = json.loads((tmp_path / "model" / "config.json").read_text())["span_attention"]
    assert saved == settings.to_dict()
    assert config_of(load_pretrained(tmp_path / "model").config) == settings


@pytest.mark.parametrize("run", [
    lambda model, ids: model.eval()(ids),
    lambda model, ids: torch.no_grad()(model)(ids),
    lambda model, ids: model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0),
], ids=["eval", "no_grad", "generate"])
def test_bad_saved_settings_fail_at_the_first_forward_not_only_the_first_training_step(run, tmp_path):
    """A plain from_pretrained with attn_implementation="span_attention" reads nothing of ours until the first forward
    (Transformers has no hook for a config field); evaluation and generation, which run SDPA, still read the
    settings once and name the file and the field."""
    folder = saved_model(tmp_path, alphas=[1, 0])
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="span_attention")
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=f"{folder}/config.json, field 'span_attention': alphas=\\[1, 0\\]: expected "
                                         "4 values"):
        run(model, ids)
    model.config.span_attention = SpanAttentionConfig().to_dict()  # mended: evaluation runs
    run(model, ids)


def test_a_diagnostics_file_that_names_a_folder_fails_when_training_starts(tmp_path):
    """Not at the first diagnostics step, after training has run."""
    from transformers import Trainer, TrainingArguments

    (tmp_path / "logs").mkdir()
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=patch_model(tiny("gpt2"), "score:1000"), train_dataset=[{"input_ids": i, "labels": i}
                                                                                     for i in ids],
                      args=TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                                             use_cpu=True, save_strategy="no", disable_tqdm=True),
                      callbacks=[SpanAttentionCallback(diagnostics_every=1, diagnostics_file="logs")])
    with pytest.raises(ValueError, match=f"diagnostics_file='logs': {tmp_path}/logs is a folder; expected the name "
                                         "of the JSONL file"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("name", ["README.md", "config.json", "./trainer_state.json", "latest", "zero_to_fp32.py"])
def test_a_diagnostics_file_named_as_a_file_the_trainer_writes_is_refused(name, tmp_path):
    """Records written into README.md or config.json of the output dir were written over, without a word, by the
    Trainer's create_model_card or save_model; into `latest` or zero_to_fp32.py, by save_model under DeepSpeed ZeRO-3
    without stage3_gather_16bit_weights_on_model_save (DeepSpeed's checkpoint)."""
    trainer = trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1, diagnostics_file=name))
    with pytest.raises(ValueError, match=f"diagnostics_file='{name}' is a file that the Trainer writes into its "
                                         "output_dir \\(saving the model, its state, its metrics or its card\\), "
                                         "over the records; name another file"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / name).exists()


def test_a_diagnostics_file_reached_through_a_symbolic_link_is_checked_where_it_lands(tmp_path):
    """A link in the output dir to README.md, or to a checkpoint folder, took the records where the Trainer writes over
    or deletes them."""
    import os

    os.symlink(tmp_path / "README.md", tmp_path / "d.jsonl")
    (tmp_path / "checkpoint-1").mkdir()
    os.symlink(tmp_path / "checkpoint-1", tmp_path / "ck")
    with pytest.raises(ValueError, match=r"diagnostics_file='d.jsonl' \(through a symbolic link: README.md\) is a file "
                                         "that the Trainer writes into its output_dir"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1, diagnostics_file="d.jsonl")).train()
    with pytest.raises(ValueError, match=r"diagnostics_file='ck/d.jsonl' \(through a symbolic link: "
                                         r"checkpoint-1/d.jsonl\) lies in the folder checkpoint-1, a checkpoint"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1, diagnostics_file="ck/d.jsonl")).train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "ck", "d.jsonl"]


def test_a_settings_section_set_to_null_says_so(tmp_path):
    """config.json's "span_attention": null (a hand edit) warned that the field 'span_attention' was "not given, but a
    field 'span_attention' is, which is not read"."""
    model = tiny("gpt2")
    patch_model(model, "score:1100").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "span_attention": None}))
    with pytest.warns(UserWarning, match=f"{tmp_path}/config.json, field 'span_attention': null, which gives no "
                                         "settings; patching with the default score:1000") as warned:
        loaded = load_pretrained(tmp_path)
    assert config_of(loaded.config).label == "score:1000" and len(warned) == 1


def test_a_settings_save_into_a_folder_that_takes_no_file_names_the_settings_file(tmp_path, monkeypatch):
    """A folder where no file can be made (read-only, immutable): the error named only the partial file written
    beside the settings first; one that cannot replace them (a folder of that name) names them."""
    import builtins
    import os

    import hf_spanattn.config

    def refused(path, *args, **kwargs):
        if str(path).endswith(".partial"):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    SpanAttentionConfig().save_pretrained(tmp_path)
    monkeypatch.setattr(hf_spanattn.config, "open", refused, raising=False)
    saved = tmp_path / "span_attention_config.json"
    with pytest.raises(PermissionError, match=f"{saved}: cannot be saved \\(Permission denied when writing "
                                              f"{saved}.[0-9]+.partial beside it first\\)"):
        SpanAttentionConfig.from_label("score:1100").save_pretrained(tmp_path)
    assert SpanAttentionConfig.from_pretrained(tmp_path).label == "score:1000"
    monkeypatch.undo()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "span_attention_config.json").mkdir()
    with pytest.raises(IsADirectoryError, match=f"{tmp_path}/mine/span_attention_config.json: cannot be saved "
                                                r"\(Is a directory\)$"):
        SpanAttentionConfig().save_pretrained(tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == ["span_attention_config.json"]


def test_a_settings_save_onto_a_full_disk_names_the_settings_file_and_keeps_those_saved_before(tmp_path, monkeypatch):
    """A write that fails (a full disk, a file-size limit) raised the operating system's error alone: "[Errno 28] No
    space left on device", naming no file."""
    import builtins
    import errno

    import hf_spanattn.config

    def no_space(text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def full(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        f.write = no_space
        return f

    SpanAttentionConfig().save_pretrained(tmp_path)
    monkeypatch.setattr(hf_spanattn.config, "open", full, raising=False)
    saved = tmp_path / "span_attention_config.json"
    with pytest.raises(OSError, match=f"{saved}: cannot be saved \\(No space left on device when writing "
                                      f"{saved}.[0-9]+.partial beside it first\\)"):
        SpanAttentionConfig.from_label("score:1100").save_pretrained(tmp_path)
    monkeypatch.undo()
    assert SpanAttentionConfig.from_pretrained(tmp_path).label == "score:1000"
    assert [p.name for p in tmp_path.iterdir()] == ["span_attention_config.json"]


def test_load_pretrained_takes_layers_as_patch_model_does(tmp_path):
    """`layers=` is patch_model's argument; load_pretrained passes it on (to a model's or an adapter's base model)
    rather than to the model class, which refused it."""
    folder = saved_model(tmp_path)
    assert config_of(load_pretrained(folder, layers=[1]).config) == SpanAttentionConfig(layers=[1])
    assert config_of(load_pretrained(folder, "score:1100", layers=(0,)).config).label == "score:1100"
    peft_model = load_pretrained(adapter(tmp_path), layers=[np.int64(1)])
    assert config_of(peft_model.get_base_model().config) == SpanAttentionConfig.from_label("score:1100", layers=[1])
    with pytest.raises(ValueError, match=r"layers=\[5\]: GPT2LMHeadModel has layers 0..1"):
        load_pretrained(folder, layers=[5])


def test_integers_as_numpy_or_0d_tensors_and_decimal_alphas_are_taken_as_numbers():
    """An integer tensor's elements as layers, a 0-d tensor as a keyframe step or diagnostics interval, Decimal
    alphas: the same settings as with Python numbers, and the callback's state stays JSON."""
    from decimal import Decimal

    config = SpanAttentionConfig(alphas=[Decimal("1"), Decimal("0.5"), 0, 0], layers=torch.tensor([1, 0]))
    assert config == SpanAttentionConfig(alphas=(1, 0.5, 0, 0), layers=[0, 1])
    assert type(config.layers[0]) is int and type(config.alphas[1]) is float
    callback = SpanAttentionCallback(schedule=[Keyframe(torch.tensor(3), "score:1000")],
                                     diagnostics_every=torch.tensor(2))
    assert json.loads(json.dumps(callback.state()))["args"]["schedule"][0]["at"] == 3
    assert callback.diagnostics_every == 2 and callback.schedule.keyframes[0].step(10, None) == 3
    for refused in (torch.tensor([True]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="expected None \\(all layers\\) or a sequence of non-negative integer"):
            SpanAttentionConfig(layers=refused)


@pytest.mark.parametrize("encode", [lambda text: b"\xef\xbb\xbf" + text.encode(), lambda text: text.encode("utf-16")],
                         ids=["UTF-8 with a byte order mark", "UTF-16"])
def test_a_settings_file_saved_by_an_editor_reads_as_written(encode, tmp_path):
    """Windows editors write a byte order mark (Notepad) or UTF-16; the settings read as they were written."""
    settings = SpanAttentionConfig.from_label("score:1100", layers=[1])
    (tmp_path / "span_attention_config.json").write_bytes(encode(json.dumps(settings.to_dict())))
    assert SpanAttentionConfig.from_pretrained(tmp_path) == settings


def failing_writes(monkeypatch, folder: Path) -> None:
    """Every file opened for writing under `folder` takes half of its first write, then the disk is full (as a
    stop in the middle of a save leaves it)."""
    import builtins
    import errno

    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax") and str(file).startswith(str(folder)):
            write = f.write

            def half(data):
                write(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")

            f.write = half
        return f

    monkeypatch.setattr(builtins, "open", open_)


def test_a_hub_id_whose_settings_cannot_be_fetched_is_named(monkeypatch):
    """Offline, or a repository without the file: the name and the file, not only the Hub client's words."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot find the requested files in the local cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(OSError, match="someone/settings: no such local file or folder, and span_attention_config.json "
                                      "could not be fetched from a Hub repository of that name \\(LocalEntryNotFound"):
        SpanAttentionConfig.from_pretrained("someone/settings")


def test_hub_arguments_that_the_hub_client_cannot_take_are_named(monkeypatch):
    """from_pretrained("me/x", revision=5): huggingface_hub's TypeError ("expected string or bytes-like object, got
    'int'", from its regular expression on the revision) came through naming neither the argument nor the file."""
    import huggingface_hub

    def download(repo_id, filename, revision=None, token=None):  # as huggingface_hub 1.x does with a revision of 5
        raise TypeError(f"expected string or bytes-like object, got {type(revision).__name__!r}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(OSError, match="me/x: no such local file or folder, and span_attention_config.json could not "
                                      "be fetched from a Hub repository of that name with revision=5 \\(TypeError: "
                                      "expected string"):
        SpanAttentionConfig.from_pretrained("me/x", revision=5)
    with pytest.raises(OSError, match="with revision=5, token=<hidden> \\(TypeError") as err:
        SpanAttentionConfig.from_pretrained("me/x", revision=5, token="hf_mine")
    assert "hf_mine" not in str(err.value)


def test_an_adapter_save_that_selects_no_adapter_writes_no_settings(tmp_path):
    """PeftModel.save_pretrained(selected_adapters=[]) saves no adapter; the settings were written all the same (into
    the folder, as the default adapter's)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(patch_model(tiny("gpt2"), "score:1100"), LoraConfig(r=2, target_modules=["c_attn"]))
    model.save_pretrained(tmp_path / "none", selected_adapters=[])
    assert not (tmp_path / "none" / "span_attention_config.json").exists()
    model.save_pretrained(tmp_path / "all")
    assert SpanAttentionConfig.from_pretrained(tmp_path / "all").label == "score:1100"


@pytest.mark.parametrize("text", ['{"meth', "[]", '{"alphas": "1000"}', "a folder"])
def test_a_plain_peft_load_of_an_adapter_with_unreadable_settings_warns_and_loads(text, tmp_path):
    """PEFT itself needs nothing of the settings saved beside an adapter: a plain load into an unpatched model
    loads, and the warning that it trains with the standard gradient names the file and why it cannot be read (a
    folder in the file's place loaded without the warning)."""
    from peft import PeftModel

    folder = settings_replaced_by_a_folder(adapter(tmp_path)) if text == "a folder" else \
        beside(adapter(tmp_path), "span_attention_config.json", text)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with pytest.warns(UserWarning, match=f"{folder} holds span attention settings that cannot be read "
                                         f"\\({folder}/span_attention_config.json: .*not patched"):
        PeftModel.from_pretrained(base, folder)


def diagnosed_run(out: Path, max_steps: int, resume: str | None = None, learning_rate: float = 1e-2,
                  save_steps: int | None = 2, diagnostics_file: str | None = None, **arguments) -> None:
    """A tiny GPT-2 trained with diagnostics every step, a checkpoint every `save_steps` (None: none)."""
    from transformers import Trainer, TrainingArguments

    ids = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))  # more keys than head dims
    args = TrainingArguments(str(out), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=learning_rate,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0, logging_steps=1,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 1, **arguments)
    trainer = Trainer(model=patch_model(tiny("gpt2"), "score:1100"), args=args,
                      train_dataset=[{"input_ids": i, "labels": i} for i in ids])
    SpanAttentionCallback(diagnostics_every=1, diagnostics_file=diagnostics_file).add_to(trainer)
    trainer.train(resume_from_checkpoint=resume)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """Diagnostics of steps 1-4, checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("stopped") / "out"
    diagnosed_run(out, 4)
    return out


def copy_of(run: Path, tmp: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp / "out"))


def steps_in(path: Path) -> list:
    steps = []
    for line in path.read_bytes().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def test_a_resumed_run_keeps_lines_of_the_diagnostics_file_that_are_not_records(stopped_run, tmp_path):
    """A note, a line of other JSON and bytes that are not UTF-8, written into the diagnostics file by hand (or by a
    symbolic link to another file), and a byte order mark that an editor put before the first record: a resumed run
    keeps each as it is, says so, and drops only its records past the step it resumes from."""
    out = copy_of(stopped_run, tmp_path)
    path = out / "span_diagnostics.jsonl"
    records = path.read_bytes().splitlines(keepends=True)
    records[0] = b"\xef\xbb\xbf" + records[0]
    others = [b"my note\n", b'{"note": "steps 3-4 looked odd"}\n', b"\xff\xfe not text\n"]
    path.write_bytes(others[0] + b"".join(records[:4]) + others[1] + b"".join(records[4:]) + others[2])
    with pytest.warns(UserWarning, match=f"{path}: line\\(s\\) 1, 6, 11 are not diagnostics records; kept as they are"):
        diagnosed_run(out, 4, resume=str(out / "checkpoint-2"))
    lines = path.read_bytes().splitlines(keepends=True)
    assert [line for line in lines if line in others] == others
    assert steps_in(path) == [1, 1, 2, 2, 3, 3, 4, 4]


def test_a_rewrite_of_the_diagnostics_file_stopped_midway_leaves_it_whole(stopped_run, tmp_path, monkeypatch):
    """Records past the resume step above a line that is kept: the file is written anew, whole or not at all."""
    out = copy_of(stopped_run, tmp_path)
    path = out / "span_diagnostics.jsonl"
    path.write_bytes(path.read_bytes() + b"my note\n")
    before = path.read_bytes()
    failing_writes(monkeypatch, out)
    with pytest.raises(OSError, match="No space left"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that the note is kept: the test above
        diagnosed_run(out, 4, resume=str(out / "checkpoint-2"), save_steps=None)
    monkeypatch.undo()
    assert path.read_bytes() == before


def test_another_runs_diagnostics_are_moved_aside_when_a_run_resumes(stopped_run, tmp_path):
    """A second run in the same folder (another learning rate) stopped before its first checkpoint; resuming the
    first from its checkpoint finds the second's records up to its step: they are moved aside, not mixed in."""
    out = copy_of(stopped_run, tmp_path)
    with pytest.warns(UserWarning, match="earlier run"):
        diagnosed_run(out, 2, learning_rate=0.5, save_steps=None)
    second = (out / "span_diagnostics.jsonl").read_bytes()
    with pytest.warns(UserWarning, match=f"{out}/span_diagnostics.jsonl holds diagnostics that this run's checkpoint "
                                         "did not log \\(step 2\\), so they are another run's; this run resumes at "
                                         f"step 4, so they are moved to {out}/span_diagnostics.jsonl.replaced-2"):
        diagnosed_run(out, 5, resume=str(out / "checkpoint-4"))
    assert (out / "span_diagnostics.jsonl.replaced-2").read_bytes() == second
    assert steps_in(out / "span_diagnostics.jsonl") == [5, 5]
    assert steps_in(out / "span_diagnostics.jsonl.replaced-1") == [1, 1, 2, 2, 3, 3, 4, 4]  # the first run's


def unnumbered(family: str):
    """A tiny model whose attention modules carry no layer index, with an input batch (head dim 4 < T: the keys
    do not span the head space, so span rules differ from the standard gradient)."""
    from transformers import DistilBertConfig, DistilBertModel, ViTConfig, ViTModel

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if family == "distilbert":
        needs_attention_backend(DistilBertModel)
        model = DistilBertModel(DistilBertConfig(dim=32, n_heads=8, n_layers=2, hidden_dim=64, vocab_size=VOCAB,
                                                 max_position_embeddings=16, dropout=0.0, attention_dropout=0.0))
        return model, {"input_ids": torch.randint(0, VOCAB, (2, 12), generator=gen)}
    model = ViTModel(ViTConfig(hidden_size=32, num_attention_heads=8, num_hidden_layers=2, intermediate_size=64,
                               image_size=24, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return model, {"pixel_values": torch.randn(2, 3, 24, 24, generator=gen)}


@pytest.mark.parametrize("family", ["distilbert", "vit"])
def test_layers_select_the_layers_of_a_model_whose_attention_carries_no_layer_index(family):
    """DistilBERT's and ViT's attention modules have no layer_idx: `layers` still selects layers (it selected none,
    silently). Layer 1's query weights get the span gradient under layers=[1] as under all layers, the stock
    gradient under layers=[0]."""
    import copy

    stock, batch = unnumbered(family)
    weights = torch.randn(stock(**batch).last_hidden_state.shape, generator=torch.Generator().manual_seed(1))

    def query_grad(layers):
        model = copy.deepcopy(stock)
        if layers != "stock":
            patch_model(model, "score:1000", layers=layers)
        (model.train()(**batch).last_hidden_state * weights).sum().backward()
        (layer1,) = [p.grad for n, p in model.named_parameters() if n.endswith(("1.attention.q_lin.weight",
                                                                                 "1.attention.q_proj.weight",
                                                                                 "1.attention.attention.query.weight"))]
        return layer1

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    stock_grad, all_layers = query_grad("stock"), query_grad(None)
    assert rel(all_layers, stock_grad) > 1e-2
    assert rel(query_grad([1]), all_layers) < 1e-5
    assert rel(query_grad(np.array([0])), stock_grad) < 1e-5


def test_layers_of_a_model_whose_layers_cannot_be_found_get_a_clear_error():
    model, _ = unnumbered("distilbert")
    model.config.n_layers = 3  # no list of 3 layers to number
    with pytest.raises(ValueError, match=r"layers=\[0\]: the attention modules of DistilBertModel carry no layer "
                                         r"index and its layers could not be found.*layers=None"):
        patch_model(model, "score:1000", layers=[0])


def test_layers_on_an_unnumbered_model_set_up_without_patch_model_warn(caplog):
    """attn_implementation='span_attention' and settings with layers put on the config by hand: nothing numbers the
    layers, so a one-time warning says that the selection does not reach them and what does."""
    import logging

    from hf_spanattn.integration import registry

    model, batch = unnumbered("distilbert")
    model.config.span_attention = SpanAttentionConfig(layers=[1]).to_dict()
    registry.register()
    model.set_attn_implementation("span_attention")
    registry.logger.warning_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        model.train()(**batch).last_hidden_state.sum().backward()
    assert any("DistilBertSelfAttention carries no layer index, so layers=[1] cannot select it" in r.getMessage()
               and "hf_spanattn.patch_model numbers the layers" in r.getMessage() for r in caplog.records)


def test_a_schedule_and_diagnostics_reach_the_layers_of_a_model_whose_attention_carries_no_layer_index(tmp_path):
    """The callback found no layer of DistilBERT: its layer table and diagnostics did nothing, without a word."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM, Trainer, TrainingArguments

    model = DistilBertForMaskedLM(DistilBertConfig(dim=32, n_heads=8, n_layers=2, hidden_dim=64, vocab_size=VOCAB,
                                                   max_position_embeddings=16))
    needs_attention_backend(DistilBertForMaskedLM)
    patch_model(model, "score:1000")
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=model, train_dataset=[{"input_ids": i, "labels": i} for i in ids],
                      args=TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                                             use_cpu=True, save_strategy="no", disable_tqdm=True),
                      callbacks=[SpanAttentionCallback([Keyframe(0, {"1": "score:1100"})], diagnostics_every=1)])
    trainer.train()
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("span/layer")}
    assert (logged["span/layer0/alpha1"], logged["span/layer1/alpha1"]) == (0.0, 1.0)
    assert logged["span/layer0/dq_share0"] == 1.0 and 0 < logged["span/layer1/dq_share0"] < 1


def test_a_settings_save_cut_short_leaves_the_saved_settings_whole(tmp_path, monkeypatch):
    """A kill while span_attention_config.json is written (here: an interrupt from inside json.dump, after part of
    the text) leaves the file saved before it as it was."""
    SpanAttentionConfig.from_label("score:1100", layers=[1]).save_pretrained(tmp_path)
    before = (tmp_path / "span_attention_config.json").read_text()

    def cut_short(data, f, **kwargs):
        f.write('{"method": "sim')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", cut_short)
    with pytest.raises(KeyboardInterrupt):
        SpanAttentionConfig.from_label("simple:10").save_pretrained(tmp_path)
    monkeypatch.undo()
    assert (tmp_path / "span_attention_config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["span_attention_config.json"]  # nothing left beside it
    assert SpanAttentionConfig.from_pretrained(tmp_path) == SpanAttentionConfig.from_label("score:1100", layers=[1])
    SpanAttentionConfig.from_label("simple:10").save_pretrained(tmp_path)  # the rerun saves
    assert SpanAttentionConfig.from_pretrained(tmp_path).label == "simple:10"


def custom_model():
    """A model of one's own, through the attention registry, whose config does not say num_hidden_layers."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    class Attention(torch.nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.config, self.layer_idx, self.is_causal = config, layer_idx, True
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 4, 4)).permute(2, 0, 3, 1, 4)
            attend = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, sdpa_attention_forward)
            return attend(self, q, k, v, None)[0].flatten(-2)

    class Model(PreTrainedModel):
        config_class = PretrainedConfig
        _supports_attention_backend = _supports_sdpa = True

        def __init__(self, config):
            super().__init__(config)
            self.layers = torch.nn.ModuleList([Attention(config, i) for i in range(2)])

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    torch.manual_seed(0)
    return Model(PretrainedConfig())


def test_a_custom_model_whose_config_does_not_say_its_layer_count_patches_and_selects_layers():
    """patch_model failed with AttributeError: 'PretrainedConfig' object has no attribute 'num_hidden_layers'. The
    layers are those the attention modules carry; layer 1's weights get the span gradient under layers=[1] as under
    all layers."""
    import copy

    stock = custom_model()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))

    def layer1_grad(layers):
        model = copy.deepcopy(stock)
        if layers != "stock":
            patch_model(model, "score:1000", layers=layers)
        model.train()(x).square().sum().backward()
        return model.layers[1].qkv.weight.grad

    all_layers, stock_grad = layer1_grad(None), layer1_grad("stock")
    assert (all_layers - stock_grad).norm() > 1e-2 * stock_grad.norm()
    assert (layer1_grad([1]) - all_layers).norm() < 1e-5 * all_layers.norm()
    with pytest.raises(ValueError, match=r"layers=\[2\]: Model has layers 0..1"):
        patch_model(copy.deepcopy(stock), "score:1000", layers=[2])


def test_two_settings_saves_at_once_each_leave_a_whole_file(tmp_path, monkeypatch):
    """A second process saves into the folder while the first is halfway through its write: whichever replaces
    the file last, it is whole (each writes its own partial file)."""
    import os

    dump, first, second = json.dump, SpanAttentionConfig.from_label("score:1100"), SpanAttentionConfig()

    def halfway(data, f, **kwargs):
        f.write('{"method": "sco')
        f.flush()
        with monkeypatch.context() as other_process:
            other_process.setattr(json, "dump", dump)
            other_process.setattr(os, "getpid", lambda: -1)
            second.save_pretrained(tmp_path)
        f.seek(0)
        dump(data, f, **kwargs)

    monkeypatch.setattr(json, "dump", halfway)
    first.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert SpanAttentionConfig.from_pretrained(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["span_attention_config.json"]


def eager_gpt2():
    model = tiny("gpt2")
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("steps,expected", [
    ([lambda m: patch_model(m.transformer, "score:1000"), unpatch_model], "eager"),
    ([lambda m: patch_model(m, "score:1000"), lambda m: unpatch_model(m.transformer)], "eager"),
    ([lambda m: patch_model(m, "score:1000"), lambda m: m.set_attn_implementation("sdpa"),
      lambda m: patch_model(m, "score:1100"), unpatch_model], "sdpa"),
], ids=["patched inside, unpatched around", "patched around, unpatched inside", "set to sdpa, patched again"])
def test_unpatch_model_gives_back_the_attention_the_model_had(steps, expected):
    """Through GPT2LMHeadModel or the GPT2Model inside it, which share one config: unpatching the one that was not
    patched gave SDPA in place of eager attention, without a word."""
    model = eager_gpt2()
    for step in steps:
        step(model)
    assert model.config._attn_implementation == expected
    assert not hasattr(model.config, "span_attention")
    assert not any(hasattr(m, "_hf_spanattn_original") for m in model.modules())
    assert not [tag for m in (model, model.transformer) for tag in m.model_tags or () if "span" in tag]



@pytest.mark.parametrize("how", ["attention set to sdpa after patching", "loaded without patching"])
def test_trainer_says_where_the_settings_on_the_config_are_not_in_force(how, tmp_path):
    """The model config holds span settings, but its attention is SDPA (set by hand after patch_model, or a saved
    patched model loaded with from_pretrained): the Trainer trained with the standard gradient, and the model saved
    and was tagged with the settings, without a word."""
    model = patch_model(tiny("gpt2"), "score:1000")
    if how == "loaded without patching":
        model.save_pretrained(tmp_path / "saved")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    else:
        model.set_attn_implementation("sdpa")
    with pytest.warns(UserWarning, match="holds the span attention settings score:1000, but its attention "
                                         "implementation is 'sdpa'.*standard gradient") as said:
        trainer_with(tmp_path / "out", model=model).train()
    drop = "unpatch_model" if how == "attention set to sdpa after patching" else "del model.config.span_attention"
    assert drop in str(said[0].message)
    patch_model(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*holds the span attention settings")
        trainer_with(tmp_path / "again", model=model).train()

def test_unpatch_model_of_a_model_loaded_with_span_attention_gives_it_sdpa(tmp_path):
    """from_pretrained(attn_implementation="span_attention"), then patch_model and unpatch_model: the span gradients
    stayed on (the default rule, the settings gone)."""
    tiny("gpt2").save_pretrained(tmp_path / "plain")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", attn_implementation="span_attention")
    unpatch_model(patch_model(model, "score:1100"))
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.config, "span_attention")


class StopAtFirstStep:
    """A training run stopped midway (Ctrl-C in a notebook): KeyboardInterrupt at the end of step 1."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                raise KeyboardInterrupt

        return Stop()


def test_a_schedule_left_on_the_layers_by_a_stopped_run_gives_way(tmp_path):
    """A run with a schedule stopped midway leaves its setting on the layers (the Trainer calls no event then).
    patch_model(model, rule) afterwards trained with the schedule's rule, and the callback given to a new trainer of
    another model did not apply its schedule, both without a word."""
    from transformers import TrainerCallback

    from hf_spanattn.integration.model_layers import attention_modules
    from hf_spanattn.integration.registry import settings_for

    callback = SpanAttentionCallback([Keyframe(0, "score:1100")], diagnostics_every=1)
    stopped = trainer_with(tmp_path, callback, StopAtFirstStep())
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    patch_model(stopped.model, "standard:QKV111")
    assert {settings_for(m).label for ms in attention_modules(stopped.model).values() for m in ms} == {
        "standard:QKV111"}

    seen = []

    class Spy(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.extend((settings_for(m).label, hasattr(m, "span_attention_probe"))
                        for ms in attention_modules(model).values() for m in ms)

    callback.diagnostics_every = 0
    trainer_with(tmp_path / "again", callback, Spy()).train()
    assert seen == [("score:1100", False)] * 2


def test_a_plain_trainer_after_a_stopped_scheduled_run_trains_with_the_models_settings(tmp_path):
    """A run with a schedule (score:1100) and diagnostics stopped inside a step leaves the schedule's setting and the
    probes on the layers; a stock Trainer without the callback then trained the model with score:1100, not its own
    score:1000, without a word."""
    from transformers import TrainerCallback

    from hf_spanattn.integration.model_layers import attention_modules
    from hf_spanattn.integration.registry import PROBE_ATTR, settings_for

    class StopInStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            raise KeyboardInterrupt

    stopped = trainer_with(tmp_path, SpanAttentionCallback([Keyframe(0, "score:1100")], diagnostics_every=1),
                           StopInStep())
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    modules = [m for ms in attention_modules(stopped.model).values() for m in ms]
    assert all(settings_for(m).label == "score:1100" and hasattr(m, PROBE_ATTR) for m in modules)  # what it left
    reference = trainer_with(tmp_path / "reference")
    reference.model.load_state_dict(stopped.model.state_dict())
    plain = trainer_with(tmp_path / "plain", model=stopped.model)
    with pytest.warns(UserWarning, match=r"setting score:1100 of a SpanAttentionCallback schedule from a training run "
                                         r"that stopped midway; Trainer trains without that callback, so the layer "
                                         r"trains with the model's own settings \(score:1000\)"):
        plain.train()
    reference.train()
    for (name, trained), expected in zip(plain.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(trained, expected), name
    assert not any(hasattr(m, PROBE_ATTR) for m in modules)
    assert {settings_for(m).label for m in modules} == {"score:1000"}


def test_a_second_trainer_writing_diagnostics_into_the_same_file_is_refused(tmp_path):
    """Two stock Trainers with diagnostics on one output dir at once: the second moved the first's records aside
    and the first then appended to the second's file. A lock beside the file, holding the process id, stops the
    second while the first's process lives; one left by a process that is gone, or by this process (a run stopped
    in a notebook), is taken over, and a run that ends removes its own."""
    import os
    import socket
    import subprocess
    import time

    lock = tmp_path / "span_diagnostics.jsonl.lock"
    records = tmp_path / "span_diagnostics.jsonl"
    records.write_text('{"step": 1, "layer": 0}\n')
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
        with pytest.raises(ValueError, match=f"{records}: another run is writing diagnostics into this file "
                                             f"\\(process {live.pid} on .*, see {lock}\\); name another"):
            trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
        assert records.read_text() == '{"step": 1, "layer": 0}\n' and lock.exists()  # the first run's, untouched
    finally:
        live.kill()
        live.wait()
    with pytest.warns(UserWarning, match="moved to"):  # its process is gone: the lock is taken over
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    assert not lock.exists() and steps_in(records) == [1, 1]
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.warns(UserWarning, match="moved to"):  # left by this process
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    assert not lock.exists()
    for when in (0, time.time() + 86400):  # cut short by a kill while it was written, long ago or (a clock set
        lock.write_text('{"pid": 4')           # back) in the future: taken over
        os.utime(lock, (when, when))
        with pytest.warns(UserWarning, match="moved to"):
            trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
        assert not lock.exists()
    lock.mkdir()
    with pytest.raises(ValueError, match=f"{lock} is where the lock of the diagnostics file goes, but it is not a"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    lock.rmdir()
    lock.write_text(records.read_text())  # a run that wrote its records under that name: not deleted
    os.utime(lock, (0, 0))
    with pytest.raises(ValueError, match=f"{lock} is where the lock of the diagnostics file goes, but it is not a"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    assert lock.read_text() == records.read_text()
    with pytest.raises(OSError, match=f"{tmp_path}/{'x' * 300}.lock: cannot write the lock of the diagnostics file "
                                      r"\(OSError: File name too long\); name another diagnostics_file"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1, diagnostics_file="x" * 300)).train()


def test_a_diagnostics_lock_whose_process_id_was_given_to_another_process_is_taken_over(tmp_path):
    """A run killed, its process id given to an unrelated process later: the diagnostics file was held for ever."""
    import os
    import socket
    import subprocess

    from hf_spanattn.training.diagnostics_file import process_start

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lock = tmp_path / "span_diagnostics.jsonl.lock"
    try:
        held = {"pid": other.pid, "host": socket.gethostname(), "process_start": process_start(other.pid)}
        lock.write_text(json.dumps(held))
        with pytest.raises(ValueError, match=f"writing diagnostics into this file \\(process {other.pid}"):
            trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
        lock.write_text(json.dumps({**held, "process_start": "another boot/12345"}))
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    finally:
        other.kill()
        other.wait()
    assert not os.path.exists(lock) and steps_in(tmp_path / "span_diagnostics.jsonl") == [1, 1]


def test_diagnostics_that_find_no_room_are_named_and_leave_no_record_cut_short_nor_a_lock(tmp_path):
    """A full disk (a file-size limit here): the append raised the bare "[Errno 28] No space left on device" and left
    a record cut short; the lock's write left an empty lock, which held the file as "a process starting now"."""
    import os
    import resource

    records = tmp_path / "span_diagnostics.jsonl"
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    lock_said = "cannot write the lock of the diagnostics file (OSError: File too large)"
    for limit, name, said in ((100, records, "cannot write the diagnostics (File too large)"),
                              (10, f"{records}.lock", lock_said)):
        trainer = trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limits[1]))  # Python ignores SIGXFSZ: writes past it fail
        try:
            with pytest.raises(OSError) as err:
                trainer.train()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        assert f"{name}: {said}; make room there, or name another diagnostics_file" in str(err.value)
        if limit == 100:  # the records of a step are written whole or not at all
            assert records.read_bytes() == b""
            os.remove(f"{records}.lock")  # a run stopped by an error keeps it (as a kill would)
    assert not os.path.exists(f"{records}.lock")
    trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    assert steps_in(records) == [1, 1]


def test_a_second_trainer_in_another_thread_of_the_process_is_refused_the_diagnostics_file(tmp_path):
    """Two Trainers in threads of one process writing diagnostics into one file: the lock holds the process id, so
    the second took it over as one that a stopped run of this process left, and moved the first's records aside. A
    run of this process holds it while its training goes on in its thread; one stopped midway (in this thread, or
    in another that lives on) is taken over. One callback given to two Trainers that train at once is refused."""
    import contextlib
    import os
    import threading

    from transformers import TrainerCallback

    class Pause(TrainerCallback):
        """Holds its run in its first step until `go`; then stops it there if `stop`."""

        def __init__(self, stop: bool = False) -> None:
            self.started, self.go, self.ended, self.leave = (threading.Event() for _ in range(4))
            self.stop = stop

        def on_step_begin(self, args, state, control, **kwargs):
            self.started.set()
            self.go.wait(60)
            if self.stop:
                raise KeyboardInterrupt

    def run_in_a_thread(pause: Pause, callback: SpanAttentionCallback | None = None) -> threading.Thread:
        def run() -> None:
            with contextlib.suppress(KeyboardInterrupt):
                trainer_with(tmp_path, callback or SpanAttentionCallback(diagnostics_every=1), pause).train()
            pause.ended.set()
            pause.leave.wait(60)  # the thread lives on after its run

        thread = threading.Thread(target=run, name="first run")
        thread.start()
        assert pause.started.wait(60)
        return thread

    records, lock = tmp_path / "span_diagnostics.jsonl", tmp_path / "span_diagnostics.jsonl.lock"
    first = Pause()
    thread = run_in_a_thread(first)
    try:
        with pytest.raises(ValueError, match=f"{records}: another run is writing diagnostics into this file \\(thread "
                                             f"'first run' of this process, {os.getpid()}, on .*, see {lock}\\)"):
            trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    finally:
        first.go.set()
        first.leave.set()
        thread.join(60)
    assert steps_in(records) == [1, 1] and not lock.exists()  # the first run's records, where it wrote them
    stopped = Pause(stop=True)
    thread = run_in_a_thread(stopped)
    stopped.go.set()
    assert stopped.ended.wait(60) and lock.exists() and thread.is_alive()
    try:
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()  # stopped, its thread alive
    finally:
        stopped.leave.set()
        thread.join(60)
    assert steps_in(records) == [1, 1] and not lock.exists()
    stopped = Pause(stop=True)
    stopped.go.set()
    with pytest.raises(KeyboardInterrupt):  # stopped in this thread, as in a notebook
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1), stopped).train()
    assert lock.exists()
    trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()
    assert steps_in(records) == [1, 1] and not lock.exists()
    # one callback given to two Trainers training at once: the second took the first's layers and records from it
    shared, first = SpanAttentionCallback([Keyframe(0, "score:1100")], diagnostics_every=1), Pause()
    thread = run_in_a_thread(first, shared)
    try:
        with pytest.raises(ValueError, match="SpanAttentionCallback: this callback is in a training run going on "
                                             "in thread 'first run'; give each Trainer a SpanAttentionCallback of"):
            trainer_with(tmp_path / "other", shared).train()
    finally:
        first.go.set()
        first.leave.set()
        thread.join(60)
    assert [json.loads(line)["span"] for line in records.read_text().splitlines()] == ["score:1100"] * 2
    assert not lock.exists() and not (tmp_path / "other" / "span_diagnostics.jsonl").exists()


def test_a_diagnostics_file_under_a_file_names_the_cause(tmp_path):
    """A file where the diagnostics file's folder goes: the folder's FileExistsError was taken for a lock another run
    took meanwhile, three times: "could not take the lock of the diagnostics file"."""
    (tmp_path / "a.txt").write_text("mine")
    with pytest.raises(OSError, match=f"{tmp_path}/a.txt/d.jsonl: cannot make the folder of the diagnostics file "
                                      r"\(FileExistsError: File exists; is a file in its way\?\); name another"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1, diagnostics_file="a.txt/d.jsonl")).train()
    assert (tmp_path / "a.txt").read_text() == "mine"


def test_a_diagnostics_file_that_is_a_pipe_is_refused(tmp_path):
    """Writing a record into a named pipe waits for a reader: the run hung at its first recorded step."""
    import os

    os.mkfifo(tmp_path / "span_diagnostics.jsonl")
    with pytest.raises(ValueError, match=f"diagnostics_file=None: {tmp_path}/span_diagnostics.jsonl is a pipe or a "
                                         "socket; expected the name of the JSONL file to write"):
        trainer_with(tmp_path, SpanAttentionCallback(diagnostics_every=1)).train()


def test_diagnostics_leave_out_calls_with_more_keys_than_queries():
    """A training step over past_key_values (prefix tuning) under the standard rule with a probe on the layers failed
    inside the backward pass ("Expected size for first two dimensions of batch2 tensor"): such calls record nothing,
    as the span rules' do (they run SDPA)."""
    from hf_spanattn.integration.model_layers import attention_modules
    from hf_spanattn.integration.registry import PROBE_ATTR

    model = patch_model(tiny("llama"), "standard:QKV110").train()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        past = model(ids[:, :3], use_cache=True).past_key_values
    recorders = {index: OrderRecorder() for index in attention_modules(model)}
    for index, modules in attention_modules(model).items():
        for module in modules:
            setattr(module, PROBE_ATTR, recorders[index])
    model(ids[:, 3:], past_key_values=past, use_cache=True).logits.sum().backward()
    assert all(r.summary() == {} for r in recorders.values())
    model(ids).logits.sum().backward()  # self-attention is recorded
    assert all(r.summary()["dq_share"][0] == 1.0 for r in recorders.values())


def test_gpt_neo_in_float64_keeps_its_outputs_on_padded_rows():
    """GPT-Neo's adapter cast float64's padding mask value to float32 (−inf), so the rows of left padding got 0
    rather than the stock attention's output (logits off by 0.05); its scores now run in float64."""
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    model = tiny("gpt_neo").double().train()
    stock = model(input_ids=ids, attention_mask=padding).logits
    patch_model(model, "score:1111")
    torch.testing.assert_close(model(input_ids=ids, attention_mask=padding).logits, stock, rtol=0, atol=1e-8)


def test_settings_of_a_named_adapter_read_through_subfolder(tmp_path):
    """SpanAttentionConfig.from_pretrained(folder, subfolder=name), as PEFT reads a named adapter: the settings of
    folder/name (it read those of folder itself, without a word)."""
    SpanAttentionConfig.from_label("score:1100").save_pretrained(tmp_path)
    SpanAttentionConfig.from_label("simple:10").save_pretrained(tmp_path / "mine ü")
    assert SpanAttentionConfig.from_pretrained(tmp_path, subfolder="mine ü").label == "simple:10"
    assert SpanAttentionConfig.from_pretrained(tmp_path).label == "score:1100"


def test_a_field_of_a_newer_version_is_kept_when_the_loaded_model_is_saved_again(tmp_path):
    """load_pretrained of settings written by a newer hf_spanattn (a field this version does not know) warns that
    the field is ignored here; saving the model again kept neither the field nor the version that wrote it."""
    folder = saved_model(tmp_path, alphas=[1, 1, 0, 0], new_field=[3], hf_spanattn_version="9.0")
    with pytest.warns(UserWarning, match="ignoring unknown fields \\['new_field'\\]"):
        model = load_pretrained(folder)
    model.save_pretrained(folder)
    section = json.loads((folder / "config.json").read_text())["span_attention"]
    assert (section["new_field"], section["hf_spanattn_version"], section["alphas"]) == ([3], "9.0", [1, 1, 0, 0])
    assert config_of(model.config).label == "score:1100"
    patch_model(model, layers=[1])  # settings changed here are this version's
    assert "new_field" not in model.config.span_attention


def _null_section(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "span_attention": None}))
    return folder


def _hand_set_layers(folder: Path):
    model = load_pretrained(folder)
    model.config.span_attention = {**model.config.span_attention, "layers": [0, 7]}
    return model


@pytest.mark.parametrize("warn,message", [
    (lambda t: load_pretrained(saved_model(t, alpha=[1, 0, 0, 0])), "ignoring unknown fields ['alpha']"),
    (lambda t: load_pretrained(saved_model(t, hf_spanattn_version="99.0")), "newer than the installed"),
    (lambda t: SpanAttentionConfig.from_pretrained(write(t / "span_attention_config.json", json.dumps(
        {"method": "score", "hf_spanattn_version": "99.0"}))), "newer than the installed"),
    (lambda t: load_pretrained(_null_section(saved_model(t))), "null, which gives no settings"),
    (lambda t: patch_model(AutoModelForCausalLM.from_pretrained(_null_section(saved_model(t)))),
     "null, which gives no settings"),
    (lambda t: _hand_set_layers(saved_model(t))(torch.tensor([[1, 2, 3]])), "layers [7] do not exist"),
    (lambda t: patch_model(tiny("gpt2"), "score:1000")(torch.tensor([[1, 2, 3]])), "backend='triton' runs on"),
    (lambda t: trainer_with(t, SpanAttentionCallback([Keyframe(0, "score:1000"), Keyframe(9, "score:1100")])).train(),
     "never reached"),
    (lambda t: trainer_with(t, SpanAttentionCallback(diagnostics_every=1, diagnostics_file=str(t.parent / "d.jsonl")))
     .train(), "lies outside the output dir"),
], ids=["unknown field, load_pretrained", "newer version, load_pretrained", "newer version, settings file",
        "null section, load_pretrained", "null section, patch_model", "layers outside the model, forward",
        "triton backend falling back, forward",
        "keyframe never reached, Trainer.train", "diagnostics file outside, Trainer.train"])
def test_a_warning_points_at_the_users_line(warn, message, tmp_path, monkeypatch):
    """It named a line of the package (registry.py, config.py), of Transformers (trainer_callback.py, the model's
    forward) or a line above the user's (patch_model's own caller)."""
    from hf_spanattn.ops.triton import backend

    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")  # a CPU tensor without TRITON_INTERPRET: falls back, saying so
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(backend, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn(tmp_path)
    ours = [w for w in caught if message in str(w.message)]
    lines = {line for _, _, line in warn.__code__.co_lines()}  # the case's own lines, not test code around it
    assert ours and all(w.filename == __file__ and w.lineno in lines for w in ours), [(w.filename, w.lineno)
                                                                                       for w in ours]


def test_the_way_round_an_adapter_without_its_base_model_trains_the_adapter_as_load_pretrained_would(tmp_path):
    """The error's suggestion, run as written, gave an adapter that did not train (PeftModel.from_pretrained's
    default is_trainable=False), where load_pretrained gives a trainable one."""
    from peft import PeftModel

    folder = adapter(tmp_path, base_model_name_or_path=None)
    with pytest.raises(ValueError) as err:
        load_pretrained(folder)
    patching, adding = str(err.value).split("add the adapter: ")[1].split("; ")
    base = tiny("gpt2")
    exec(patching, {"patch_model": patch_model, "SpanAttentionConfig": SpanAttentionConfig, "base": base,
                    "folder": folder})
    model = eval(adding, {"PeftModel": PeftModel, "base": base, "folder": folder})
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    assert lora and all(p.grad is not None for p in lora)
    assert config_of(base.config) == SpanAttentionConfig.from_pretrained(folder)


@pytest.mark.parametrize("at", [" 20% ", "20%\n", " 1ep"])
def test_a_keyframe_time_with_spaces_around_is_read_as_a_label_is(at):
    """' 20% ' was refused ("expected a step (int), a share ('20%') or an epoch ('2ep')") where '20 %' was taken."""
    assert Keyframe(at, "score:1000").step(10, 4) == Keyframe(at.strip(), "score:1000").step(10, 4)


@pytest.mark.parametrize("patched", [None, "score:1000"], ids=["into an unpatched model", "into other settings"])
def test_the_call_a_plain_peft_load_of_an_adapter_with_settings_suggests_runs_as_written(patched, tmp_path):
    """It read SpanAttentionConfig.from_pretrained(folder): a name not imported and a variable the user does not
    hold."""
    from peft import PeftModel

    import hf_spanattn

    folder = adapter(tmp_path)  # saved with score:1100
    base = tiny("gpt2") if patched is None else patch_model(tiny("gpt2"), patched)
    with pytest.warns(UserWarning, match="call hf_spanattn.patch_model") as caught:
        model = PeftModel.from_pretrained(base, folder, is_trainable=True)
    said = next(str(w.message) for w in caught if "call hf_spanattn.patch_model" in str(w.message))
    call = re.search(r"call (hf_spanattn\.patch_model\(.*\)\))", said)[1]
    eval(call, {"hf_spanattn": hf_spanattn, "model": model})
    assert config_of(base.config) == SpanAttentionConfig.from_pretrained(folder)
    assert base.config._attn_implementation == "span_attention"


def test_a_label_that_does_not_read_as_settings_is_named():
    """patch_model(model, 'score:100') said "alphas=(1.0, 0.0, 0.0): expected 4 values", not naming the label."""
    with pytest.raises(ValueError, match=re.escape("label='score:100': alphas=(1.0, 0.0, 0.0): expected 4 values")):
        patch_model(tiny("gpt2"), "score:100")
    with pytest.raises(ValueError, match=re.escape("label='standard:1000': alphas=(1.0, 0.0, 0.0, 0.0): expected 0")):
        SpanAttentionConfig.from_label("standard:1000")


def test_a_settings_field_named_almost_right_warns(tmp_path):
    """A config.json whose settings field is misspelled by hand ('span_atention'): load_pretrained patched with the
    default settings without a word."""
    folder = saved_model(tmp_path, alphas=[1, 1, 0, 0])
    config = json.loads((folder / "config.json").read_text())
    config["span_atention"] = config.pop("span_attention")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=f"{folder}/config.json, field 'span_attention': not given, but a field "
                                         "'span_atention' is, which is not read; patching with the default score:1000"):
        load_pretrained(folder)


def test_hostile_steps_in_the_diagnostics_file_and_the_log_history_do_not_stop_a_resumed_run(stopped_run, tmp_path):
    """A record whose step has 400 digits (OverflowError) and a log_history entry of the checkpoint whose step is a
    list (TypeError: unhashable) stopped the resumed run; the record is kept as it is, the entry is not compared."""
    out = copy_of(stopped_run, tmp_path)
    path = out / "span_diagnostics.jsonl"
    path.write_bytes(b'{"step": -1' + b"0" * 400 + b', "note": "mine"}\n' + path.read_bytes())
    state = out / "checkpoint-2" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "log_history": [{"step": [1]}, {"step": {}}]}))
    diagnosed_run(out, 4, resume=str(out / "checkpoint-2"))
    assert steps_in(path) == [-10**400, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_file_that_is_not_a_diagnostics_file_is_refused_and_left_as_it_is(stopped_run, tmp_path):
    """diagnostics_file naming a file of JSON that holds no record (here a checkpoint's trainer_state.json, written
    on one line without a line end): a resumed run took its one line for a record cut short, rewrote the file without
    it and appended its records; a fresh run moved it aside. A file in a checkpoint folder is refused as such: the
    Trainer deletes the folder (save_total_limit) with the records in it."""
    out = copy_of(stopped_run, tmp_path)
    state = out / "state.json"
    state.write_text(json.dumps(json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())))
    before = state.read_bytes()
    for resume in (str(out / "checkpoint-2"), None):
        with pytest.raises(ValueError, match=f"{state} holds no diagnostics records .* name another diagnostics_file"):
            diagnosed_run(out, 4, resume=resume, diagnostics_file="state.json")
        assert state.read_bytes() == before
    state = out / "checkpoint-2" / "trainer_state.json"  # one in a checkpoint folder, which the Trainer replaces
    before = state.read_bytes()
    with pytest.raises(ValueError, match="diagnostics_file='checkpoint-2/trainer_state.json' lies in the folder "
                                         "checkpoint-2, a checkpoint that the Trainer writes over or deletes"):
        diagnosed_run(out, 4, resume=str(out / "checkpoint-2"), diagnostics_file="checkpoint-2/trainer_state.json")
    assert state.read_bytes() == before


def test_hostile_attributes_restored_from_a_checkpoint_do_not_stop_the_run(stopped_run, tmp_path):
    """The Trainer sets every attribute that trainer_state.json lists for the callback; the callback's own per-run
    state set so by hand (`_frames`, `_pending`) stopped the resumed run with errors that named neither."""
    out = copy_of(stopped_run, tmp_path)
    state = out / "checkpoint-2" / "trainer_state.json"
    data = json.loads(state.read_text())
    data["stateful_callbacks"]["SpanAttentionCallback"]["attributes"].update(_frames="x", _pending=[1], _layers=5)
    state.write_text(json.dumps(data))
    diagnosed_run(out, 4, resume=str(out / "checkpoint-2"), restore_callback_states_from_checkpoint=True)
    assert steps_in(out / "span_diagnostics.jsonl") == [1, 1, 2, 2, 3, 3, 4, 4]


@pytest.mark.parametrize("name", ["on_step_begin", "state", "__class__", "__dict__"])
def test_a_checkpoint_attribute_naming_a_method_of_the_callback_is_refused(name, stopped_run, tmp_path):
    """The Trainer sets every attribute that trainer_state.json lists for the callback (setattr on a new one): a name
    of a method ({"on_step_begin": 5}) failed later in Transformers' call_event ("'int' object is not callable"), or
    at the next checkpoint save ({"state": 5}), and a special one ({"__class__": 5}) in setattr, naming nothing."""
    out = copy_of(stopped_run, tmp_path)
    state = out / "checkpoint-2" / "trainer_state.json"
    data = json.loads(state.read_text())
    data["stateful_callbacks"]["SpanAttentionCallback"]["attributes"][name] = 5
    state.write_text(json.dumps(data))
    with pytest.raises(AttributeError, match=f"SpanAttentionCallback: {name!r} = 5: .* trainer_state.json, field "
                                             "stateful_callbacks.* are \\['last_step'\\]"):
        diagnosed_run(out, 4, resume=str(out / "checkpoint-2"), restore_callback_states_from_checkpoint=True)
    callback = SpanAttentionCallback()
    callback.on_log = on_log = lambda *args, **kwargs: None  # a method replaced by code (as mock.patch does) is kept
    callback.schedule = None
    assert callback.on_log is on_log


def test_a_patched_model_saved_whole_trains_in_a_process_that_did_not_import_the_package(tmp_path):
    """torch.save of a patched model, torch.load in a fresh process that does not import hf_spanattn: its training
    forward raised KeyError ('span_attention' is not registered in Transformers' AttentionInterface), and a patched
    GPT-Neo did not load at all (its adapter, a bound method, unpickled as getattr(module, '_neo_attn')). Loading
    either registers span_attention (importing the package), and the model trains with the gradients it had before
    it was saved; the settings section on its config stays a plain dict (config.to_dict() loads weights_only)."""
    import subprocess

    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    expected = {}
    for family in ("gpt2", "gpt_neo"):
        model = patch_model(tiny(family), "score:1100", layers=[1])
        torch.save(model, tmp_path / f"{family}.pt")
        expected[family] = gradients_of(model, ids)
        assert not all(torch.equal(a, b) for a, b in zip(expected[family], gradients_of(tiny(family), ids)))
        torch.save(model.config.to_dict(), tmp_path / "config.pt")
        assert torch.load(tmp_path / "config.pt")["span_attention"]["layers"] == [1]
    script = """if True:
        import sys, torch
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        folder = sys.argv[1]
        ids = torch.load(f"{folder}/ids.pt")
        assert "hf_spanattn" not in sys.modules
        for family in ("gpt2", "gpt_neo"):
            model = torch.load(f"{folder}/{family}.pt", weights_only=False)
            model(ids, labels=ids).loss.backward()
            torch.save([p.grad for p in model.parameters()], f"{folder}/{family}.loaded.pt")
            for registry in (AttentionInterface, AttentionMaskInterface):  # as in a fresh process for the next
                registry._global_mapping.pop("span_attention")
    """
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for family in expected:
        loaded = torch.load(tmp_path / f"{family}.loaded.pt")
        assert all(torch.equal(a, b) for a, b in zip(loaded, expected[family], strict=True)), family


def test_a_model_loaded_with_span_attention_and_saved_whole_trains_in_a_process_that_did_not_import_the_package(
        tmp_path):
    """from_pretrained(attn_implementation="span_attention") (no patch_model), a training step, torch.save; torch.load
    in a fresh process that does not import hf_spanattn: its training forward raised KeyError ('span_attention' is not
    registered in the AttentionInterface). Now it trains with the gradients it had."""
    import subprocess

    patch_model(tiny("llama", seed=1), "score:1100", layers=[1]).save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="span_attention")
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    expected = gradients_of(model, ids)
    torch.save(model, tmp_path / "model.pt")
    script = """if True:
        import sys, torch
        folder = sys.argv[1]
        ids = torch.load(f"{folder}/ids.pt")
        assert "hf_spanattn" not in sys.modules
        model = torch.load(f"{folder}/model.pt", weights_only=False).train()
        model(ids, labels=ids).loss.backward()
        torch.save([p.grad for p in model.parameters()], f"{folder}/loaded.pt")
    """
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = torch.load(tmp_path / "loaded.pt")
    assert all(torch.equal(a, b) for a, b in zip(loaded, expected, strict=True))


def gradients_of(model, ids) -> list:
    model.train()
    model(ids, labels=ids).loss.backward()
    return [p.grad for p in model.parameters()]


def test_an_adapter_loads_in_a_subfolder_and_under_the_name_given(tmp_path):
    """load_pretrained(folder, subfolder="sub") of an adapter saved in folder/sub: the subfolder went to the base
    model's from_pretrained, which failed with "Unrecognized model in <folder>. Should have a `model_type` key",
    naming neither the adapter nor the subfolder. adapter_name="mine" went there too, where Transformers takes it
    without an adapter to load: the adapter was loaded as "default" without a word."""
    folder = adapter(tmp_path)
    (tmp_path / "repo").mkdir()
    folder.rename(tmp_path / "repo" / "sub")
    for subfolder in ("sub", Path("sub")):
        model = load_pretrained(tmp_path / "repo", subfolder=subfolder)
        assert config_of(model.get_base_model().config).label == "score:1100"
        assert list(model.peft_config) == ["default"]
    assert list(load_pretrained(tmp_path / "repo" / "sub", adapter_name="mine").peft_config) == ["mine"]
    for name in (5, "", "a.b"):  # torch's error named only the module
        with pytest.raises(ValueError, match=f"load_pretrained: adapter_name={name!r}: expected the name to give"):
            load_pretrained(tmp_path / "repo" / "sub", adapter_name=name)


def test_an_adapter_saved_with_other_settings_than_the_patched_model_says_which_win(tmp_path):
    """The adapter holds score:1100, the model it is loaded into is patched with simple:10: the load warns naming
    both and that the model's settings win (they do: it trains with simple:10). As the model's own settings, and
    through load_pretrained with settings given, nothing is said."""
    from peft import PeftModel

    folder = adapter(tmp_path)
    for add in ("from_pretrained", "load_adapter"):
        base = patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), "simple:10")
        with pytest.warns(UserWarning, match=f"{folder} holds span attention settings \\(score:1100\\), other than "
                                             "those the model it was loaded into is patched with \\(simple:10\\): "
                                             "the model's settings win, it trains with simple:10"):
            if add == "from_pretrained":
                PeftModel.from_pretrained(base, folder)
            else:
                PeftModel.from_pretrained(base, folder, adapter_name="first").load_adapter(folder, "second")
        assert config_of(base.config).label == "simple:10"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        PeftModel.from_pretrained(patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), "score:1100"),
                                  folder)
        assert config_of(load_pretrained(folder, config="simple:10").get_base_model().config).label == "simple:10"
    assert not [w for w in seen if "span attention settings" in str(w.message)]


@pytest.mark.parametrize("family", ["bart", "whisper", "t5"])
def test_encoder_decoder_models_are_refused_for_the_flag_they_lack(family):
    """BART, Whisper and T5 call Transformers' attention registry; what they lack is the attention-backend flag
    (the message said they do not route through the registry), and T5's attention adds a learned position bias."""
    import transformers

    small = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
    model = {"bart": lambda: transformers.BartModel(transformers.BartConfig(**small)),
             "whisper": lambda: transformers.WhisperModel(transformers.WhisperConfig(**small, num_mel_bins=8,
                                                                                     pad_token_id=0)),
             "t5": lambda: transformers.T5Model(transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                                                                      num_layers=1, num_heads=2))}[family]()
    with pytest.raises(ValueError) as err:
        patch_model(model, "score:1000")
    message = str(err.value)
    assert f"{type(model).__name__} does not declare Transformers' attention-backend support (its class leaves " \
           "_supports_attention_backend False" in message and "route" not in message
    assert ("learned relative position bias ('position_bias')" in message) == (family == "t5")


@pytest.mark.parametrize("call,fragment", [
    (lambda: SpanAttentionConfig(layers=[10**5000, -1]), "layers=[<an int of 16610 bits>, -1]: expected None"),
    (lambda: patch_model(tiny("gpt2"), "score:1000", layers=[10**5000]), "layers=[<an int of 16610 bits>]: GPT2"),
    (lambda: span_attention(*[torch.randn(1, 1, 4, 4)] * 3, scale=10**5000), "got <an int of 16610 bits> (int)"),
], ids=["int layer", "patch layers", "scale"])
def test_errors_show_an_int_past_the_digit_limit_by_its_size(call, fragment):
    """An int past Python's digit limit in an error is named by its size (its repr raised Python's own ValueError, which
    names no argument)."""
    with pytest.raises((ValueError, TypeError)) as err:
        call()
    assert fragment in str(err.value) and len(str(err.value)) < 1000, str(err.value)[:300]


def test_a_keyframe_past_pythons_digit_limit_is_said_to_be_never_reached():
    """A keyframe at a step of 5000 digits: the note that it is never reached names it by its size (printing the step
    raised Python's digit-limit ValueError, naming nothing)."""
    schedule = Schedule([Keyframe(0, "score:1000"), Keyframe(10**5000, "score:1100")])
    notes = schedule.unreached(schedule.resolve(10, None, 2), 10)
    assert notes == ["keyframe at=<an int of 16610 bits> (step <an int of 16610 bits>) is never reached: training "
                     "ends after max_steps=10 (steps 0..9)"]


def test_an_adapter_saved_unpatched_over_settings_saved_before_warns_that_they_are_left(tmp_path):
    """An adapter saved from a patched model, then again from the same model unpatched, into the same folder: the
    settings file of the first save is left (it may have been written by hand) and would patch the model loaded from
    it, which is said (it was left without a word)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(patch_model(tiny("gpt2"), "score:1100"), LoraConfig(r=2, target_modules=["c_attn"]))
    model.save_pretrained(tmp_path)
    unpatch_model(model)
    with pytest.warns(UserWarning, match=f"{tmp_path}/span_attention_config.json is left from before: the model saved "
                                         "now is not patched"):
        model.save_pretrained(tmp_path)
    assert SpanAttentionConfig.from_pretrained(tmp_path).label == "score:1100"


def stop_after_the_settings(monkeypatch) -> None:
    """SpanAttentionConfig.save_pretrained writes the settings, then the process stops (as a kill at this point)."""
    write = SpanAttentionConfig.save_pretrained

    def stopped(self, folder, *args, **kwargs):
        write(self, folder, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(SpanAttentionConfig, "save_pretrained", stopped)


def test_an_adapter_save_stopped_at_its_settings_leaves_no_adapter_without_them(tmp_path, monkeypatch):
    """A save stopped after PEFT's files but before span_attention_config.json left an adapter that
    load_pretrained patched with the default settings without a word: the settings are written first, so a stop
    there leaves no adapter; the save done again writes both."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(patch_model(tiny("gpt2"), "score:1100"), LoraConfig(r=2, target_modules=["c_attn"]))
    stop_after_the_settings(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path / "a")
    assert not (tmp_path / "a" / "adapter_config.json").exists()
    with pytest.raises(FileNotFoundError, match=f"load_pretrained: {tmp_path}/a holds span_attention_config.json but "
                                                "neither a model \\(config.json\\) nor a PEFT adapter"):
        load_pretrained(tmp_path / "a")
    monkeypatch.undo()
    model.save_pretrained(tmp_path / "a")
    assert SpanAttentionConfig.from_pretrained(tmp_path / "a").label == "score:1100"
    assert (tmp_path / "a" / "adapter_config.json").exists()


def test_an_adapter_save_that_finds_no_room_names_the_folder(tmp_path):
    """A full disk (a file-size limit here): PEFT's bare "[Errno 27] File too large", naming no file; the mark that
    keeps load_pretrained from pairing the new settings with earlier weights stays."""
    import resource

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(patch_model(tiny("gpt2"), "score:1100"), LoraConfig(r=2, target_modules=["c_attn"]))
    model.save_pretrained(tmp_path)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))  # the settings fit, the adapter's files do not
    try:
        with pytest.raises(OSError, match=f"^\\[Errno 27\\] {tmp_path}: the adapter's save did not finish \\(File too "
                                          "large\\); save it again once there is room$"):
            model.save_pretrained(tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert (tmp_path / ".span_attention_save_unfinished").exists()


def test_an_adapter_save_stopped_over_an_earlier_adapter_is_refused_at_load(tmp_path, monkeypatch):
    """The same stopped save into a folder holding an earlier adapter left the new settings beside the earlier
    weights, which load_pretrained paired without a word: a mark file stays until PEFT's save is done, and a folder
    that has it is refused; the save done again loads with the new settings."""
    from peft import LoraConfig, get_peft_model

    tiny("gpt2").save_pretrained(tmp_path / "base")
    base = patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "score:1100")
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["c_attn"]))
    model.save_pretrained(tmp_path)
    patch_model(base, "simple:10")
    stop_after_the_settings(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").exists() and SpanAttentionConfig.from_pretrained(tmp_path).label == (
        "simple:10")
    with pytest.raises(OSError, match=f"load_pretrained: the last save into {tmp_path} did not finish "
                                      r"\(.span_attention_save_unfinished is there\)"):
        load_pretrained(tmp_path)
    monkeypatch.undo()
    model.save_pretrained(tmp_path)
    assert not (tmp_path / ".span_attention_save_unfinished").exists()
    assert config_of(load_pretrained(tmp_path).get_base_model().config).label == "simple:10"


def test_the_note_that_settings_are_missing_is_said_for_each_model(caplog):
    """The settings deleted from a patched model's config: it trains on the default, which a note says; it was said
    once per process, so a second model whose settings were deleted trained on the default without a word."""
    import logging

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    models = [patch_model(tiny("gpt2", seed=seed), "simple:10") for seed in (0, 1)]
    for model in models:
        del model.config.span_attention
    with caplog.at_level(logging.WARNING, logger="hf_spanattn"):
        for model in models + models:  # each model twice: said once for each
            model.train()(input_ids=ids, labels=ids).loss.backward()
    notes = [r.getMessage() for r in caplog.records if "has no 'span_attention' settings" in r.getMessage()]
    assert len(notes) == 2 and all("using the default score:1000" in n for n in notes)


def test_a_model_built_from_the_config_of_a_patched_one_says_it_trains_with_span_gradients():
    """Two models built from one config object, one patched: Transformers' attention setting lives on the config, so
    the other trained with span gradients, and unpatching the other unpatched the first, without a word."""
    config = tiny("llama").config
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    patched, other = (type(tiny("llama"))(config) for _ in range(2))
    patch_model(patched, "score:1000")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patched.train()(input_ids=ids, labels=ids).loss.backward()  # the patched model itself: no warning
    with pytest.warns(UserWarning, match=r"LlamaAttention belongs to a model that hf_spanattn.patch_model was not "
                                         r"given, but its config object \(LlamaConfig\) is that of a model it was"):
        other.train()(input_ids=ids, labels=ids).loss.backward()
    with pytest.warns(UserWarning, match="so its settings change with it, from score:1000 to simple:10"):
        patch_model(other, "simple:10")
    with pytest.warns(UserWarning, match=r"unpatch_model: another model that patch_model was given shares the config "
                                         r"object of LlamaForCausalLM \(both built from one config\), and is"):
        unpatch_model(other)
    assert patched.config._attn_implementation == "sdpa"



def test_an_attention_module_put_into_a_patched_model_trains_without_a_word_of_another_model():
    """An attention module put into a patched model after patch_model (built on its config) trains with its settings,
    as it should, but warned that it belonged to another model built from the same config."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    model = patch_model(tiny("llama"), "score:1000")
    model.model.layers[0].self_attn = LlamaAttention(model.config, 0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.train()(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None

def test_layers_removed_from_a_model_cannot_be_selected():
    """Layers pruned from a model whose config still counts them (or a middle one dropped): a selection of a removed
    layer was taken, and no layer got span gradients, without a word."""
    pruned = tiny("llama", layers=3)
    pruned.model.layers = pruned.model.layers[:2]  # num_hidden_layers still 3
    with pytest.raises(ValueError, match=r"layers=\[2\]: LlamaForCausalLM has no attention module of layer 2; its "
                                         r"attention modules carry the layer indices 0, 1$"):
        patch_model(pruned, "score:1000", layers=[2])
    gap = tiny("llama", layers=3)
    gap.model.layers = torch.nn.ModuleList([gap.model.layers[0], gap.model.layers[2]])
    gap.config.num_hidden_layers = 2
    with pytest.raises(ValueError, match=r"layers=\[0, 1\]: LlamaForCausalLM has no attention module of layer 1; "
                                         r"its attention modules carry the layer indices 0, 2"):
        patch_model(gap, "score:1000", layers=[0, 1])
    assert patch_model(pruned, "score:1000", layers=[1]).config.span_attention["layers"] == [1]


def _llava_grads_match(expected_model: torch.nn.Module, model: torch.nn.Module, image_tokens: int = 4) -> None:
    """The gradients of every parameter on one image and text equal the stock model's (the settings give them)."""
    ids = torch.cat([torch.full((1, image_tokens), VOCAB), torch.randint(1, VOCAB, (1, 6))], 1)
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, pixel_values=pixels, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    expected, got = grads(expected_model), grads(model)
    scale = max(grad.norm() for grad in expected.values())  # (key biases have a gradient of 0, up to rounding)
    for name, grad in expected.items():
        assert (got[name] - grad).norm() <= 1e-12 * scale, name


def test_a_composite_model_s_towers_train_with_the_settings_it_was_patched_with(tmp_path):
    """A vision-language model's text and vision attention read their sub-configs (text_config, vision_config), while
    patch_model writes the settings on the model's config: every tower trained with the default score:1000, whatever
    the label, with only a note that the settings were missing. Here score:1111 gives the stock gradients."""
    from transformers import LlavaForConditionalGeneration

    from hf_spanattn.integration.registry import settings_for

    patched = patch_model(tiny_llava(dtype=torch.float64), "score:1111")
    _llava_grads_match(tiny_llava(dtype=torch.float64), patched)
    attention = [m for m in patched.modules() if type(m).__name__ in ("LlamaAttention", "CLIPAttention")]
    patch_model(patched, "simple:10")
    assert [settings_for(m).label for m in attention] == ["simple:10"] * 4
    patched.save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, model_class=LlavaForConditionalGeneration, layers=[1])
    text = [m for m in loaded.modules() if type(m).__name__ == "LlamaAttention"]
    assert [getattr(settings_for(m), "label", None) for m in text] == [None, "simple:10"]
    patch_model(loaded.model.language_model, "score:1100")  # the text model alone: its own config's settings
    assert [settings_for(m).label for m in text] == ["score:1100"] * 2



def test_a_composite_model_loaded_with_span_attention_trains_with_its_saved_settings(tmp_path):
    """A patched vision-language model saved, then loaded with from_pretrained(attn_implementation="span_attention")
    as a patched model may be: its towers read their sub-configs, which hold no settings, so it trained with the
    default score:1000 in place of the saved rule, saying the config had none. Now the saved score:1111, the stock
    gradients."""
    from transformers import LlavaForConditionalGeneration

    stock = tiny_llava(dtype=torch.float64)
    patch_model(copy.deepcopy(stock), "score:1111").save_pretrained(tmp_path)
    loaded = LlavaForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="span_attention",
                                                           dtype=torch.float64)
    _llava_grads_match(stock, loaded)

def test_a_hybrid_model_s_layers_without_attention_cannot_be_selected():
    """A hybrid model whose convolution layers carry a layer index too (LFM2: conv, attention, conv, attention): a
    selection of a convolution layer was taken, and no layer got span gradients, without a word."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                        block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"] * 2)
    model = Lfm2ForCausalLM(config)
    with pytest.raises(ValueError, match=r"layers=\[0, 1\]: Lfm2ForCausalLM has no attention module of layer 0; its "
                                         r"attention modules carry the layer indices 1, 3$"):
        patch_model(model, "score:1000", layers=[0, 1])
    assert patch_model(model, "score:1000", layers=[3, 1]).config.span_attention["layers"] == [1, 3]


def test_a_schedule_s_layer_table_naming_only_layers_without_attention_is_refused(tmp_path):
    """A keyframe's layer table naming a hybrid model's convolution layer (LFM2: conv, attention, conv, attention), or
    a layer removed from the model, set an override that nothing read, without a word."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                        block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention"] * 2)
    model = patch_model(Lfm2ForCausalLM(config), "score:1000")
    callback = SpanAttentionCallback([Keyframe(0, "score:1000"), Keyframe(1, {"0-1": "score:1100", "2": "simple:10"})])
    with pytest.raises(ValueError, match=r"^SpanAttentionCallback: keyframe at=1 span=\{'0-1': 'score:1100', '2': "
                                         r"'simple:10'\}: layers '2': Lfm2ForCausalLM has no attention module of layer "
                                         r"2; its attention modules carry the layer indices 1, 3$"):
        trainer_with(tmp_path, callback, model=model).train()
    trainer = trainer_with(tmp_path, SpanAttentionCallback([Keyframe(0, {"0-1": "score:1100", "3": "simple:10"})]),
                           model=model)
    trainer.train()  # a range that spans a convolution layer is taken
    logged = trainer.state.log_history[0]
    assert (logged["span/layer1/alpha1"], logged["span/layer3/alpha_q"]) == (1.0, 1.0)
    llama = patch_model(tiny("llama"), "score:1000")
    del llama.model.layers[1]  # its config still counts 2 layers
    with pytest.raises(ValueError, match=r"layers 1: LlamaForCausalLM has no attention module of layer 1; its "
                                         r"attention modules carry the layer indices 0$"):
        trainer_with(tmp_path, SpanAttentionCallback([Keyframe(0, {1: "score:1100"})]), model=llama).train()


def test_settings_put_on_a_composite_model_s_text_config_patch_that_tower(tmp_path):
    """Settings set by hand on a vision-language model's text_config (on the object, or in config.json), the model's
    own field not given: every tower trained with the default score:1000 without a word. Now the language model
    trains with them, the vision tower with stock gradients, and a warning names the field (and the file)."""
    from transformers import LlavaForConditionalGeneration

    from hf_spanattn.integration.registry import settings_for

    model = tiny_llava()
    model.config.text_config.span_attention = SpanAttentionConfig.from_label("score:1100").to_dict()
    with pytest.warns(UserWarning, match="not given, but text_config.span_attention is: patching that tower of "
                                         "LlavaForConditionalGeneration with its settings, the others keep stock"):
        patch_model(model)
    assert [getattr(settings_for(m), "label", None) for m in model.modules() if type(m).__name__ == "LlamaAttention"] \
        == ["score:1100"] * 2
    assert model.config.vision_config._attn_implementation == "sdpa"
    patch_model(tiny_llava(), "score:1100").save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved["text_config"]["span_attention"] = saved.pop("span_attention")
    del saved["vision_config"]["span_attention"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(UserWarning, match=f"{tmp_path / 'config.json'}, field 'span_attention': not given, but "
                                         "text_config.span_attention is"):
        loaded = load_pretrained(tmp_path, model_class=LlavaForConditionalGeneration)
    assert loaded.config.vision_config._attn_implementation == "sdpa"
    assert loaded.config.text_config._attn_implementation == "span_attention"


def test_a_tower_saved_alone_keeps_the_settings_of_its_composite_model(tmp_path):
    """model.language_model.save_pretrained (or the vision tower's) wrote no settings: the composite model's config
    holds them, so the tower loaded with load_pretrained trained with the default score:1000. Now each tower's config
    carries them while patched, through a later patch_model with other settings and unpatch_model."""
    from transformers import AutoModel

    model = patch_model(tiny_llava(), "score:1100")
    for name, tower in [("text", model.model.language_model), ("vision", model.model.vision_tower)]:
        tower.save_pretrained(tmp_path / name)
        assert load_pretrained(tmp_path / name, model_class=AutoModel).config.span_attention == \
            model.config.span_attention
    patch_model(model, "simple:10", layers=[1])  # CLIP's attention carries no layer index: its tower stays stock
    model.model.language_model.save_pretrained(tmp_path / "simple")
    assert load_pretrained(tmp_path / "simple", model_class=AutoModel).config.span_attention == \
        model.config.span_attention
    assert not hasattr(model.config.vision_config, "span_attention")
    unpatch_model(model)
    model.model.language_model.save_pretrained(tmp_path / "stock")
    assert "span_attention" not in json.loads((tmp_path / "stock" / "config.json").read_text())


def test_unpatch_model_of_a_composite_model_unpatches_a_tower_patched_alone():
    """patch_model(model.model.vision_tower), then unpatch_model(model): the model itself was never patched, so the
    vision tower kept training with span gradients. Now every tower is back to stock."""
    model = tiny_llava(patch_size=4, dtype=torch.float64)
    patch_model(model.model.vision_tower, "score:1100")
    unpatch_model(model)
    assert not hasattr(model.config.vision_config, "span_attention")
    _llava_grads_match(tiny_llava(patch_size=4, dtype=torch.float64), model, image_tokens=16)


def test_load_pretrained_keeps_the_attention_given_to_a_tower(tmp_path):
    """load_pretrained(..., attn_implementation={"text_config": "span_attention", "vision_config": "sdpa"}): the vision
    tower was patched all the same, without a word. Now it keeps the attention given, with stock gradients."""
    from transformers import LlavaForConditionalGeneration

    stock = tiny_llava(patch_size=4, dtype=torch.float64)
    patch_model(copy.deepcopy(stock), "score:1100").save_pretrained(tmp_path)
    loaded = load_pretrained(tmp_path, model_class=LlavaForConditionalGeneration, dtype=torch.float64,
                             attn_implementation={"text_config": "span_attention", "vision_config": "sdpa"})
    assert loaded.config.vision_config._attn_implementation == "sdpa"
    patch_model(stock.model.language_model, "score:1100")
    _llava_grads_match(stock, loaded, image_tokens=16)


@pytest.mark.parametrize("case", ["vision tower alone", "text tower otherwise", "vision tower unpatched"])
def test_a_composite_model_saved_with_a_tower_patched_apart_loads_as_it_trained(case, tmp_path):
    """A vision-language model whose vision tower alone was patched, or whose language model was patched again with
    other settings, or whose vision tower was unpatched, saved whole: load_pretrained patched every tower with the
    composite model's settings (or the default), dropping what was done to the tower. Now each tower trains as it
    did before the save."""
    from transformers import LlavaForConditionalGeneration

    model = tiny_llava(patch_size=4, dtype=torch.float64)  # 16 patches and a class token: more than d = 8
    if case == "vision tower alone":
        patch_model(model.model.vision_tower, "score:1100")
    else:
        patch_model(model, "score:1000")
        if case == "text tower otherwise":
            patch_model(model.model.language_model, "score:1100")
        else:
            unpatch_model(model.model.vision_tower)
    model.save_pretrained(tmp_path)
    said = {"vision tower alone": "not given, but vision_config.span_attention is: patching that tower",
            "text tower otherwise": "but text_config.span_attention differs: score:1100: those towers train so",
            "vision tower unpatched": "but vision_config holds none: stock gradients: those towers train so"}[case]
    with pytest.warns(UserWarning, match=said):
        loaded = load_pretrained(tmp_path, model_class=LlavaForConditionalGeneration, dtype=torch.float64)
    _llava_grads_match(model, loaded, image_tokens=16)


@pytest.mark.parametrize("settings", [{}, {"layers": [1]}], ids=["every layer", "layers=[1]"])
def test_a_composite_model_s_settings_set_again_by_hand_load_as_it_trained(settings, tmp_path):
    """Settings set on a patched composite model's config by hand (as README allows) reach every tower at once, but
    the copies patch_model had written on the towers' sub-configs stayed as they were: the saved model loaded with the
    old settings on its towers (with a warning that they trained so). The copies follow at the next forward pass."""
    from transformers import LlavaForConditionalGeneration

    model = patch_model(tiny_llava(patch_size=4, dtype=torch.float64), "score:1000")
    model.config.span_attention = SpanAttentionConfig.from_label("score:1100", **settings).to_dict()
    _llava_grads_match(patch_model(tiny_llava(patch_size=4, dtype=torch.float64), "score:1100", **settings), model,
                       image_tokens=16)
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        loaded = load_pretrained(tmp_path, model_class=LlavaForConditionalGeneration, dtype=torch.float64)
    assert not [w for w in said if "differs" in str(w.message)]
    _llava_grads_match(model, loaded, image_tokens=16)


def test_a_composite_model_holding_a_tower_without_the_backend_flag_that_takes_sdpa_s_arguments_is_patched():
    """Phi-4-multimodal declares attention-backend support around an audio encoder that does not, but whose attention
    passes SDPA's arguments (its learned relative bias inside the mask): patched, its gradients are the stock ones
    under score:1111 (BLIP-2 around T5, whose attention takes a position bias, is refused)."""
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    torch.manual_seed(0)
    audio = dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=4, input_size=8,
                 ext_pw_out_channel=32, depthwise_separable_out_channel=32, nemo_conv_channels=32, time_reduction=2,
                 audio_token_id=VOCAB + 2, left_chunk=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=4, crop_size=16, image_token_id=VOCAB + 1)
    config = Phi4MultimodalConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=VOCAB + 3, pad_token_id=0, bos_token_id=0,
                                  eos_token_id=0, vision_config=vision, audio_config=audio)
    stock = Phi4MultimodalForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    model = patch_model(copy.deepcopy(stock), "score:1111")
    features = torch.randn(2, 24, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def grads(model):
        encoder = model.model.embed_tokens_extend.audio_embed.encoder
        encoder(features, None).pow(2).sum().backward()
        return {name: p.grad for name, p in encoder.named_parameters() if p.grad is not None}

    expected, got = grads(stock), grads(model)
    assert model.config.audio_config._attn_implementation == "span_attention"
    scale = max(grad.norm() for grad in expected.values())  # (key biases have a gradient of 0, up to rounding)
    assert all((got[name] - grad).norm() <= 1e-12 * scale for name, grad in expected.items())


@pytest.mark.parametrize("last", ["model", "adapter"])
def test_a_model_and_an_adapter_saved_into_one_folder_load_as_transformers_loads_them(last, tmp_path):
    """A model saved into a folder that holds an adapter (or an adapter saved into a model's folder): Transformers'
    from_pretrained loads the model saved there with the adapter on top, but load_pretrained loaded the adapter's
    base model (other weights) with the adapter and the adapter's settings, leaving the saved model and its settings
    out. Now it loads what from_pretrained loads, with the model's settings (the adapter's where the model has none),
    says so where the two differ, and the adapter is trainable (is_trainable=True)."""
    from peft import LoraConfig, get_peft_model

    tiny("gpt2", seed=0).save_pretrained(tmp_path / "base")
    model = patch_model(tiny("gpt2", seed=1), "score:1100", layers=[1])
    lora = get_peft_model(patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "simple:10"),
                          LoraConfig(r=2, target_modules=["c_attn"], init_lora_weights=False))
    if last == "model":
        lora.save_pretrained(tmp_path / "both")
        model.save_pretrained(tmp_path / "both")
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "both")
        if not torch.equal(stock.transformer.wte.weight, model.transformer.wte.weight):
            pytest.skip(f"Transformers {transformers.__version__} loads the adapter's base model from such a folder, "
                        "as load_pretrained does there")
        with pytest.warns(UserWarning, match=r"span_attention_config.json holds span attention settings \(simple:10\)"
                                             r".* it trains with score:1100 on layers \[1\]"):
            loaded = load_pretrained(tmp_path / "both")
        expected = patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "both"), "score:1100", layers=[1])
    else:
        unpatch_model(model).save_pretrained(tmp_path / "both")
        lora.save_pretrained(tmp_path / "both")
        loaded = load_pretrained(tmp_path / "both")
        expected = patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "both"), "simple:10")
    assert isinstance(loaded, type(model)) and loaded.peft_config
    (tmp_path / "both" / ".span_attention_save_unfinished").touch()  # an adapter save stopped midway: refused
    with pytest.raises(OSError, match="the last save into .* did not finish"):
        load_pretrained(tmp_path / "both")
    trained = {name for name, weight in loaded.named_parameters() if weight.requires_grad}
    assert trained == {name for name in loaded.state_dict() if "lora" in name}
    expected.requires_grad_(True)  # from_pretrained adds the adapter frozen; load_pretrained's is trainable
    loaded.requires_grad_(True)
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    for one, other in zip(gradients_of(loaded, ids), gradients_of(expected, ids), strict=True):
        assert (one is None) == (other is None) and (one is None or torch.equal(one, other))


def test_patching_a_model_otherwise_than_another_built_from_one_config_says_both_change():
    """Two models built from one config object, patched with two settings: the first took the second's settings
    (its layers read the shared config) without a word. Now the second patch_model says so, naming both settings."""
    config = tiny("gpt2").config
    first, second = (type(tiny("gpt2"))(config) for _ in range(2))
    patch_model(first, "score:1000")
    with pytest.warns(UserWarning, match=r"patch_model: another model that patch_model was given shares the config "
                                         r"object of GPT2LMHeadModel .* from score:1000 to score:1100 on layers \[1\]"):
        patch_model(second, "score:1100", layers=[1])
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = patch_model(copy.deepcopy(tiny("gpt2")), "score:1100", layers=[1])
    expected.load_state_dict(first.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(gradients_of(first, ids), gradients_of(expected, ids), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(second, "score:1100", layers=[1])  # the same settings again: nothing changes for the first


@pytest.mark.parametrize("what", ["model", "adapter"])
def test_load_pretrained_with_output_loading_info_gives_the_model_and_the_info(what, tmp_path):
    """from_pretrained(..., output_loading_info=True) returns (model, loading info); load_pretrained passed the pair
    to patch_model, which failed saying it got a tuple. Now it gives the pair, the model patched with the saved
    settings (an adapter's: the info of its base model)."""
    folder = saved_model(tmp_path, alphas=[1, 1, 0, 0], layers=[1]) if what == "model" else adapter(tmp_path)
    model, info = load_pretrained(folder, output_loading_info=True)
    base = model.get_base_model() if what == "adapter" else model
    assert config_of(base.config) == SpanAttentionConfig.from_label("score:1100").replace(
        layers=[1] if what == "model" else None)
    stock, stock_info = AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert info == stock_info
    weights = {name.replace("base_model.model.", "").replace(".base_layer", ""): weight
               for name, weight in model.state_dict().items() if "lora_" not in name}
    assert all(torch.equal(weights[name], weight) for name, weight in stock.state_dict().items())


def test_replace_with_the_same_method_keeps_the_alphas():
    """replace(method=...) with the method the settings have changes nothing (it gave the method's default alphas);
    another method takes its own default alphas."""
    config = SpanAttentionConfig.from_label("score:1100+QKV101@per_block", layers=[1])
    assert config.replace(method="score") == config
    assert config.replace(method=np.str_("score"), layers=[0]) == SpanAttentionConfig.from_label(
        "score:1100+QKV101@per_block", layers=[0])
    assert config.replace(method="reductionistic", score_grad="exact").alphas == SpanAttentionConfig(
        method="reductionistic").alphas


def test_a_ramp_starts_from_the_setting_an_earlier_keyframe_left_on_the_layer():
    """A layer the previous keyframe's table leaves out keeps an earlier keyframe's setting (as at_step has it), so a
    ramp of that layer starts from it; it was refused as a ramp "from the model setting"."""
    schedule = Schedule([Keyframe(0, "score:1111"), Keyframe(4, {"0": "standard:QKV111"}),
                         Keyframe(8, {"1": "score:1000"}, ramp=True)])
    frames = schedule.resolve(20, None, 2)
    for step in (4, 5, 7, 8, 12):
        t = min((step - 4) / (8 - 4), 1.0)
        settings = Schedule.at_step(frames, step)
        assert settings[0] == SpanAttentionConfig(method="standard")
        assert settings[1].alphas == pytest.approx((1, 1 - t, 1 - t, 1 - t), abs=1e-15), step
    with pytest.raises(ValueError, match="ramps layer 1 from the model setting to score:1000"):  # none before: refused
        Schedule([Keyframe(0, {"0": "score:1111"}), Keyframe(8, {"1": "score:1000"}, ramp=True)]).resolve(20, None, 2)


def test_an_alpha_equal_at_both_ends_of_a_ramp_stays_as_set():
    frames = Schedule([Keyframe(0, "score:1,0.1,0.3,0.1+QKV0.7,1,1"),
                       Keyframe(10, "score:1,0.1,0,0.1+QKV0.7,1,1", ramp=True)]).resolve(20, None, 1)
    for step in range(10):
        config = Schedule.at_step(frames, step)[0]
        assert (config.alphas[1], config.alphas[3], config.qkv_alphas[0]) == (0.1, 0.1, 0.7), config.label
        assert config.alphas[2] == pytest.approx(0.3 * (1 - step / 10), abs=1e-16)


@pytest.mark.parametrize("step", [np.int64(5), torch.tensor(5), np.float32(5.0), torch.tensor(5.0)],
                         ids=["numpy int", "0-d int tensor", "numpy float", "0-d float tensor"])
def test_settings_at_a_step_given_as_a_numpy_or_tensor_number(step):
    """A step as a loop over np.arange or a tensor counter gives it: the settings at the same Python number (it was
    refused as "not a number")."""
    frames = Schedule([Keyframe(0, "score:1111"), Keyframe(10, "score:1000", ramp=True)]).resolve(20, None, 2)
    assert Schedule.at_step(frames, step) == Schedule.at_step(frames, 5)
    with pytest.raises(TypeError, match=r"step=tensor\(True\): expected the optimizer step"):
        Schedule.at_step(frames, torch.tensor(True))


def test_shares_and_epochs_equally_apart_fall_on_steps_equally_apart():
    """A share or an epoch that falls between two steps goes to the nearest, a half up: '15%' and '25%' of 10 steps
    are steps 2 and 3 (Python's round, a half to even, put both on step 2, refused as one step, and '25%' on 20 %)."""
    shares = [Keyframe(f"{p}%", "score:1000").step(10, None) for p in (5, 15, 25, 35, 45)]
    epochs = [Keyframe(f"{e}ep", "score:1000").step(100, 3) for e in (0.5, 1.5, 2.5)]
    assert shares == [1, 2, 3, 4, 5] and epochs == [2, 5, 8]
    schedule = Schedule([Keyframe(0, "score:1111"), Keyframe("15%", "score:1100"), Keyframe("25%", "score:1000")])
    assert [step for step, _, _ in schedule.resolve(10, None, 1)] == [0, 2, 3]


def test_an_order_recorder_given_float16_records_sums_their_squares_without_overflow():
    """A record of float16 gradients past 256 (a loss scale's): the figures of the same record in float64, where
    the squares taken in float16 overflowed to inf (norms inf, cosines NaN)."""
    records = []
    x = [t.detach().requires_grad_(True) for t in qkv(12)]
    span_attention(*x, config="score:1100", probe=records.append).sum().backward()

    def summary(dtype):
        recorder = OrderRecorder()
        for record in records:
            recorder({k: [p.to(dtype) * 1024 for p in v] if isinstance(v, list) else
                      v if k in ("rule", "rank_k", "rank_v") else v.to(dtype) * 1024 for k, v in record.items()})
        return recorder.summary(per_head=True)

    half, wide = summary(torch.float16), summary(torch.float64)
    assert half.keys() == wide.keys()
    for key in wide:
        assert np.allclose(half[key], wide[key], rtol=1e-3, atol=0), key


def test_an_order_recorder_keeps_records_past_1e154_within_float64s_range():
    """Records of float64 gradients past 1e154 (an α of 1e200): their squares' sums overflowed float64 (norms inf,
    shares and cosines NaN). The norms are now those of the records at scale 1 times the scale, and the shares and
    cosines theirs, whichever order small and huge records come in."""
    records = []
    x = [t.detach().double().requires_grad_(True) for t in qkv(12)]
    span_attention(*x, config="score:1100", probe=records.append).sum().backward()

    def summary(*scales):
        recorder = OrderRecorder()
        for scale in scales:
            recorder({k: [p * scale for p in v] if isinstance(v, list) else v if k in ("rule", "rank_k", "rank_v")
                      else v * scale for k, v in records[0].items()})
        return recorder.summary(per_head=True)

    one = summary(1.0)
    for scales, factor in [((1e200,), 1e200), ((1e-300, 1e200), 1e200), ((1e200, 1.0, 1e200), math.sqrt(2) * 1e200)]:
        got = summary(*scales)
        for key, want in one.items():
            times = factor if "norm" in key else 1.0
            assert np.allclose(np.asarray(got[key]) / times, want, rtol=1e-12, atol=0), (scales, key)


@pytest.mark.parametrize("label,field,value", [
    ("score:1000", "alphas", (1, 1, 0, 0)), ("score:1000@per_block", "score_grad", "exact"),
    ("score:1000+QKV101", "qkv_alphas", [1, 1, 1]), ("score:1000", "method", "reductionistic"),
])
def test_a_keyword_of_from_label_that_contradicts_the_label_is_refused(label, field, value):
    """from_label's keywords set the fields the label leaves out; one the label sets too replaced it silently
    (`from_label('score:1000', alphas=...)` gave other alphas than the label says). Agreeing, it is taken."""
    with pytest.raises(ValueError, match=f"label='{re.escape(label)}' sets {field}=.*, and the keyword argument gives "
                                         f"{field}="):
        SpanAttentionConfig.from_label(label, **{field: value})
    written = SpanAttentionConfig.from_label(label)
    assert SpanAttentionConfig.from_label(label, **{field: getattr(written, field)}) == written
    assert SpanAttentionConfig.from_label("score:1000", score_grad="per_block", layers=[1]) == SpanAttentionConfig(
        score_grad="per_block", layers=[1])


@pytest.mark.parametrize("alpha", [0.0, -0.0, 1e30, 5e-324, decimal.Decimal("0.1"), np.float16(0.1), torch.tensor(0.5)],
                         ids=repr)
@pytest.mark.parametrize("field", ["alpha1", "alpha0 per_block", "simple alpha_perp", "alpha_q"])
def test_alphas_at_the_edges_give_the_reference_gradients_in_a_patched_model(alpha, field, monkeypatch):
    """Every α the settings accept (zero of either sign, huge, subnormal, a Decimal, a float16 number, a 0-d tensor)
    gives, in each attention call of a patched float64 Llama, the dQ, dK, dV of the float64 reference formulas at
    that α (T = 12 > head_dim = 8, so that every order of span violation is there)."""
    import hf_spanattn.integration.registry as registry

    config = {"alpha1": SpanAttentionConfig(alphas=(1, alpha, 0, 0)),
              "alpha0 per_block": SpanAttentionConfig(alphas=(alpha, 1, 0, 0), score_grad="per_block"),
              "simple alpha_perp": SpanAttentionConfig(method="simple", alphas=(1, alpha)),
              "alpha_q": SpanAttentionConfig(qkv_alphas=(alpha, 1, 1))}[field]
    calls = []

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        leaves = [x.detach().requires_grad_(True) for x in (query, key, value)]  # the call's own q, k, v
        out = span_attention(*leaves, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                             **kwargs)
        out.retain_grad()
        calls.append((leaves, out, attn_mask, is_causal, scale, kwargs["config"]))
        return out

    monkeypatch.setattr(registry, "span_attention", spy)
    model = patch_model(tiny("llama").double(), config)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    model(ids, labels=ids).loss.backward()
    assert len(calls) == 2
    for leaves, out, mask, causal, scale, used in calls:
        assert used == config
        _, expected = reference(*leaves, out.grad, config, attn_mask=mask, is_causal=causal, scale=scale)
        for name, x, e in zip("qkv", leaves, expected):
            assert (x.grad - e).norm() <= 1e-12 * e.norm() + 1e-300, name


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of a batch of T = 10 > head_dim tokens (with T <= head_dim the parallel span is the whole
    space, and score:1000 gives the standard gradient)."""
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    model.train().zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_layers_reordered_after_patching_are_named_before_training(tmp_path):
    """Layers reordered after patch_model with `layers`: the selection follows each attention module's layer_idx,
    which from_pretrained renumbers by place, so the saved model trained other layers with span gradients, without a
    word. Trainer.train names them; the saved model's gradients differ from the model's (the reason for the word)."""
    model = patch_model(tiny("llama", layers=3).double(), "score:1000", layers=[0])
    model.model.layers = torch.nn.ModuleList(model.model.layers[::-1])
    with pytest.warns(UserWarning, match=r"Trainer\.train: layers=\[0\] selects attention by its layer index, and "
                                         r"model\.layers\.0 \(layer_idx 2\), model\.layers\.2 \(layer_idx 0\) of "
                                         r"LlamaForCausalLM hold attention of another index than their place"):
        trainer_with(tmp_path, model=model).train()
    model.save_pretrained(tmp_path / "saved")
    loaded, saved = _grads(load_pretrained(tmp_path / "saved").double()), _grads(model)
    assert any(not torch.allclose(loaded[name], saved[name]) for name in saved)


def test_a_duplicated_layer_s_copy_is_named_before_training(tmp_path):
    """A layer duplicated after patch_model (copy.deepcopy appended: two attention modules of one layer_idx), under a
    selection of that layer: both train with span gradients, the copy's place is another layer's after a reload."""
    model = patch_model(tiny("llama", layers=2), "score:1000", layers=[1])
    model.model.layers.append(copy.deepcopy(model.model.layers[1]))
    model.config.num_hidden_layers = 3
    with pytest.warns(UserWarning, match=r"Trainer\.train: layers=\[1\] .* model\.layers\.2 \(layer_idx 1\) of "):
        trainer_with(tmp_path, model=model).train()


def test_a_selected_layer_dropped_after_patching_is_named_before_training(tmp_path):
    """The one layer `layers` selects, dropped after patch_model: no layer trained with span gradients, as stock, and
    the saved model failed to load with load_pretrained; Trainer.train says so first."""
    model = patch_model(tiny("llama", layers=3).double(), "score:1000", layers=[2])
    model.model.layers = model.model.layers[:2]
    stock = unpatch_model(copy.deepcopy(model))
    with pytest.warns(UserWarning, match=r"Trainer\.train: model config field 'span_attention': layers=\[2\]: "
                                         r"LlamaForCausalLM has no attention module of layer 2; its attention modules "
                                         r"carry the layer indices 0, 1, so no layer of that index gets span"):
        trainer_with(tmp_path, model=copy.deepcopy(model)).train()
    got, expected = _grads(model), _grads(stock)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_an_inner_model_replaced_after_patching_is_named_before_training(tmp_path):
    """`model.model = other.model` after patch_model: the inner model reads the other model's config (SDPA), so it
    trained with the standard gradient while config.json saved score:1000, without a word. Trainer.train names it."""
    model = patch_model(tiny("llama"), "score:1000")
    model.model = tiny("llama", seed=1).model
    with pytest.warns(UserWarning, match=r"Trainer\.train: model\.layers\.0\.self_attn, model\.layers\.1\.self_attn of "
                                         r"LlamaForCausalLM read their attention implementation from a config that is "
                                         r"not the model's \(LlamaConfig with attn_implementation='sdpa'"):
        trainer_with(tmp_path, model=model).train()


@pytest.mark.parametrize("family", ["gpt2", "gpt_neo", "llama"])
def test_a_model_left_as_patched_trains_without_a_word_of_its_structure(tmp_path, family):
    model = patch_model(tiny(family, layers=2), "score:1000", layers=[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer_with(tmp_path, model=model).train()


@pytest.mark.parametrize("how", ["built on a copy of the config", "copied (depth up-scaling)"])
def test_a_layer_with_a_copy_of_the_patched_config_is_stock_after_unpatching_and_patched_again(how):
    """A decoder layer built after patch_model on copy.deepcopy(model.config), or copied with copy.deepcopy(layer)
    (which copies its config), reads a config of its own that says span_attention: after unpatch_model it kept span
    gradients, as the only layer of the model, without a word. Patched again, it trains with the new settings."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = patch_model(tiny("llama").double(), "score:1000")
    torch.manual_seed(1)
    if how == "copied (depth up-scaling)":
        model.model.layers.append(copy.deepcopy(model.model.layers[1]))
        model.model.layers[2].self_attn.layer_idx = 2
        model.config.num_hidden_layers = 3
    else:
        model.model.layers[1] = LlamaDecoderLayer(copy.deepcopy(model.config), 1).double()
    unpatch_model(model)
    stock = copy.deepcopy(model)
    stock.model.layers[-1].self_attn.config = stock.config
    got, expected = _grads(model), _grads(stock)
    assert all(torch.allclose(got[name], expected[name], rtol=1e-12, atol=0) for name in expected)
    assert not hasattr(model.model.layers[-1].self_attn.config, "span_attention")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        patch_model(model, "score:1100")
    got, expected = _grads(model), _grads(patch_model(stock, "score:1100"))
    assert all(torch.allclose(got[name], expected[name], rtol=1e-12, atol=0) for name in expected)


def test_a_model_config_replaced_after_patching_is_named_before_training(tmp_path):
    """`model.config` replaced after patch_model by a config without settings: the modules still read the patched
    config and trained with span gradients, which save_pretrained no longer wrote, without a word."""
    model = patch_model(tiny("llama"), "score:1000")
    config = copy.deepcopy(model.config)
    del config.span_attention
    config._attn_implementation = "sdpa"
    model.config = config
    with pytest.warns(UserWarning, match=r"Trainer\.train: model\.layers\.0\.self_attn, model\.layers\.1\.self_attn "
                                         r"of LlamaForCausalLM read their attention implementation from a "
                                         r"config that is not the model's, set to 'span_attention'"):
        trainer_with(tmp_path, model=model).train()


def test_a_model_config_replaced_after_patching_is_stock_after_unpatching():
    """`model.config` replaced after patch_model, then unpatch_model: the inner model kept the patched config, and
    the model trained with span gradients after unpatching, without a word."""
    model = patch_model(tiny("llama").double(), "score:1000")
    stock = copy.deepcopy(model)
    unpatch_model(stock)
    config = copy.deepcopy(model.config)
    del config.span_attention
    config._attn_implementation = "sdpa"
    model.config = config
    unpatch_model(model)
    got, expected = _grads(model), _grads(stock)
    assert all(torch.allclose(got[name], expected[name], rtol=1e-12, atol=0) for name in expected)


def test_a_layer_taken_from_another_patched_model_after_patching_is_named_before_training(tmp_path):
    """A decoder layer of another model patched otherwise, put into a patched model after patch_model: it read that
    model's settings (patch_model refuses it before, not after), so it trained under score:1100 in a model of
    score:1000, without a word."""
    model, other = patch_model(tiny("llama"), "score:1000"), patch_model(tiny("llama", seed=1), "score:1100")
    model.model.layers[1] = other.model.layers[1]
    with pytest.warns(UserWarning, match=r"Trainer\.train: model\.layers\.1\.self_attn \(under score:1100\) of "
                                         r"LlamaForCausalLM read the settings of another patched model"):
        trainer_with(tmp_path, model=model).train()


def test_unpatching_a_model_holding_another_patched_model_s_inner_model_leaves_that_model_patched():
    """`model.model = other.model`, both patched, then unpatch_model(model): Transformers' set_attn_implementation set
    the other model's config to SDPA, so it trained with the standard gradient while its config kept score:1100, without
    a word. It keeps its span gradients, and the shared part is named."""
    other = patch_model(tiny("llama", seed=1).double(), "score:1100")
    expected = _grads(other)
    model = patch_model(tiny("llama").double(), "score:1000")
    model.model = other.model
    with pytest.warns(UserWarning, match=r"unpatch_model: model of LlamaForCausalLM is also a part of another patched "
                                         r"model \(put in after patch_model\), which keeps its span gradients"):
        unpatch_model(model)
    got = _grads(other)
    assert other.config._attn_implementation == "span_attention"
    assert all(torch.allclose(got[name], expected[name], rtol=1e-12, atol=0) for name in expected)
