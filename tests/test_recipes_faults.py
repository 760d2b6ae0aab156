"""The recipes on interrupted runs, partial or hostile records, hand-edited files and arguments of the
wrong kind: the right result, or an error that names the file, field or argument and what is allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import merge  # noqa: E402
import pack  # noqa: E402
import report  # noqa: E402
import run_clm  # noqa: E402
import run_identity  # noqa: E402
import sweep  # noqa: E402
from test_pack import FAKE_RUN, write_sweep  # noqa: E402
from test_recipes import DATA, TINY  # noqa: E402
from test_recipes_pretrained import SMALL, data_files, flags, pretrained  # noqa: E402

needs_data = pytest.mark.skipif(not (DATA / "gpt2-tokenizer").is_dir(), reason="needs ../shared/data")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """pack.py runs test_pack's stand-in for run_clm.py; returns the (span, seed) of the runs it made."""
    script = tmp_path / "fake_run_clm.py"
    script.write_text(FAKE_RUN)
    monkeypatch.setattr(pack, "RUN_CLM", script)
    monkeypatch.setattr(sweep, "check_args", lambda *a: None, raising=False)  # the stand-in takes no arguments
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    calls = tmp_path / "calls.jsonl"
    return lambda: [(c["span"], c["seed"]) for c in map(json.loads, calls.read_text().splitlines())] \
        if calls.exists() else []


def one_record(tmp_path: Path, fake) -> dict:
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    assert pack.main([str(config), "--results", str(tmp_path / "made")]) == 0
    return json.loads((tmp_path / "made" / "H2xL1__score-1000__seed0.json").read_text())


# merge.py: the fields of a record that become folder names


@pytest.mark.parametrize("field,value,message", [
    ("shape", "../../escape", "shape='../../escape': expected a folder name"),
    ("shape", "{tmp}/abs", "shape='{tmp}/abs': expected a folder name"),  # absolute, in the test's folder
    ("shape", "..", "shape='..': expected a folder name"),
    ("span", "score:1000/../../../escape", "span='score:1000/../../../escape': not a span label"),
    ("seed", "0/../../escape", "seed='0/../../escape': expected an integer from 0 to 4294967295"),
    ("seed", -1, "seed=-1: expected an integer from 0 to 4294967295"),
    ("name", "../x", "name='../x': expected a folder name"),
])
def test_merge_never_writes_outside_out(field, value, message, tmp_path, fake):
    value, message = (x.replace("{tmp}", str(tmp_path)) if isinstance(x, str) else x for x in (value, message))
    record = {**one_record(tmp_path, fake), field: value}
    hostile = tmp_path / "in" / "hostile.json"
    hostile.parent.mkdir()
    hostile.write_text(json.dumps(record))
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(SystemExit) as err:
        merge.main([str(hostile), "--out", str(tmp_path / "a" / "b" / "out")])
    assert str(hostile) in str(err.value) and message in str(err.value)
    assert {p for p in tmp_path.rglob("*")} == before  # nothing written anywhere


METRICS = {"span": "score:1000", "span_config": {}, "final_train_loss": 5.0, "min_val_loss": 4.0, "best_epoch": 2.0,
           "val_perplexity": 54.6, "val_accuracy": 0.1, "train_runtime_s": 4.0, "device": "cpu (x86_64)",
           "train_history": [{"epoch": 1.0, "step": 5, "loss": 5.5}, {"epoch": 2.0, "step": 10, "loss": 5.0}],
           "eval_history": [{"epoch": 1.0, "step": 5, "loss": 4.5}, {"epoch": 2.0, "step": 10, "loss": 4.0}],
           "early_stopping": {"patience": 1, "threshold": 0.0, "stopped_early": True, "stopped_at_epoch": 2.0,
                              "num_train_epochs": 3.0},
           "config": {"model": {}, "data": {}, "span": {}, "training": {"seed": 0}, "hf_spanattn": "0",
                      "transformers": "0", "torch": "0"}}


def a_record(**changes) -> dict:
    """pack.py's record of a finished run (H2xL1, score:1000, seed 0), with `changes`."""
    run = pack.Run("H2xL1__score-1000__seed0", Path("tree/H2xL1/score-1000/seed0"), {"seed": "0"})
    return {**pack.result_record(run, METRICS, 5.0, 1), **changes}


@pytest.mark.parametrize("changes,message", [
    ({"best_epoch": "2"}, "best_epoch is '2': expected a finite number"),
    ({"best_epoch": None}, "best_epoch is missing: expected a finite number"),
    ({"early_stopping": {"stopped_early": True}}, "early_stopping.patience=None: expected an integer >= 1"),
    ({"early_stopping": {**METRICS["early_stopping"], "num_train_epochs": None}},
     "early_stopping.num_train_epochs is missing: expected a finite number"),
    ({"early_stopping": {**METRICS["early_stopping"], "stopped_at_epoch": "2"}},
     "early_stopping.stopped_at_epoch is '2': expected a finite number"),
    ({"early_stopping": {**METRICS["early_stopping"], "stopped_early": "yes"}},
     "early_stopping.stopped_early='yes': expected true or false"),
    ({"parallel": "2"}, "parallel='2': expected an integer >= 1"),
    ({"device": 5}, "device=5: expected the device's name or null"),
    ({"seed": 2**32}, "seed=4294967296: expected an integer from 0 to 4294967295"),
    ({"seed": 10**300}, "expected an integer from 0 to 4294967295"),
    ({"seed": 1}, "seed=1: config.training.seed is 0, the seed the run was made with"),
    ({"span": "score:1100"},
     "name='H2xL1__score-1000__seed0': the shape, span and seed make 'H2xL1__score-1100__seed0'"),
    ({"shape": "H4xL6"}, "the shape, span and seed make 'H4xL6__score-1000__seed0'"),
])
def test_merge_refuses_a_record_whose_fields_disagree_or_that_it_cannot_report(changes, message, tmp_path):
    """Each would be written into the tree and then stop the report (a field it formats as a number), or go into
    the tree where its name does not say (pack.py counts the named run finished, the report another)."""
    assert pack.record_problems(a_record()) == []  # the unchanged record is whole
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record(**changes)))
    with pytest.raises(SystemExit) as err:
        merge.main([str(path), "--out", str(tmp_path / "out")])
    assert f"merge: {path}: not a result of recipes/pack.py: " in str(err.value) and message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_merge_reports_a_run_that_recorded_no_time(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record(train_runtime_s=0.0)))
    merge.main([str(path), "--out", str(tmp_path / "out")])
    assert "| cpu (x86_64) | 1 | 1 | 0.0 | – |" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize("text", ["", "[]", "\n\n"])
def test_merge_of_inputs_without_records_says_so(text, tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(text)
    with pytest.raises(SystemExit, match=f"merge: no results in {path}, and none under {tmp_path / 'out' / 'runs'}"):
        merge.main([str(path), "--out", str(tmp_path / "out")])


def test_merge_puts_a_partial_result_in_the_tree_aside_and_skips_a_cut_line(tmp_path, fake, capsys):
    record = one_record(tmp_path, fake)
    out = tmp_path / "out"
    dest = out / "runs" / "H2xL1" / "score-1000" / "seed0" / "metrics.json"
    dest.parent.mkdir(parents=True)
    dest.write_text('{"span": "score:1000", "min_val')  # a merge stopped while writing
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text(json.dumps(record) + "\n" + json.dumps(record)[:40])  # a command stopped while appending
    merge.main([str(jsonl), "--out", str(out)])
    assert json.loads(dest.read_text()) == record
    assert dest.with_name("metrics.json.replaced-1").read_text() == '{"span": "score:1000", "min_val'
    said = capsys.readouterr()
    assert f"skipping {jsonl} line 2: not valid JSON" in said.err and "cut short" in said.err


# pack.py: what counts as a finished run


@pytest.mark.parametrize("text", ["{}", '{"name": "H2xL1__score-1000__seed0", "min_val_loss": 1', "[]",
                                  "RECORD_OF_ANOTHER_RUN", "RECORD_WITH_NULL_LOSS"])
def test_pack_redoes_a_run_whose_result_file_is_partial_or_hostile(text, tmp_path, fake, capsys):
    record = one_record(tmp_path, fake)
    text = {"RECORD_OF_ANOTHER_RUN": json.dumps({**record, "name": "H2xL1__score-1100__seed0"}),
            "RECORD_WITH_NULL_LOSS": json.dumps({**record, "min_val_loss": None})}.get(text, text)
    results = tmp_path / "results"
    results.mkdir()
    (results / "H2xL1__score-1000__seed0.json").write_text(text)
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    assert pack.main([str(config), "--results", str(results)]) == 0
    assert fake() == [("score:1000", 0), ("score:1000", 0)]  # made once for one_record, then redone
    assert (results / "H2xL1__score-1000__seed0.json.invalid-1").read_text() == text  # kept, not deleted
    assert pack.load_records(results)[0]["name"] == "H2xL1__score-1000__seed0"
    said = capsys.readouterr().out
    assert f"{results / 'H2xL1__score-1000__seed0.json'}: not a finished run's result (" in said


def test_pack_counts_a_run_that_ends_without_a_whole_result_as_failed(tmp_path, fake, monkeypatch, capsys):
    script = tmp_path / "no_metrics.py"
    script.write_text("print('done, but no metrics.json')\n")
    monkeypatch.setattr(pack, "RUN_CLM", script)
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    assert pack.main([str(config), "--results", str(tmp_path / "results")]) == 1
    assert "FAILED H2xL1__score-1000__seed0: it ended without a whole result (FileNotFoundError" in \
        capsys.readouterr().out
    assert not list((tmp_path / "results").iterdir())


def test_pack_appends_after_a_cut_line_on_a_line_of_its_own(tmp_path, fake, capsys):
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000", "score:1100"], [0])
    jsonl = tmp_path / "r.jsonl"
    assert pack.main([str(config), "--jsonl", str(jsonl), "--max_runs", "1"]) == 0
    jsonl.write_text(jsonl.read_text() + '{"name": "H2xL1__score-1100__se')  # stopped while appending
    assert pack.main([str(config), "--jsonl", str(jsonl)]) == 0
    assert fake() == [("score:1000", 0), ("score:1100", 0)]
    assert "line 2: not valid JSON" in capsys.readouterr().out
    records, problems = pack.read_records(jsonl)
    assert [r["name"] for r in records] == ["H2xL1__score-1000__seed0", "H2xL1__score-1100__seed0"]
    assert len(problems) == 1 and problems[0].startswith(f"{jsonl} line 2: not valid JSON")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):  # now inside the file: merge refuses it
        pack.load_records(jsonl)


@pytest.mark.parametrize("document,message", [
    ("args: [1, 2]", "document 2: args=[1, 2]: expected a mapping"),
    ("shape: [{n_head: 2}]", "unknown key 'shape'; allowed keys are output_dir, args, spans, seeds, shapes"),
])
def test_pack_checks_every_sweep_document(document, message, tmp_path, fake):
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    config.write_text(config.read_text() + "---\n" + document + "\n")
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        pack.main([str(config), "--results", str(tmp_path / "r")])
    assert fake() == []


# report.py: metrics.json files it cannot use, and no side effects before its inputs are checked


def metrics_file(runs: Path, label: str, seed: int, val: float, **changes) -> Path:
    folder = runs / "H1xL1" / run_identity.span_dir(label) / f"seed{seed}"
    folder.mkdir(parents=True)
    data = {"span": label, "min_val_loss": val, "final_train_loss": val + 0.1, "train_runtime_s": 1.0,
            "train_history": [{"step": 10, "loss": val + 0.1}], "eval_history": [{"step": 10, "loss": val}],
            "config": {"training": {"seed": seed}, "data": {"block_size": 8}}}
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    (folder / "metrics.json").write_text(json.dumps(data))
    return folder / "metrics.json"


@pytest.mark.parametrize("changes,message", [
    ({"config": ...}, "config is missing"),
    ({"config": {"training": {}}}, "config.training.seed is None: expected an integer"),
    ({"min_val_loss": None}, "min_val_loss is null: the run recorded no evaluation"),
    ({"min_val_loss": "1.2"}, "min_val_loss is '1.2': expected a finite number"),
    ({"final_train_loss": ...}, "final_train_loss is missing"),
    ({"span": 7}, "span=7: not a span label"),
    ({"eval_history": [{"step": 10}]}, "eval_history[0].loss is missing"),
    ({"train_history": {"step": 1}}, "train_history: expected a list"),
    ({"min_val_loss": 10**400}, "min_val_loss is 1000000000000000000000000000000000000000: expected a finite number"),
    ({"config": {"training": {"seed": 0}, "data": "wikitext"}}, "config.data is str: expected an object"),
    ({"config": {"training": {"seed": 0}, "model": [256]}}, "config.model is list: expected an object"),
    ({"config": {"training": {"seed": 0, "per_device_train_batch_size": "4"}}},
     "config.training.per_device_train_batch_size is '4': expected a finite number"),
    ({"config": {"training": {"seed": 0}, "data": {"block_size": "128"}}},
     "config.data.block_size is '128': expected a finite number"),
    ({"unigram_val_loss": "low"}, "unigram_val_loss is 'low': expected a finite number"),
    ({"world_size": "2"}, "world_size is '2': expected a finite number"),
])
def test_report_leaves_out_a_metrics_json_it_cannot_use_and_names_it(changes, message, tmp_path, capsys):
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    bad = metrics_file(runs, "score:1000", 0, 5.9, **changes)
    report.main([str(runs), "--out", str(tmp_path / "out")])
    said = capsys.readouterr().err
    assert f"report: leaving out {bad}: " in said and message in said
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| standard:QKV111 | 1 |" in text and "| score:1000 |" not in text


def test_report_on_a_baseline_loss_of_zero_gives_no_percentage(tmp_path, capsys):
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 0.0)
    metrics_file(runs, "score:1000", 0, 0.5)
    report.main([str(runs), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| score:1000 | 1 | 0.6000 | -500.000 | 0.5000 | – |" in text  # train Δ against 0.1, val against 0
    assert "validation loss is 0, so score:1000 has no Δ %" in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    ('{"span": "score:1000", "min_val_loss": ' + "9" * 5000 + "}", "not valid JSON (ValueError: Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (RecursionError"),
    (b"\xff\xfe{}", "not valid JSON (UnicodeDecodeError"),
])
def test_a_metrics_json_past_pythons_limits_is_named(content, message, tmp_path, capsys):
    """Digits past int's limit, nesting past the recursion limit, bytes that are not UTF-8: report.py and sweep.py
    (read_json), pack.py (a record) and merge.py (a result in the tree) name the file."""
    path = metrics_file(tmp_path / "runs", "score:1000", 0, 5.9)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(SystemExit) as err:
        report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert f"report: {path}: {message}" in str(err.value)
    copy = tmp_path / "record.json"
    copy.write_bytes(path.read_bytes())
    assert pack.read_records(copy)[1][0].startswith(f"{copy}: not valid JSON")
    run = pack.Run("H1xL1__score-1000__seed0", path.parent, {})
    said = []
    assert pack.finished_names([run], None, None, say=lambda text, **_: said.append(text)) == set()
    assert said[0].startswith(f"{path}: not a finished run's result (not valid JSON (")


def test_report_draws_the_diagnostics_of_a_run_with_a_line_cut_short(tmp_path, capsys):
    """A run stopped while writing span_diagnostics.jsonl and resumed leaves the cut line inside the file."""
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    folder = metrics_file(runs, "score:1000", 0, 5.9).parent
    lines = [json.dumps({**DIAGNOSTIC, "step": 2}), json.dumps(DIAGNOSTIC)[:30], json.dumps({**DIAGNOSTIC, "step": 4}),
             json.dumps({**DIAGNOSTIC, "step": 6, "dq_share": []})]
    (folder / "span_diagnostics.jsonl").write_text("\n".join(lines) + "\n")
    report.main([str(runs), "--out", str(tmp_path / "out")])
    said = capsys.readouterr().err
    assert f"{folder / 'span_diagnostics.jsonl'}:2: left out: not a whole JSON record" in said
    assert f"{folder / 'span_diagnostics.jsonl'}:4: left out: dq_share=[]: expected a list of numbers" in said
    assert (tmp_path / "out" / "diagnostics_H1xL1_score-1000.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["{tmp}/typo/runs"], "{tmp}/typo/runs: no such folder"),
    (["{tmp}/typo/runs", "--out", "{tmp}/new/out"], "{tmp}/typo/runs: no such folder"),
    (["{tmp}/runs", "--out", "{tmp}/file"], "--out {tmp}/file: exists and is not a folder"),
    (["{tmp}/empty"], "no usable metrics.json under {tmp}/empty"),
])
def test_report_on_a_wrong_path_changes_nothing(argv, message, tmp_path):
    metrics_file(tmp_path / "runs", "standard:QKV111", 0, 6.0)
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as err:
        report.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert message.replace("{tmp}", str(tmp_path)) in str(err.value)
    assert sorted(tmp_path.rglob("*")) == before


# run_clm.py: half-written checkpoints, and two runs on one folder


def checkpoint(folder: Path, step: int, complete: bool) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    if complete:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_resume_skips_a_half_written_checkpoint_and_keeps_it(tmp_path, capsys):
    out = tmp_path / "out"
    config = {"model": {}, "data": {}, "span": {"span": "score:1000"}, "training": {"seed": 0}}
    run_identity.write_config(out, config)
    checkpoint(out, 2, True)
    checkpoint(out, 4, False)
    (out / "checkpoint-6").mkdir()  # stopped before anything was written
    assert run_identity.resume_point(str(out), config, None, overwrite=False) == str(out / "checkpoint-2")
    said = capsys.readouterr().err
    assert f"{out / 'checkpoint-4'}: a checkpoint left half-written" in said and "incomplete-checkpoint-4" in said
    assert (out / "incomplete-checkpoint-4" / "model.safetensors").read_bytes() == b"weights"
    assert (out / "incomplete-checkpoint-6").is_dir() and not (out / "checkpoint-4").exists()
    checkpoint(out, 4, False)  # the same again: kept under another name
    assert run_identity.resume_point(str(out), config, None, overwrite=False) == str(out / "checkpoint-2")
    assert (out / "incomplete-checkpoint-4-2" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="--resume_from_checkpoint .*checkpoint-8: not a complete checkpoint"):
        run_identity.resume_point(str(out), config, str(checkpoint(out, 8, False)), overwrite=False)


@needs_data
def test_a_rerun_after_a_kill_during_a_save_resumes_the_last_complete_checkpoint(tmp_path):
    start = pretrained(tmp_path / "start", "gpt2")
    out = tmp_path / "out"
    args = flags({**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start,
                  "output_dir": out, "num_train_epochs": 2, "save_strategy": "epoch"})
    full = run_clm.main(args)
    (out / "metrics.json").unlink()  # as if killed while saving the epoch-2 checkpoint
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    again = run_clm.main(args)
    assert again["resumed_from"] == str(out / "checkpoint-2")
    assert [e["loss"] for e in again["eval_history"]] == pytest.approx([e["loss"] for e in full["eval_history"]],
                                                                       rel=1e-5)
    assert (out / "incomplete-checkpoint-4" / "model.safetensors").is_file()


def test_a_second_run_on_a_folder_in_use_stops_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(run_clm, "run", lambda *a: pytest.fail("the second run started"))
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "out.lock"
        lock.write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename, "started": "now"}))
        with pytest.raises(SystemExit) as err:
            run_clm.main(["--output_dir", str(out), "--tokenizer_name", str(DATA / "gpt2-tokenizer")])
        assert f"{out}: another run is writing into this folder (process {holder.pid} on" in str(err.value)
        assert f"delete {lock}" in str(err.value) and json.loads(lock.read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over_and_released(tmp_path, monkeypatch, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    lock = tmp_path / "out.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": "then"}))
    seen = []
    monkeypatch.setattr(run_clm, "run", lambda *a: seen.append(json.loads(lock.read_text())["pid"]) or {})
    run_clm.main(["--output_dir", str(out), "--tokenizer_name", str(DATA / "gpt2-tokenizer")])
    assert seen == [os.getpid()] and not lock.exists()
    assert "taking over the lock of a run that ended" in capsys.readouterr().err


@pytest.mark.parametrize("name,content,message", [
    ("latin1.txt", "café crème\n".encode("latin-1"), "could not be read as text (the file must be UTF-8) "
                                                       "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"),
    ("bad.jsonl", '{"text": "a"}\n{oops\n', "could not be read as json (ValueError: "),
    ("table.csv", "id,body\n1,a b c\n", "no 'text' column, and its first, 'id', holds Value('int64'), not text"),
])
def test_a_data_file_that_cannot_be_read_says_why(name, content, message, tmp_path):
    """The loaders' own message was "An error occurred while generating the dataset"."""
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ValueError) as err:
        run_clm.load_file(str(path), "--train_file")
    assert f"--train_file {path}: {message}" in str(err.value)
    assert "An error occurred while generating the dataset" not in str(err.value)


def test_jsonl_rows_without_text_are_counted_aloud(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": "the cat"} if i % 3 else {"title": "x"}) + "\n" for i in range(9)))
    assert run_clm.load_file(str(path), "--train_file")["text"] == ["", "the cat", "the cat"] * 3
    assert f"--train_file {path}: 3 of its 9 rows have no 'text'; they count as empty texts" in caplog.text


def tiny_run(tmp_path: Path, **changes) -> dict:
    """A run of a few steps of a 1-layer GPT-2 with d = 16 on a few hundred tokens of text."""
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.txt").write_text(" the cat sat on the mat" * 40)
    (tmp_path / "data" / "validation.txt").write_text(" the dog ran" * 30)
    args = {"data_dir": tmp_path / "data", "tokenizer_name": DATA / "gpt2-tokenizer", "n_embd": 16, "n_head": 1,
            "n_layer": 1, "block_size": 16, "overlap": 0, "per_device_train_batch_size": 4, "disable_tqdm": True,
            "output_dir": tmp_path / "out", "save_strategy": "no", "load_best_model_at_end": False, **changes}
    return run_clm.main([f"--{k}={v}" for k, v in args.items()])


@needs_data
def test_a_start_that_failed_does_not_block_the_corrected_command(tmp_path, capsys):
    """A start that fails after recording its settings (here: a layer the model does not have) leaves only
    run_config.json; the corrected command ran into "holds a run made with other settings"."""
    with pytest.raises(ValueError, match=r"--span_layers: layers=\[3\]: GPT2LMHeadModel has layers 0..0"):
        tiny_run(tmp_path, span="score:1000", span_layers=3)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run_config.json"]
    metrics = tiny_run(tmp_path, span="score:1000", span_layers=0, max_steps=2)
    assert metrics["span_config"]["layers"] == [0] and metrics["resumed_from"] is None
    assert "a start with other settings that made no checkpoint; this run starts afresh" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "run_config.json").read_text())["span"]["span_layers"] == "0"
    with pytest.raises(ValueError, match="holds a run made with other settings"):  # a finished run is kept
        tiny_run(tmp_path, span="score:1000", span_layers=0, max_steps=3)


@needs_data
def test_a_rerun_after_a_kill_before_any_checkpoint_writes_its_own_diagnostics(tmp_path, caplog):
    """The callback appended the new run's records to those of the stopped start: every step twice, and the
    plot drawn over both."""
    out = tmp_path / "out"
    out.mkdir()
    stale = "".join(json.dumps({**DIAGNOSTIC, "step": step}) + "\n" for step in (1, 2, 3)) + '{"step": 4, "la'
    (out / "span_diagnostics.jsonl").write_text(stale)
    tiny_run(tmp_path, span="score:1000", span_diagnostics_every=1, max_steps=2)
    steps = [json.loads(line)["step"] for line in (out / "span_diagnostics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # one record per step and layer, of this run only
    assert (out / "span_diagnostics.jsonl.replaced-1").read_text() == stale  # kept
    assert "left by an earlier start of this run" in caplog.text


# hand-edited run_clm.py and sweep files


@pytest.mark.parametrize("text,message", [
    ("- a\n- b\n", "{file}: expected a mapping of run_clm.py arguments"),
    ("span: score:1000\nno_such_argument: 1\n", "{file}: Some keys are not used by the HfArgumentParser: "
                                                "['no_such_argument']"),
    ("span: [1\n", "{file}: not valid YAML/JSON"),
])
def test_a_bad_run_clm_config_file_is_named(text, message, tmp_path, monkeypatch):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    file = tmp_path / "run.yaml"
    file.write_text(text)
    with pytest.raises(ValueError) as err:
        run_clm.main([str(file)])
    assert message.replace("{file}", str(file)) in str(err.value)


@pytest.mark.parametrize("change,message", [
    ({"seeds": [0], "shape": [{"n_head": 2}]}, "unknown key 'shape'"),
    ({"output_dir": ["a"]}, "output_dir=['a']: expected a folder path"),
    ({"args": {**TINY, "learning_rate": "fast"}}, "--learning_rate/--learning-rate: invalid float value: 'fast'"),
    ({"args": {**TINY, "save_strategy": False}}, "invalid choice: 'False'"),
    ({"args": {**TINY, "save_strategy": False}}, "quote it, as 'no'"),
    ({"args": {**TINY, "no_such_argument": 1}}, "not used by the HfArgumentParser: ['--no_such_argument=1']"),
    ({"args": {**TINY, "train_file": "missing.txt"}}, "missing.txt: no such file"),
    ({"shapes": [{"n_head": 3}]}, "--n_embd 32 must be a multiple of --n_head 3"),
    # set in args or a shape, these were overridden by spans, seeds and output_dir without a word
    ({"args": {**TINY, "span": "score:1100"}}, "args sets span, which the sweep gives each run"),
    ({"args": {**TINY, "seed": 5}}, "args sets seed, which the sweep gives each run"),
    ({"args": {**TINY, "output_dir": "elsewhere"}}, "args sets output_dir, which the sweep gives each run"),
    ({"shapes": [{"n_head": 2, "n_layer": 1, "span": "score:1100"}]}, "shapes[0] sets span"),
    # a folder name of several parts: the run went deeper than <shape>/<span>/seed<k>, where report.py never looks
    ({"shapes": [{"n_head": 2, "n_layer": 1, "tokenizer_name": str(DATA / "gpt2-tokenizer")}]},
     "is not one folder name (letters, digits and '._=+-'); give such values in args"),
    ({"seeds": [-1]}, "seeds: -1: allowed seeds are 0 to 4294967295"),
    ({"seeds": [2**32]}, "seeds: 4294967296: allowed seeds are 0 to 4294967295"),
])
def test_a_bad_sweep_file_fails_before_any_run(change, message, tmp_path):
    config = {"output_dir": str(tmp_path / "runs"), "args": TINY, "spans": ["score:1000"], "seeds": [0],
              "shapes": [{"n_head": 2, "n_layer": 1}], **change}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError) as err:
        sweep.main([str(tmp_path / "s.yaml"), "--launcher", "false"])
    assert message in str(err.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("recipe", ["sweep", "pack", "run_clm", "span_schedule"])
def test_a_key_given_twice_in_a_yaml_file_is_named(recipe, tmp_path):
    """Plain YAML keeps the last of two equal keys without a word: the first setting was lost."""
    path = tmp_path / "config.yaml"
    if recipe == "span_schedule":
        path.write_text("- {at: 0, span: score:1000, at: 5}\n")
        call = lambda: run_clm.parse_args(["--span_schedule", str(path), "--output_dir", str(tmp_path / "o")])  # noqa: E731
    elif recipe == "run_clm":
        path.write_text(f"span: score:1000\noutput_dir: {tmp_path / 'o'}\nspan: standard:QKV111\n")
        call = lambda: run_clm.parse_args([str(path)])  # noqa: E731
    else:
        path.write_text(f"output_dir: {tmp_path / 'runs'}\nspans: [score:1000]\nseeds: [0]\nargs:\n  n_embd: 32\n"
                        "spans: [standard:QKV111]\n")
        call = (lambda: sweep.main([str(path), "--dry_run"])) if recipe == "sweep" else \
            (lambda: pack.main([str(path), "--results", str(tmp_path / "r"), "--dry_run"]))
    with pytest.raises((ValueError, SystemExit)) as err:
        call()
    key, lines = {"span_schedule": ("at", "1 and 1"), "run_clm": ("span", "1 and 3")}.get(recipe, ("spans", "2 and 6"))
    assert str(path) in str(err.value) and f"the key '{key}' is given twice (lines {lines})" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("content,message", [
    ("spans: [score:1000]\n---\nspans: [score:1100]\n", "2 YAML documents; sweep.py runs one (recipes/pack.py runs"),
    (b"\xff\xfespans: []", "not valid YAML (UnicodeDecodeError"),
    (None, "{path}: not a file"),
])
def test_a_sweep_file_sweep_py_cannot_read_is_named(content, message, tmp_path):
    path = tmp_path / "sweep.yaml"
    if content is None:
        path.mkdir()
    else:
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ValueError) as err:
        sweep.main([str(path), "--dry_run"])
    assert f"{path}: " in str(err.value) and message.format(path=path) in str(err.value)


def test_sweep_redoes_a_run_whose_metrics_json_was_cut_short(tmp_path, capsys):
    config = {"output_dir": str(tmp_path / "runs"), "args": TINY, "spans": ["score:1000"], "seeds": [0],
              "shapes": [{"n_head": 2, "n_layer": 1}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    [(folder, run_args)] = sweep.plan(config)
    run_identity.write_config(folder, sweep.expected_config(run_args))
    (folder / "metrics.json").write_text('{"span": "sc')
    launcher = tmp_path / "fake.py"  # writes a metrics.json as a finished run would
    launcher.write_text("import json, sys\nout = [a for a in sys.argv if a.startswith('--output_dir=')][0][13:]\n"
                        "json.dump({'span': 'score:1000', 'config': {}}, open(out + '/metrics.json', 'w'))\n")
    assert sweep.main([str(tmp_path / "s.yaml"), "--launcher", f"{sys.executable} {launcher}"]) == 0
    assert "metrics.json is not whole" in capsys.readouterr().out
    assert (folder / "metrics.json.invalid-1").read_text() == '{"span": "sc'
    assert json.loads((folder / "metrics.json").read_text())["span"] == "score:1000"


def test_sweep_stops_at_a_folder_another_run_holds(tmp_path, capsys):
    config = {"output_dir": str(tmp_path / "runs"), "args": TINY, "spans": ["score:1000"], "seeds": [0],
              "shapes": [{"n_head": 2, "n_layer": 1}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    [(folder, _)] = sweep.plan(config)
    with run_identity.RunLock(folder):
        assert sweep.main([str(tmp_path / "s.yaml"), "--launcher", "false"]) == 1
    assert f"{folder}: another run is writing into it (process {os.getpid()}" in capsys.readouterr().out


@pytest.mark.parametrize("text,message", [
    ("block_size: 2.5\n", "{file}: block_size=2.5: expected an integer"),
    ("learning_rate: fast\n", "{file}: learning_rate='fast': expected a number"),
    ("save_strategy: no\n", "{file}: save_strategy=False: expected text (YAML reads a bare yes/no/on/off"),
    ("token_subset: all\n", "{file}: token_subset='all': allowed values are first, spread"),
    ("do_train: maybe\n", "{file}: do_train='maybe': expected true or false"),
    ("span_layers: {0: 1}\n", "{file}: span_layers={0: 1}: expected text, got dict"),
    ("config_overrides: {n_embd: 64}\n", "{file}: config_overrides={'n_embd': 64}: expected text, got dict"),
])
def test_a_config_file_value_of_the_wrong_type_is_named(text, message, tmp_path, monkeypatch):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    file = tmp_path / "run.yaml"
    file.write_text(text + f"output_dir: {tmp_path / 'out'}\n")
    with pytest.raises(ValueError) as err:
        run_clm.main([str(file)])
    assert message.replace("{file}", str(file)) in str(err.value)


def test_config_file_values_are_read_as_the_command_line_reads_them(tmp_path):
    """YAML 1.1 reads 1e-3 as text; a list serves a comma-separated argument; "64" is a number."""
    file = tmp_path / "run.yaml"
    file.write_text(f"learning_rate: 1e-3\nspan_layers: [0, 2]\nblock_size: '64'\nspan: score:1000\n"
                    f"tokenizer_name: {DATA / 'gpt2-tokenizer'}\noutput_dir: {tmp_path / 'out'}\n"
                    "span_schedule:\n  - {at: 0, span: standard:QKV111}\n  - {at: '50%', span: score:1000}\n")
    model, data, span, training, *_ = run_clm.parse_args([str(file)])
    assert training.learning_rate == 0.001 and data.block_size == 64
    assert span.config().layers == (0, 2)
    assert [k.span for k in span.callback().schedule.keyframes] == ["standard:QKV111", "score:1000"]


@pytest.mark.parametrize("call,message", [
    (lambda t: merge.main([str(t / "r.jsonl"), "--out", str(t / "file")]), "--out {tmp}/file: {tmp}/file is a file"),
    (lambda t: pack.main([str(t / "s.yaml"), "--results", str(t / "r"), "--set", "seed=3"]),
     "--set 'seed=3': expected KEY=VALUE with a run_clm.py argument other than output_dir, span and seed"),
    (lambda t: pack.main([str(t / "s.yaml"), "--results", str(t / "r"), "--budget", "nan"]),
     "--budget nan: allowed values are numbers >= 0"),
    (lambda t: pack.main([str(t / "s.yaml"), "--results", str(t / "r"), "--max_runs", "-1"]),
     "--max_runs -1: allowed values are numbers >= 0"),
    (lambda t: sweep.main([str(t / "s.yaml"), "--launcher", " "]), "--launcher is empty"),
    (lambda t: report.main([str(t / "file")]), "report: {tmp}/file: not a folder"),
    (lambda t: run_clm.main(["--early_stopping_threshold", "nan", "--output_dir", str(t / "o")]),
     "--early_stopping_threshold nan: allowed values are >= 0"),
    (lambda t: run_clm.main(["--output_dir", " "]), "--output_dir is empty"),
    (lambda t: run_clm.main(["--output_dir", "/"]), "--output_dir /: the root of the file system"),
    (lambda t: run_clm.main(["--span_schedule", str(t / "typo.yaml"), "--output_dir", str(t / "o")]),
     "--span_schedule {tmp}/typo.yaml: no such file"),
    # a result lost after its run (the record is written to a folder), or a traceback before any
    (lambda t: pack.main([str(t / "s.yaml"), "--jsonl", str(t)]), "--jsonl {tmp}: is a folder; expected the path of"),
    (lambda t: pack.main([str(t / "s.yaml"), "--jsonl", str(t / "file" / "r.jsonl")]),
     "--jsonl {tmp}/file/r.jsonl: {tmp}/file is a file, so it cannot be made"),
    (lambda t: pack.main([str(t / "s.yaml"), "--results", str(t / "file" / "r")]),
     "--results {tmp}/file/r: {tmp}/file is a file"),
    (lambda t: pack.main([str(t / "s.yaml"), "--results", str(t / "r"), "--tmp_dir", str(t / "typo")]),
     "--tmp_dir {tmp}/typo: no such folder"),
    (lambda t: sweep.main([str(t / "s.yaml"), "--launcher", "no-such-launcher --nproc 2"]),
     "--launcher 'no-such-launcher --nproc 2': no command 'no-such-launcher' here"),
    # run_clm.py: numbers the Trainer, NumPy or PyTorch refuse only later, without the flag's name, or not at all
    (lambda t: run_clm.main(["--seed", "-1", "--output_dir", str(t / "o")]), "--seed -1: allowed values are 0 to"),
    (lambda t: run_clm.main(["--data_seed", str(2**32), "--output_dir", str(t / "o")]),
     "--data_seed 4294967296: allowed values are 0 to 4294967295"),
    (lambda t: run_clm.main(["--gradient_accumulation_steps", "0", "--output_dir", str(t / "o")]),
     "--gradient_accumulation_steps 0: allowed values are >= 1"),
    (lambda t: run_clm.main(["--per_device_train_batch_size", "0", "--output_dir", str(t / "o")]),
     "--per_device_train_batch_size 0: allowed values are >= 1"),
    (lambda t: run_clm.main(["--num_train_epochs", "0", "--output_dir", str(t / "o")]),  # trained nothing, "loss 0.0"
     "--num_train_epochs 0.0: expected a number > 0 (or --max_steps N)"),
    (lambda t: run_clm.main(["--num_train_epochs", "nan", "--output_dir", str(t / "o")]),
     "--num_train_epochs nan: expected a number > 0"),
    (lambda t: run_clm.main(["--learning_rate", "nan", "--output_dir", str(t / "o")]),
     "--learning_rate nan: expected a finite number >= 0"),
    # empty values (an unset shell variable): a model from scratch without a word, a Hub lookup of ''
    (lambda t: run_clm.main(["--model_name_or_path", "", "--output_dir", str(t / "o")]),
     "--model_name_or_path is empty: give a Hub id or a local folder, or leave the flag out"),
    (lambda t: run_clm.main(["--config_name", " ", "--output_dir", str(t / "o")]), "--config_name is empty"),
    (lambda t: run_clm.main(["--tokenizer_name", "", "--output_dir", str(t / "o")]), "--tokenizer_name is empty"),
    (lambda t: run_clm.main(["--span_layers", "", "--output_dir", str(t / "o")]),  # was: all layers
     "--span_layers '': expected comma-separated integers (leave it unset for all layers)"),
    (lambda t: run_clm.main(["--config_overrides", "n_embd=64,n_embd=32", "--output_dir", str(t / "o")]),
     "--config_overrides 'n_embd=64,n_embd=32': n_embd is given twice"),
])
def test_unusual_command_line_values_are_named(call, message, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "r.jsonl").write_text("")
    write_sweep(tmp_path / "s.yaml", ["score:1000"], [0])
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises((SystemExit, ValueError)) as err:
        call(tmp_path)
    assert message.replace("{tmp}", str(tmp_path)) in str(err.value) + capsys.readouterr().err
    assert sorted(tmp_path.rglob("*")) == before


# plot_diagnostics.py: a diagnostics file of a stopped run, or edited by hand
DIAGNOSTIC = {"step": 2, "epoch": 0.5, "layer": 0, "span": "score:1000", "dq_share": [0.7, 0.2, 0.1, 0.0],
              "dk_share": [1.0, 0.0, 0.0, 0.0], "cos_q": 0.9, "cos_k": float("nan"), "rank_k": 4.0, "rank_v": 4.0}


@pytest.mark.parametrize("line,message", [
    (json.dumps(DIAGNOSTIC)[:40], "{file}:3: left out: not a whole JSON record (a line cut short"),
    ('["step", 4]', "{file}:3: left out: expected a JSON object, got list"),
    (json.dumps({**DIAGNOSTIC, "layer": "1"}), "{file}:3: left out: layer='1': expected an integer >= 0"),
    (json.dumps({**DIAGNOSTIC, "dq_share": "0.7"}), "{file}:3: left out: dq_share='0.7': expected a list of numbers"),
    (json.dumps({k: v for k, v in DIAGNOSTIC.items() if k != "cos_q"}), "{file}:3: left out: cos_q=None: expected"),
    (json.dumps({**DIAGNOSTIC, "dk_share": []}), "{file}:3: left out: dk_share=[]: expected a list of numbers"),
])
def test_plot_diagnostics_leaves_out_a_line_it_cannot_use_and_names_it(line, message, tmp_path, capsys):
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    whole = [json.dumps({**DIAGNOSTIC, "layer": layer}) for layer in (0, 1)]
    file.write_text("\n".join([*whole, line]) + "\n")
    assert [r["layer"] for r in plot_diagnostics.read_records(file)] == [0, 1]
    assert message.format(file=file) in capsys.readouterr().err


@pytest.mark.parametrize("output,message", [
    ("", "-o {tmp}: expected the path of the figure, ending in .png"),  # a folder
    ("figure", "-o {tmp}/figure: expected the path of the figure, ending in .png"),  # matplotlib would add .png
])
def test_plot_diagnostics_output_that_is_not_a_figure_path_is_refused(output, message, tmp_path, capsys):
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    file.write_text(json.dumps(DIAGNOSTIC) + "\n")
    with pytest.raises(SystemExit):
        plot_diagnostics.main([str(file), "-o", str(tmp_path / output)])
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["span_diagnostics.jsonl"]
    plot_diagnostics.main([str(file), "-o", str(tmp_path / "new" / "d.png")])  # a new folder is made
    assert (tmp_path / "new" / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_diagnostics_draws_the_records_of_a_run_stopped_while_writing(tmp_path, capsys):
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    file.write_text(json.dumps(DIAGNOSTIC) + "\n" + json.dumps({**DIAGNOSTIC, "step": 4})[:30])
    plot_diagnostics.main([str(file)])
    assert f"{file}:2: left out" in capsys.readouterr().err
    assert (tmp_path / "span_diagnostics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name,text,message", [
    ("missing.jsonl", None, "{path}: cannot read the diagnostics file (FileNotFoundError"),
    ("", None, "{path}: cannot read the diagnostics file (IsADirectoryError"),
    ("cut.jsonl", '{"step": 2, "lay', "{path}: no diagnostics records"),
])
def test_plot_diagnostics_without_records_names_the_file(name, text, message, tmp_path):
    import plot_diagnostics

    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit, match=message.format(path=path).replace("(", r"\(")):
        plot_diagnostics.main([str(path)])


@pytest.mark.parametrize("argv,message", [
    (["--accum", "0"], "--accum 0: expected an integer >= 1"),  # was: bash's "division by 0", then on
    (["--accum", "abc"], "--accum abc: expected an integer >= 1"),  # was: "abc: unbound variable"
    (["--parallel", "-1"], "--parallel -1: expected an integer >= 1"),
    (["--budget"], "--budget needs a value"),  # was: "$2: unbound variable"
    (["--accum", "3"], "--accum 3 must divide 128"),
])
def test_gpu_sweep_script_names_a_bad_option_before_doing_anything(argv, message, tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_sweep.sh"), *argv], capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path / "out")})
    assert result.returncode == 2 and f"gpu_sweep.sh: {message}" in result.stderr
    assert not (tmp_path / "out").exists()
