"""The recipes end to end on the offline WikiText-2 copy: training, sweep, report, two processes."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "recipes"))

import report  # noqa: E402
import run_clm  # noqa: E402
import sweep  # noqa: E402

pytestmark = pytest.mark.skipif(not (DATA / "wikitext-2-raw-v1").is_dir(), reason="needs ../shared/data")

TINY = {"data_dir": str(DATA / "wikitext-2-raw-v1"), "train_file": "train.PARTIAL-first-1MB.txt",
        "tokenizer_name": str(DATA / "gpt2-tokenizer"), "n_embd": 32, "n_head": 2, "n_layer": 1, "block_size": 32,
        "max_train_tokens": 1200, "max_eval_tokens": 600, "num_train_epochs": 1, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2, "per_device_eval_batch_size": 16, "disable_tqdm": True, "dropout": 0.0}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}


def flags(args: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in args.items()]


def test_training_writes_the_metrics_json(tmp_path, capfd, monkeypatch):
    logging.Logger.warning_once.cache_clear()  # Transformers warns once per process
    loads, load_best = [], run_clm.Trainer._load_best_model
    monkeypatch.setattr(run_clm.Trainer, "_load_best_model", lambda self: [loads.append(1), load_best(self)][1])
    metrics = run_clm.main(flags({**TINY, "span": "score:1000@per_block", "span_layers": "0",
                                  "output_dir": tmp_path, "num_train_epochs": 2}))
    console = "".join(capfd.readouterr())
    assert "loss_type" not in console  # nor, loading the best checkpoint, a missing tied lm_head.weight:
    assert "missing keys" not in console and loads == [1]
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["span"] == metrics["span"] == "score:1000@per_block"
    assert saved["span_config"]["layers"] == [0]
    assert [e["epoch"] for e in saved["eval_history"]] == [1.0, 2.0]
    assert saved["min_val_loss"] == min(e["loss"] for e in saved["eval_history"])
    assert abs(saved["val_perplexity"] - 2.718281828 ** saved["min_val_loss"]) < 1e-3 * saved["val_perplexity"]
    assert 0 <= saved["val_accuracy"] <= 1
    assert saved["config"]["model"]["n_embd"] == 32 and saved["config"]["data"]["block_size"] == 32
    assert json.loads((tmp_path / "config.json").read_text())["span_attention"]["score_grad"] == "per_block"


def test_blocks_overlap_by_half_and_mark_the_unpredicted_label():
    out = run_clm.blocks(list(range(10)), size=4, overlap=0.5)
    assert out["input_ids"] == [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9]]
    assert out["labels"][1] == [-100, 3, 4, 5]


def test_blocks_keep_spreads_the_windows_over_the_whole_text():
    out = run_clm.blocks(list(range(40)), size=4, overlap=0, keep=3)  # 10 windows, starting 0, 4, …, 36
    assert [w[0] for w in out["input_ids"]] == [0, 12, 24]
    assert out["labels"][1] == [-100, 13, 14, 15]
    assert run_clm.blocks(list(range(40)), size=4, overlap=0, keep=10) == run_clm.blocks(list(range(40)), 4, 0)
    assert len(run_clm.blocks(list(range(40)), size=4, overlap=0, keep=50)["input_ids"]) == 10


def test_spread_subset_reads_the_whole_split(tmp_path):
    """--token_subset spread draws its blocks from the whole file; first takes the file's first tokens."""
    text = "".join(f" part{i} a b\n" for i in range(500))
    (tmp_path / "train.txt").write_text(text)
    (tmp_path / "validation.txt").write_text(text)
    tokenizer = run_clm.AutoTokenizer.from_pretrained(DATA / "gpt2-tokenizer")
    training = run_clm.TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", do_train=True,
                                         do_eval=True)
    seen = {}
    for subset in ("first", "spread"):
        data = run_clm.DataArguments(data_dir=str(tmp_path), block_size=32, overlap=0, max_train_tokens=320,
                                     max_eval_tokens=64, token_subset=subset)
        train = run_clm.build_datasets(data, tokenizer, training)["train"]
        assert len(train) == 10
        seen[subset] = [int(i) for i in re.findall(r"part(\d+)", tokenizer.decode(train[:]["input_ids"].flatten()))]
    assert min(seen["first"]) == 0 and max(seen["first"]) < 100  # 320 tokens: the first lines
    assert min(seen["spread"]) == 0 and max(seen["spread"]) > 400


def test_tokenized_cache_key_follows_the_texts_and_the_tokenizer():
    tokenizer = run_clm.AutoTokenizer.from_pretrained(DATA / "gpt2-tokenizer")
    other = run_clm.AutoTokenizer.from_pretrained(DATA / "gpt2-tokenizer")
    texts = run_clm.datasets.Dataset.from_dict({"text": ["a b c", "d e"]})
    key = run_clm.tokenized_fingerprint(texts, tokenizer)
    assert key == run_clm.tokenized_fingerprint(texts, other)
    assert key != run_clm.tokenized_fingerprint(run_clm.datasets.Dataset.from_dict({"text": ["a b c", "d f"]}), other)
    other.add_tokens(["zzqq"])
    assert key != run_clm.tokenized_fingerprint(texts, other)


def test_token_scores_are_the_next_token_argmax_and_nll():
    torch = run_clm.torch
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=generator)
    labels = torch.randint(0, 11, (3, 7), generator=generator)
    labels[:, 0], labels[1, 4] = -100, -100
    scores = run_clm.token_scores(logits, labels)
    log_p = torch.log_softmax(logits[:, :-1].double(), -1)
    nll = -log_p.gather(-1, labels[:, 1:].clamp_min(0)[..., None]).squeeze(-1)
    assert scores.shape == (3, 6, 2)
    assert torch.equal(scores[..., 0], logits[:, :-1].argmax(-1).float())
    assert torch.allclose(scores[..., 1].double(), nll, atol=1e-5)


def test_unigram_loss_counts_the_training_tokens():
    train = run_clm.datasets.Dataset.from_dict({"input_ids": [[1, 2, 2, 3], [2, 2, 0, 4]]}).with_format("torch")
    validation = run_clm.datasets.Dataset.from_dict({"labels": [[-100, 2, 3, 5], [-100, 4, -100, 1]]}) \
        .with_format("torch")
    counts = {0: 1, 1: 1, 2: 4, 3: 1, 4: 1, 5: 0}  # over a vocabulary of 6, add-½
    expected = -sum(math.log((counts[t] + 0.5) / (8 + 0.5 * 6)) for t in (2, 3, 5, 4, 1)) / 5
    assert run_clm.unigram_loss(train, validation, vocab_size=6) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("argv,message", [
    (["--span", "score:12"], "expected 4 values"),
    (["--span", "fancy:1000"], "allowed values are standard, simple, reductionistic, score"),
    (["--span_grad", "hooks"], "exact"),
    (["--span_layers", "1,x"], "comma-separated integers"),
    (["--overlap", "1.5"], "0 <= overlap < 1"),
    (["--no_such_flag", "1"], "not used by the HfArgumentParser"),
    # named the field of the settings the flag sets (alphas=, layers=, score_grad=, diagnostics_every=), not the flag
    (["--span", "score:100"], "--span: label='score:100': alphas=(1.0, 0.0, 0.0): expected 4 values"),
    (["--span", "simple:10", "--span_grad", "per_block"], "--span_grad per_block: score_grad='per_block': only"),
    (["--span_layers", "-1"], "--span_layers '-1': layers=(-1,): expected None (all layers) or a sequence"),
    (["--span_diagnostics_every", "-1"], "--span_diagnostics_every -1: diagnostics_every=-1: expected an integer"),
])
def test_bad_flags_fail_before_any_data_is_read(argv, message, monkeypatch, tmp_path):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    with pytest.raises((ValueError, SystemExit)) as err:
        run_clm.main([*argv, "--output_dir", str(tmp_path)])
    assert message in str(err.value) or err.type is SystemExit


def write_sweep(tmp_path: Path, spans: list[str], seeds: list[int]) -> Path:
    config = {"output_dir": str(tmp_path / "runs"), "args": TINY, "spans": spans, "seeds": seeds,
              "shapes": [{"n_head": 2, "n_layer": 1}]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# the sweep's runs and report also run in test_sweep_runs_one_setting_once_and_redoes_a_run_made_otherwise
@pytest.mark.slow
def test_sweep_report_and_resume_after_two_interruptions(tmp_path):
    config = write_sweep(tmp_path, ["standard:QKV111", "score:1000"], [0, 1])
    # a launcher that dies on its 2nd and 4th call, as an interrupted machine would
    counter = tmp_path / "calls"
    launcher = tmp_path / "flaky.py"
    launcher.write_text(
        "import os, sys, runpy\n"
        f"n = int(open({str(counter)!r}).read()) + 1 if os.path.exists({str(counter)!r}) else 1\n"
        f"open({str(counter)!r}, 'w').write(str(n))\n"
        "if n in (2, 4): sys.exit(3)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    argv = [str(config), "--launcher", f"{sys.executable} {launcher}"]
    finished = {}
    for attempt in range(3):
        env_before = dict(os.environ)
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
        try:
            code = sweep.main(argv)
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        assert code == (3 if attempt < 2 else 0)
        for path in sorted((tmp_path / "runs").glob("*/*/*/metrics.json")):
            text = path.read_text()
            assert finished.setdefault(path, text) == text  # a finished run is never redone
    assert len(finished) == 4
    assert not list((tmp_path / "runs").glob("*/*/*/checkpoint-*"))  # pruned after finishing
    assert not list((tmp_path / "runs").glob("*/*/*/tokenizer*")) and not list((tmp_path / "runs").glob("*/*/*/*.bin"))

    report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "report")])
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| standard:QKV111 | 2 |" in table and "| score:1000 | 2 |" in table
    rows = (tmp_path / "report" / "report.csv").read_text().splitlines()
    assert rows[0].startswith("shape,span,runs") and len(rows) == 3
    for png in ("loss_curves_H2xL1.png", "improvements_H2xL1.png"):
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_interrupted_run_resumes_from_its_last_checkpoint(tmp_path):
    args = flags({**TINY, "span": "score:1000", "output_dir": tmp_path, "num_train_epochs": 2})
    full = run_clm.main(args)
    # as if killed after the epoch-1 checkpoint
    (tmp_path / "metrics.json").unlink()
    shutil.rmtree(tmp_path / f"checkpoint-{full['train_history'][1]['step']}")
    metrics = run_clm.main(args)
    assert metrics["resumed_from"].endswith("checkpoint-" + str(metrics["train_history"][0]["step"]))
    assert [e["epoch"] for e in metrics["eval_history"]] == [1.0, 2.0]
    assert [e["loss"] for e in metrics["eval_history"]] == pytest.approx([e["loss"] for e in full["eval_history"]],
                                                                          rel=1e-6)


def test_a_run_never_resumes_a_checkpoint_of_other_settings(tmp_path):
    """standard:QKV111 in X, then score:1000 (or other data) in X: refused before training, the first run's
    files untouched; with --overwrite_output_dir the first run moves to X.replaced-1 and the second starts afresh."""
    out = tmp_path / "X"
    run_clm.main(flags({**TINY, "span": "standard:QKV111", "output_dir": out}))
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for change, message in (({"span": "score:1000"}, "span.span: 'standard:QKV111' → 'score:1000'"),
                            ({"max_train_tokens": 1000}, "data.max_train_tokens: 1200 → 1000"),
                            ({"train_file": "validation.txt"}, "data.train_file:"),
                            ({"learning_rate": 1e-3}, "training.learning_rate:"),
                            ({"n_layer": 2}, "model.n_layer: 1 → 2")):
        with pytest.raises(ValueError, match="--overwrite_output_dir") as err:
            run_clm.main(flags({**TINY, "span": "standard:QKV111", "output_dir": out, **change}))
        assert message in str(err.value) and "not resumed" in str(err.value)
        assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == first
    metrics = run_clm.main(flags({**TINY, "span": "score:1000", "output_dir": out, "overwrite_output_dir": True}))
    assert metrics["span"] == "score:1000" and metrics["resumed_from"] is None
    moved = tmp_path / "X.replaced-1"
    assert {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*") if p.is_file()} == first
    assert json.loads((out / "run_config.json").read_text())["span"]["span"] == "score:1000"
    assert json.loads((out / "config.json").read_text())["span_attention"]["alphas"] == [1, 0, 0, 0]


def test_two_processes_match_one_process_step_by_step(tmp_path):
    """accelerate launch --multi_gpu --num_processes 2 with --use_cpu (gloo) and the same global batch gives
    the same losses as one process."""
    # 2448 tokens make 152 blocks: full batches of 4 only, so no process pads its last batch
    common = {**TINY, "span": "score:1100", "max_train_tokens": 2448, "gradient_accumulation_steps": 1,
              "logging_strategy": "steps", "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no",
              "load_best_model_at_end": False, "seed": 3, "data_seed": 3}
    one = tmp_path / "one"
    two = tmp_path / "two"
    subprocess.run([sys.executable, str(ROOT / "recipes" / "run_clm.py"),
                    *flags({**common, "per_device_train_batch_size": 4, "output_dir": one})], env=ENV, check=True,
                   capture_output=True)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    result = subprocess.run([*launch, str(ROOT / "recipes" / "run_clm.py"),
                             *flags({**common, "per_device_train_batch_size": 2, "output_dir": two, "use_cpu": True})],
                            env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads((d / "metrics.json").read_text())["train_history"] for d in (one, two)]
    assert json.loads((two / "metrics.json").read_text())["world_size"] == 2
    assert len(losses[0]) == len(losses[1]) >= 8
    for a, b in zip(*losses):
        assert a["step"] == b["step"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"])  # fp32 sums in another order


def test_schedule_and_diagnostics_flags_write_the_jsonl_and_the_plot(tmp_path):
    import plot_diagnostics

    schedule = '[{"at": 0, "span": "score:1111"}, {"at": "100%", "span": "score:1000", "ramp": true}]'
    run_clm.main(flags({**TINY, "n_layer": 2, "span": "score:1111", "span_schedule": schedule,
                        "span_diagnostics_every": 2, "output_dir": tmp_path}))
    records = [json.loads(line) for line in (tmp_path / "span_diagnostics.jsonl").read_text().splitlines()]
    assert {r["layer"] for r in records} == {0, 1} and records[0]["span"] == "score:1111"
    assert records[-1]["span"].startswith("score:1,") and records[-1]["dq_share"][3] < records[0]["dq_share"][3]
    png = plot_diagnostics.plot(records, tmp_path / "diagnostics.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("schedule,message", [
    ('[{"at": 0, "span": "score:12"}]', "4 values"),
    ('{"at": 0}', "expected a list of keyframes"),
    ('[{"at": 0, "span": {"0-x": "score:1000"}}]', "layer spec"),
    ('[{"at": 0, "spam": "score:1000"}]', r"^--span_schedule '\[.*\]': schedule keyframe \{'at': 0, 'spam'"),
    ('[{"at": 0, "span": "score:12"}]', r"^--span_schedule '\[.*\]': keyframe at=0 span='score:12': label="),
    ('[{"at": 0.5, "span": "score:1000"}]', r"keyframe at=0.5: expected a step \(int\), a share"),
    ('[{"at": "150%", "span": "score:1000"}]', "keyframe at='150%': a share of training is at most '100%'"),
    ('[{"at": "-1ep", "span": "score:1000"}]', "keyframe at='-1ep': must be finite and not negative"),
    ("[" * 10_000 + "]" * 10_000, r"^--span_schedule: not valid YAML/JSON \(RecursionError"),
    ("binary.yaml", r"--span_schedule .*binary.yaml: not valid YAML/JSON \(UnicodeDecodeError"),
])
def test_bad_schedules_fail_before_any_data_is_read(schedule, message, monkeypatch, tmp_path):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    if schedule.endswith(".yaml"):
        schedule = str(tmp_path / schedule)
        Path(schedule).write_bytes(b"\xff\xfe- at: 0\n")
    with pytest.raises(ValueError, match=message):
        run_clm.main(["--span_schedule", schedule, "--output_dir", str(tmp_path)])


def test_a_schedule_naming_layers_past_the_models_fails_by_its_flag_before_any_data_is_read(monkeypatch, tmp_path):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    with pytest.raises(ValueError, match=r"^--span_schedule '\[.*\]': keyframe .*layers 1 are outside 0\.\.0"):
        run_clm.main(flags({**TINY, "span_schedule": '[{"at": 0, "span": {"1": "score:1000"}}]',
                            "output_dir": tmp_path}))


def test_sweep_runs_one_setting_once_and_redoes_a_run_made_otherwise(tmp_path, capsys):
    spans = ["score:1000", "score:1,0,0,0", "standard:QKV111"]
    config = yaml.safe_load(write_sweep(tmp_path, spans, [0, 0]).read_text())
    runs = sweep.plan(config)
    assert [folder.parts[-2:] for folder, _ in runs] == [("score-1000", "seed0"), ("standard-QKV111", "seed0")]
    said = capsys.readouterr().out
    assert "span 'score:1,0,0,0' is the same setting as 'score:1000'" in said and "seed 0 is the same" in said

    path = write_sweep(tmp_path, ["score:1000"], [0])
    env_before = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT / "src"))
    try:
        assert sweep.main([str(path)]) == 0
        run = tmp_path / "runs" / "H2xL1" / "score-1000" / "seed0"
        done = (run / "metrics.json").read_text()
        assert sweep.main([str(path)]) == 0  # the same sweep again: nothing is redone
        assert (run / "metrics.json").read_text() == done and "1 runs, 1 finished" in capsys.readouterr().out
        # the same sweep on other data (as compare.sh with another SPANATTN_DATA): moved aside and redone
        assert sweep.main([str(path), "--train_file", "validation.txt"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    said = capsys.readouterr().out
    folder = DATA / "wikitext-2-raw-v1"
    assert "1 runs, 0 finished" in said
    assert f"data.train_file: '{folder / 'train.PARTIAL-first-1MB.txt'}' → '{folder / 'validation.txt'}'" in said
    assert (run.parent / "seed0.replaced-1" / "metrics.json").read_text() == done
    redone = json.loads((run / "metrics.json").read_text())
    assert redone["config"]["data"]["train_file"] == "validation.txt"
    runs = report.load_runs(tmp_path / "runs")  # the run moved aside is not in the report
    assert runs["H2xL1"]["score:1000"][0]["config"]["data"]["train_file"] == "validation.txt"


@pytest.mark.parametrize("recipe", ["run_clm", "sweep", "report", "plot_diagnostics"])
def test_every_recipe_prints_its_help(recipe, capsys):
    module = __import__(recipe)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("hub_call", ["tokenizer", "dataset"])
def test_without_the_hub_the_console_names_the_offline_route(hub_call, monkeypatch, tmp_path):
    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    argv = ["--output_dir", str(tmp_path)]
    if hub_call == "tokenizer":
        monkeypatch.setattr(run_clm.AutoTokenizer, "from_pretrained", unreachable)
    else:
        monkeypatch.setattr(run_clm.datasets, "load_dataset", unreachable)
        argv += ["--tokenizer_name", TINY["tokenizer_name"]]
    with pytest.raises(SystemExit) as exit_:
        run_clm.main(argv)
    message = str(exit_.value)
    assert "could not download" in message and "couldn't connect" in message
    assert "SPANATTN_DATA=../shared/data bash scripts/compare.sh" in message


def test_a_failed_run_shows_its_output_and_its_last_lines_on_the_console(tmp_path, capsys):
    config = write_sweep(tmp_path, ["standard:QKV111"], [0])
    launcher = tmp_path / "fails.py"
    launcher.write_text("import sys\nprint('  3%|▎ | 1/30 [00:01<00:29]', flush=True)\n"
                        "sys.exit('run_clm.py: the real reason\\n  what to do about it')\n")
    assert sweep.main([str(config), "--launcher", f"{sys.executable} {launcher}"]) == 1
    out = capsys.readouterr().out
    assert "1/30 [00:01<00:29]" in out  # the progress bar reaches the console
    assert "run_clm.py: the real reason\n  what to do about it\n  failed with exit code 1" in out


def fake_run(runs: Path, label: str, seed: int, val: list[float], diagnostics: bool = False) -> None:
    """A metrics.json as run_clm.py writes it, with validation losses `val` at steps 10, 20, ..."""
    folder = runs / "H1xL2" / sweep.span_dir(label) / f"seed{seed}"
    folder.mkdir(parents=True)
    evals = [{"epoch": i / len(val), "step": 10 * i, "loss": v, "accuracy": 0.1, "perplexity": 2.718 ** v}
             for i, v in enumerate(val, 1)]
    metrics = {"span": label, "min_val_loss": min(val), "final_train_loss": val[-1] - 0.1, "train_runtime_s": 50.0,
               "train_history": [{"epoch": e["epoch"], "step": e["step"], "loss": e["loss"] - 0.1} for e in evals],
               "eval_history": evals, "world_size": 1,
               "config": {"training": {"seed": seed, "per_device_train_batch_size": 4,
                                       "gradient_accumulation_steps": 1},
                          "data": {"data_dir": None, "dataset_name": "wikitext",
                                   "dataset_config_name": "wikitext-2-v1", "block_size": 128},
                          "span": {"span": label, "span_diagnostics_every": 10 if diagnostics else 0}}}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    if diagnostics:
        record = {"step": 1, "epoch": 0.1, "layer": 0, "span": label, "dq_share": [0.8, 0.1, 0.1, 0.0],
                  "dk_share": [0.9, 0.1, 0.0, 0.0], "cos_q": 1.0, "cos_k": 1.0}
        lines = [json.dumps({**record, "step": s}) for s in (1, 11)]
        (folder / "span_diagnostics.jsonl").write_text("\n".join(lines) + "\n")


def test_report_states_delta_with_its_seed_spread_and_keeps_noise_small(tmp_path):
    runs = tmp_path / "runs"
    for seed, (base, other) in enumerate([(6.40, 6.40001), (6.50, 6.49998)]):
        fake_run(runs, "standard:QKV111", seed, [7.0, base], diagnostics=seed == 0)
        fake_run(runs, "score:1000", seed, [7.0, other], diagnostics=seed == 0)
    report.main([str(runs), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.md").read_text()
    deltas = [(6.40 - 6.40001) / 6.40 * 100, (6.50 - 6.49998) / 6.50 * 100]
    mean, std = sum(deltas) / 2, abs(deltas[0] - deltas[1]) / 2 ** 0.5
    assert f"| {mean:+.3f} ± {std:.3f} |" in text
    assert f"score:1000: Δ = {mean:+.3f} % ± {std:.3f} % (within twice its seed spread" in text
    assert "can neither confirm nor refute" in text and "20 optimizer steps on about 10,240 tokens" in text
    rows = report.table(report.load_runs(runs)["H1xL2"])
    assert report.delta_limit(rows) >= report.PAPER_DELTA  # a 0.0003 % difference stays a sliver
    for png in ("loss_curves_H1xL2.png", "improvements_H1xL2.png", "diagnostics_H1xL2_standard-QKV111.png",
                "diagnostics_H1xL2_score-1000.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text


def test_a_clear_difference_is_called_beyond_the_spread(tmp_path):
    runs = tmp_path / "runs"
    for seed, (base, other) in enumerate([(6.40, 6.30), (6.50, 6.41)]):
        fake_run(runs, "standard:QKV111", seed, [base])
        fake_run(runs, "score:1000", seed, [other])
    rows = report.table(report.load_runs(runs)["H1xL2"])
    assert report.delta_limit(rows) > max(rows[1]["val_delta_paired"])
    assert "beyond twice its seed spread over 2 seeds" in report.verdict("H1xL2", report.load_runs(runs)["H1xL2"], rows)


def test_runs_with_the_papers_training_are_set_beside_its_result(tmp_path):
    runs = tmp_path / "runs"
    for seed, (base, other) in enumerate([(6.40, 6.30), (6.50, 6.41)]):
        fake_run(runs, "standard:QKV111", seed, [base])
        fake_run(runs, "score:1000", seed, [other])

    def verdict() -> str:
        spans = report.load_runs(runs)["H1xL2"]
        return report.verdict("H1xL2", spans, report.table(spans))

    small = verdict()
    assert "neither confirm nor refute" in small and "a hint at this size, not a result" in small
    for path in runs.glob("*/*/seed*/metrics.json"):
        metrics = json.loads(path.read_text())
        metrics["config"]["model"] = {"n_embd": 256, "n_layer": 6, "n_head": 4}
        metrics["config"]["data"]["block_size"] = 512
        metrics["config"]["training"].update(per_device_train_batch_size=64, gradient_accumulation_steps=2,
                                             num_train_epochs=50.0)
        path.write_text(json.dumps(metrics))
    full = verdict()
    assert "These runs have the paper's training" in full and "beyond twice its seed spread over 2 seeds)" in full
    assert "neither confirm" not in full and "a hint at this size" not in full
    metrics["config"]["training"]["num_train_epochs"] = 5.0  # one run with a shorter schedule
    path.write_text(json.dumps(metrics))
    assert "neither confirm nor refute" in verdict()


@pytest.mark.parametrize("family,left_out", [("gpt2", {"lm_head.weight"}), ("llama", set())])
def test_the_recipe_leaves_the_tied_head_out_of_checkpoints_under_transformers_4_too(family, left_out):
    """Transformers 4 (which the package's requirements allow) names a model's tied weights only in the class's
    `_tied_weights_keys`; the recipe read `all_tied_weights_keys`, which it lacks, and stopped before training. That
    class list names the head also where the config unties it (Llama's default): it must be saved then."""
    from models import tiny

    current, older = tiny(family), tiny(family)
    if hasattr(older, "all_tied_weights_keys"):
        del older.all_tied_weights_keys  # as a Transformers 4 model
    keys = [run_clm.stock_causal_lm(model)._keys_to_ignore_on_save for model in (current, older)]
    assert keys[0] == keys[1] == left_out
