"""The Hub page of a model trained or saved with the package names it: the card's tags carry
hf_spanattn, the rule label and the package version, and base_model where it was fine-tuned.
Uploads go to a stand-in for the Hub API (nothing leaves the machine)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.modelcard
import transformers.trainer
import transformers.utils.hub
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import EntryNotFoundError
from models import VOCAB, route_hub, tiny
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

import hf_spanattn

EXPECTED_TAGS = {"hf_spanattn", "span_attention:score:1100@per_block", f"hf_spanattn_version:{hf_spanattn.__version__}"}


class FakeHub:
    """What Transformers calls on the Hub API when pushing; keeps each README.md it would upload."""

    def __init__(self):
        self.cards: list[str] = []

    def create_repo(self, repo_id, **kwargs):
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        for op in operations:
            if op.path_in_repo == "README.md":
                self.cards.append(Path(op.path_or_fileobj).read_text())

    def upload_folder(self, repo_id, folder_path, **kwargs):
        self.cards.append((Path(folder_path) / "README.md").read_text())

    def model_info(self, repo_id, **kwargs):
        return types.SimpleNamespace(tags=["license:mit"])


@pytest.fixture
def hub(monkeypatch):
    fake = FakeHub()
    route_hub(monkeypatch, fake, transformers.utils.hub, transformers.trainer, transformers.modelcard)

    def no_card_yet(*args, **kwargs):
        raise EntryNotFoundError("no README.md in the repository yet")

    monkeypatch.setattr(transformers.utils.hub.ModelCard, "load", no_card_yet)
    return fake


def card_of(text: str) -> ModelCard:
    return ModelCard(text)


def fine_tuned(family: str = "gpt2"):
    """A patched model as if loaded from a Hub repository."""
    model = tiny(family)
    model.config._name_or_path = "someone/tiny-base"
    return hf_spanattn.patch_model(model, "score:1100@per_block")


def test_model_push_to_hub_card_names_the_method(hub):
    model = fine_tuned()
    model.push_to_hub("me/tiny-span")
    (card,) = hub.cards
    assert EXPECTED_TAGS <= set(card_of(card).data.tags)


def test_patching_again_or_unpatching_replaces_the_tags():
    model = fine_tuned()
    model.add_model_tags(["mine"])
    hf_spanattn.patch_model(model, "score:1000")
    assert set(model.model_tags) == {"mine", "hf_spanattn", "span_attention:score:1000",
                                     f"hf_spanattn_version:{hf_spanattn.__version__}"}
    hf_spanattn.unpatch_model(model)
    assert model.model_tags == ["mine"]


def test_trainer_push_to_hub_card_names_the_method_and_the_base_model(hub, tmp_path):
    model = fine_tuned()
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, disable_tqdm=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    trainer.push_to_hub()
    assert hub.cards == [(tmp_path / "out" / "README.md").read_text()]
    card = card_of(hub.cards[0])
    assert EXPECTED_TAGS <= set(card.data.tags)
    assert card.data.base_model == "someone/tiny-base"


def test_lora_adapter_card_names_the_method_and_the_base_model(tmp_path):
    model = get_peft_model(fine_tuned("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    card = card_of((tmp_path / "adapter" / "README.md").read_text())
    assert EXPECTED_TAGS <= set(card.data.tags)
    assert card.data.base_model == "someone/tiny-base"
    assert card.data.library_name == "peft"


@pytest.mark.parametrize("existing,kept", [("mine", ["mine"]), ([1, None, "mine"], [1, None, "mine"]),
                                           (("a", "hf_spanattn"), ["a"]), (5, [5]), (b"mine", [b"mine"]),
                                           (["span_attention:my notes", "hf_spanattn_version:mine"],
                                            ["span_attention:my notes", "hf_spanattn_version:mine"]),
                                           (np.array(["a", "hf_spanattn"]), ["a"])])
def test_odd_existing_tags_are_kept_as_they_are(existing, kept):
    """A tag set as one string is one tag (as add_model_tags takes it), not one per character, and so are bytes
    and a number; tags that are not strings are left alone rather than failing the patch, and so are a user's own
    tags that only begin as the package's do; an array of tags is a list of them."""
    model = fine_tuned()
    model.model_tags = existing
    hf_spanattn.patch_model(model, "score:1000")
    assert model.model_tags == [*kept, "hf_spanattn", "span_attention:score:1000",
                                f"hf_spanattn_version:{hf_spanattn.__version__}"]
    hf_spanattn.unpatch_model(model)
    assert model.model_tags == kept


def trainer_of(model, out: Path, **kwargs) -> Trainer:
    ids = torch.randint(1, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(str(out), max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True,
                             disable_tqdm=True, save_strategy="no", **kwargs)
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])


@pytest.mark.parametrize("given", [None, "mine", ["mine"]])
def test_trainer_create_model_card_alone_names_the_method(given, tmp_path):
    """Transformers' create_model_card takes its tags only from its argument: called alone, without push_to_hub, it
    wrote a card without the package's tags."""
    trainer = trainer_of(fine_tuned(), tmp_path)
    trainer.create_model_card(tags=given)
    tags = set(card_of((tmp_path / "README.md").read_text()).data.tags)
    assert EXPECTED_TAGS <= tags
    assert ("mine" in tags) == (given is not None)
    hf_spanattn.unpatch_model(trainer.model)
    trainer.create_model_card()
    assert not {tag for tag in card_of((tmp_path / "README.md").read_text()).data.tags if "span" in tag}


def test_a_trainer_class_defined_after_patching_names_the_method_in_its_card(tmp_path):
    """TRL's trainers write their own card (at every checkpoint); one imported after patch_model has its
    create_model_card wrapped when the class is defined."""
    model = fine_tuned()

    class OwnCard(Trainer):
        def create_model_card(self, model_name=None, tags=None):
            yaml = ModelCardData(tags=list(tags or [])).to_yaml()
            (Path(self.args.output_dir) / "README.md").write_text(f"---\n{yaml}\n---\n")

    trainer = trainer_of(model, tmp_path)
    trainer.__class__ = OwnCard
    trainer.create_model_card()
    assert EXPECTED_TAGS <= set(card_of((tmp_path / "README.md").read_text()).data.tags)


def test_a_card_written_again_after_patching_again_names_only_the_new_settings(tmp_path):
    """Transformers keeps the tags of the README.md already in the output dir when given tags: the card of a model
    patched again named both rules."""
    trainer = trainer_of(fine_tuned(), tmp_path)
    trainer.create_model_card(tags=np.array(["mine"]))  # numpy's str_ tags: written as plain strings, readable
    hf_spanattn.patch_model(trainer.model, "score:1000")
    trainer.create_model_card()
    tags = card_of((tmp_path / "README.md").read_text()).data.tags
    assert "span_attention:score:1000" in tags and "mine" in tags
    assert not [tag for tag in tags if tag.startswith("span_attention:score:1100")]
    hf_spanattn.unpatch_model(trainer.model)
    trainer.create_model_card(tags=["yours"])
    tags = card_of((tmp_path / "README.md").read_text()).data.tags
    assert "yours" in tags and "mine" in tags and not [tag for tag in tags if "span" in tag]


def test_a_model_loaded_with_attn_implementation_span_attention_names_the_method_after_training(hub, tmp_path):
    """from_pretrained(..., attn_implementation="span_attention") trains with span gradients without patch_model,
    which tags the model: its cards had no hf_spanattn tags."""
    hf_spanattn.patch_model(tiny("gpt2"), "score:1100@per_block").save_pretrained(tmp_path / "saved")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="span_attention")
    trainer = trainer_of(model, tmp_path / "out")
    trainer.train()
    trainer.create_model_card()
    assert EXPECTED_TAGS <= set(card_of((tmp_path / "out" / "README.md").read_text()).data.tags)
    model.push_to_hub("me/tiny-span")
    assert EXPECTED_TAGS <= set(card_of(hub.cards[-1]).data.tags)
