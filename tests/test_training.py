"""Saving, loading and training patched models with the stock Trainer."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from models import VOCAB, tiny, tiny_bert2gpt2
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_spanattn import SpanAttentionConfig, load_pretrained, patch_model, unpatch_model
from hf_spanattn.integration.stored import config_of


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=16, seed=0):
        self.ids = torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(tmp_path, **overrides):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=4, learning_rate=1e-3, logging_steps=1, save_steps=2, report_to=[], use_cpu=True,
                seed=7, data_seed=7, disable_tqdm=True)
    return TrainingArguments(**{**base, **overrides})


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


CONFIG = SpanAttentionConfig.from_label("score:1100@per_block", layers=[1])


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neo"])
def test_save_load_round_trip(family, tmp_path):
    model = patch_model(tiny(family), CONFIG)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["span_attention"]
    assert SpanAttentionConfig.from_dict(saved) == CONFIG
    ids = torch.randint(1, VOCAB, (2, 12))
    loaders = [lambda: load_pretrained(str(tmp_path))]
    if family != "gpt_neo":  # GPT-Neo's attention classes are not looked up in the registry
        loaders.append(lambda: AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                                    attn_implementation="span_attention"))
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    for load in loaders:
        loaded = load()
        assert config_of(loaded.config) == CONFIG  # dataclass equality: field by field
        loaded.train()
        loaded(ids, labels=ids).loss.backward()
        for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


def test_checkpoint_loads_as_a_plain_model_without_the_package(tmp_path):
    model = patch_model(tiny("gpt2"), "score:1000").eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(1, VOCAB, (1, 10))
    with torch.no_grad():
        expected = model(ids).logits
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()\n"
        "assert 'hf_spanattn' not in sys.modules and m.config._attn_implementation != 'span_attention'\n"
        f"ids = torch.tensor({ids.tolist()})\n"
        "print(m(ids).logits.flatten().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    logits = torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))
    assert (logits - expected.flatten()).abs().max() < 1e-5


def test_trainer_trains_and_resumes_with_the_same_settings(tmp_path):
    full = patch_model(tiny("gpt2"), CONFIG)
    Trainer(model=full, args=args(tmp_path / "full"), train_dataset=Tokens()).train()
    stock = tiny("gpt2")
    Trainer(model=stock, args=args(tmp_path / "stock"), train_dataset=Tokens()).train()
    assert any((p - q).abs().max() > 1e-6 for p, q in zip(full.parameters(), stock.parameters()))

    checkpoint = tmp_path / "full" / "checkpoint-2"
    resumed = load_pretrained(str(checkpoint))
    assert config_of(resumed.config) == CONFIG
    trainer = Trainer(model=resumed, args=args(tmp_path / "resumed"), train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert config_of(resumed.config) == CONFIG and resumed.config._attn_implementation == "span_attention"
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name


def test_a_run_resumed_with_other_settings_than_its_checkpoints_says_so(tmp_path):
    """A checkpoint saved at score:1100@per_block on layer 1, resumed with the model patched otherwise or not at
    all, trained on with the model's settings without a word."""
    quick = dict(max_steps=2, save_steps=1, gradient_accumulation_steps=1, logging_steps=2)
    Trainer(model=patch_model(tiny("gpt2"), CONFIG), args=args(tmp_path, **quick), train_dataset=Tokens(4)).train()
    for model, now, resume in [(patch_model(tiny("gpt2"), "score:1000"), "score:1000", True),
                               (tiny("gpt2"), r"the standard gradient \(the model is not patched\)",
                                str(tmp_path / "checkpoint-1"))]:
        trainer = Trainer(model=model, args=args(tmp_path, **quick), train_dataset=Tokens(4))
        with pytest.warns(UserWarning, match="resume_from_checkpoint: .*checkpoint-[12] was saved with span attention "
                                             r"settings score:1100@per_block on layers \[1\], but the model given to "
                                             f"the Trainer trains with {now}: the model's settings win. To continue "
                                             "with the checkpoint's, patch the model with them first: "
                                             r"hf_spanattn.patch_model\(model, 'score:1100@per_block', layers=\[1\]\)"):
            trainer.train(resume_from_checkpoint=resume)
    with warnings.catch_warnings():  # the same settings: nothing to say
        warnings.filterwarnings("error", message="resume_from_checkpoint")
        trainer = Trainer(model=patch_model(tiny("gpt2"), CONFIG), args=args(tmp_path, **quick),
                          train_dataset=Tokens(4))
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    saved = json.loads((tmp_path / "checkpoint-1" / "config.json").read_text())
    saved["span_attention"]["alphas"] = "x" * 10_000  # edited by hand: said, cut
    (tmp_path / "checkpoint-1" / "config.json").write_text(json.dumps(saved))
    trainer = Trainer(model=patch_model(tiny("gpt2"), CONFIG), args=args(tmp_path, **quick), train_dataset=Tokens(4))
    with pytest.warns(UserWarning, match="resume_from_checkpoint: the span attention settings .*checkpoint-1 was saved "
                                         r"with cannot be read \(.*alphas.*\); the model given to the Trainer trains "
                                         "with score:1100@per_block on layers") as caught:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert max(len(str(w.message)) for w in caught) < 1000


def test_a_run_resumed_with_a_tower_patched_otherwise_than_in_its_checkpoint_says_so(tmp_path):
    """An encoder-decoder saved at score:1100 on every tower, resumed with its decoder patched with score:1000: the
    decoder trained on with score:1000 without a word, the model's own settings being those of the checkpoint."""
    quick = dict(max_steps=2, save_steps=1, gradient_accumulation_steps=1, logging_steps=2)
    Trainer(model=patch_model(tiny_bert2gpt2(), "score:1100"), args=args(tmp_path, **quick),
            train_dataset=Tokens(4)).train()
    model = patch_model(tiny_bert2gpt2(), "score:1100")
    patch_model(model.decoder, "score:1000")
    with pytest.warns(UserWarning, match=r"checkpoint-2 was saved with span attention settings score:1100 on the "
                                         r"tower decoder \(config.json, field decoder.span_attention\), but the model "
                                         "given to the Trainer trains it with score:1000: the model's settings win. "
                                         r".*hf_spanattn.patch_model\(model.decoder, 'score:1100'\)"):
        Trainer(model=model, args=args(tmp_path, **quick), train_dataset=Tokens(4)).train(resume_from_checkpoint=True)
    with warnings.catch_warnings():  # the same settings on every tower: nothing to say
        warnings.filterwarnings("error", message="resume_from_checkpoint")
        Trainer(model=patch_model(tiny_bert2gpt2(), "score:1100"), args=args(tmp_path, **quick),
                train_dataset=Tokens(4)).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gradient_checkpointing_gives_the_same_gradients(family, reentrant):
    """Reentrant checkpointing runs the first forward without autograd (SDPA itself) and recomputes
    it with the span kernel's forward, which differs from SDPA's in the last bits: equal to 1e-5
    relative per tensor, not bit for bit."""
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model = patch_model(tiny(family), "score:1100")
    model.train()
    model(ids, labels=ids).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad - expected[name]).norm() <= 1e-5 * expected[name].norm(), name


def test_bf16_autocast_on_cpu_trains_finite(tmp_path):
    model = patch_model(tiny("llama"), "score:1000")
    trainer = Trainer(model=model, args=args(tmp_path, bf16=True, max_steps=3, save_steps=100),
                      train_dataset=Tokens())
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_fsdp2_in_two_processes_gives_the_gradients_and_diagnostics_of_one(tmp_path):
    """A tiny grouped-query Llama sharded with `fully_shard` over 2 gloo processes, 2 rows each, against the
    unsharded model on all 4 rows: the same parameter gradients, and diagnostics reduced to the same figures."""
    from gloo_workers import BATCH, LABELS, fsdp_gradients_and_diagnostics, one_step, spawn

    spawn(fsdp_gradients_and_diagnostics, 2, str(tmp_path))
    sharded = torch.load(tmp_path / "fsdp.pt")
    gradients, diagnostics = one_step(patch_model(tiny("llama"), "score:1100"), BATCH, LABELS)
    assert sharded["gradients"].keys() == gradients.keys()
    for name, grad in gradients.items():
        assert (sharded["gradients"][name] - grad).norm() <= 1e-5 * grad.norm(), name
    assert sharded["diagnostics"].keys() == diagnostics.keys() == {0, 1}
    for layer, want in diagnostics.items():
        got = sharded["diagnostics"][layer]
        assert got.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                       torch.tensor(value, dtype=torch.float64), rtol=1e-5, atol=1e-12,
                                       msg=lambda m, layer=layer, key=key: f"layer {layer}, {key}: {m}")


@pytest.mark.slow
def test_ddp_patched_after_wrapping_in_two_processes_gives_the_gradients_of_one(tmp_path):
    """2 gloo processes patch their DistributedDataParallel wrapper, as one patches what `accelerator.prepare`
    returns: the gradients of the model patched in one process over the same 4 rows (float64)."""
    from gloo_workers import BATCH, LABELS, ddp_patched_after_wrapping, spawn

    spawn(ddp_patched_after_wrapping, 2, str(tmp_path))
    wrapped = torch.load(tmp_path / "ddp.pt")
    model = patch_model(tiny("gpt2").double(), "score:1100")
    model(BATCH, labels=LABELS).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(wrapped[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_no_warning_from_the_package_under_trainer_torch_compile(tmp_path, caplog):
    """`TrainingArguments(torch_compile=True)` traces the patched model with Dynamo: no warning is raised in
    the package or names one of its files (as Dynamo's warning about an `lru_cache` call site does),
    and nothing is logged at WARNING by its loggers."""
    import hf_spanattn

    package = Path(hf_spanattn.__file__).parent
    files = {path.name for path in package.rglob("*.py")}
    torch._dynamo.reset()
    model = patch_model(tiny("gpt2", layers=1), "score:1100")
    trainer = Trainer(model=model, args=args(tmp_path, torch_compile=True, torch_compile_backend="aot_eager",
                                             max_steps=1, save_strategy="no"), train_dataset=Tokens())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        trainer.train()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if Path(w.filename).is_relative_to(package) or w.filename == __file__  # ours name the user's line
            or any(f"{name}:" in str(w.message) for name in files)]
    ours += [record.getMessage() for record in caplog.records if record.name.startswith("hf_spanattn")]
    assert not ours, "\n".join(ours)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_model_patched_after_the_trainer_made_it_with_model_init_says_that_train_makes_it_anew(tmp_path):
    """With model_init, `train` makes the model anew: the model the Trainer held, patched after the Trainer was made,
    was dropped for an unpatched one without a word. A model_init that patches, and a search's trials (each with
    settings of its own), train as they are."""
    quick = args(tmp_path, max_steps=1, save_strategy="no", gradient_accumulation_steps=1)
    trainer = Trainer(model_init=lambda: tiny("gpt2"), args=quick, train_dataset=Tokens(4))
    patch_model(trainer.model, "score:1100", layers=[1])
    with pytest.warns(UserWarning, match=r"makes its model anew with model_init .* trains with the standard gradient "
                                         r"\(the model is not patched\), but the model it held trained with score:1100 "
                                         r"on layers \[1\]: .* hf_spanattn.patch_model\(make_model\(\), 'score:1100', "
                                         r"layers=\[1\]\)"):
        trainer.train()
    assert config_of(trainer.model.config) is None  # the stock Trainer's model: trained unpatched
    assert len(trainer.callback_handler.callbacks) == len(Trainer(model=tiny("gpt2"), args=quick).callback_handler
                                                         .callbacks)  # the check leaves no callback behind
    trainer = Trainer(model_init=lambda: patch_model(tiny("gpt2"), "score:1000"), args=quick, train_dataset=Tokens(4))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*model_init")
        trainer.train()
    assert config_of(trainer.model.config) == SpanAttentionConfig.from_label("score:1000")


def test_each_trial_of_a_hyperparameter_search_trains_with_the_settings_its_model_init_gives(tmp_path):
    pytest.importorskip("optuna")
    from transformers import TrainerCallback

    labels = ["score:1000", "score:1100", "standard:QKV111"]
    trained = []

    class Settings(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            trained.append(config_of(model.config).label)

    def model_init(trial):
        return patch_model(tiny("gpt2"), labels[0] if trial is None else trial.suggest_categorical("span", labels))

    trainer = Trainer(model_init=model_init, args=args(tmp_path, max_steps=1, save_strategy="no"),
                      train_dataset=Tokens(4), eval_dataset=Tokens(2, seed=1), callbacks=[Settings()])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*model_init")  # the trials' settings differ by design
        best = trainer.hyperparameter_search(direction="minimize", backend="optuna", n_trials=3,
                                             hp_space=lambda trial: {})
    assert len(trained) == 3 and set(trained) <= set(labels) and best.hyperparameters["span"] in labels


@pytest.mark.slow
def test_a_data_parallel_run_whose_ranks_differ_is_refused_on_every_rank(tmp_path):
    """2 gloo processes: a model patched on one rank only (the other imports hf_spanattn before the Trainer and
    patches nothing), callbacks with other diagnostics, a diagnostics file whose lock another
    run holds (rank 0 reads it, rank 1 trains on without that), and diagnostics sums of one size but
    other heads and orders are refused on both ranks, naming what each holds; so is a second reduction."""
    from gloo_workers import ranks_that_differ, spawn

    spawn(ranks_that_differ, 2, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"refused-{rank}.json").read_text())
        assert got["unpatched rank"] == ["ValueError", got["unpatched rank"][1]]
        assert "rank 0: 'score:1100'; rank 1: 'the standard gradient (the model is not patched)'" in \
            got["unpatched rank"][1]
        assert got["callbacks"][0] == "ValueError" and "SpanAttentionCallback settings" in got["callbacks"][1]
        assert '"diagnostics_every": 1' in got["callbacks"][1] and '"diagnostics_every": 2' in got["callbacks"][1]
        assert got["lock held"][0] == "ValueError" and "another run is writing diagnostics into this file" in \
            got["lock held"][1]
        assert got["layouts"][0] == "RuntimeError" and "different layers, heads or orders" in got["layouts"][1]
        assert got["twice"][0] == "ValueError" and "already holds the sums over the ranks" in got["twice"][1]


@pytest.mark.slow
def test_diagnostics_past_1e154_are_reduced_over_ranks_within_float64s_range(tmp_path):
    """2 gloo processes record parts of about 1e200 (an α of 1e200 on float64 inputs), scaled apart on each rank:
    every rank's reduced figures are those of one recorder given both records (its sums over W² = 4 ranks' squares:
    norms halved), where the squares' sums overflowed float64 (norms inf, shares and cosines NaN)."""
    from gloo_workers import RECORD_SCALES, _recorded, spawn, sums_past_1e154

    spawn(sums_past_1e154, 2, str(tmp_path))
    want = _recorded(2, 2, *RECORD_SCALES).summary(per_head=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"summary-{rank}.json").read_text())
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert np.allclose(np.asarray(got[key]) * (2 if "norm" in key else 1), value, rtol=1e-12, atol=0), key


@pytest.mark.parametrize("wrap", ["ddp", "data_parallel"])
def test_a_model_wrapped_for_data_parallelism_is_patched_through_the_wrapper(wrap):
    """patch_model and unpatch_model on DistributedDataParallel (as `accelerator.prepare` returns it; here over a
    one-process gloo group) or DataParallel reach the model inside: the wrapper's gradients are those of the model
    patched before wrapping."""
    import torch.distributed as dist

    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = patch_model(tiny("gpt2").double(), "score:1100")
    expected(ids, labels=ids).loss.backward()
    model = tiny("gpt2").double()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapper = torch.nn.DataParallel(model) if wrap == "data_parallel" else \
            torch.nn.parallel.DistributedDataParallel(model)
        assert patch_model(wrapper, "score:1100") is wrapper
        assert config_of(model.config).label == "score:1100"
        wrapper(ids, labels=ids).loss.backward()
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
        unpatch_model(wrapper)
        assert config_of(model.config) is None
    finally:
        dist.destroy_process_group()
