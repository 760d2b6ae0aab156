"""Packing whole runs into a time budget (recipes/pack.py), early stopping, and the merge (recipes/merge.py)."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import merge  # noqa: E402
import pack  # noqa: E402
import run_clm  # noqa: E402
from test_recipes import DATA, TINY, flags  # noqa: E402

SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")

# Stands in for run_clm.py where only the packing is tested: sleeps FAKE_SLEEP seconds, writes a
# metrics.json of run_clm.py's form with losses drawn from the span and seed, notes its start and
# end in FAKE_CALLS, and fails for the span FAKE_FAIL. Seed 1 stops early.
FAKE_RUN = """
import json, os, sys, time, zlib
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
start = time.time()
if args["span"] == os.environ.get("FAKE_FAIL"):
    print("boom: this run fails")
    sys.exit(3)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
seed = int(args["seed"])
noise = lambda key: zlib.crc32(f"{args['span']}/{seed}/{key}".encode()) % 1000 / 1e4
epochs = 2 if seed == 1 else 3
evals = [{"epoch": float(e), "step": 5 * e, "loss": 6 - 0.2 * e + noise(e), "accuracy": 0.1, "perplexity": 1.0}
         for e in range(1, epochs + 1)]
train = [{"epoch": float(e), "step": 5 * e, "loss": 7 - 0.3 * e + noise(-e), "learning_rate": 1e-3}
         for e in range(1, epochs + 1)]
best = min(evals, key=lambda e: e["loss"])
metrics = {"span": args["span"], "span_config": {}, "final_train_loss": train[-1]["loss"], "min_val_loss": best["loss"],
           "best_epoch": best["epoch"], "val_perplexity": 1.0, "val_accuracy": 0.1, "train_history": train,
           "eval_history": evals, "train_runtime_s": time.time() - start, "device": "fake",
           "backend": "fake-backend",
           "early_stopping": {"patience": 1, "threshold": 0.0, "stopped_early": seed == 1,
                              "stopped_at_epoch": 2.0 if seed == 1 else None, "num_train_epochs": 3.0},
           "config": {"model": {}, "data": {"data_dir": "fake", "train_file": "t", "validation_file": "v"},
                      "span": {}, "training": {"seed": seed}, "hf_spanattn": "0", "transformers": "0", "torch": "0"}}
open(os.path.join(args["output_dir"], "metrics.json"), "w").write(json.dumps(metrics))
with open(os.environ["FAKE_CALLS"], "a") as f:
    f.write(json.dumps({"span": args["span"], "seed": seed, "start": start, "end": time.time()}) + "\\n")
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "fake_run_clm.py"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(pack, "RUN_CLM", script)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    return lambda: [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def write_sweep(path: Path, spans: list[str], seeds: list[int], args: dict | None = None,
                tree: Path | None = None) -> Path:
    config = {"output_dir": str(tree or path.parent / "tree"), "args": args or {}, "spans": spans, "seeds": seeds,
              "shapes": [{"n_head": 2, "n_layer": 1}]}
    path.write_text(yaml.safe_dump(config))
    return path


def test_packs_whole_runs_into_the_budget_and_skips_finished_ones(tmp_path, fake, monkeypatch):
    config = write_sweep(tmp_path / "sweep.yaml", ["standard:QKV111", "score:1000"], [0, 1])
    results = tmp_path / "results"
    monkeypatch.setenv("FAKE_SLEEP", "2.5")
    assert pack.main([str(config), "--results", str(results), "--budget", "0"]) == 0
    assert [(c["span"], c["seed"]) for c in fake()] == [("standard:QKV111", 0)]  # a first run always starts
    first = {p.name: p.read_text() for p in results.iterdir()}
    # runs take 2.5 s and a little: in 7.4 s a second run starts (about 4.9 s left), a third cannot (at most 2.4 s)
    assert pack.main([str(config), "--results", str(results), "--budget", "7.4"]) == 0
    assert [(c["span"], c["seed"]) for c in fake()][1:] == [("score:1000", 0), ("standard:QKV111", 1)]
    monkeypatch.setenv("FAKE_SLEEP", "0")
    assert pack.main([str(config), "--results", str(results), "--jsonl", str(tmp_path / "all.jsonl")]) == 0
    calls = fake()
    assert len(calls) == 4 and len({(c["span"], c["seed"]) for c in calls}) == 4  # nothing finished ran twice
    assert all(results.joinpath(name).read_text() == text for name, text in first.items())
    files = sorted(results.iterdir())
    assert [p.name for p in files] == ["H2xL1__score-1000__seed0.json", "H2xL1__score-1000__seed1.json",
                                       "H2xL1__standard-QKV111__seed0.json", "H2xL1__standard-QKV111__seed1.json"]
    for path in files:
        record = json.loads(path.read_text())
        assert SAFE_NAME.fullmatch(path.name) and path.name == record["name"] + ".json"
        assert set(pack.REQUIRED) <= set(record)
        assert record["min_val_loss"] == min(e["loss"] for e in record["eval_history"])
        assert record["epochs_run"] == record["eval_history"][-1]["epoch"] == (2.0 if record["seed"] == 1 else 3.0)
    # the new run's line, and those of the runs in --results that it lacked (written by commands without --jsonl)
    assert sorted(r["name"] for r in pack.load_records(tmp_path / "all.jsonl")) == [p.stem for p in files]
    assert not list((tmp_path / "tree").glob("**/*"))  # runs write only their JSON


def test_a_result_left_out_of_the_jsonl_gets_its_line_without_running_again(tmp_path, fake, capsys):
    config = write_sweep(tmp_path / "sweep.yaml", ["standard:QKV111"], [0, 1])
    results, jsonl = tmp_path / "results", tmp_path / "all.jsonl"
    # the state a command stopped between write_record's two writes leaves: the result in --results only
    assert pack.main([str(config), "--results", str(results), "--max_runs", "1"]) == 0
    capsys.readouterr()
    assert pack.main([str(config), "--results", str(results), "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert f"{jsonl}: added the line of H2xL1__standard-QKV111__seed0 from {results}" in out
    assert len(fake()) == 2  # the finished run did not run again
    lines = pack.load_records(jsonl)
    assert sorted(r["name"] for r in lines) == ["H2xL1__standard-QKV111__seed0", "H2xL1__standard-QKV111__seed1"]
    assert lines[0] == json.loads((results / "H2xL1__standard-QKV111__seed0.json").read_text())
    assert pack.main([str(config), "--results", str(results), "--jsonl", str(jsonl)]) == 0
    assert "added the line" not in capsys.readouterr().out and len(pack.load_records(jsonl)) == 2


def test_two_runs_at_once_overlap(tmp_path, fake, monkeypatch):
    config = write_sweep(tmp_path / "sweep.yaml", ["standard:QKV111"], [0, 1, 2])
    monkeypatch.setenv("FAKE_SLEEP", "1.5")
    jsonl = tmp_path / "out" / "results.jsonl"
    assert pack.main([str(config), "--jsonl", str(jsonl), "--parallel", "2"]) == 0
    calls = sorted(fake(), key=lambda c: c["start"])
    assert len(calls) == 3
    assert calls[1]["start"] < calls[0]["end"]  # the first two ran side by side
    assert calls[2]["start"] >= min(calls[0]["end"], calls[1]["end"])  # never three at once
    assert sorted(r["seed"] for r in pack.load_records(jsonl)) == [0, 1, 2]
    assert {r["parallel"] for r in pack.load_records(jsonl)} == {2}


def test_a_failed_run_stops_new_starts_and_shows_its_log(tmp_path, fake, monkeypatch, capsys):
    config = write_sweep(tmp_path / "sweep.yaml", ["standard:QKV111", "score:1000", "score:1100"], [0])
    monkeypatch.setenv("FAKE_FAIL", "score:1000")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    code = pack.main([str(config), "--results", str(tmp_path / "results"), "--tmp_dir", str(scratch)])
    assert code == 1
    out = capsys.readouterr().out
    assert "FAILED H2xL1__score-1000__seed0 (exit code 3" in out and "boom: this run fails" in out
    assert [c["span"] for c in fake()] == ["standard:QKV111"]  # score:1100 was not started
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["H2xL1__standard-QKV111__seed0.json"]
    assert not list(scratch.iterdir())  # temporary folders removed, the failed run's too


def test_several_documents_run_in_order_and_inherit(tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text("output_dir: out\nargs: {n_embd: 64, block_size: 32}\nspans: [score:1000]\nseeds: [0]\n"
                    "shapes: [{n_head: 2, n_layer: 1}]\n---\nargs: {block_size: 16}\nspans: [score:1100, score:1000]\n")
    runs = pack.plan_runs(pack.load_sweeps(path), {"n_embd": "32"})
    assert [r.name for r in runs] == ["H2xL1__score-1000__seed0", "H2xL1__score-1100__seed0"]
    assert runs[0].args["block_size"] == "32" and runs[1].args["block_size"] == "16"
    assert {r.args["n_embd"] for r in runs} == {"32"} and "output_dir" not in runs[0].args
    # was: the second document's block_size for score:1000 went unused without a word
    assert "sweep config, document 2: H2xL1__score-1000__seed0 is planned by document 1 already, which it runs with " \
           "its own arguments, not these (block_size: '32' → '16')" in capsys.readouterr().out


def test_early_stopping_records_its_epoch_and_keeps_the_full_schedule(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "tiles")
    epochs, lr = 3, 1e-3
    # a threshold no loss can beat: every evaluation after the first counts as no better
    metrics = run_clm.main(flags({**TINY, "span": "score:1000", "output_dir": tmp_path, "num_train_epochs": epochs,
                                  "learning_rate": lr, "warmup_steps": 0, "early_stopping_patience": 1,
                                  "early_stopping_threshold": 1e9, "save_strategy": "no",
                                  "load_best_model_at_end": False}))
    assert metrics["early_stopping"] == {"patience": 1, "threshold": 1e9, "stopped_early": True,
                                         "stopped_at_epoch": 2.0, "num_train_epochs": float(epochs)}
    assert [e["epoch"] for e in metrics["eval_history"]] == [1.0, 2.0]
    assert json.loads((tmp_path / "metrics.json").read_text())["early_stopping"] == metrics["early_stopping"]
    total = epochs * metrics["train_history"][0]["step"]  # optimizer steps of the whole run
    for entry in metrics["train_history"]:
        # the rate of the step-th optimizer step: linear from lr to 0 over all epochs' steps
        assert entry["learning_rate"] == pytest.approx(lr * (total - entry["step"] + 1) / total, rel=1e-9)
    assert metrics["device"].startswith("cpu") and metrics["backend"] == "tiles"


@pytest.mark.parametrize("argv,message", [
    (["--early_stopping_patience", "0"], "allowed values are >= 1"),
    (["--early_stopping_patience", "2", "--eval_strategy", "no", "--load_best_model_at_end", "false"],
     "needs evaluations"),
])
def test_bad_early_stopping_flags_fail_before_any_data_is_read(argv, message, monkeypatch, tmp_path):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    with pytest.raises(ValueError, match=message):
        run_clm.main([*argv, "--output_dir", str(tmp_path)])


def make_results(tmp_path: Path) -> tuple[Path, Path, Path]:
    """3 spans × 3 seeds in two commands, merged after each: a folder of 6 runs, then a JSONL of the other 3."""
    out = tmp_path / "paper"
    config = write_sweep(tmp_path / "sweep.yaml", ["standard:QKV111", "score:1000", "score:1100"], [0, 1, 2],
                         tree=out / "runs")
    folder, jsonl = tmp_path / "cmd1", tmp_path / "cmd2" / "results.jsonl"
    assert pack.main([str(config), "--results", str(folder), "--max_runs", "6"]) == 0
    merge.main([str(folder), "--out", str(out)])
    assert pack.main([str(config), "--jsonl", str(jsonl)]) == 0  # skips the runs merged into the tree
    assert len(jsonl.read_text().splitlines()) == 3
    merge.main([str(jsonl), "--out", str(out)])
    return folder, jsonl, out


def test_merge_writes_the_table_from_all_commands(tmp_path, fake):
    folder, jsonl, out = make_results(tmp_path)

    records = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    records += [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(records) == 9
    val = {(r["span"], r["seed"]): r["min_val_loss"] for r in records}
    train = {(r["span"], r["seed"]): r["final_train_loss"] for r in records}

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):
        return math.sqrt(sum((x - mean(xs)) ** 2 for x in xs) / (len(xs) - 1))

    with open(out / "report.csv") as f:
        rows = {r["span"]: r for r in csv.DictReader(f)}
    base = [val["standard:QKV111", s] for s in range(3)]
    for span in ("standard:QKV111", "score:1000", "score:1100"):
        v, t = [val[span, s] for s in range(3)], [train[span, s] for s in range(3)]
        per_seed = [(val["standard:QKV111", s] - val[span, s]) / val["standard:QKV111", s] * 100 for s in range(3)]
        expected = {"val_mean": mean(v), "val_std": std(v), "train_mean": mean(t), "train_std": std(t),
                    "val_delta": (mean(base) - mean(v)) / mean(base) * 100, "val_delta_std": std(per_seed)}
        for key, value in expected.items():
            assert float(rows[span][key]) == pytest.approx(value, rel=1e-12, abs=1e-12), (span, key)
        assert rows[span]["runs"] == "3" and rows[span]["shape"] == "H2xL1"
    assert float(rows["score:1000"]["val_delta"]) != 0  # the fake's losses differ by span

    text = (out / "report.md").read_text()
    assert "| score:1100 | 3 |" in text
    assert "3 of 9 runs stopped early" in text  # seed 1 of each span
    assert "| fake | fake-backend | 1 | 9 |" in text  # time per epoch by device and attention backend
    for span in ("standard:QKV111", "score:1000", "score:1100"):
        assert f"| H2xL1 | {span} | 1 | " in text and f"| H2xL1 | {span} | 0 | " not in text
    for png in ("loss_curves_H2xL1.png", "improvements_H2xL1.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tree = out / "runs" / "H2xL1" / "score-1000" / "seed2" / "metrics.json"
    assert json.loads(tree.read_text())["name"] == "H2xL1__score-1000__seed2"
    runs = pack.plan_runs(pack.load_sweeps(tmp_path / "sweep.yaml"), {})
    assert pack.finished_names(runs, None, None) == {r.name for r in runs}  # a new command would skip them all


def test_the_merged_runs_of_the_paper_sweep_are_not_ignored_by_git():
    """pack.py skips a run whose metrics.json is in the sweep's tree: that tree must be committed."""
    sweep = yaml.safe_load_all((ROOT / "recipes/configs/paper_gpu.yaml").read_text())
    tree = ROOT / next(sweep)["output_dir"] / "H4xL6" / "score-1000" / "seed0" / "metrics.json"
    check = subprocess.run(["git", "check-ignore", "-v", str(tree)], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 1, check.stdout  # 0: ignored, by the rule it prints


def test_the_paper_sweep_runs_the_comparisons_seed_by_seed_first():
    """One run fits a GPU command: the paper's headline comes first, seed by seed ([1000] by both readings
    against the standard gradient), then the maths' prediction, and the 4 × 6 table holds every setting of
    the paper's score comparison."""
    runs = [r.name for r in pack.plan_runs(pack.load_sweeps(ROOT / "recipes/configs/paper_gpu.yaml"), {}, check=False)]
    assert runs[:15] == [f"H4xL6__{span}__seed{seed}"
                         for group in (("standard-QKV111", "score-1000_per_block", "score-1000"),
                                       ("score-1111_per_block", "score-1111"))
                         for seed in range(3) for span in group]
    table = {"standard-QKV111", "score-1000", "score-1100", "score-1000_per_block", "score-1111_per_block",
             "score-1111"}
    assert {f"H4xL6__{span}__seed{seed}" for span in table for seed in range(3)} <= set(runs)
    assert len(runs) == len(set(runs))


def test_merge_keeps_what_is_there_and_refuses_a_different_result(tmp_path, fake):
    folder, jsonl, out = make_results(tmp_path)
    tree = out / "runs" / "H2xL1" / "score-1000" / "seed0" / "metrics.json"
    before = tree.read_text()
    assert merge.merge([folder, jsonl], out / "runs") == (0, 9)
    assert tree.read_text() == before

    changed = json.loads((folder / "H2xL1__score-1000__seed0.json").read_text())
    changed["min_val_loss"] += 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps(changed))
    with pytest.raises(SystemExit, match=re.escape(str(tree)) + ".*--replace"):
        merge.main([str(other), "--out", str(out)])
    assert tree.read_text() == before
    merge.main([str(other), "--out", str(out), "--replace"])
    assert json.loads(tree.read_text())["min_val_loss"] == changed["min_val_loss"]


def test_bad_merge_inputs_name_the_path(tmp_path):
    out = ["--out", str(tmp_path / "paper")]
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "missing")) + ": no such file or folder"):
        merge.main([str(tmp_path / "missing"), *out])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "empty")) + ": no result files"):
        merge.main([str(tmp_path / "empty"), *out])
    (tmp_path / "bad.json").write_text('{"name": "x", ')
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "bad.json")) + ": not valid JSON"):
        merge.main([str(tmp_path / "bad.json"), *out])
    (tmp_path / "bad.jsonl").write_text('{"name": "x"}\n\n[1, \n')
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "bad.jsonl")) + " line 1: .*missing shape, span"):
        merge.main([str(tmp_path / "bad.jsonl"), *out])
    (tmp_path / "bad2.jsonl").write_text("{oops\n")
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "bad2.jsonl")) + " line 1: not valid JSON"):
        merge.main([str(tmp_path / "bad2.jsonl"), *out])
    assert not (tmp_path / "paper").exists()  # nothing written


def test_bad_pack_inputs_name_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "nope.yaml")) + ": no such file"):
        pack.main([str(tmp_path / "nope.yaml"), "--results", str(tmp_path / "r")])
    (tmp_path / "bad.yaml").write_text("spans: [score:1000\n")
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "bad.yaml")) + ": not valid YAML"):
        pack.main([str(tmp_path / "bad.yaml"), "--results", str(tmp_path / "r")])
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    (tmp_path / "r.jsonl").write_text("not json\n")  # a line of no use is named, and its run is to do
    assert pack.main([str(config), "--jsonl", str(tmp_path / "r.jsonl"), "--dry_run"]) == 0
    said = capsys.readouterr().out
    assert f"{tmp_path / 'r.jsonl'} line 1: not valid JSON" in said and "the line is ignored" in said
    assert "1 runs, 0 finished before, 1 to do" in said
    (tmp_path / "file").write_text("")
    for argv, message in [(["--results", str(tmp_path / "file")], "exists and is not a folder"),
                          ([], "give --results FOLDER and/or --jsonl FILE"),
                          (["--results", "r", "--set", "n_embd"], "expected KEY=VALUE"),
                          (["--results", "r", "--parallel", "0"], "allowed values are >= 1")]:
        with pytest.raises(SystemExit):
            pack.main([str(config), *argv])
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "wikitext-2-raw-v1").is_dir(), reason="needs ../shared/data")
def test_real_runs_two_at_once_on_the_cpu_with_early_stopping(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "triton")  # no CUDA and no TRITON_INTERPRET here: fused runs
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "1")
    args = {**TINY, "max_train_tokens": 600, "num_train_epochs": 3, "early_stopping_patience": 1,
            "early_stopping_threshold": "1e9", "save_strategy": "no", "load_best_model_at_end": False}
    config = write_sweep(tmp_path / "sweep.yaml", ["standard:QKV111"], [0], args)
    # a second document: another span whose patience outlasts its 3 epochs
    config.write_text(config.read_text() + "---\nspans: [score:1000]\nargs: {early_stopping_patience: 5}\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    results, jsonl = tmp_path / "results", tmp_path / "out" / "results.jsonl"
    assert pack.main([str(config), "--results", str(results), "--jsonl", str(jsonl), "--parallel", "2",
                      "--tmp_dir", str(scratch), "--budget", "1"]) == 0
    records = {r["name"]: r for r in pack.load_records(results)}
    assert sorted(records) == ["H2xL1__score-1000__seed0", "H2xL1__standard-QKV111__seed0"]
    assert {r["name"]: r for r in pack.load_records(jsonl)} == records
    stopped, full = records["H2xL1__standard-QKV111__seed0"], records["H2xL1__score-1000__seed0"]
    assert stopped["early_stopping"]["stopped_early"] and stopped["early_stopping"]["stopped_at_epoch"] == 2.0
    assert not full["early_stopping"]["stopped_early"] and full["early_stopping"]["stopped_at_epoch"] is None
    assert stopped["epochs_run"] == 2.0 and full["epochs_run"] == 3.0
    assert full["config"]["args"]["early_stopping_patience"] == "5"
    for record in records.values():
        assert record["parallel"] == 2 and record["device"].startswith("cpu")
        assert record["backend"] == "fused"  # what ran, not the variable
        assert record["min_val_loss"] == min(e["loss"] for e in record["eval_history"])
    assert not list(scratch.iterdir()) and not (tmp_path / "tree").exists()
