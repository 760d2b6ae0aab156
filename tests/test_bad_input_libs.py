"""Libraries users put around a patched model: a module of their own around a Transformers backbone,
sentence-transformers, Accelerate's own training loop, torch.func, weight averaging and parametrizations. Each
case gives the stock model's (SDPA's) result, the model patched alone's, or a clear error."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from models import VOCAB, tiny
from transformers import Trainer, TrainingArguments

from hf_spanattn import patch_model, unpatch_model
from hf_spanattn.integration.stored import config_of

IDS = torch.randint(1, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))


class Around(torch.nn.Module):
    """A module of one's own around a Transformers model (as a SentenceTransformer or a model with a head of its
    own holds one): its forward returns the backbone's output."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        return self.backbone(input_ids=input_ids, labels=labels)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def trainer(tmp_path, model: torch.nn.Module, **kwargs) -> Trainer:
    return Trainer(model=model, train_dataset=[{"input_ids": i, "labels": i} for i in IDS],
                   args=TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True), **kwargs)


def test_a_module_around_one_transformers_model_is_patched_through_it():
    """patch_model and unpatch_model of a module holding one Transformers model (a SentenceTransformer, a head of
    one's own) reach that model, as through PEFT: the gradients of the model patched alone, then the stock ones.
    A module holding several is refused, naming each."""
    stock = tiny("gpt2").double()
    alone = grads(patch_model(copy.deepcopy(stock), "score:1100"))
    around = Around(copy.deepcopy(stock))
    assert patch_model(around, "score:1100") is around
    assert config_of(around.backbone.config).label == "score:1100"
    for got, want in zip(grads(around), alone):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    unpatch_model(around)
    for got, want in zip(grads(around), grads(stock)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    two = torch.nn.ModuleDict({"query": tiny("gpt2"), "document": tiny("gpt2")})
    with pytest.raises(TypeError, match=r"patch_model needs .* got ModuleDict; it holds 2 of them \(query, document\), "
                                        r"and patch_model takes one: give it each one alone"):
        patch_model(two, "score:1000")


def test_a_module_around_a_model_loaded_unpatched_from_a_patched_save_says_it_trains_stock(tmp_path):
    """A Trainer given a module around a model loaded without patching from a patched save (as SentenceTransformer
    loads its folder) trained with the standard gradient without a word, where the model itself gets the stock
    Trainer's warning; now the same warning."""
    from transformers import AutoModelForCausalLM

    patch_model(tiny("gpt2"), "score:1100").save_pretrained(tmp_path / "saved")
    loaded = Around(AutoModelForCausalLM.from_pretrained(tmp_path / "saved"))
    with pytest.warns(UserWarning, match=r"Trainer\.train: the model config holds the span attention settings "
                                         r"score:1100, but its attention implementation is 'sdpa'"):
        trainer(tmp_path / "run", loaded).train()


def test_a_schedule_runs_on_a_module_around_a_patched_model(tmp_path):
    """SpanAttentionCallback on a Trainer whose model is a module around a patched one (a SentenceTransformer's
    trainer): it raised patch_model's TypeError; now the schedule's α and the diagnostics, as on the model itself."""
    from hf_spanattn.training import Keyframe, SpanAttentionCallback

    def logged(model: torch.nn.Module, name: str) -> dict:
        callback = SpanAttentionCallback(schedule=[Keyframe(0, "score:1100")], diagnostics_every=1)
        run = trainer(tmp_path / name, model, callbacks=[callback])
        run.args.logging_steps = 1
        run.train()
        return {k: v for k, v in run.state.log_history[0].items() if k.startswith("span/")}

    stock = tiny("gpt2")
    around = logged(Around(patch_model(copy.deepcopy(stock), "score:1000")), "around")
    alone = logged(patch_model(copy.deepcopy(stock), "score:1000"), "alone")
    assert around.keys() == alone.keys() and "span/alpha1" in around
    for key, value in alone.items():
        assert around[key] == pytest.approx(value, rel=1e-6), key


def tiny_bert_folder(folder) -> str:
    """A tiny BERT and a word-level tokenizer saved to `folder`, as a sentence-transformers model starts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *"the cat dog sat on a mat ran red blue".split()]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]").save_pretrained(folder)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)).save_pretrained(folder)
    return str(folder)


def test_sentence_transformer_patched_whole_trains_as_its_model_patched_alone(tmp_path):
    """patch_model of a SentenceTransformer (on a tiny BERT saved to a folder) patches its Transformers model: one
    training step with MultipleNegativesRankingLoss gives the weights of the inner model patched alone; under
    standard:QKV111 those of the stock one; saved and loaded again, the inner config.json keeps the settings."""
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    tiny_bert_folder(tmp_path / "bert")
    texts = ["the cat sat on a mat " * 4, "a dog ran", "red blue mat " * 7, "the dog sat on the cat"]
    pairs = [st.InputExample(texts=[a, b]) for a, b in zip(texts, texts[::-1])]

    def step(model) -> list[torch.Tensor]:
        model.double()
        features = [model.preprocess([e.texts[i] for e in pairs]) for i in (0, 1)]
        model.zero_grad()
        MultipleNegativesRankingLoss(model)(features, None).backward()
        with torch.no_grad():
            return [p - 0.1 * p.grad for p in model.parameters() if p.grad is not None]

    def loaded(folder=tmp_path / "bert"):
        return st.SentenceTransformer(str(folder), device="cpu")

    whole = patch_model(loaded(), "score:1100")
    inner = loaded()
    patch_model(inner[0].auto_model, "score:1100")
    for got, want in zip(step(whole), step(inner)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(step(patch_model(loaded(), "standard:QKV111")), step(loaded())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    whole.save(str(tmp_path / "saved"))
    again = patch_model(loaded(tmp_path / "saved"))
    assert config_of(again[0].auto_model.config).label == "score:1100"
    for got, want in zip(step(again), step(whole)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_sentence_transformer_resumed_unpatched_from_a_patched_checkpoint_says_so(tmp_path):
    """SentenceTransformerTrainer resuming a checkpoint saved patched (its config.json holds the settings) with a
    SentenceTransformer that is not patched trained on with the standard gradient without the stock Trainer's
    resume warning; now that warning, naming both."""
    st = pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    folder = tiny_bert_folder(tmp_path / "bert")
    pairs = Dataset.from_dict({"anchor": ["the cat sat", "a dog ran"] * 2, "positive": ["red mat", "blue cat"] * 2})

    def trainer(model, steps: int):
        args = st.SentenceTransformerTrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=2,
                                                       max_steps=steps, save_steps=1, report_to=[], use_cpu=True,
                                                       disable_tqdm=True)
        return st.SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs,
                                             loss=MultipleNegativesRankingLoss(model))

    trainer(patch_model(st.SentenceTransformer(folder, device="cpu"), "score:1100"), 1).train()
    with pytest.warns(UserWarning, match=r"resume_from_checkpoint: .*checkpoint-1 was saved with span attention "
                                         r"settings score:1100, but the model given to the Trainer trains with the "
                                         r"standard gradient"):
        trainer(st.SentenceTransformer(folder, device="cpu"), 2).train(resume_from_checkpoint=True)


class Int8Linear(torch.nn.Module):
    """A Linear whose frozen weight is stored as int8 with a scale per output row, dequantized in the forward pass
    (what weight-only quantization of a projection amounts to)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.register_buffer("scale", weight.abs().amax(1, keepdim=True) / 127)
        self.register_buffer("weight", torch.round(weight / self.scale).to(torch.int8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized())

    def dequantized(self) -> torch.Tensor:
        return self.weight.to(self.scale.dtype) * self.scale


def trained_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients of the parameters that train (frozen and quantized weights have none)."""
    model.zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_projections_quantized_to_int8_get_the_rule_of_their_dequantized_weights():
    """A model whose q, k and v projections hold frozen int8 weights trains, under each rule, with the gradients of
    the same model holding the dequantized weights in plain Linear layers (float64, so to rounding): a rule acts on
    the attention's dQ and dK, whatever the projections are; and standard:QKV111 is the quantized model's own."""
    quantized = tiny("llama").double()
    for layer in quantized.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(layer.self_attn, name, Int8Linear(getattr(layer.self_attn, name)))
    reference = copy.deepcopy(quantized)
    for layer in reference.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(layer.self_attn, name).dequantized()
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            setattr(layer.self_attn, name, linear)
    stock = trained_grads(quantized)
    torch.testing.assert_close(trained_grads(patch_model(copy.deepcopy(quantized), "standard:QKV111")), stock,
                               rtol=0, atol=0)
    for label in ("score:1000", "score:1100@per_block", "reductionistic:1100", "simple:10"):
        got = trained_grads(patch_model(copy.deepcopy(quantized), label))
        want = trained_grads(patch_model(copy.deepcopy(reference), label))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
        assert not all(torch.allclose(a, b) for a, b in zip(got, stock))  # the rule acts


def test_a_bitsandbytes_qlora_model_trains_as_stock_under_the_standard_rule_and_saves_both_configs(tmp_path):
    """QLoRA: a 4-bit bitsandbytes model (CPU backend) with LoRA on q, k and v gets the stock model's gradients under
    standard:QKV111 and trains under score:1000; saved, the folder keeps quantization_config beside the settings,
    and load_pretrained gives it back quantized and patched."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from hf_spanattn import load_pretrained

    torch.manual_seed(0)  # bitsandbytes' CPU kernel takes rows of at least its block size, 64
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                 intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
                     ).save_pretrained(tmp_path / "base")
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)

    def qlora(label: str | None) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"],
                                                 init_lora_weights=False))
        return model if label is None else patch_model(model, label)

    stock = trained_grads(qlora(None))
    assert len(stock) == 12  # lora_A and lora_B of q, k and v in two layers
    torch.testing.assert_close(trained_grads(qlora("standard:QKV111")), stock, rtol=0, atol=0)
    model = qlora("score:1000")
    assert not all(torch.allclose(a, b) for a, b in zip(trained_grads(model), stock))
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["quantization_config"]["load_in_4bit"] and saved["span_attention"]["method"] == "score"
    loaded = load_pretrained(tmp_path / "merged")
    assert type(loaded.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert config_of(loaded.config).label == "score:1000" and loaded.config._attn_implementation == "span_attention"
