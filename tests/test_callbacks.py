"""SpanAttentionCallback: schedules checked through gradients, resume, diagnostics."""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings

import pytest
import torch
from models import VOCAB, needs_attention_backend, tiny, tiny_llava
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_spanattn import SpanAttentionConfig, patch_model, span_attention
from hf_spanattn.training import Keyframe, OrderRecorder, Schedule, SpanAttentionCallback

BATCH = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
# the first label is never predicted; -100 there makes the Trainer's token count exact
LABELS = BATCH.masked_fill(torch.arange(16) == 0, -100)


class Same(torch.utils.data.Dataset):
    """The same batch every step (a permutation of 4 sequences): with lr = 0 each step's gradient
    depends on the rule alone."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": BATCH[i % 4], "labels": LABELS[i % 4]}


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def train(model, tmp_path, callbacks, dataset=None, **overrides):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=0.0,
                report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                max_grad_norm=0.0)  # the recorded gradients are the raw ones
    trainer = Trainer(model=model, args=TrainingArguments(**{**base, **overrides}),
                      train_dataset=Same() if dataset is None else dataset, callbacks=callbacks)
    trainer.train()
    return trainer


def expected_grads(label_or_config, **patch_kwargs):
    model = patch_model(tiny("gpt2"), label_or_config, **patch_kwargs)
    model.train()
    model(BATCH, labels=LABELS).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, tol=1e-5):
    for name in b:
        assert torch.allclose(a[name], b[name], rtol=tol, atol=1e-8), name


@pytest.mark.parametrize("schedule,expected", [
    ([Keyframe(0, "standard:QKV111"), Keyframe(2, "score:1000")],
     ["standard:QKV111", "standard:QKV111", "score:1000", "score:1000"]),
    ([Keyframe(0, "score:1111"), Keyframe("100%", "score:1000", ramp=True)],
     ["score:1111", "score:1,0.75,0.75,0.75", "score:1,0.5,0.5,0.5", "score:1,0.25,0.25,0.25"]),
    ([{"at": 0, "span": "standard:QKV111"}, {"at": "50%", "span": {"1": "score:1000"}}],
     ["standard:QKV111", "standard:QKV111", ("score:1000", [1]), ("score:1000", [1])]),
])
def test_schedule_changes_the_rule_exactly_at_its_step(schedule, expected, tmp_path):
    recorder = GradRecorder()
    train(patch_model(tiny("gpt2"), "score:1100"), tmp_path, [SpanAttentionCallback(schedule), recorder])
    assert len(recorder.grads) == 4
    for step, (grads, want) in enumerate(zip(recorder.grads, expected)):
        label, layers = want if isinstance(want, tuple) else (want, None)
        if layers:  # the other layer keeps the model's setting from the last keyframe naming it
            config = SpanAttentionConfig.from_label(label)
            model = patch_model(tiny("gpt2"), "standard:QKV111")
            cb = SpanAttentionCallback([Keyframe(0, {"0": "standard:QKV111", "1": label})])
            want_grads = _grads_with_callback(model, cb, tmp_path / f"ref{step}")
            assert config.label == label
        else:
            want_grads = expected_grads(label)
        assert_same(grads, want_grads), step


def _grads_with_callback(model, callback, path):
    recorder = GradRecorder()
    train(model, path, [callback, recorder], max_steps=1)
    return recorder.grads[0]


def test_resume_from_a_mid_schedule_checkpoint_continues_it(tmp_path):
    schedule = [Keyframe(0, "standard:QKV111"), Keyframe(3, "score:1100")]
    kwargs = dict(learning_rate=1e-2, save_strategy="steps", save_steps=2, max_steps=5, max_grad_norm=0.0)
    full = patch_model(tiny("gpt2"), "score:1000")
    train(full, tmp_path / "full", [SpanAttentionCallback(schedule)], **kwargs)
    resumed = patch_model(tiny("gpt2"), "score:1000")
    trainer = Trainer(model=resumed, train_dataset=Same(), callbacks=[SpanAttentionCallback(schedule)],
                      args=TrainingArguments(output_dir=str(tmp_path / "full"), per_device_train_batch_size=4,
                                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **kwargs))
    trainer.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    no_switch = patch_model(tiny("gpt2"), "score:1000")
    train(no_switch, tmp_path / "other", [SpanAttentionCallback([Keyframe(0, "standard:QKV111")])], **kwargs)
    for (name, p), q in zip(full.named_parameters(), resumed.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    assert any((p - r).abs().max() > 1e-5 for p, r in zip(full.parameters(), no_switch.parameters()))


@pytest.mark.parametrize("label", ["score:1000", "score:0.5,2,0,1.5", "reductionistic:1100", "simple:0.3,1.7",
                                   "score:1100@per_block", "score:1100+QKV101"])
def test_order_components_sum_to_the_applied_gradient(label):
    config = SpanAttentionConfig.from_label(label)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=gen).requires_grad_(True) for _ in range(3))
    records = []
    out = span_attention(q, k, v, is_causal=True, config=config, probe=records.append)
    d_out = torch.randn(out.shape, generator=gen)
    dq, dk, _ = torch.autograd.grad(out, (q, k, v), d_out)
    assert len(records) == 1  # the backward runs in chunks of the (batch, head) pairs, reported as one batch
    rec = records[0]
    total_q, total_k = sum(rec["dq_orders"]), sum(rec["dk_orders"])
    for total, applied, grad in ((total_q, rec["dq"], dq), (total_k, rec["dk"], dk)):
        assert (total - applied).norm() <= 1e-5 * applied.norm()  # both 0 where α_K = 0
        assert (applied.reshape(grad.shape) - grad).norm() <= 1e-6 * grad.norm()
    std_q, _, _ = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                                      (q, k, v), d_out)
    assert ((rec["dq_standard"].reshape(std_q.shape) - std_q).norm() / std_q.norm()).item() <= 1e-5
    assert rec["rank_k"].shape == (2, 4, 1) and (rec["rank_k"] == 8).all()


class Collect(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_diagnostics_off_or_on_leave_training_unchanged_and_log(tmp_path):
    kwargs = dict(learning_rate=1e-2, max_steps=4, max_grad_norm=0.0)
    plain = patch_model(tiny("gpt2"), "score:1100")
    train(plain, tmp_path / "plain", [], **kwargs)
    for every in (0, 2):
        model = patch_model(tiny("gpt2"), "score:1100")
        callback = SpanAttentionCallback(diagnostics_every=every, diagnostics_per_head=True)
        trainer = Trainer(model=model, train_dataset=Same(), args=TrainingArguments(
            output_dir=str(tmp_path / f"every{every}"), per_device_train_batch_size=4, report_to=[], use_cpu=True,
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, **kwargs))
        callback.add_to(trainer)
        collect = Collect()
        trainer.add_callback(collect)
        trainer.train()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p, q), (every, name)
        path = tmp_path / f"every{every}" / "span_diagnostics.jsonl"
        if every == 0:
            assert not path.exists()
            continue
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(r["step"], r["layer"]) for r in records] == [(1, 0), (1, 1), (3, 0), (3, 1)]
        for r in records:
            assert r["span"] == "score:1100" and len(r["dq_share"]) == 4
            assert abs(sum(r["dq_share"]) - 1) < 1e-9 and r["dq_share"][2] == 0 == r["dq_share"][3]
            assert 0 < r["cos_q"] <= 1 and r["rank_k"] == 8 and len(r["dq_norm_per_head"]) == 4
        assert any("span/layer1/dq_share0" in entry for entry in collect.logs)


def test_settings_are_validated_when_training_starts(tmp_path):
    with pytest.raises(ValueError, match="not patched"):
        train(tiny("gpt2"), tmp_path, [SpanAttentionCallback([Keyframe(0, "score:1000")])])
    bad = [
        ([Keyframe(0, "score:1000"), Keyframe("50%", "reductionistic:1000", ramp=True)], "same method"),
        ([Keyframe(0, {"0-5": "score:1000"})], "outside 0..1"),
        ([Keyframe("soon", "score:1000")], "expected a step"),
        ([Keyframe(3, "score:1000"), Keyframe(1, "score:1100")], "in order of time"),
        ([Keyframe(0, "score:1000"), Keyframe("50%", "score:1100"), Keyframe(2, "score:0000")],
         r"at='50%' and at=2 both fall on step 2"),
        ([Keyframe(0, "score:10")], "4 values"),
    ]
    for schedule, message in bad:
        with pytest.raises(ValueError, match=message):
            train(patch_model(tiny("gpt2"), "score:1000"), tmp_path, [SpanAttentionCallback(schedule)])
    with pytest.raises(ValueError, match="diagnostics_every"):
        SpanAttentionCallback(diagnostics_every=-1)
    with pytest.raises(ValueError, match="'at', 'span'"):
        Schedule([{"when": 0}])


def test_recorder_summary_without_records_is_empty():
    assert OrderRecorder().summary() == {}
    assert copy.copy(OrderRecorder()).summary() == {}


class Many(torch.utils.data.Dataset):
    """`n` rows, each one of the 4 sequences."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": BATCH[i % 4], "labels": LABELS[i % 4]}


class RuleRecorder(TrainerCallback):
    """The rule in force in layer 0 at each optimizer step (after the span callback has set it)."""

    def __init__(self):
        self.labels, self.epochs = {}, {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        from hf_spanattn.integration.registry import settings_for

        self.labels[state.global_step] = settings_for(model.transformer.h[0].attn).label
        self.epochs[state.global_step] = state.epoch


def test_epoch_keyframes_use_the_steps_of_one_pass_over_the_data(tmp_path):
    """23 rows, batches of 1, 2 accumulated: 12 optimizer steps per epoch (the last one of a single
    batch), so "1ep" is step 12 whatever max_steps is (20 here, which spreads over 2 epochs)."""
    recorder = RuleRecorder()
    callback = SpanAttentionCallback([Keyframe(0, "standard:QKV111"), Keyframe("1ep", "score:1000")])
    trainer = Trainer(model=patch_model(tiny("gpt2"), "score:1100"), train_dataset=Many(23), callbacks=[recorder],
                      args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1,
                                             gradient_accumulation_steps=2, max_steps=20, learning_rate=0.0,
                                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True))
    callback.add_to(trainer)
    trainer.train()
    assert trainer.state.max_steps == 20 and len(recorder.labels) == 20
    assert recorder.epochs[12] == 1.0 and recorder.epochs[11] < 1.0  # the Trainer's own count
    switch = min(step for step, label in recorder.labels.items() if label == "score:1000")
    assert switch == 12
    assert all(recorder.labels[s] == "standard:QKV111" for s in range(12))


def test_a_fresh_run_moves_an_earlier_runs_diagnostics_aside(tmp_path):
    """A run that starts at step 0 where an earlier run left its diagnostics (a kill before the first
    checkpoint, or the same command twice) writes its own file; the earlier one is kept beside it."""
    def run():
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                 learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0)
        trainer = Trainer(model=patch_model(tiny("gpt2"), "score:1100"), train_dataset=Same(), args=args)
        SpanAttentionCallback(diagnostics_every=1).add_to(trainer)
        trainer.train()

    run()
    path = tmp_path / "span_diagnostics.jsonl"
    earlier = path.read_text()
    with pytest.warns(UserWarning, match=r"earlier run.*replaced-1"):
        run()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2]
    assert (tmp_path / "span_diagnostics.jsonl.replaced-1").read_text() == earlier


def test_resumed_diagnostics_do_not_repeat_steps_and_stay_in_the_output_dir(tmp_path):
    """A run stopped after step 4 with checkpoints at 2 and 4 resumes from 2 in another folder, with
    the callback state restored from the checkpoint: the callback stays first, writes into the new
    output dir, and the JSONL there holds each step once."""
    import shutil

    def run(output_dir, max_steps, resume=None):
        model = patch_model(tiny("gpt2"), "score:1100")
        args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=max_steps,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, restore_callback_states_from_checkpoint=True)
        trainer = Trainer(model=model, train_dataset=Same(), args=args)
        SpanAttentionCallback(diagnostics_every=1).add_to(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    first = tmp_path / "first"
    run(first, 4)
    stopped = (first / "span_diagnostics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in stopped.splitlines()] == [1, 1, 2, 2, 3, 3, 4, 4]
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    trainer = run(moved, 6, resume=str(moved / "checkpoint-2"))
    assert isinstance(trainer.callback_handler.callbacks[0], SpanAttentionCallback)
    assert (first / "span_diagnostics.jsonl").read_text() == stopped  # the old folder is left alone
    records = [json.loads(line) for line in (moved / "span_diagnostics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["layer"]) for r in records] == [(s, layer) for s in range(1, 7) for layer in (0, 1)]

    # a path that an older checkpoint recorded, absolute and in the old folder, is taken in the new one
    state_file = moved / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["stateful_callbacks"]["SpanAttentionCallback"]["args"]["diagnostics_file"] = str(first / "diag.jsonl")
    state_file.write_text(json.dumps(state))
    with pytest.warns(UserWarning, match="outside the output dir"):
        run(moved, 6, resume=str(moved / "checkpoint-4"))
    assert not (first / "diag.jsonl").exists() and (moved / "diag.jsonl").is_file()


def _span_figures(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k.startswith("span/")}


@pytest.mark.parametrize("attach", ["callbacks", "add_to"])
def test_alphas_and_diagnostics_reach_log_history_checkpoints_and_tensorboard(attach, tmp_path):
    """A ramp from score:1111 to score:1000 over 4 steps, diagnostics at steps 1 and 3, TensorBoard on:
    the α each step trained with and the diagnostics are in log_history, in the checkpoint's
    trainer_state.json and in TensorBoard's event files, however the callback was added."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    schedule = [Keyframe(0, "score:1111"), Keyframe("100%", "score:1000", ramp=True)]
    callback = SpanAttentionCallback(schedule, diagnostics_every=2)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                             report_to=["tensorboard"], save_strategy="steps", save_steps=4, logging_steps=1,
                             use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=patch_model(tiny("gpt2"), "score:1111"), args=args, train_dataset=Same(),
                      callbacks=[callback] if attach == "callbacks" else None)
    if attach == "add_to":
        callback.add_to(trainer)
    trainer.train()

    steps = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(steps) == [1, 2, 3, 4]
    for step, entry in steps.items():  # step s trains with the setting at global step s - 1
        alpha = 1 - (step - 1) / 4
        assert [entry[f"span/alpha{i}"] for i in range(4)] == [1, alpha, alpha, alpha], step
        assert [entry[f"span/alpha_{n}"] for n in "qkv"] == [1, 1, 1]
    records = [json.loads(line) for line in (tmp_path / "span_diagnostics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["layer"]) for r in records] == [(1, 0), (1, 1), (3, 0), (3, 1)]
    for r in records:
        entry, layer = steps[r["step"]], f"span/layer{r['layer']}/"
        for side in ("dq", "dk"):
            assert [entry[f"{layer}{side}_share{o}"] for o in range(4)] == r[f"{side}_share"]
        assert [entry[layer + k] for k in ("cos_q", "cos_k", "rank_k", "rank_v")] == \
               [r[k] for k in ("cos_q", "cos_k", "rank_k", "rank_v")]
    assert [step for step, entry in steps.items() if "span/layer0/cos_q" in entry] == [1, 3]

    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    assert [entry for entry in saved if "loss" in entry] == list(steps.values())

    events = sorted(tmp_path.glob("runs/*/events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    scalars = {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}
    for step, entry in steps.items():
        figures = _span_figures(entry)
        assert len(figures) == (7 + 2 * 2 * 4 + 2 * 4 if step in (1, 3) else 7)
        for key, value in figures.items():
            assert scalars[f"train/{key}"][step] == pytest.approx(value, rel=1e-6), (key, step)  # float32 there


def test_alphas_are_logged_per_layer_where_layers_differ(tmp_path):
    """A layer table (and layers that the model's settings leave stock) gives each layer its own α."""
    table = [Keyframe(0, {"1": "score:1100"}), Keyframe(2, {"1": "reductionistic:1000"})]
    model = patch_model(tiny("gpt2", layers=3), "score:1111", layers=[1, 2])
    trainer = train(model, tmp_path, [SpanAttentionCallback(table)])
    steps = {entry["step"]: _span_figures(entry) for entry in trainer.state.log_history if "loss" in entry}
    stock = {"span/layer0/alpha_q": 1, "span/layer0/alpha_k": 1, "span/layer0/alpha_v": 1}
    kept = {"span/layer2/alpha0": 1, "span/layer2/alpha1": 1, "span/layer2/alpha2": 1, "span/layer2/alpha3": 1,
            "span/layer2/alpha_q": 1, "span/layer2/alpha_k": 1, "span/layer2/alpha_v": 1}
    for step, alphas in ((1, (1, 1, 0, 0)), (2, (1, 1, 0, 0)), (3, (1, 0, 0, 0)), (4, (1, 0, 0, 0))):
        layer1 = {f"span/layer1/alpha{i}": a for i, a in enumerate(alphas)}
        layer1.update({"span/layer1/alpha_q": 1, "span/layer1/alpha_k": 1, "span/layer1/alpha_v": 1})
        assert steps[step] == {**stock, **layer1, **kept}, step


def test_a_callback_run_outside_a_callback_handler_warns_that_reporters_may_miss_its_logs():
    with pytest.warns(UserWarning, match="found no transformers CallbackHandler"):
        SpanAttentionCallback()._move_first()


@pytest.mark.slow
def test_diagnostics_under_ddp_are_those_of_one_process_over_the_global_batch(tmp_path):
    """2 gloo processes with 2 rows each against 1 process with all 4 rows, two steps: each rank logs the
    figures of the global batch, and the JSONL holds them once."""
    from gloo_workers import spawn, train_with_diagnostics

    one = train_with_diagnostics(str(tmp_path / "one"), per_device=4, max_steps=2)
    spawn(train_with_diagnostics, 2, str(tmp_path / "two"), 2, 2)
    ranks = [json.loads((tmp_path / "two" / f"log_history-{r}.json").read_text()) for r in range(2)]
    assert [e for e in ranks[0] if "loss" in e] == [e for e in ranks[1] if "loss" in e]
    figures = [[_span_figures(e) for e in history if "loss" in e] for history in (one, ranks[0])]
    assert len(figures[0]) == len(figures[1]) == 2 and all(len(f) == 7 + 2 * 2 * 4 + 2 * 4 for f in figures[0])
    for want, got in zip(*figures):
        assert want.keys() == got.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key
    records = [[json.loads(line) for line in (tmp_path / d / "span_diagnostics.jsonl").read_text().splitlines()]
               for d in ("one", "two")]
    assert len(records[0]) == len(records[1]) == 4
    for want, got in zip(*records):
        for key in ("dq_norm", "dk_norm", "dq_share", "dk_share"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-12), key
        for key in ("cos_q", "cos_k", "rank_k", "rank_v"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), key


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
# slow: each case starts processes that import DeepSpeed (9 s alone, up to 54 s within the whole suite)
@pytest.mark.parametrize("stage,processes", [pytest.param(3, 1, marks=pytest.mark.slow),
                                             pytest.param(2, 2, marks=pytest.mark.slow),
                                             pytest.param(3, 2, marks=pytest.mark.slow)])
def test_deepspeed_zero_trains_as_one_process_without_it(stage, processes, tmp_path):
    """The Trainer with DeepSpeed ZeRO on its CPU backend (gloo), `processes` ranks over the 4 rows, against one
    process without DeepSpeed, two steps under a schedule (a layer table at step 1): the same losses, α and
    diagnostics in the logs and the records, and a saved model (ZeRO-3: gathered) with the same weights and settings."""
    from gloo_workers import spawn, train_with_diagnostics

    import hf_spanattn

    schedule = [{"at": 0, "span": "score:1100"}, {"at": 1, "span": {"1": "score:1000"}}]
    one = train_with_diagnostics(str(tmp_path / "one"), 4, 2, None, schedule)
    spawn(train_with_diagnostics, processes, str(tmp_path / "ds"), 4 // processes, 2, stage, schedule)
    ranks = [json.loads((tmp_path / "ds" / f"log_history-{r}.json").read_text()) for r in range(processes)]
    steps = [[e for e in history if "loss" in e] for history in (one, *ranks)]
    assert len(steps[0]) == 2 and all(len(s) == 2 for s in steps)
    assert steps[0][0]["span/layer1/alpha1"] == 1.0 and steps[0][1]["span/layer1/alpha1"] == 0.0  # the table's
    for want, got in zip(steps[0], steps[1]):
        assert got.keys() == want.keys()
        for key in [k for k in want if k == "loss" or k.startswith("span/")]:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key
    records = [[json.loads(line) for line in (tmp_path / d / "span_diagnostics.jsonl").read_text().splitlines()]
               for d in ("one", "ds")]
    assert len(records[0]) == len(records[1]) == 4
    for want, got in zip(*records):
        assert got["span"] == want["span"]
        assert got["dq_share"] == pytest.approx(want["dq_share"], rel=1e-5, abs=1e-12)
    saved = [hf_spanattn.load_pretrained(tmp_path / d) for d in ("one", "ds")]
    assert saved[1].config.span_attention == saved[0].config.span_attention
    assert hf_spanattn.SpanAttentionConfig.from_dict(saved[1].config.span_attention).label == "score:1100"
    # the same weights, within 1e-3 of how far training moved them: Adam's step m/√v moves an entry whose gradient
    # is near 0 by up to the learning rate on rounding alone
    weights, start = [model.state_dict() for model in saved], tiny("gpt2").state_dict()
    for name, want in weights[0].items():
        moved = (want - start[name]).abs().max()
        assert moved > 0 and (weights[1][name] - want).abs().max() <= 1e-3 * moved, name


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_a_deepspeed_engine_is_patched_through_the_model_inside(tmp_path):
    """patch_model given the DeepSpeedEngine (ZeRO-3) that `deepspeed.initialize` or `accelerator.prepare` returns
    patches the model inside: the gradients of the model patched alone."""
    from gloo_workers import BATCH, LABELS, deepspeed_engine_patched, spawn

    spawn(deepspeed_engine_patched, 1, str(tmp_path))
    engine = torch.load(tmp_path / "deepspeed.pt")
    model = patch_model(tiny("gpt2"), "score:1100")
    model(BATCH[:2], labels=LABELS[:2]).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(engine[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize("keyframe,message", [
    (Keyframe("100%", "score:1000"), "keyframe at='100%' (step 2) is never reached: training ends after max_steps=2 "
                                     "(steps 0..1)"),
    (Keyframe("3ep", "score:1000"), "keyframe at='3ep' (step 3) is never reached"),
    (Keyframe(5, "score:1000", ramp=True), "keyframe at=5 (step 5) is never reached: training ends after "
                                           "max_steps=2, so its ramp stops 20% of the way there"),
])
def test_a_keyframe_past_the_last_step_warns_once_when_training_starts(keyframe, message, tmp_path):
    """Steps 0..max_steps-1 train; a keyframe at max_steps or later changes nothing (a ramp towards one is cut
    short), which is said once, naming the keyframe and max_steps. A ramp that ends at "100%" is not."""
    recorder = RuleRecorder()
    with pytest.warns(UserWarning) as warned:
        train(patch_model(tiny("gpt2"), "score:1100"), tmp_path, [SpanAttentionCallback([Keyframe(0, "score:1111"),
                                                                                       keyframe]), recorder],
              max_steps=2)
    ours = [str(w.message) for w in warned if "SpanAttentionCallback" in str(w.message)]
    assert len(ours) == 1 and message in ours[0], ours
    assert list(recorder.labels) == [0, 1] and recorder.labels[1] != "score:1000"  # never in force
    if keyframe.ramp:
        assert recorder.labels[1] == "score:1,0.8,0.8,0.8"
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="SpanAttentionCallback")
            train(patch_model(tiny("gpt2"), "score:1100"), tmp_path / "ramp", max_steps=2, callbacks=[
                SpanAttentionCallback([Keyframe(0, "score:1111"), Keyframe("100%", "score:1000", ramp=True)])])


def _bert2bert(decoder_heads: int, encoder_layers: int = 2):
    """A tiny BERT2BERT EncoderDecoderModel: an encoder of 2 heads, a decoder of `decoder_heads` and 2 layers."""
    import transformers

    needs_attention_backend(transformers.BertModel, transformers.BertLMHeadModel)
    torch.manual_seed(0)
    bert = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = transformers.EncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.BertConfig(**{**bert, "num_hidden_layers": encoder_layers}),
        transformers.BertConfig(**{**bert, "num_attention_heads": decoder_heads}, is_decoder=True,
                                add_cross_attention=True))
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    return transformers.EncoderDecoderModel(config)


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": BATCH[i, :12], "labels": BATCH[(i + 1) % 4, :12]}


@pytest.mark.parametrize("decoder_heads", [2, 4])
def test_diagnostics_of_an_encoder_decoder_are_those_of_each_tower(decoder_heads, tmp_path):
    """Layer i of the encoder and of the decoder are two layers: their figures were summed into one record of
    "layer i" (or, with other head counts, the backward failed inside the recorder). Each gets its own record and
    log entries, equal to those of a recorder on that tower's layer alone."""
    from hf_spanattn.integration.registry import PROBE_ATTR

    trainer = Trainer(model=patch_model(_bert2bert(decoder_heads), "score:1100"), train_dataset=Pairs(),
                      callbacks=[SpanAttentionCallback(diagnostics_every=1)],
                      args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                             learning_rate=0.0, report_to=[], use_cpu=True, save_strategy="no",
                                             logging_steps=1, disable_tqdm=True))
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "span_diagnostics.jsonl").read_text().splitlines()]
    towers = {"encoder": "encoder.encoder.layer", "decoder": "decoder.bert.encoder.layer"}
    assert sorted((r["tower"], r["layer"]) for r in records) == sorted((t, i) for t in towers.values() for i in (0, 1))

    model = patch_model(_bert2bert(decoder_heads), "score:1100").train()
    recorders = {}
    for path in towers.values():
        for index in (0, 1):
            recorders[path, index] = OrderRecorder()
            layer = model.get_submodule(f"{path}.{index}")
            layer.attention.self.__dict__[PROBE_ATTR] = recorders[path, index]
    pairs = [Pairs()[i] for i in range(4)]
    model(input_ids=torch.stack([p["input_ids"] for p in pairs]), labels=torch.stack([p["labels"] for p in pairs])
          ).loss.backward()
    logged = trainer.state.log_history[0]
    for record in records:
        want = recorders[record["tower"], record["layer"]].summary()
        for key in ("dq_norm", "dk_norm", "dq_share", "dk_share", "cos_q", "cos_k", "rank_k", "rank_v"):
            assert record[key] == pytest.approx(want[key], rel=1e-5, abs=1e-12), (record["tower"], key)
        prefix = f"span/{record['tower']}.{record['layer']}/"
        assert [logged[f"{prefix}dq_share{o}"] for o in range(4)] == record["dq_share"]
        assert logged[f"{prefix}cos_k"] == record["cos_k"]


def test_the_alphas_of_towers_patched_otherwise_are_logged_per_tower(tmp_path):
    """An encoder-decoder patched with score:1100 and its decoder then with score:1000: the log said α = (1, 1, 0, 0)
    for every layer, the encoder's. Each tower's layers log the α they train with, as their diagnostics show."""
    model = patch_model(_bert2bert(2), "score:1100")
    patch_model(model.decoder, "score:1000")
    trainer = Trainer(model=model, train_dataset=Pairs(), callbacks=[SpanAttentionCallback(diagnostics_every=1)],
                      args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                             learning_rate=0.0, report_to=[], use_cpu=True, save_strategy="no",
                                             logging_steps=1, disable_tqdm=True))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert not any(key.startswith("span/alpha") for key in logged)
    records = [json.loads(line) for line in (tmp_path / "span_diagnostics.jsonl").read_text().splitlines()]
    assert len(records) == 4
    for record in records:
        alphas = SpanAttentionConfig.from_label(record["span"]).alphas
        prefix = f"span/{record['tower']}.{record['layer']}/"
        assert [logged[f"{prefix}alpha{i}"] for i in range(4)] == list(alphas)
        assert [share > 0 for share in record["dq_share"]] == [a > 0 for a in alphas]  # what trained
    assert {r["tower"]: r["span"] for r in records} == {"encoder.encoder.layer": "score:1100",
                                                        "decoder.bert.encoder.layer": "score:1000"}


class Pictures(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        ids = torch.cat([torch.full((16,), VOCAB), BATCH[i, :8]])
        return {"input_ids": ids, "labels": ids.masked_fill(ids == VOCAB, -100),
                "pixel_values": torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i))}


def _vision_tower_grads(label):
    """The vision tower's parameter gradients of a tiny LLaVA patched with `label`, on both Pictures."""
    model = patch_model(tiny_llava(patch_size=4), label).train()
    rows = [Pictures()[i] for i in range(2)]
    model(**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None and "vision_tower" in n}


def test_a_schedule_of_labels_reaches_a_vision_tower_whose_attention_carries_no_layer_index(tmp_path):
    """LLaVA: CLIP's attention carries no layer index, Llama's does. A schedule's label (all layers) reached the
    text layers only, the vision tower training with the model's setting. Its gradients are now those of the model
    patched by hand with the label, its diagnostics are recorded per tower, and a layer table says what it leaves."""
    recorder = GradRecorder()
    schedule = [Keyframe(0, "score:1000")]
    train(patch_model(tiny_llava(patch_size=4), "score:1100"), tmp_path,
          [SpanAttentionCallback(schedule, diagnostics_every=1), recorder], Pictures(), per_device_train_batch_size=2,
          max_steps=1)
    want, other = _vision_tower_grads("score:1000"), _vision_tower_grads("score:1100")
    assert any(not torch.allclose(want[n], other[n], rtol=1e-4) for n in want)  # the rule shows in the vision tower
    assert_same(recorder.grads[0], want)
    records = [json.loads(line) for line in (tmp_path / "span_diagnostics.jsonl").read_text().splitlines()]
    # CLIP's layers: model.vision_tower.encoder.layers (Transformers 5), ...vision_tower.vision_model.encoder.layers (4)
    vision = next(name for name, _ in tiny_llava().named_modules() if name.endswith("vision_tower.encoder.layers")
                  or name.endswith("vision_tower.vision_model.encoder.layers"))
    assert sorted((r["tower"], r["layer"], r["span"]) for r in records) == [
        (tower, layer, "score:1000") for tower in ("model.language_model.layers", vision) for layer in (0, 1)]
    with pytest.warns(UserWarning, match=r"2 attention modules of the model \(CLIPAttention\) carry no layer index, "
                                         "so a layer table cannot name them; they keep the model's settings"):
        train(patch_model(tiny_llava(patch_size=4), "score:1100"), tmp_path / "table", max_steps=1,
              callbacks=[SpanAttentionCallback([Keyframe(0, {"*": "score:1000"})])])


def test_a_label_reaches_every_layer_of_an_encoder_deeper_than_its_decoder(tmp_path):
    """An encoder of 3 layers and a decoder of 2: the config counts the decoder's, and a label (every layer) left
    encoder layer 2 with the model's setting. Its gradients are now those of the model patched with the label."""
    recorder = GradRecorder()
    trainer = Trainer(model=patch_model(_bert2bert(2, encoder_layers=3), "score:1100"), train_dataset=Pairs(),
                      callbacks=[SpanAttentionCallback([Keyframe(0, "score:1000")]), recorder],
                      args=TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1,
                                             learning_rate=0.0, report_to=[], use_cpu=True, save_strategy="no",
                                             disable_tqdm=True, max_grad_norm=0.0))
    trainer.train()

    def by_hand(label):
        model = patch_model(_bert2bert(2, encoder_layers=3), label).train()
        pairs = [Pairs()[i] for i in range(4)]
        model(input_ids=torch.stack([p["input_ids"] for p in pairs]),
              labels=torch.stack([p["labels"] for p in pairs])).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None and "encoder.layer.2." in n}

    want, other = by_hand("score:1000"), by_hand("score:1100")
    got = recorder.grads[0]
    assert any((want[n] - other[n]).norm() > 1e-3 * want[n].norm() for n in want)  # the rule shows there
    assert all((got[n] - want[n]).norm() <= 1e-5 * want[n].norm() for n in want)


def test_a_callback_kept_after_training_holds_none_of_the_models_modules(tmp_path):
    """A callback kept for the next run (the trials of a search, one callback for all) held the attention modules,
    with their weights, of the model trained last, after the trainer and the model were dropped."""
    import gc
    import weakref

    callback = SpanAttentionCallback([Keyframe(0, "score:1100")], diagnostics_every=1)
    model = tiny("gpt2")
    patch_model(model, "score:1000")
    modules = [weakref.ref(m) for m in model.modules()]
    trainer = train(model, tmp_path, [callback], max_steps=1)
    assert trainer.state.log_history[0]["span/alpha1"] == 1.0  # the schedule was in force
    del trainer, model
    gc.collect()
    assert not [ref() for ref in modules if ref() is not None]


def test_a_composite_whose_vision_tower_alone_is_patched_is_refused_naming_the_tower(tmp_path):
    """The vision tower patched alone: the callback said "the model is not patched", as if nothing were, without the
    way to train that tower under the schedule."""
    model = tiny_llava(patch_size=4)
    patch_model(model.model.vision_tower, "score:1100")
    with pytest.raises(ValueError, match=r"the model is not patched, only its tower model.vision_tower \(patch_model "
                                         r"given the tower\).*call hf_spanattn.patch_model\(model, config\) before "
                                         r"training \(then patch_model\(model.model.vision_tower, ...\) again"):
        train(model, tmp_path, [SpanAttentionCallback([Keyframe(0, "score:1000")])], max_steps=1)


def test_a_run_resumed_with_another_schedule_than_its_checkpoints_says_so(tmp_path):
    """A checkpoint trained under one schedule, resumed with a callback of another (or none): the new one took over
    at the step without a word. Resumed with the same schedule, or the checkpoint's callback restored: nothing said."""
    schedule = [Keyframe(0, "standard:QKV111"), Keyframe(1, {0: "score:1000"})]
    quick = dict(max_steps=2, save_strategy="steps", save_steps=1)
    train(patch_model(tiny("gpt2"), "score:1100"), tmp_path, [SpanAttentionCallback(schedule)], **quick)
    checkpoint = str(tmp_path / "checkpoint-1")

    def resumed(callbacks, restore=False):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=0.0,
                                 report_to=[], use_cpu=True, disable_tqdm=True, **quick,
                                 restore_callback_states_from_checkpoint=restore)
        Trainer(model=patch_model(tiny("gpt2"), "score:1100"), train_dataset=Same(), args=args,
                callbacks=callbacks).train(resume_from_checkpoint=checkpoint)

    for other, named in [([Keyframe(0, "score:1111")], r"the schedule \[\{'at': 0, 'span': 'score:1111'"),
                         (None, "no schedule")]:
        recorder = RuleRecorder()
        with pytest.warns(UserWarning, match=r"SpanAttentionCallback: the run resumes at step 1 from a checkpoint "
                                             r"trained with the schedule \[\{'at': 0, .*'span': \{'0': 'score:1000'\}"
                                             rf".*\], and follows this callback's, {named}"):
            resumed([SpanAttentionCallback(other), recorder])
        assert recorder.labels[1] == ("score:1111" if other else "score:1100")  # what the callback given sets
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpanAttentionCallback: the run resumes")
        for callback, restore in [(SpanAttentionCallback(copy.deepcopy(schedule)), False),
                                  (SpanAttentionCallback(), True)]:
            resumed([callback], restore)


def test_a_schedules_label_over_a_tower_patched_apart_says_it_sets_that_tower_too(tmp_path):
    """The vision tower patched with settings of its own, then a schedule of labels: the label replaced the tower's
    settings for the steps it was in force without a word. A layer table, which leaves the layers it does not name
    as they are, and a model patched alike throughout, are not warned about."""
    def model(apart=True):
        model = patch_model(tiny_llava(patch_size=4), "standard:QKV111")
        return patch_model(model.model.vision_tower, "score:1100") and model if apart else model

    with pytest.warns(UserWarning, match=r"SpanAttentionCallback: the schedule's labels \(keyframes at=0, '50%'\) set "
                                         r"every layer, also those of the towers patched with settings of their own, "
                                         r"model.vision_tower \(score:1100\), while they are in force"):
        train(model(), tmp_path, [SpanAttentionCallback([Keyframe(0, "score:1000"), Keyframe("50%", "score:1111"),
                                                         Keyframe(3, {"1": "score:1000"})])], max_steps=4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SpanAttentionCallback: the schedule's labels")
        train(model(), tmp_path / "table", [SpanAttentionCallback([Keyframe(0, {"0": "score:1000"})])], max_steps=1)
        train(model(apart=False), tmp_path / "alike", [SpanAttentionCallback([Keyframe(0, "score:1000")])], max_steps=1)


def test_a_run_trained_without_the_callback_resumes_with_it_and_saves_its_state(tmp_path):
    """A checkpoint trained without the callback, resumed with one: the Trainer's next save failed with
    KeyError: 'SpanAttentionCallback' (its state read back from the checkpoint had no entry for it). The run trains
    on under the schedule, and its checkpoints hold the callback's state."""
    quick = dict(max_steps=2, save_strategy="steps", save_steps=1)
    train(patch_model(tiny("gpt2"), "score:1100"), tmp_path, [], **quick)
    recorder = RuleRecorder()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=0.0, report_to=[],
                             use_cpu=True, disable_tqdm=True, **quick)
    Trainer(model=patch_model(tiny("gpt2"), "score:1100"), train_dataset=Same(), args=args,
            callbacks=[SpanAttentionCallback([Keyframe(0, "score:1000")]), recorder]).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert recorder.labels == {1: "score:1000"}
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["SpanAttentionCallback"]["args"]["schedule"] == [{"at": 0, "span": "score:1000", "ramp": False}]


def test_the_labels_of_a_schedule_with_a_table_reach_a_vision_tower_whose_attention_carries_no_layer_index(tmp_path):
    """LLaVA under a label, then a layer table: CLIP's attention kept the model's settings throughout, the label
    reaching it only in a schedule of labels alone. It now follows the labels (its gradients those of the model patched
    with the label), keeping the last one's setting while the table is in force, and the warning says so."""
    recorder = GradRecorder()
    schedule = [Keyframe(0, "score:1000"), Keyframe(1, {"0": "score:1111"})]
    with pytest.warns(UserWarning, match=r"\(CLIPAttention\) carry no layer index, so a layer table cannot name them; "
                                         r"they follow the schedule's labels \(keyframes at=0\), keeping the setting "
                                         "the last one gave them while a table is in force"):
        train(patch_model(tiny_llava(patch_size=4), "score:1100"), tmp_path,
              [SpanAttentionCallback(schedule, diagnostics_every=1), recorder], Pictures(),
              per_device_train_batch_size=2, max_steps=2)
    assert_same(recorder.grads[0], _vision_tower_grads("score:1000"))
    records = [json.loads(line) for line in (tmp_path / "span_diagnostics.jsonl").read_text().splitlines()]
    assert {(r["step"], r["span"]) for r in records if "vision_tower" in r["tower"]} == {(1, "score:1000"),
                                                                                          (2, "score:1000")}
