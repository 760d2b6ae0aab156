"""PEFT adapters carry the settings: saved beside the adapter (and in Trainer checkpoints), restored
by `load_pretrained`; a plain PEFT reload into an unpatched model warns."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import transformers
from models import VOCAB, tiny
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_spanattn
from hf_spanattn.config import CONFIG_NAME

TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "k_proj", "v_proj"]}


def lora_model(family: str, folder: str, label: str = "score:1000"):
    """A pretrained start (a tiny model saved to `folder`), patched, with LoRA whose B is not zero."""
    tiny(family).save_pretrained(folder)
    base = hf_spanattn.patch_model(AutoModelForCausalLM.from_pretrained(folder), label)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], lora_dropout=0.0))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model.train()


def lora_gradients(model) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n.replace(".default", ""): p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_adapter_folder_keeps_the_settings_and_reloads_them(family, tmp_path):
    model = lora_model(family, str(tmp_path / "base"))
    before = lora_gradients(model)
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / CONFIG_NAME).read_text())
    assert hf_spanattn.SpanAttentionConfig.from_dict(saved).label == "score:1000"

    reloaded = hf_spanattn.load_pretrained(str(tmp_path / "adapter"))
    assert isinstance(reloaded, PeftModel)
    after = lora_gradients(reloaded.train())
    assert after.keys() == before.keys() and before
    for name, grad in before.items():
        assert rel(after[name], grad) <= 1e-6, name

    # plain PEFT into an unpatched base: it says so, and the gradients are the standard ones
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with pytest.warns(UserWarning, match="not patched"):
        plain = PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    stock = lora_gradients(plain.train())
    assert max(rel(stock[name], grad) for name, grad in before.items()) > 1e-4
    with warnings.catch_warnings(record=True) as caught:  # patched first: no warning
        warnings.simplefilter("always")
        base = hf_spanattn.patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "score:1000")
        PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    assert not [w for w in caught if "not patched" in str(w.message)]


def test_an_adapter_added_to_an_unpatched_peft_model_says_it_trains_with_the_standard_gradient(tmp_path):
    """PeftModel.load_adapter (a second adapter, then set_adapter) of a folder with settings into an unpatched model
    trained it with the standard gradient without a word; only PeftModel.from_pretrained said so."""
    lora_model("llama", str(tmp_path / "base"), "score:1100").save_pretrained(tmp_path / "adapter")
    plain = get_peft_model(tiny("llama"), LoraConfig(r=2, target_modules=["k_proj"]), adapter_name="mine")
    with pytest.warns(UserWarning, match=r"adapter holds span attention settings \(score:1100\) but the model it was "
                                         "loaded into is not patched, so it trains with the standard gradient"):
        plain.load_adapter(tmp_path / "adapter", adapter_name="saved")
    with warnings.catch_warnings(record=True) as caught:  # from_pretrained, which calls load_adapter: said once
        warnings.simplefilter("always")
        PeftModel.from_pretrained(tiny("llama"), tmp_path / "adapter")
    assert len([w for w in caught if "not patched" in str(w.message)]) == 1


def test_trainer_checkpoint_of_a_lora_model_keeps_the_settings(tmp_path):
    model = lora_model("llama", str(tmp_path / "base"), "score:1100@per_block")
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, save_steps=1, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert os.path.isfile(checkpoint / "adapter_config.json")
    reloaded = hf_spanattn.load_pretrained(str(checkpoint))
    settings = reloaded.get_base_model().config.span_attention
    assert hf_spanattn.SpanAttentionConfig.from_dict(settings).label == "score:1100@per_block"
    assert reloaded.get_base_model().config._attn_implementation == "span_attention"


def test_an_adapter_loaded_into_a_model_set_to_span_attention_without_settings_trains_with_the_adapters(tmp_path):
    """AutoPeftModelForCausalLM.from_pretrained(adapter, attn_implementation="span_attention"): the base model's config
    holds no settings, those saved beside the adapter patch it (not the default rule)."""
    from peft import AutoPeftModelForCausalLM

    model = lora_model("llama", str(tmp_path / "base"), "score:1100")
    before = lora_gradients(model)
    model.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", attn_implementation="span_attention",
                                                          is_trainable=True)
    assert not [w for w in caught if "not patched" in str(w.message)]
    after = lora_gradients(loaded.train())
    assert after.keys() == before.keys() and before
    for name, grad in before.items():
        assert rel(after[name], grad) <= 1e-6, name


@pytest.mark.parametrize("kind", ["PrefixTuningConfig", "PromptTuningConfig"])
def test_a_prompt_learning_adapter_loads_for_inference_and_the_error_names_is_trainable(kind, tmp_path):
    """PEFT loads prompt-learning adapters (prefix tuning, prompt tuning, p-tuning) for inference only."""
    import peft

    tiny("llama").save_pretrained(tmp_path / "base")
    base = hf_spanattn.patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "score:1100")
    model = get_peft_model(base, getattr(peft, kind)(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    stock = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                           getattr(peft, kind)(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    try:
        with torch.no_grad():
            stock(input_ids=ids)
    except Exception as error:  # PEFT 0.13's prefix tuning hands Transformers 4.56 a legacy tuple cache
        pytest.skip(f"{kind} fails without hf_spanattn in PEFT {peft.__version__} with Transformers "
                    f"{transformers.__version__}: {error!r}")
    model.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"adapter \(prompt learning\), which PEFT loads for inference only: pass "
                                         "is_trainable=False"):
        hf_spanattn.load_pretrained(tmp_path / "adapter")
    loaded = hf_spanattn.load_pretrained(tmp_path / "adapter", is_trainable=False)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    settings = loaded.get_base_model().config.span_attention
    assert hf_spanattn.SpanAttentionConfig.from_dict(settings).label == "score:1100"


@pytest.mark.parametrize("order", ["patched before wrapping", "patched after wrapping"])
def test_an_attention_module_in_modules_to_save_trains_with_the_models_settings(order, tmp_path):
    """PEFT's modules_to_save trains a deep copy of the module, config included: the copy of an attention module
    follows patch_model and unpatch_model as the module it copies does."""
    import peft

    tiny("llama").save_pretrained(tmp_path / "base")
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))

    def k_grad(model, name: str) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return dict(model.named_parameters())[name].grad

    def reference(label: str | None) -> torch.Tensor:  # LoRA's B is zero: the model's function is the base model's
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        model = hf_spanattn.patch_model(model, label) if label else model
        return k_grad(model, "model.layers.1.self_attn.k_proj.weight")

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    if order == "patched before wrapping":
        hf_spanattn.patch_model(base, "score:1100")
    lora = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.layers.1.self_attn"])
    try:
        get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora)(input_ids=ids, labels=ids)
    except Exception as error:  # PEFT 0.13 wraps no module holding a LoRA target, calls none with keywords
        pytest.skip(f"modules_to_save of an attention module fails without hf_spanattn in PEFT {peft.__version__} "
                    f"with Transformers {transformers.__version__}: {error!r}")
    model = get_peft_model(base, lora)
    if order == "patched after wrapping":
        hf_spanattn.patch_model(model, "score:1100")
    copy = "base_model.model.model.layers.1.self_attn.modules_to_save.default.k_proj.weight"
    assert rel(k_grad(model, copy), reference("score:1100")) <= 1e-6
    hf_spanattn.patch_model(model, "score:1000")
    assert rel(k_grad(model, copy), reference("score:1000")) <= 1e-6
    hf_spanattn.unpatch_model(model)
    assert rel(k_grad(model, copy), reference(None)) <= 1e-6


@pytest.mark.parametrize("peft", [True, False])
def test_a_run_resumed_into_a_model_set_to_span_attention_without_settings_says_what_it_trains_with(peft, tmp_path):
    """A model set to span_attention by from_pretrained, without settings, trains with the default rule, not the
    standard gradient; resuming a LoRA checkpoint, PEFT's load_adapter patches it with the checkpoint's settings."""
    tiny("llama").save_pretrained(tmp_path / "base")
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def trainer(model, out: str) -> Trainer:
        if peft:
            model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
        args = TrainingArguments(str(tmp_path / out), max_steps=2, save_steps=1, per_device_train_batch_size=2,
                                 report_to="none", use_cpu=True, disable_tqdm=True)
        return Trainer(model=model, args=args, train_dataset=data)

    base = hf_spanattn.patch_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), "score:1100")
    trainer(base, "first").train()
    resumed = trainer(AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="span_attention"),
                      "second")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-1"))
    said = [str(w.message) for w in caught if "resume_from_checkpoint" in str(w.message)]
    if peft:
        assert not said
        settings = resumed.model.get_base_model().config.span_attention
        assert hf_spanattn.SpanAttentionConfig.from_dict(settings).label == "score:1100"
    else:
        assert len(said) == 1 and "trains with score:1000: the model's settings win" in said[0]


def test_adapter_settings_that_do_not_fit_a_model_set_to_span_attention_name_their_file(tmp_path):
    from peft import AutoPeftModelForCausalLM

    lora_model("llama", str(tmp_path / "base"), "score:1100").save_pretrained(tmp_path / "adapter")
    saved = tmp_path / "adapter" / CONFIG_NAME
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "layers": [5]}))
    with pytest.raises(ValueError, match=rf"^{saved}: layers=\[5\]: LlamaForCausalLM has layers 0..1"):
        AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", attn_implementation="span_attention")
