"""Task heads (sequence and token classification, question answering) on a patched model: the same outputs and
standard gradients as the stock model, and saved heads that load back with them."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from models import VOCAB, tiny_config
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import hf_spanattn
from hf_spanattn.integration.stored import config_of

PAD = 5


def head(auto_class, family: str, **fields):
    """A tiny model of `family` with the head of `auto_class`, float64, padding token PAD."""
    torch.manual_seed(0)
    config = tiny_config(family)
    config.pad_token_id = PAD
    config.update(fields)
    return auto_class.from_config(config).double()


def padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12, 9 and 5 tokens padded with PAD on `side`, and their attention mask."""
    ids = torch.randint(PAD + 1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, length in enumerate((12, 9, 5)):
        cut = slice(length, None) if side == "right" else slice(None, 12 - length)
        mask[row, cut], ids[row, cut] = 0, PAD
    return ids, mask


HEADS = {
    "sequence": (AutoModelForSequenceClassification, {"num_labels": 3},
                 lambda ids: {"labels": torch.tensor([0, 2, 1])}),
    "multi-label": (AutoModelForSequenceClassification, {"num_labels": 3, "problem_type": "multi_label_classification"},
                    lambda ids: {"labels": torch.tensor([[1.0, 0, 1], [0, 1, 0], [1, 1, 0]])}),
    "token": (AutoModelForTokenClassification, {"num_labels": 4}, lambda ids: {"labels": ids % 4}),
    "question answering": (AutoModelForQuestionAnswering, {}, lambda ids: {"start_positions": torch.tensor([1, 2, 0]),
                                                                          "end_positions": torch.tensor([3, 4, 2])}),
}


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("kind", HEADS)
def test_heads_train_as_stock_under_the_standard_rule(family, kind):
    """Padded on the left (the classifier reads the last token that is not padding), in training mode (the heads'
    dropout drawn from the same seed): outputs, loss and gradients are the stock model's."""
    auto_class, fields, targets = HEADS[kind]
    stock = head(auto_class, family, **fields)
    patched = hf_spanattn.patch_model(copy.deepcopy(stock), "standard:QKV111")
    ids, mask = padded("left")
    params = inspect.signature(stock.forward).parameters.values()  # Transformers 4's GPT-2 QA head takes no use_cache
    cache = {"use_cache": False} if any(p.name == "use_cache" or p.kind is p.VAR_KEYWORD for p in params) else {}
    outputs = []
    for model in (stock, patched):
        torch.manual_seed(3)
        out = model(input_ids=ids, attention_mask=mask, **cache, **targets(ids))
        out.loss.backward()
        outputs.append(out)
    for key in outputs[0].keys():
        torch.testing.assert_close(outputs[1][key], outputs[0][key], rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_load_pretrained_keeps_a_saved_classifier(family, tmp_path):
    """Without model_class, a saved classifier loads as the classifier it is, not a causal LM without its head."""
    model = hf_spanattn.patch_model(head(AutoModelForSequenceClassification, family, num_labels=3), "score:1100")
    model.save_pretrained(tmp_path)
    loaded = hf_spanattn.load_pretrained(tmp_path, dtype=torch.float64)
    assert type(loaded) is type(model)
    assert config_of(loaded.config).label == "score:1100"
    ids, mask = padded("right")
    with torch.no_grad():
        expected = model.eval()(ids, attention_mask=mask).logits
        torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, expected)


def test_load_pretrained_keeps_the_multiple_choice_head_of_gpt2_double_heads(tmp_path):
    """GPT2DoubleHeadsModel (a language and a multiple-choice head) loads as itself, not as GPT2LMHeadModel."""
    from transformers import GPT2DoubleHeadsModel

    model = GPT2DoubleHeadsModel(head(AutoModelForSequenceClassification, "gpt2").config).double().eval()
    hf_spanattn.patch_model(model, "score:1000").save_pretrained(tmp_path)
    loaded = hf_spanattn.load_pretrained(tmp_path, dtype=torch.float64)
    assert type(loaded) is GPT2DoubleHeadsModel and config_of(loaded.config).label == "score:1000"
    choices = padded("right")[0][None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(choices, mc_token_ids=torch.tensor([[4, 8, 11]])).mc_logits,
                                   model(choices, mc_token_ids=torch.tensor([[4, 8, 11]])).mc_logits)


def test_load_pretrained_keeps_a_classifier_adapters_head(tmp_path):
    """A LoRA adapter of a classifier (task_type SEQ_CLS, its score head saved with it) loads onto a classifier, as
    PEFT's AutoPeftModelForSequenceClassification loads it: the trained head is not dropped."""
    head(AutoModelForSequenceClassification, "llama", num_labels=3).save_pretrained(tmp_path / "base")
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", dtype=torch.float64)
    model = get_peft_model(hf_spanattn.patch_model(base, "score:1000"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS"))
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.add_(0.5)  # trained
    model.save_pretrained(tmp_path / "adapter")
    loaded = hf_spanattn.load_pretrained(tmp_path / "adapter", dtype=torch.float64)
    assert isinstance(loaded.get_base_model(), type(base))
    assert config_of(loaded.get_base_model().config).label == "score:1000"
    ids, mask = padded("left")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids, attention_mask=mask).logits,
                                   model.eval()(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_patch_model_refuses_a_config_that_asks_for_attention_weights(family, tmp_path):
    """A config with output_attentions=True gets eager attention, which returns the weights. Patched, the forward pass
    was SDPA's, returning none without a word, and save_pretrained then failed in Transformers' config validation
    (output_attentions needs eager attention): patch_model refuses it, naming the field, and the model is unchanged."""
    model = head(AutoModelForSequenceClassification, family, num_labels=3, output_attentions=True)
    with pytest.raises(ValueError, match="sets output_attentions=True, which Transformers allows with eager attention"):
        hf_spanattn.patch_model(model, "score:1000")
    assert model.config._attn_implementation == "eager" and getattr(model.config, "span_attention", None) is None
    model.save_pretrained(tmp_path)
    model.config.output_attentions = False  # as the message says
    hf_spanattn.patch_model(model, "score:1000").save_pretrained(tmp_path)
    assert hf_spanattn.load_pretrained(tmp_path).config._attn_implementation == "span_attention"
