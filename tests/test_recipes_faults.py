"""The recipes on interrupted runs, partial or hostile records, hand-edited files and arguments of the
wrong kind: the right result, or an error that names the file, field or argument and what is allowed."""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
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
    ({"parallel": "2"}, "parallel='2': expected an integer from 1 to 2^63 - 1"),
    ({"device": 5}, "device=5: expected the device's name or null"),
    ({"backend": ["triton"]}, "backend=['triton']: expected the attention backend's name or null"),
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


def test_merge_writes_nothing_where_a_file_stands_in_the_way_of_a_result(tmp_path):
    """It wrote the first records, then stopped with a FileExistsError at the file."""
    path = tmp_path / "in.jsonl"
    later = a_record(span="score:1100", name="H2xL1__score-1100__seed0")
    path.write_text(json.dumps(a_record()) + "\n" + json.dumps(later) + "\n")
    blocking = tmp_path / "out" / "runs" / "H2xL1" / "score-1100" / "seed0"
    blocking.parent.mkdir(parents=True)
    blocking.write_text("x")
    with pytest.raises(SystemExit, match=f"merge: {blocking} is a file where the folder of H2xL1__score-1100__seed0 "):
        merge.main([str(path), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "runs" / "H2xL1" / "score-1000").exists()


@pytest.mark.parametrize("name,text,message", [
    ("in.jsonl", "{a}\n{b}\n", "{path} holds two different results for H2xL1__score-1000__seed0 (line 1 and line 2)"),
    ("in.json", "[{a}, {b}]", "{path} holds two different results for H2xL1__score-1000__seed0 (record 1 of a list "
                              "and record 2 of a list)"),
    ("in", None, "{path}/a.json and {path}/b.jsonl line 1 hold different results for H2xL1__score-1000__seed0"),
])
def test_merge_names_where_two_different_results_of_one_run_are(name, text, message, tmp_path):
    """Two in one file were said as "in.jsonl and in.jsonl hold different results", two in one folder as the folder
    twice."""
    path, a, b = tmp_path / name, json.dumps(a_record()), json.dumps(a_record(wall_s=6.0))
    if text is None:
        path.mkdir()
        (path / "a.json").write_text(a)
        (path / "b.jsonl").write_text(b + "\n")
    else:
        path.write_text(text.format(a=a, b=b))
    with pytest.raises(SystemExit) as err:
        merge.main([str(path), "--out", str(tmp_path / "out")])
    assert f"merge: {message.format(path=path)}; keep one of them" == str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda text: "\ufeff" + text, None),  # a byte order mark, as some editors save a file: still JSON Lines
    (lambda text: text.replace("\n", "\r\n"), None),
    (lambda text: text.replace("GPU", "GPU\u2028"), None),  # in a string: was "not valid JSON", the line cut there
    (lambda text: text.replace('"wall_s": 5.0', '"wall_s": 5.0, "wall_s": 0.1'),  # json kept the last, silently
     "line 1: not valid JSON (the key 'wall_s' is given twice in one object; keep one)"),
])
def test_merge_reads_records_as_they_were_edited(edit, message, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(edit(json.dumps(a_record(device="GPU | 80 GB\nx")) + "\n").encode())
    if message is not None:
        with pytest.raises(SystemExit) as err:
            merge.main([str(path), "--out", str(tmp_path / "out")])
        assert f"merge: {path} {message}" in str(err.value)
        return
    merge.main([str(path), "--out", str(tmp_path / "out")])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| GPU / 80 GB x | not recorded | 1 | 1 |" in report  # one row of the table


@pytest.mark.parametrize("changes,message", [
    ({"early_stopping": "yes"}, "early_stopping='yes': expected an object or null"),
    ({"early_stopping": {**METRICS["early_stopping"], "patience": "1"}}, "early_stopping.patience='1': expected an"),
    ({"device": 5}, "device=5: expected the device's name or null"),
    ({"backend": 5}, "backend=5: expected the attention backend's name or null"),
    ({"parallel": "2"}, "parallel='2': expected an integer from 1 to 2^63 - 1"),
    ({"parallel": 0}, "parallel=0: expected an integer from 1 to 2^63 - 1"),  # was: counted as 1 without a word
    ({"parallel": 10**400}, "expected an integer from 1 to 2^63 - 1"),  # was: OverflowError in the notes
    ({"epochs_run": "3"}, "epochs_run is '3': expected a finite number"),
    ({"best_epoch": None}, "best_epoch is missing: expected a finite number"),  # a run that stopped early
    ({"eval_history": [{"epoch": "2", "step": 10, "loss": 4.0}], "epochs_run": 0},
     "eval_history[0].epoch is '2': expected a finite number"),
])
def test_merge_leaves_out_a_metrics_json_in_the_tree_with_hand_edited_run_fields(changes, message, tmp_path, capsys):
    """A metrics.json already in the tree (a sweep's run, a hand edit) is checked only as report.py reads it; the
    notes on the runs then stopped the merge, after the records were written, with a TypeError or AttributeError."""
    edited = {**a_record(**changes), "config": {**METRICS["config"], "training": {"seed": 5}}}
    folder = tmp_path / "out" / "runs" / "H2xL1" / "score-1000" / "seed5"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(edited))
    (tmp_path / "in.jsonl").write_text(json.dumps(a_record()) + "\n")
    merge.main([str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"report: leaving out {folder / 'metrics.json'}: " in err and message in err
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| cpu (x86_64) | not recorded | 1 | 1 |" in table  # the whole record alone


@pytest.mark.parametrize("changes", [{"shape": "H" * 10**6}, {"span": "score:" + "1" * 10**6}, {"name": "n" * 10**6},
                                     {"early_stopping": ["e" * 10**6]},
                                     {"early_stopping": {**METRICS["early_stopping"], "patience": "p" * 10**6}},
                                     {"early_stopping": {**METRICS["early_stopping"], "stopped_early": "s" * 10**6}},
                                     {"config": {**METRICS["config"], "training": {"seed": "s" * 10**6}}}])
def test_merge_names_a_huge_value_without_echoing_it_whole(changes, tmp_path):
    """The message held the value whole: a megabyte of text."""
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record(**changes)))
    with pytest.raises(SystemExit, match=f"merge: {path}: not a result of recipes/pack.py: ") as err:
        merge.main([str(path), "--out", str(tmp_path / "out")])
    assert len(str(err.value)) < 1000


def test_merge_names_a_key_given_twice_without_echoing_it_whole(tmp_path):
    path = tmp_path / "in.json"
    key = json.dumps("k" * 10**6)
    path.write_text("{" + key + ": 1, " + key + ": 2}")
    with pytest.raises(SystemExit, match=f"merge: {path}: not valid JSON \\(the key 'kkk") as err:
        merge.main([str(path), "--out", str(tmp_path / "out")])
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("link", ["seed0/metrics.json", "seed0"])
def test_merge_names_a_link_in_the_tree_that_leads_outside_it(link, tmp_path):
    """It was blamed on the record's shape and span."""
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record()))
    span = tmp_path / "out" / "runs" / "H2xL1" / "score-1000"
    span.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (span / link).parent.mkdir(exist_ok=True)
    (span / link).symlink_to(tmp_path / "elsewhere" / "x")
    dest = span / "seed0" / "metrics.json"
    with pytest.raises(SystemExit, match=f"merge: {dest}, where H2xL1__score-1000__seed0 goes, leads outside "
                                         f"{tmp_path / 'out' / 'runs'} through a link"):
        merge.main([str(path), "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == []


def test_merge_names_a_pipe_given_as_input_and_a_link_loop_in_the_tree(tmp_path):
    os.mkfifo(tmp_path / "results.jsonl")  # was: "no such file or folder"
    with pytest.raises(SystemExit, match=f"merge: {tmp_path / 'results.jsonl'}: not a file or folder"):
        merge.main([str(tmp_path / "results.jsonl"), "--out", str(tmp_path / "out")])
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record()))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "runs").symlink_to(tmp_path / "out" / "runs")  # was: RuntimeError: Symlink loop
    with pytest.raises(SystemExit, match=f"merge: {tmp_path / 'out' / 'runs'}/H2xL1/.*cannot be followed"):
        merge.main([str(path), "--out", str(tmp_path / "out")])


def test_a_merge_that_finds_no_room_names_the_result_and_leaves_none_empty(tmp_path, fake):
    """A full disk (a file-size limit here) raised the bare "[Errno 28] No space left on device" and left an empty
    metrics.json in the tree."""
    import resource

    one_record(tmp_path, fake)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))  # the lock fits, a result does not
    try:
        with pytest.raises(OSError, match="H2xL1/score-1000/seed0/metrics.json: cannot be written \\(File too large "):
            merge.main([str(tmp_path / "made"), "--out", str(tmp_path / "out")])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert not list((tmp_path / "out").rglob("*.json*")) and not (tmp_path / "out.lock").exists()
    merge.main([str(tmp_path / "made"), "--out", str(tmp_path / "out")])
    assert [p.name for p in (tmp_path / "out").rglob("metrics.json*")] == ["metrics.json"]


def test_a_second_merge_into_the_same_folder_stops_at_once(tmp_path):
    """Both wrote the tree and then the report, each over the other's: the last one could leave runs out."""
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record()))
    out = tmp_path / "paper"
    with run_identity.RunLock(out, "--out"):
        with pytest.raises(SystemExit, match=f"{out}: another run is writing into this folder \\(process "
                                             f"{os.getpid()} .*choose another --out"):
            merge.main([str(path), "--out", str(out)])
        assert not out.exists()
    merge.main([str(path), "--out", str(out)])
    assert (out / "report.md").is_file() and not (tmp_path / "paper.lock").exists()


def test_merge_reports_a_run_that_recorded_no_time(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(a_record(train_runtime_s=0.0)))
    merge.main([str(path), "--out", str(tmp_path / "out")])
    assert "| cpu (x86_64) | not recorded | 1 | 1 | 0.0 | – |" in (tmp_path / "out" / "report.md").read_text()


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


def test_pack_moves_a_symlinked_partial_result_aside_and_not_the_file_it_points_to(tmp_path, fake):
    """<results>/<name>.json as a link to a file elsewhere: the link is moved aside, the file stays where it is."""
    one_record(tmp_path, fake)
    results, elsewhere = tmp_path / "results", tmp_path / "mine" / "notes.json"
    results.mkdir()
    elsewhere.parent.mkdir()
    elsewhere.write_text('{"a user\'s own file": 1')
    (results / "H2xL1__score-1000__seed0.json").symlink_to(elsewhere)
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    assert pack.main([str(config), "--results", str(results)]) == 0
    assert elsewhere.read_text() == '{"a user\'s own file": 1' and list(elsewhere.parent.iterdir()) == [elsewhere]
    assert (results / "H2xL1__score-1000__seed0.json.invalid-1").readlink() == elsewhere
    assert pack.load_records(results)[0]["name"] == "H2xL1__score-1000__seed0"


# pack.py: what counts as a finished run


def test_pack_refuses_a_result_name_too_long_for_a_file_before_anything_runs(tmp_path, fake):
    """A shape's folder name of 190 characters beside a span of 4 long alphas: 'File name too long' from the
    results folder's check, a traceback."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:" + ",".join(["0.12345678901234566"] * 4)], [0])
    sweep_file = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**sweep_file, "shapes": [{"n_head": 2, "n_layer": 1, "run_name": "x" * 180}]}))
    with pytest.raises(SystemExit, match=r"\(291 characters\): more than the 230 characters a result file's name"):
        pack.main([str(config), "--results", str(tmp_path / "r")])
    assert fake() == [] and not (tmp_path / "r").exists()


@pytest.mark.parametrize("kind", ["folder", "link"])
def test_a_result_is_written_whole_past_whatever_is_at_its_temporary_name(kind, tmp_path, fake):
    """<results>/.<name>.json.tmp a folder: IsADirectoryError after the run, its result not written; a link to a
    user's file: the record written into that file, the link renamed to the result. run_clm.py's metrics.json and
    run_config.json go the same way (run_identity.write_json)."""
    results, mine = tmp_path / "r", tmp_path / "mine.txt"
    results.mkdir()
    mine.write_text("mine")
    for name in (".H2xL1__score-1000__seed0.json.tmp", ".metrics.json.tmp"):
        if kind == "folder":
            (results / name).mkdir()
        else:
            (results / name).symlink_to(mine)
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    assert pack.main([str(config), "--results", str(results)]) == 0
    assert pack.load_records(results)[0]["name"] == "H2xL1__score-1000__seed0"
    run_identity.write_json(results / "metrics.json", {"a": 1})
    assert json.loads((results / "metrics.json").read_text()) == {"a": 1} and mine.read_text() == "mine"
    assert not (results / "H2xL1__score-1000__seed0.json").is_symlink()
    assert sorted(p.name for p in results.iterdir()) == [".H2xL1__score-1000__seed0.json.tmp", ".metrics.json.tmp",
                                                          "H2xL1__score-1000__seed0.json", "metrics.json"]


@pytest.mark.parametrize("where", ["--results", "--jsonl", "tree"])
def test_pack_stops_at_a_finished_run_made_with_other_settings(where, tmp_path, fake, capsys):
    """A rerun with another --set counts a finished run only where its recorded settings are this command's, apart
    from the batch split (gpu_sweep.sh --accum); else it stops before running anything, naming the run, the setting
    and its two values, unless --keep_other_settings."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000", "score:1100"], [0], tree=tmp_path / "paper" / "runs")
    target = ["--results", str(tmp_path / "r")] if where != "--jsonl" else ["--jsonl", str(tmp_path / "r.jsonl")]
    first = ["--set", "learning_rate=0.001", "--set", "per_device_train_batch_size=4",
             "--set", "gradient_accumulation_steps=2"]
    assert pack.main([str(config), *target, *first, "--max_runs", "1"]) == 0
    if where == "tree":  # merged, and read from the sweep's tree by a command on new results
        merge.main([str(tmp_path / "r"), "--out", str(tmp_path / "paper")])
        target = ["--results", str(tmp_path / "new")]
    saved = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != "calls.jsonl"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        pack.main([str(config), *target, "--set", "learning_rate=2e-3"])
    message = str(err.value)
    assert "H2xL1__score-1000__seed0 made with other settings than this command's (training.learning_rate: " \
           "0.001 → 0.002; training.per_device_train_batch_size × gradient_accumulation_steps: 8 → 128)" in message
    assert "--keep_other_settings" in message and "another --results" in message
    assert fake() == [("score:1000", 0)]  # nothing ran
    assert {p: p.read_bytes() for p in saved} == saved and not (tmp_path / "new").exists()
    # the same settings, written otherwise and with the batch of 8 split as 2 × 4: finished
    assert pack.main([str(config), *target, "--set", "learning_rate=1e-3", "--set", "per_device_train_batch_size=2",
                      "--set", "gradient-accumulation-steps=4", "--dry_run"]) == 0
    assert "2 runs, 1 finished before, 1 to do" in capsys.readouterr().out
    assert pack.main([str(config), *target, "--set", "learning_rate=2e-3", "--keep_other_settings", "--max_runs",
                      "1"]) == 0
    said = capsys.readouterr().out
    assert "H2xL1__score-1000__seed0 was made with other settings (training.learning_rate: 0.001 → 0.002;" in said
    assert fake() == [("score:1000", 0), ("score:1100", 0)]  # score:1000 kept as finished, score:1100 run


def test_pack_takes_the_per_head_diagnostics_for_no_other_setting(tmp_path, fake, capsys):
    """pack.py keeps no diagnostics file, yet a finished run made with --span_diagnostics_per_head stopped a rerun
    without it as a run of other settings. span_diagnostics_every stays one: its steps make the Trainer log, which
    changes train_history and final_train_loss."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    results = ["--results", str(tmp_path / "r")]
    assert pack.main([str(config), *results, "--set", "span_diagnostics_per_head=true"]) == 0
    capsys.readouterr()
    assert pack.main([str(config), *results]) == 0
    assert "1 runs, 1 finished before, 0 to do" in capsys.readouterr().out and len(fake()) == 1
    with pytest.raises(SystemExit, match=r"span\.span_diagnostics_every: 0 → 5"):
        pack.main([str(config), *results, "--set", "span_diagnostics_every=5"])


@pytest.mark.parametrize("args,said", [
    ([1], "config.args=[1]: not the run's arguments as recipes/pack.py records them"),
    ({"learning_rate": {"a": 1}}, "'learning_rate': {'a': 1}}: not the run's arguments"),
    # 1001 arguments, more than run_clm.py has: argparse would take minutes, quadratic in their number, at 10^5
    ({f"k{i}": "1" for i in range(1001)}, " characters): not the run's arguments"),
    ({"../x": "1"}, "its arguments are refused by run_clm.py now (Some specified arguments are not used by the "
                    "HfArgumentParser: ['--../x=1']); ../x: '1' → (unset)"),
])
def test_a_record_whose_arguments_are_hostile_stops_the_command_named(args, said, tmp_path, fake):
    record = one_record(tmp_path, fake)
    results = tmp_path / "r"
    results.mkdir()
    config = record["config"]
    record["config"] = {**config, "args": {**config["args"], **args} if isinstance(args, dict) else args}
    (results / f"{record['name']}.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit) as err:
        pack.main([str(tmp_path / "sweep.yaml"), "--results", str(results)])
    assert f"{record['name']} made with other settings than this command's (" in str(err.value)
    assert said in str(err.value) and len(str(err.value)) < 2000


def test_a_dry_run_away_from_the_data_lists_the_runs_without_comparing_settings(tmp_path, fake, capsys):
    """A dry run does not check the runs' arguments (its data may be on the machine that runs): the settings of
    finished runs cannot be compared there, and it says so rather than stop."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000", "score:1100"], [0])
    assert pack.main([str(config), "--results", str(tmp_path / "r"), "--max_runs", "1"]) == 0
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000", "score:1100"], [0], {"train_file": "elsewhere.txt"})
    assert pack.main([str(config), "--results", str(tmp_path / "r"), "--dry_run"]) == 0
    said = capsys.readouterr().out
    assert "the settings of finished runs are not compared (the arguments of H2xL1__score-1000__seed0: " \
           "--train_file elsewhere.txt: no such file)\n2 runs, 1 finished before, 1 to do" in said


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


def test_a_tmp_dir_that_takes_no_folders_is_named(tmp_path, fake, monkeypatch):
    """--tmp_dir read-only (or full): the traceback named the run's temporary folder inside it, not --tmp_dir."""
    import errno
    import tempfile

    def refused(prefix, dir):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + "x1y2"))

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    (tmp_path / "tmp").mkdir()
    with pytest.raises(SystemExit) as err:
        pack.main([str(config), "--results", str(tmp_path / "r"), "--tmp_dir", str(tmp_path / "tmp")])
    assert str(err.value).startswith(f"pack: --tmp_dir {tmp_path / 'tmp'}: a run's folder cannot be made there "
                                     "(Permission denied)")
    assert fake() == []


def test_a_jsonl_line_that_finds_no_room_is_named_and_leaves_no_line_cut_short(tmp_path, fake):
    """A full disk (a file-size limit here) raised the bare "[Errno 28] No space left on device" and left a line cut
    short, which the next command appended after: merge.py then refused the file."""
    import resource

    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000", "score:1100"], [0])
    jsonl = tmp_path / "r.jsonl"
    assert pack.main([str(config), "--jsonl", str(jsonl), "--max_runs", "1"]) == 0
    before = jsonl.read_bytes()
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 500, limits[1]))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(OSError, match=f"{jsonl}: cannot be written \\(File too large\\)"):
            pack.main([str(config), "--jsonl", str(jsonl)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert jsonl.read_bytes() == before
    assert pack.main([str(config), "--jsonl", str(jsonl)]) == 0
    assert [r["name"] for r in pack.load_records(jsonl)] == ["H2xL1__score-1000__seed0", "H2xL1__score-1100__seed0"]


@pytest.mark.parametrize("flag", ["--results", "--jsonl"])
def test_a_second_pack_command_on_the_same_results_stops_at_once(flag, tmp_path, fake):
    """Both ran every run: twice the device time, and two records of each run that merge.py then refused."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    where = tmp_path / ("results" if flag == "--results" else "results.jsonl")
    with run_identity.RunLock(where, flag, "folder" if flag == "--results" else "file"):
        with pytest.raises(SystemExit) as err:
            pack.main([str(config), flag, str(where)])
    kind = "folder" if flag == "--results" else "file"
    assert f"{where}: another run is writing into this {kind} (process {os.getpid()}" in str(err.value)
    assert f"choose another {flag}" in str(err.value) and fake() == []
    assert pack.main([str(config), flag, str(where)]) == 0 and not where.with_name(where.name + ".lock").exists()


def _pack_with_a_slow_run(tmp_path: Path):
    """(pack.py process, the file its run writes its pid to, its --tmp_dir, the sweep) of a pack command on
    results tmp_path/r whose one run sleeps 2 minutes, returned once that run has started."""
    pid_file, tmp = tmp_path / "run.pid", tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "slow_run.py"
    script.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)\n")
    driver = tmp_path / "drive.py"
    driver.write_text(f"import pathlib, sys\nsys.path.insert(0, {str(ROOT / 'recipes')!r})\nimport pack\n"
                      f"pack.RUN_CLM = pathlib.Path({str(script)!r})\nimport sweep\nsweep.check_args = print\n"
                      "sys.exit(pack.main(sys.argv[1:]))\n")  # check_args: the stand-in takes no arguments
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    process = subprocess.Popen([sys.executable, str(driver), str(config), "--results", str(tmp_path / "r"),
                                "--tmp_dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not pid_file.is_file() or not pid_file.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the run did not start")
        time.sleep(0.1)
    return process, pid_file, tmp, config


def test_a_pack_command_stopped_by_sigterm_stops_its_runs(tmp_path):
    """kill (or timeout) ended pack.py at once: its runs went on, unseen, each in a temporary folder left behind."""
    process, pid_file, tmp, _ = _pack_with_a_slow_run(tmp_path)
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) != 0
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)
        assert list(tmp.iterdir()) == []
    finally:
        process.kill()


@pytest.mark.skipif(sys.platform != "linux", reason="a run dies with pack.py through Linux's PR_SET_PDEATHSIG")
def test_a_pack_command_killed_by_sigkill_takes_its_runs_with_it(tmp_path, fake, capsys):
    """SIGKILL (a command limit's last word) reaches no handler: the run went on, unseen, beside a rerun's."""
    process, pid_file, tmp, config = _pack_with_a_slow_run(tmp_path)
    try:
        process.kill()
        process.wait(timeout=60)
        status = Path(f"/proc/{pid_file.read_text()}/status")
        deadline = time.monotonic() + 30
        while status.exists() and "State:\tZ" not in status.read_text():  # gone, or dead and not yet reaped
            assert time.monotonic() < deadline, "the run goes on after pack.py was killed"
            time.sleep(0.1)
    finally:
        process.kill()
        if pid_file.is_file() and pid_file.read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    [left] = tmp.iterdir()  # no handler saw SIGKILL: the run's temporary folder stays, until the next command
    assert pack.main([str(config), "--results", str(tmp_path / "r"), "--tmp_dir", str(tmp)]) == 0
    assert list(tmp.iterdir()) == [] and fake() == [("score:1000", 0)]
    assert f"{left}: removed, the temporary folder of a run of a pack command on these results that was killed " \
        f"(process {process.pid})" in capsys.readouterr().out


def test_pack_removes_only_the_temporary_folders_of_dead_commands_on_its_results(tmp_path, fake, capsys):
    """A folder of a live command, of one on other results or without a word of whose it is, is another's to keep."""
    tmp, results = tmp_path / "tmp", tmp_path / "r"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        owners = {"dead": {"pid": int(dead.stdout), "results": [str(results)]},
                  "dead-run-live": {"pid": int(dead.stdout), "run_pid": live.pid, "results": [str(results)]},
                  "live": {"pid": live.pid, "results": [str(results)]},
                  "other-results": {"pid": int(dead.stdout), "results": [str(tmp_path / "other")]},
                  "other-host": {"pid": int(dead.stdout), "results": [str(results)], "host": "elsewhere"},
                  "edited": {"pid": str(dead.stdout), "results": [str(results)]}, "unmarked": None}
        for name, owner in owners.items():
            (tmp / name).mkdir(parents=True)
            (tmp / name / "train.log").write_text("...")
            if owner is not None:
                (tmp / name / pack.OWNER).write_text(json.dumps({"host": socket.gethostname(), **owner}))
        config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
        assert pack.main([str(config), "--results", str(results), "--tmp_dir", str(tmp)]) == 0
    finally:
        live.kill()
    assert sorted(p.name for p in tmp.iterdir()) == sorted(set(owners) - {"dead"})
    assert f"{tmp / 'dead'}: removed" in capsys.readouterr().out


def test_a_sweep_stopped_while_a_run_goes_on_stops_the_run(tmp_path, monkeypatch):
    pid_file = tmp_path / "run.pid"
    command = [sys.executable, "-c", f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                     "print('started', flush=True)\ntime.sleep(120)\n"]

    class Stopped:  # the console of a sweep stopped as its run prints
        def write(self, text):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdout", Stopped())
    with pytest.raises(KeyboardInterrupt):
        sweep.run_and_log(command, tmp_path / "train.log")
    monkeypatch.undo()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert (tmp_path / "train.log").read_text().startswith("started")


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
     "config.training.per_device_train_batch_size='4': expected an integer from 1 to 2^63 - 1"),
    ({"config": {"training": {"seed": 0}, "data": {"block_size": "128"}}},
     "config.data.block_size='128': expected an integer"),
    ({"unigram_val_loss": "low"}, "unigram_val_loss is 'low': expected a finite number"),
    ({"min_val_loss": math.nan, "eval_history": [{"step": 10, "loss": math.nan}]},  # a run that diverged
     "min_val_loss is nan: expected a finite number; eval_history[0].loss is nan"),
    ({"world_size": "2"}, "world_size='2': expected an integer >= 1"),
    # counts the report multiplies into "about N tokens": it said "about inf tokens", "blocks of 2.5", "100.0 tokens"
    ({"config": {"training": {"seed": 0}, "data": {"block_size": 1e308}}},
     "config.data.block_size=1e+308: expected an integer from 1 to 2^63 - 1"),
    ({"config": {"training": {"seed": 0}, "data": {"block_size": 2.5}}}, "config.data.block_size=2.5: expected an"),
    ({"config": {"training": {"seed": 0, "gradient_accumulation_steps": 10**400}}},
     "config.training.gradient_accumulation_steps=1000000000000"),
    ({"world_size": 2.5}, "world_size=2.5: expected an integer >= 1"),
    ({"train_history": [{"step": 10.5, "loss": 6.0}]}, "train_history[0].step=10.5: expected an integer >= 0"),
    # the data source in words: a path of another type stopped the report with a TypeError
    ({"config": {"training": {"seed": 0}, "data": {"data_dir": 5, "train_file": "t.txt"}}},
     "config.data.data_dir=5: expected text or null"),
    ({"config": {"training": {"seed": 0}, "data": {"dataset_name": ["wikitext"]}}},
     "config.data.dataset_name=['wikitext']: expected text or null"),
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
    assert f"**Left out** (a metrics.json the report cannot use):\n\n- {bad}: " in text and message in text


@pytest.mark.parametrize("base,value,said", [
    (800.0, 5.9, "(perplexity e^800)"),  # a diverged baseline: OverflowError in the perplexity
    (6.0, 1e308, "validation loss is 6 and score:1000's 1e+308, so score:1000 has no Δ %"),  # axis limits of inf
])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # matplotlib's ticks of a curve at 1e308
def test_report_on_losses_past_what_a_float_holds(base, value, said, tmp_path, capsys):
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, base)
    metrics_file(runs, "score:1000", 0, value)
    report.main([str(runs), "--out", str(tmp_path / "out")])
    assert said in (tmp_path / "out" / "report.md").read_text() + capsys.readouterr().err
    assert (tmp_path / "out" / "improvements_H1xL1.png").is_file()


def test_report_names_runs_that_differ_in_more_than_the_span(tmp_path, capsys):
    """Records merged from commands of other settings (here: blocks of 16 against 8) went into one Δ % without a
    word, and the text described the first run's settings as every run's."""
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    metrics_file(runs, "score:1000", 0, 5.9, config={"training": {"seed": 0}, "data": {"block_size": 16}})
    metrics_file(runs, "score:1100", 0, 5.9)
    report.main([str(runs), "--out", str(tmp_path / "out")])
    said = "score:1000 seed 0 (data.block_size: 8 → 16)"
    assert f"these runs differ from standard:QKV111 seed 0 in more than the span, so their Δ % measures that too: " \
           f"{said}." in (tmp_path / "out" / "report.md").read_text()
    assert f"report: H1xL1: runs of other settings than the span: {said}\n" in capsys.readouterr().err


def test_report_names_runs_of_data_files_edited_between_them(tmp_path, capsys):
    """Runs of the same data paths whose contents differed (a file edited between runs) went into one Δ %."""
    runs = tmp_path / "runs"
    for label, digest in (("standard:QKV111", "a" * 64), ("score:1000", "b" * 64)):
        metrics_file(runs, label, 0, 6.0, config={"training": {"seed": 0}, "data": {"block_size": 8},
                                                  "data_sha256": {"train": digest}})
    metrics_file(runs, "score:1100", 0, 5.9)  # recorded before the contents were: compared by the rest
    report.main([str(runs), "--out", str(tmp_path / "out")])
    assert f"score:1000 seed 0 (data_sha256.train: '{'a' * 64}' → '{'b' * 64}')." in \
        (tmp_path / "out" / "report.md").read_text()
    assert "score:1100" not in capsys.readouterr().err


@pytest.mark.parametrize("split,said", [((64, 2), None), ((32, 2), "training.per_device_train_batch_size × "
                                                                    "gradient_accumulation_steps: 128 → 64")])
def test_report_takes_the_batch_split_for_no_other_setting(split, said, tmp_path):
    """Runs of one batch of 128 in 1 or 2 steps (gpu_sweep.sh --accum) were named as runs of other settings."""
    runs = tmp_path / "runs"
    for label, (batch, steps) in (("standard:QKV111", (128, 1)), ("score:1000", split)):
        training = {"seed": 0, "per_device_train_batch_size": batch, "gradient_accumulation_steps": steps}
        metrics_file(runs, label, 0, 6.0, config={"training": training, "data": {"block_size": 8}})
    report.main([str(runs), "--out", str(tmp_path / "out")])
    text = (tmp_path / "out" / "report.md").read_text()
    assert ("Not like the others" in text) == (said is not None) and (said is None or f"({said})" in text)


def test_report_names_a_figure_name_too_long_for_a_file_before_writing(tmp_path):
    """A shape folder of 246 characters: matplotlib's "File name too long" traceback at the first figure."""
    runs, shape = tmp_path / "runs", "H1xL1_" + "x" * 240
    for label, value in (("standard:QKV111", 6.0), ("score:1000", 5.9)):
        folder = metrics_file(runs, label, 0, value).parent.parent
        (runs / shape).mkdir(exist_ok=True)
        folder.rename(runs / shape / folder.name)
    with pytest.raises(SystemExit, match=r"report: .*loss_curves_H1xL1_x+.*: a file name of 262 bytes, past the 255"):
        report.main([str(runs), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_report_reads_a_span_label_as_its_setting(tmp_path):
    """score:1,0,0,0 is score:1000: one row, and two runs of it with one seed are named."""
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    path = metrics_file(runs, "score:1000", 0, 5.9)
    path.write_text(path.read_text().replace('"score:1000"', '"score:1,0,0,0"'))
    report.main([str(runs), "--out", str(tmp_path / "out")])
    assert "| score:1000 | 1 |" in (tmp_path / "out" / "report.md").read_text()
    twin = metrics_file(runs, "score:1000", 1, 5.8)
    twin.write_text(twin.read_text().replace('"seed": 1', '"seed": 0'))
    with pytest.raises(SystemExit, match=r"are both span score:1000 with seed 0 in shape H1xL1"):
        report.main([str(runs), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.write_bytes(codecs.BOM_UTF8 + p.read_bytes()), None),  # as some editors save it: still JSON
    (lambda p: p.write_text(p.read_text()[:-1] + ', "min_val_loss": 1.0}'),  # json.loads kept the last, silently
     "{path}: the key 'min_val_loss' is given twice in one object; keep one"),
    (lambda p: (p.unlink(), p.mkdir()), "{path}: cannot be read (IsADirectoryError"),  # was: a traceback
])
def test_a_hand_edited_metrics_json_is_read_or_named(edit, message, tmp_path):
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    path = metrics_file(runs, "score:1000", 0, 5.9)
    edit(path)
    if message is None:
        report.main([str(runs), "--out", str(tmp_path / "out")])
        assert "| score:1000 | 1 |" in (tmp_path / "out" / "report.md").read_text()
        return
    with pytest.raises(SystemExit) as err:
        report.main([str(runs), "--out", str(tmp_path / "out")])
    assert message.format(path=path) in str(err.value)


def test_a_report_that_finds_no_room_is_named_and_leaves_the_report_before(tmp_path):
    """A full disk (a file-size limit here): matplotlib's bare "[Errno 28] No space left on device", and report.md
    and report.csv were cut to nothing before being written."""
    import resource

    runs, out = tmp_path / "runs", tmp_path / "out"
    metrics_file(runs, "standard:QKV111", 0, 0.4)
    metrics_file(runs, "score:1000", 0, 0.5)
    report.main([str(runs), "--out", str(out)])
    before = {name: (out / name).read_bytes() for name in ("report.md", "report.csv")}
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, limits[1]))  # Python ignores SIGXFSZ: writes past it fail
    try:
        with pytest.raises(SystemExit) as err:
            report.main([str(runs), "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value).startswith(f"report: --out {out}: ") and str(err.value).endswith(
        "cannot be written (File too large); make room there, or give another --out")
    assert {name: (out / name).read_bytes() for name in before} == before


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
    config = {"training": {"seed": 0}, "span": {"span_diagnostics_every": 2}}
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    folder = metrics_file(runs, "score:1000", 0, 5.9, config=config).parent
    lines = [json.dumps({**DIAGNOSTIC, "step": 2}), json.dumps(DIAGNOSTIC)[:30], json.dumps({**DIAGNOSTIC, "step": 4}),
             json.dumps({**DIAGNOSTIC, "step": 6, "dq_share": []})]
    (folder / "span_diagnostics.jsonl").write_text("\n".join(lines) + "\n")
    report.main([str(runs), "--out", str(tmp_path / "out")])
    said = capsys.readouterr().err
    assert f"{folder / 'span_diagnostics.jsonl'}:2: left out: not a whole JSON record" in said
    assert f"{folder / 'span_diagnostics.jsonl'}:4: left out: dq_share=[]: expected a list of numbers" in said
    assert (tmp_path / "out" / "diagnostics_H1xL1_score-1000.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_draws_no_diagnostics_for_a_run_that_recorded_none(tmp_path):
    """A start with diagnostics, stopped before its first checkpoint, and a run with other settings and none in
    the same folder: the file is the stopped start's."""
    runs = tmp_path / "runs"
    metrics_file(runs, "standard:QKV111", 0, 6.0)
    folder = metrics_file(runs, "score:1000", 0, 5.9, config={"training": {"seed": 0}, "span": {}}).parent
    (folder / "span_diagnostics.jsonl").write_text(json.dumps(DIAGNOSTIC) + "\n")
    report.main([str(runs), "--out", str(tmp_path / "out")])
    assert not list((tmp_path / "out").glob("diagnostics_*"))


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


@pytest.mark.parametrize("place,message", [
    (lambda t: (t / "report.md").mkdir(), "{tmp}/report.md is a folder, where the report writes a file"),  # was:
    (lambda t: (t / "loss_curves_H1xL1.png").mkdir(), "{tmp}/loss_curves_H1xL1.png is a folder"),  # IsADirectoryError
    (lambda t: (t / "report.csv").symlink_to(t / "gone" / "report.csv"), "{tmp}/report.csv is a link to nothing"),
    (lambda t: (t / "runs/H1xL1/standard-QKV111/seed1").mkdir() or  # was: left out without a word
     (t / "runs/H1xL1/standard-QKV111/seed1/metrics.json").symlink_to(t / "gone.json"),
     "{tmp}/runs/H1xL1/standard-QKV111/seed1/metrics.json: cannot be read (FileNotFoundError"),
])
def test_report_where_a_file_is_a_folder_or_a_link_to_nothing_names_it(place, message, tmp_path):
    metrics_file(tmp_path / "runs", "standard:QKV111", 0, 6.0)
    place(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as err:
        report.main([str(tmp_path / "runs")])
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


@needs_data
def test_a_save_past_the_file_size_limit_is_named_and_the_rerun_finishes(tmp_path):
    """A checkpoint save that found no room (a file-size limit here, a full disk alike) failed with torch's
    "[enforce fail at inline_container.cc:672] . unexpected pos 6437184 vs 6437072", naming neither file nor cause."""
    import resource

    start = pretrained(tmp_path / "start", "gpt2")
    out = tmp_path / "out"
    args = flags({**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start,
                  "output_dir": out, "save_strategy": "epoch"})
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, limits[1]))  # Python ignores SIGXFSZ: writes past it fail
    try:
        with pytest.raises(SystemExit) as err:
            run_clm.main(args)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value).startswith(f"--output_dir {out}: a save failed: a file reached this process's file-size "
                                     f"limit of {2**20} bytes (SafetensorError: ")
    assert "Raise the limit (`ulimit -f`), then run the same command again: it resumes from" in str(err.value)
    assert not (out / "metrics.json").exists() and not (tmp_path / "out.lock").exists()
    assert run_clm.main(args)["min_val_loss"] > 0 and (out / "incomplete-checkpoint-2").is_dir()


@needs_data
def test_a_rerun_after_a_stop_past_the_last_checkpoint_makes_the_last_evaluation(tmp_path):
    """A run stopped after its last checkpoint (saved before the last evaluation) resumed there with nothing left to
    train: metrics.json lacked the last evaluation, and its min_val_loss was an earlier one's."""
    start = pretrained(tmp_path / "start", "gpt2")
    out = tmp_path / "out"
    args = flags({**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start, "output_dir": out,
                  "num_train_epochs": 2, "save_strategy": "steps", "save_steps": 3})
    full = run_clm.main(args)
    (out / "metrics.json").unlink()  # as if killed after the last checkpoint
    again = run_clm.main(args)
    assert again["resumed_from"] == str(out / "checkpoint-4")
    assert again["eval_history"] == full["eval_history"] and again["min_val_loss"] == full["min_val_loss"]


@needs_data
@pytest.mark.parametrize("edited", ["train", "tokenizer"])
def test_a_data_file_or_tokenizer_edited_since_a_run_makes_another_run(edited, tmp_path):
    """A rerun after the data file or the tokenizer was edited returned the finished run's metrics of the tokens
    before; a stopped run resumed its checkpoint on the other tokens, or stopped in the Trainer's "Error(s) in loading
    state_dict" (a token added): the settings recorded only the paths."""
    from transformers import AutoTokenizer

    start = pretrained(tmp_path / "start", "gpt2")
    out = tmp_path / "out"
    files = data_files(tmp_path / "data", "txt")
    args = flags({**SMALL, **files, "model_name_or_path": start, "output_dir": out})
    first = run_clm.main(args)
    if edited == "train":
        with open(files["train_file"], "a") as f:
            f.write(" One more line .\n")
    else:
        tokenizer = AutoTokenizer.from_pretrained(start)
        tokenizer.add_tokens(["<new>"])
        tokenizer.save_pretrained(start)
    with pytest.raises(ValueError, match=rf"holds a run made with other settings \(data_sha256.{edited}: "):
        run_clm.main(args)
    assert run_clm.main([*args, "--overwrite_output_dir"])["config"]["data_sha256"] != first["config"]["data_sha256"]
    assert run_identity.differences(first["config"], {**first["config"], "data_sha256": None}) == []  # older records


@pytest.mark.parametrize("flag,level", [([], "INFO"), (["--log_level", "error"], "ERROR")])
def test_transformers_logs_at_the_verbosity_the_user_set(flag, level, tmp_path, monkeypatch):
    """TRANSFORMERS_VERBOSITY=info (which sets Transformers' verbosity when it is imported) gave no info logs:
    run_clm.py set warnings only; --log_level wins over it, as in the Trainer."""
    import transformers

    before = transformers.utils.logging.get_verbosity()
    monkeypatch.setattr(run_clm, "run", lambda *args: transformers.utils.logging.get_verbosity())
    transformers.utils.logging.set_verbosity_info()
    try:
        during = run_clm.main(["--output_dir", str(tmp_path / "out"), *flag])
    finally:
        transformers.utils.logging.set_verbosity(before)
    assert during == getattr(logging, level)


@needs_data
def test_a_run_launched_in_accelerates_mixed_precision_is_another_run_than_one_without(tmp_path, monkeypatch):
    """accelerate launch with mixed_precision bf16 (flag or config file) trains in bf16 autocast without --bf16, so
    a rerun without it into the same folder returned the bf16 run's metrics as its own, or resumed its checkpoint."""
    start = pretrained(tmp_path / "start", "gpt2")
    args = flags({**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start,
                  "output_dir": tmp_path / "out", "use_cpu": True})
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch gives the process
    bf16 = run_clm.main(args)
    assert bf16["config"]["mixed_precision"] == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    with pytest.raises(ValueError, match=r"holds a run made with other settings \(mixed_precision: 'bf16' → 'no'\)"):
        run_clm.main(args)


@pytest.mark.parametrize("group,value,message", [
    ("data", "wikitext", "data='wikitext': expected an object of settings"),  # was: AttributeError, no file named
    ("span", {"span": "score:12"}, "alphas=(1.0, 2.0): expected 4 values"),
    ("data", {"data_dir": ["a"], "train_file": "t.txt"}, "expected str, bytes or os.PathLike object, not list"),
])
def test_a_hand_edited_run_config_is_named(group, value, message, tmp_path):
    out = tmp_path / "out"
    config = {"model": {}, "data": {}, "span": {"span": "score:1000"}, "training": {"seed": 0}}
    run_identity.write_config(out, {**config, group: value})
    checkpoint(out, 2, True)
    with pytest.raises(ValueError) as err:
        run_identity.resume_point(str(out), config, None, overwrite=False)
    assert f"{out / 'run_config.json'}: not a run configuration as run_clm.py records it (" in str(err.value)
    assert message in str(err.value)


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


def test_a_second_run_through_a_symlink_to_the_folder_stops_at_once(tmp_path):
    """The lock was named after the path as given: out.lock and link.lock, two runs in one folder."""
    (tmp_path / "out").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "out")
    with run_identity.RunLock(tmp_path / "out"):
        for path in (tmp_path / "link", tmp_path / "link" / ".." / "out", f"{tmp_path}/out/"):
            with pytest.raises(SystemExit, match=f"{tmp_path / 'out'}: another run is writing into this folder"):
                with run_identity.RunLock(path):
                    pass


@needs_data
def test_an_output_dir_that_is_the_pretrained_models_folder_is_refused(tmp_path):
    """The run wrote its weights, config and tokenizer over the model it started from."""
    start = pretrained(tmp_path / "start", "gpt2")
    tokenizer = shutil.copytree(DATA / "gpt2-tokenizer", tmp_path / "tokenizer")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    args = {**SMALL, **data_files(tmp_path / "data", "txt"), "model_name_or_path": start}
    for flag, folder in (("model_name_or_path", start), ("tokenizer_name", tokenizer)):
        with pytest.raises(ValueError, match=f"--output_dir {folder} is the folder of --{flag}: the run would write"):
            run_clm.main(flags({**args, flag: folder, "output_dir": f"{folder}/"}))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == {**before, **{
        p: p.read_bytes() for p in (tmp_path / "data").iterdir()}}


def test_paths_starting_with_a_tilde_are_in_the_home_folder(tmp_path, monkeypatch):
    """--data_dir=~/d (no shell expands a ~ after '=' or in a YAML file) was "no such folder"; a sweep's
    output_dir: ~/runs made a folder named ~ where run_clm.py (through TrainingArguments) wrote into the home folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d").mkdir()
    for split in ("train", "validation"):
        (tmp_path / "d" / f"{split}.txt").write_text("a b c\n")
    (tmp_path / "tok").symlink_to(DATA / "gpt2-tokenizer")
    (tmp_path / "s.yaml").write_text("- {at: 0, span: score:1000}\n")
    model, data, span, training, *_ = run_clm.parse_args(
        ["--data_dir=~/d", "--tokenizer_name=~/tok", "--span_schedule=~/s.yaml", "--output_dir=~/o"])
    assert data.files() == {split: str(tmp_path / "d" / f"{split}.txt") for split in ("train", "validation")}
    assert data.tokenizer_name == str(tmp_path / "tok") and training.output_dir == str(tmp_path / "o")
    assert span.callback().schedule.keyframes[0].span == "score:1000"
    [(folder, run_args)] = sweep.plan({"output_dir": "~/runs", "spans": ["score:1000"], "seeds": [0]}, check=False)
    assert folder == tmp_path / "runs" / "H4xL6" / "score-1000" / "seed0"


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


def test_a_lock_that_finds_no_room_is_named_and_left_nowhere(tmp_path):
    """A full disk (a file-size limit here) raised the bare "[Errno 28] No space left on device" and left an empty
    lock, which held the folder as "a process starting now" for the next command."""
    import resource

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, limits[1]))  # Python ignores SIGXFSZ: writes past it fail
    try:
        with pytest.raises(SystemExit) as err, run_identity.RunLock(tmp_path / "out"):
            pass
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value) == (f"--output_dir {tmp_path / 'out'}: its lock {tmp_path / 'out.lock'} cannot be written "
                              "(OSError: File too large); make room there, or choose another --output_dir")
    assert not (tmp_path / "out.lock").exists()
    with run_identity.RunLock(tmp_path / "out"):
        assert (tmp_path / "out.lock").is_file()


@needs_data
def test_a_run_config_that_cannot_be_written_is_named_with_the_output_dir_and_leaves_the_old_one(tmp_path):
    """A folder that takes no file, or no more bytes (a file-size limit here): the traceback ended in
    "[Errno 27] File too large", naming no file, or named only the hidden file written first."""
    import resource

    out = tmp_path / "out"
    run_identity.write_config(out, {"before": 1})
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2000, limits[1]))  # the lock fits, the configuration does not
    try:
        with pytest.raises(SystemExit) as err:
            run_clm.main(flags({**TINY, "output_dir": out}))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value) == (f"--output_dir {out}: {out / 'run_config.json'}: cannot be written (File too large "
                              "when writing .run_config.json.tmp beside it first)")
    assert os.listdir(out) == ["run_config.json"] and json.loads((out / "run_config.json").read_text()) == {"before": 1}


@needs_data
def test_a_datasets_cache_that_cannot_be_written_is_named_not_the_data_file(tmp_path, monkeypatch):
    """HF_HOME read-only (a file where its folder goes here): the error said the train file "could not be read as
    text"."""
    import datasets

    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    files = data_files(tmp_path / "data", "txt")
    with pytest.raises(SystemExit) as err:
        run_clm.main(flags({**SMALL, **files, "output_dir": tmp_path / "out",
                            "tokenizer_name": DATA / "gpt2-tokenizer"}))
    assert str(err.value).startswith(f"--train_file {files['train_file']}: the datasets cache cannot be written "
                                     f"({tmp_path / 'cache'}")
    assert str(err.value).endswith("point HF_DATASETS_CACHE (or HF_HOME) to a folder this user can write")


def test_a_modules_cache_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    """HF_HOME read-only (a file where its folder goes here): evaluate's traceback ended in a PermissionError."""
    import evaluate

    (tmp_path / "modules").write_text("not a folder")
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")
    with pytest.raises(SystemExit) as err:
        run_clm.make_compute_metrics()
    assert str(err.value).startswith(f"{run_clm.METRIC_PATH}: evaluate's modules cache cannot be written "
                                     f"({tmp_path / 'modules'}")
    assert str(err.value).endswith("point HF_MODULES_CACHE (or HF_HOME) to a folder this user can write")


@pytest.mark.parametrize("name", ["train.txt", "train.jsonl", "train.csv"])
def test_a_data_file_replaced_by_another_of_the_same_time_is_read_anew(name, tmp_path, monkeypatch):
    """`datasets` keys a local file's cache by its modification time alone: a file replaced by another with the same
    time (cp -p, rsync -t, tar) gave the rows of the one before."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    path = tmp_path / name
    texts = {".txt": lambda t: f"{t}\n", ".jsonl": lambda t: json.dumps({"text": t}) + "\n",
             ".csv": lambda t: f"text\n{t}\n"}[path.suffix]
    for text in ("the first text", "the other text"):  # the same size too
        path.write_text(texts(text))
        os.utime(path, (2e9, 2e9))
        assert [t.strip() for t in run_clm.load_file(str(path), "--train_file")["text"]] == [text]


def test_csv_cells_that_pandas_reads_as_missing_are_text(tmp_path):
    """A CSV row whose text was None, NA, nan or null (pandas' missing values) was trained as an empty text."""
    words = ["None", "NA", "nan", "null", "N/A", "", "some text"]
    path = tmp_path / "train.csv"
    path.write_text("text,label\n" + "".join(f"{w},{i}\n" for i, w in enumerate(words)))
    assert run_clm.load_file(str(path), "--train_file")["text"][:] == words


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_a_file_written_again_keeps_the_permissions_given_it(mode, tmp_path):
    """run_config.json made private by hand (chmod 600) was readable by all after a resumed run wrote it again."""
    path = tmp_path / "run_config.json"
    path.write_text("{}")
    path.chmod(mode)
    run_identity.write_json(path, {"a": 1})
    assert path.stat().st_mode & 0o777 == mode and json.loads(path.read_text()) == {"a": 1}


def test_a_lock_whose_process_id_was_given_to_another_process_is_taken_over(tmp_path, capsys):
    """A run killed, its process id given to an unrelated process later (a reboot, a long day): the folder was held
    for ever as that process's; a lock cut short with a time in the future (a clock set back) was "a process starting
    now" for ever."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    lock = tmp_path / "out.lock"
    try:
        mine = {"pid": other.pid, "host": socket.gethostname(), "process_start": run_identity.process_start(other.pid)}
        lock.write_text(json.dumps(mine))
        with pytest.raises(SystemExit, match=f"another run is writing into this folder \\(process {other.pid} on"):
            with run_identity.RunLock(tmp_path / "out"):
                pass
        lock.write_text(json.dumps({**mine, "process_start": "another boot/12345"}))
        with run_identity.RunLock(tmp_path / "out"):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        other.kill()
        other.wait()
    assert "taking over the lock of a run that ended" in capsys.readouterr().err
    lock.write_text('{"pid": 4')
    os.utime(lock, (time.time() + 86400,) * 2)
    with run_identity.RunLock(tmp_path / "out"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("pid", [1e400, 1e308, 2**63, -1, 0, True])
def test_a_lock_file_edited_by_hand_is_taken_over_once_old(pid, tmp_path, capsys):
    """A process id past int64 or infinite failed with an OverflowError; -1 and 0 (whole groups of processes) held
    the folder for ever."""
    lock = tmp_path / "out.lock"
    lock.write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))
    os.utime(lock, (0, 0))
    with run_identity.RunLock(tmp_path / "out"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "taking over the lock of a run that ended" in capsys.readouterr().err and not lock.exists()


@pytest.mark.parametrize("edit", [{"host": "h" * 10**6}, {"started": ["x"] * 10**5}])
def test_a_lock_file_edited_by_hand_is_named_without_echoing_it_whole(edit, tmp_path):
    """A host or start time of a megabyte went into the message whole."""
    lock = tmp_path / "out.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, **edit}))
    with pytest.raises(SystemExit) as err, run_identity.RunLock(tmp_path / "out"):
        pass
    assert f"another run is writing into this folder (process {os.getpid()} on " in str(err.value)
    assert " characters)" in str(err.value) and len(str(err.value)) < 1000


def test_a_folder_where_the_lock_goes_is_named_and_kept(tmp_path, monkeypatch):
    """A run in out.lock, then one in out: an IsADirectoryError, or "another run is writing into this folder ... delete
    out.lock", the other run's folder."""
    (tmp_path / "out.lock").mkdir()
    (tmp_path / "out.lock" / "metrics.json").write_text("{}")
    monkeypatch.setattr(run_clm, "run", lambda *a: pytest.fail("the run started"))
    for age in (0, time.time()):
        os.utime(tmp_path / "out.lock", (age, age))
        with pytest.raises(SystemExit, match=f"{tmp_path}/out.lock is where the lock of {tmp_path}/out goes, but it is "
                                             "not a lock file this recipe wrote; move it away, or choose another "
                                             "--output_dir"):
            run_clm.main(["--output_dir", str(tmp_path / "out"), "--tokenizer_name", str(DATA / "gpt2-tokenizer")])
    assert (tmp_path / "out.lock" / "metrics.json").read_text() == "{}"


@pytest.mark.parametrize("flag", ["--results", "--tmp_dir"])
def test_pack_names_a_folder_option_that_is_a_link_loop(flag, tmp_path, fake, capsys):
    """--results: FileExistsError from mkdir, after the runs were planned."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0])
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(SystemExit):
        pack.main([str(config), "--jsonl", str(tmp_path / "r.jsonl"), flag, str(tmp_path / "loop")])
    assert f"{flag} {tmp_path / 'loop'}: a link to nothing (or to itself); expected a folder" in capsys.readouterr().err
    assert fake() == []


def test_pack_reads_a_jsonl_file_whatever_the_case_of_its_suffix(tmp_path, fake):
    """results.JSONL was read as one JSON value: with two lines, every run was redone and appended again."""
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0, 1])
    jsonl = tmp_path / "results.JSONL"
    assert pack.main([str(config), "--jsonl", str(jsonl)]) == 0
    assert pack.main([str(config), "--jsonl", str(jsonl)]) == 0
    assert len(fake()) == 2 and len(jsonl.read_text().splitlines()) == 2


def test_merge_reads_the_files_of_a_folder_whatever_the_case_of_their_suffix(tmp_path):
    """A folder holding RESULTS.JSONL was "no result files"; one beside a.json was skipped without a word."""
    folder = tmp_path / "in"
    (folder / "old.json").mkdir(parents=True)  # a folder is not a result file, whatever its name
    (folder / "old.json" / "x.json").write_text(json.dumps(a_record(min_val_loss=3.0)))
    record = a_record()  # once: it is stamped with the time it is made
    (folder / "RESULTS.JSONL").write_text(json.dumps(record) + "\n")
    assert merge.merge([folder], tmp_path / "runs") == (1, 0)
    tree = tmp_path / "runs" / "H2xL1" / "score-1000" / "seed0" / "metrics.json"
    assert json.loads(tree.read_text()) == record


@pytest.mark.parametrize("name,content,message", [
    ("latin1.txt", "café crème\n".encode("latin-1"), "could not be read as text (the file must be UTF-8) "
                                                       "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9"),
    ("bad.jsonl", '{"text": "a"}\n{oops\n', "could not be read as JSON (line 2: Expecting property name"),
    ("table.csv", "id,body\n1,a b c\n", "no 'text' column, and its first, 'id', holds Value('int64'), not text"),
    # the loaders' fallback said "Trailing data", "If using all scalar values, you must pass an index", or
    # 'Instruction "train" corresponds to no data!'
    ("cut.jsonl", '{"text": "a"}\n{"text": "b"', "could not be read as JSON (line 2: Expecting ',' delimiter"),
    ("twice.jsonl", '{"text": "a"}\n{"text": "a", "text": "b"}\n',
     "could not be read as JSON (line 2: the key 'text' is given twice in one object; keep one)"),
    ("rows.json", "[]", "holds no rows of text (a split needs text)"),
    ("header.csv", "text\n", "holds no rows of text (a split needs text)"),
    # a file of null ended the process (a segmentation fault in the loader); of other single values, lines of
    # them or of lists, or with half a surrogate pair, the loaders said "DataFrame constructor not properly
    # called!", "Trailing data at position 5" or "If using all scalar values, you must pass an index"
    ("null.json", "null", "starts with 'null'; expected rows: one JSON object with a 'text' field a line"),
    ("nulls.jsonl", "\n  null\nnull\n", "starts with 'null'; expected rows"),
    ("string.json", '"a b"', "starts with '\"a b\"'; expected rows"),
    ("numbers.jsonl", "5\n6\n", "starts with '5'; expected rows"),
    ("lists.jsonl", '[{"text": "a"}]\n[{"text": "b"}]\n',
     'could not be read as JSON (line 1: [{"text": "a"}] is not a JSON object with a \'text\' field)'),
    ("mixed.jsonl", '{"text": "a"}\n7\n', "could not be read as JSON (line 2: 7 is not a JSON object"),
    ("surrogate.jsonl", '{"text": "a \\ud800 b"}\n',
     "could not be read as JSON (a \\u escape of half a surrogate pair, which is not a character)"),
])
def test_a_data_file_that_cannot_be_read_says_why(name, content, message, tmp_path):
    """The loaders' own message was "An error occurred while generating the dataset"."""
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ValueError) as err:
        run_clm.load_file(str(path), "--train_file")
    assert f"--train_file {path}: {message}" in str(err.value)
    assert "An error occurred while generating the dataset" not in str(err.value)


@pytest.mark.parametrize("second", ["1", "a"])
def test_a_data_file_column_of_a_huge_name_is_named_without_echoing_it_whole(second, tmp_path, caplog):
    """A CSV header of one 200 000-character line: the warning, and the error where the column is no text, held it."""
    path = tmp_path / "table.csv"
    path.write_text("c" * 200_000 + f"\n{second}\n")
    said = []
    try:
        run_clm.load_file(str(path), "--train_file")
    except ValueError as err:  # a column of numbers is no text
        said.append(str(err))
    assert len(said) == (second == "1")
    said.append(caplog.text)
    assert all("'cccc" in text and "... (200002 characters)" in text and len(text) < 2000 for text in said)


def test_a_data_file_read_by_its_first_column_says_so(tmp_path, caplog):
    """A file of other columns, or one separated by ';', trained on its first column (ids and all) without a word."""
    path = tmp_path / "semicolons.csv"
    path.write_text("id;text\n1;the cat\n2;the dog\n")
    assert run_clm.load_file(str(path), "--train_file")["text"] == ["1;the cat", "2;the dog"]
    assert f"--train_file {path}: no 'text' column; its first, 'id;text', is read as the text" in caplog.text


@pytest.mark.parametrize("kind", ["txt", "jsonl", "csv"])
def test_a_byte_order_mark_is_not_text(kind, tmp_path):
    """A .txt file saved with a UTF-8 byte order mark gave its first row three more tokens (the json and csv loaders
    read past it); CRLF line ends read as LF."""
    text = {"txt": "a b\n c\n", "jsonl": '{"text": "a b"}\n{"text": " c"}\n', "csv": 'text\n"a b"\n" c"\n'}[kind]
    plain, marked = tmp_path / f"plain.{kind}", tmp_path / f"marked.{kind}"
    plain.write_text(text)
    marked.write_bytes(codecs.BOM_UTF8 + text.replace("\n", "\r\n").encode())
    read = lambda path: run_clm.load_file(str(path), "--train_file")["text"]  # noqa: E731
    assert read(marked) == read(plain)
    (tmp_path / "mark_only.txt").write_bytes(codecs.BOM_UTF8)
    with pytest.raises(ValueError, match="mark_only.txt is empty: a split needs text"):  # was: SchemaInferenceError
        run_clm.DataArguments(train_file=str(tmp_path / "mark_only.txt"))


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
def test_a_rerun_of_a_finished_run_leaves_it_as_it_is(tmp_path, caplog):
    """Without a checkpoint to resume, it trained the run again and wrote over its metrics.json (on a GPU, with
    other numbers); from the last checkpoint, it wrote over the run's training time with that of a start of 0 steps."""
    first = tiny_run(tmp_path, max_steps=2)
    saved = {p: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert tiny_run(tmp_path, max_steps=2) == first
    assert {p: p.read_bytes() for p in (tmp_path / "out").iterdir()} == saved
    assert "metrics.json: this run is finished, so it is not run again" in caplog.text
    again = tiny_run(tmp_path, max_steps=2, overwrite_output_dir=True)  # runs it afresh, the first run kept aside
    assert again["train_history"] == first["train_history"] and (tmp_path / "out.replaced-1" / "metrics.json").is_file()


@needs_data
def test_a_block_size_past_what_a_model_can_hold_is_named(tmp_path, monkeypatch):
    """From scratch the model gets --block_size positions: 10^22 of them failed inside torch, naming no flag."""
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    with pytest.raises(ValueError, match=r"--block_size 10000000000000000000000: a model of that many positions "
                                         r"cannot be built here \(TypeError: "):
        tiny_run(tmp_path, block_size=10**22)


@needs_data
def test_a_rerun_after_a_kill_before_any_checkpoint_writes_its_own_diagnostics(tmp_path):
    """The callback appended the new run's records to those of the stopped start: every step twice, and the
    plot drawn over both. SpanAttentionCallback moves them aside."""
    out = tmp_path / "out"
    out.mkdir()
    stale = "".join(json.dumps({**DIAGNOSTIC, "step": step}) + "\n" for step in (1, 2, 3)) + '{"step": 4, "la'
    (out / "span_diagnostics.jsonl").write_text(stale)
    with pytest.warns(UserWarning, match="holds the diagnostics of an earlier run; this run starts at step 0, so "
                                         "they are moved to .*span_diagnostics.jsonl.replaced-1"):
        tiny_run(tmp_path, span="score:1000", span_diagnostics_every=1, max_steps=2)
    steps = [json.loads(line)["step"] for line in (out / "span_diagnostics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # one record per step and layer, of this run only
    assert (out / "span_diagnostics.jsonl.replaced-1").read_text() == stale  # kept


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
    ({"spans": ["score:1000", "score:12"]},
     "sweep config: spans: label='score:12': alphas=(1.0, 2.0): expected 4 values"),  # no file
    ({"args": {**TINY, "config_overrides": {"n_embd": 64}}},  # was: "--config_overrides={'n_embd': 64}"
     """--config_overrides '{"n_embd": 64}': expected comma-separated key=value pairs"""),
])
def test_a_bad_sweep_file_fails_before_any_run(change, message, tmp_path):
    config = {"output_dir": str(tmp_path / "runs"), "args": TINY, "spans": ["score:1000"], "seeds": [0],
              "shapes": [{"n_head": 2, "n_layer": 1}], **change}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as err:  # one line, as pack.py and merge.py: no traceback
        sweep.main([str(tmp_path / "s.yaml"), "--launcher", "false"])
    assert str(err.value).startswith("sweep: ") and message in str(err.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("set_by", ["sweep file", "--set"])
def test_a_true_or_false_where_a_number_goes_is_blamed_on_yaml_only_where_yaml_read_it(set_by, tmp_path, capsys):
    """pack.py's --set num_train_epochs=True got "YAML reads a bare yes/no/on/off as true/false: quote it", which no
    command line needs."""
    args = {**TINY, "num_train_epochs": True} if set_by == "sweep file" else TINY
    config = write_sweep(tmp_path / "sweep.yaml", ["score:1000"], [0], args)
    extra = ["--set", "num_train_epochs=True"] if set_by == "--set" else []
    with pytest.raises(SystemExit) as err:
        pack.main([str(config), "--results", str(tmp_path / "r"), *extra])
    assert "argument --num_train_epochs/--num-train-epochs: invalid float value: 'True'" in str(err.value)
    hint = "(YAML reads a bare yes/no/on/off as true/false: quote it, as 'no')"
    assert str(err.value).endswith(hint if set_by == "sweep file" else "(given by --set 'num_train_epochs=True')")
    assert not (tmp_path / "r").exists()


BIG = "x" * 10**5


@pytest.mark.parametrize("change,message", [
    ({"seeds": ["a"] * 1000}, "seeds=['a', 'a',"),
    ({"output_dir": [BIG]}, "output_dir=['xxx"),
    ({"args": BIG}, "args='xxx"),
    ({"shapes": BIG}, "shapes='xxx"),
    ({"shapes": [{"n_head": BIG}]}, "shapes: {'n_head': 'xxx"),
    ({"unknown" + BIG: 1}, "unknown key 'unknownxxx"),
    ({"args": {**TINY, "learning_rate": "9" * 10**4 + "x"}}, "invalid float value: '999"),  # argparse's message
])
def test_a_sweep_file_is_named_without_echoing_a_huge_value_whole(change, message, tmp_path):
    config = {"output_dir": str(tmp_path / "runs"), "args": TINY, "spans": ["score:1000"], "seeds": [0],
              "shapes": [{"n_head": 2, "n_layer": 1}], **change}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as err:
        pack.main([str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r")])
    assert message in str(err.value) and " characters)" in str(err.value) and len(str(err.value)) < 1000


def test_a_pack_file_document_is_named_without_echoing_a_huge_value_whole(tmp_path):
    config = write_sweep(tmp_path / "s.yaml", ["score:1000"], [0])
    config.write_text(config.read_text() + "---\nargs: " + BIG + "\n")
    with pytest.raises(SystemExit, match="document 2: args='xxx") as err:
        pack.main([str(config), "--results", str(tmp_path / "r")])
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("change,message", [
    ({"output_dir": "runs\0x"}, r"output_dir='runs\x00x': expected a folder path"),  # was: a ValueError traceback
    ({"args": {"run_name": "a\0b"}}, "args: 'run_name' holds a NUL character, which no command line can pass"),
    # argparse took the last of the two, without a word
    ({"args": {"num_train_epochs": 3, "num-train-epochs": 5}},
     "args gives 'num-train-epochs' and 'num_train_epochs', one run_clm.py argument; keep one"),  # sorted by safe_dump
    ({"args": {"output-dir": "elsewhere"}}, "args sets output_dir, which the sweep gives each run"),
])
def test_a_sweep_argument_no_command_line_can_pass_as_written_is_named(change, message, tmp_path, fake):
    config = {"output_dir": str(tmp_path / "runs"), "spans": ["score:1000"], "seeds": [0], **change}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as err:
        pack.main([str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r")])
    assert message in str(err.value) and fake() == []


def test_a_set_argument_replaces_the_sweep_files_whatever_its_dashes(tmp_path, fake, capsys):
    """--set num-train-epochs=2 beside the file's num_train_epochs: 3 passed both, the record holding both."""
    config = write_sweep(tmp_path / "s.yaml", ["score:1000"], [0], {"num_train_epochs": 3})
    assert pack.main([str(config), "--results", str(tmp_path / "r"), "--set", "num-train-epochs=2"]) == 0
    args = json.loads((tmp_path / "r" / "H2xL1__score-1000__seed0.json").read_text())["config"]["args"]
    assert args["num_train_epochs"] == "2" and "num-train-epochs" not in args
    with pytest.raises(SystemExit):
        pack.main([str(config), "--results", str(tmp_path / "r"), "--set", "output-dir=x"])
    assert "--set 'output-dir=x': expected KEY=VALUE with a run_clm.py argument other" in capsys.readouterr().err


def test_pack_does_not_count_a_tree_metrics_json_of_another_run_as_this_ones(tmp_path, fake, capsys):
    """A metrics.json copied by hand into another run's folder: that run was skipped for ever, the report had the
    other twice or once."""
    config = write_sweep(tmp_path / "s.yaml", ["score:1000", "score:1100"], [0])
    assert pack.main([str(config), "--results", str(tmp_path / "r"), "--max_runs", "1"]) == 0
    record = json.loads((tmp_path / "r" / "H2xL1__score-1000__seed0.json").read_text())
    moved = tmp_path / "tree" / "H2xL1" / "score-1100" / "seed0" / "metrics.json"
    moved.parent.mkdir(parents=True)
    moved.write_text(json.dumps(record))
    assert pack.main([str(config), "--results", str(tmp_path / "r")]) == 0
    assert fake() == [("score:1000", 0), ("score:1100", 0)]
    assert f"{moved}: not a finished run's result (it holds span 'score:1000' with seed 0, not score:1100 with seed " \
        "0); the run is redone" in capsys.readouterr().out


def test_sweep_args_are_given_as_run_clm_py_reads_them():
    """A null unsets an argument (a later document of a pack file may unset one an earlier set): it was passed as
    --max_train_tokens=None. Lists and mappings were passed in Python's notation."""
    config = {"output_dir": "runs", "spans": ["score:1000"], "seeds": [0],
              "args": {**TINY, "max_train_tokens": None, "span_layers": [0], "report_to": ["none"],
                       "span_schedule": [{"at": 0, "span": "score:1000"}]}}
    [(_, run_args)] = sweep.plan(config)
    assert not any(a.startswith("--max_train_tokens") for a in run_args)
    assert {"--span_layers=0", "--report_to=none", '--span_schedule=[{"at": 0, "span": "score:1000"}]'} <= set(run_args)


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


@pytest.mark.parametrize("kind,what", [("folder", "not a file: a folder"), ("pipe", "not a file (a pipe or a device?)"),
                                       ("loop", "a link to nothing (or to itself)")])
@pytest.mark.parametrize("name,read", [
    ("s.yaml", lambda path: pack.main([str(path), "--results", str(path.parent / "r")])),
    ("s.yaml", lambda path: sweep.main([str(path), "--dry_run"])),
    ("run.yaml", lambda path: run_clm.parse_args([str(path)])),
    ("train.txt", lambda path: run_clm.parse_args(["--train_file", str(path), "--output_dir", str(path.parent / "o")])),
    ("at.yaml", lambda path: run_clm.main(["--span_schedule", str(path), "--output_dir", str(path.parent / "o")])),
], ids=["pack", "sweep", "run_clm-config", "run_clm-train_file", "run_clm-span_schedule"])
def test_a_file_argument_that_is_a_folder_a_pipe_or_a_link_loop_is_named_as_such(name, read, kind, what, tmp_path):
    """A folder or a pipe given as the sweep file, run_clm.py's config, data or schedule file was 'no such file'."""
    path = tmp_path / name
    {"folder": path.mkdir, "pipe": lambda: os.mkfifo(path), "loop": lambda: path.symlink_to(name)}[kind]()
    with pytest.raises((SystemExit, ValueError)) as err:
        read(path)
    assert f"{path}: {what}" in str(err.value)


@pytest.mark.parametrize("kind,what", [
    ("yaml", "not valid JSON (JSONDecodeError: Expecting value: line 1 column 1"), ("folder", "not a file: a folder"),
    ("pipe", "not a file (a pipe or a device?)"), ("list", "a JSON list; expected a JSON object of DeepSpeed settings"),
    ("twice", "not valid JSON (KeyGivenTwice: the key 'zero_optimization' is given twice")])
@pytest.mark.parametrize("given", ["flag", "config file"])
def test_a_deepspeed_config_that_is_no_json_file_is_named(kind, what, given, tmp_path):
    """--deepspeed naming a YAML file or a folder gave TrainingArguments' error, which names no file ("Expecting
    value: line 1 column 1 (char 0)", IsADirectoryError), and a pipe hung reading it. A JSON list failed deep inside
    ("'list' object has no attribute 'get'"), and of a key given twice the first was dropped without a word."""
    path = tmp_path / "ds_config"
    {"yaml": lambda: path.write_text("zero_optimization:\n  stage: 3\n"), "folder": path.mkdir,
     "pipe": lambda: os.mkfifo(path), "list": lambda: path.write_text('[{"zero_optimization": {"stage": 3}}]'),
     "twice": lambda: path.write_text('{"zero_optimization": {"stage": 3}, "zero_optimization": {"stage": 1}}')}[kind]()
    run = tmp_path / "run.yaml"
    run.write_text(f"output_dir: {tmp_path / 'o'}\ndeepspeed: {path}\n")
    argv = [str(run)] if given == "config file" else ["--output_dir", str(tmp_path / "o"), "--deepspeed", str(path)]
    with pytest.raises(ValueError) as err:
        run_clm.parse_args(argv)
    where = f"{run}: deepspeed=" if given == "config file" else "--deepspeed "
    assert f"{where}{path}: {what}" in str(err.value) and "DeepSpeed" in str(err.value)


def test_a_later_sweep_document_replaces_an_argument_however_the_earlier_one_spelled_it(tmp_path):
    """Document 1's num-train-epochs and document 2's num_train_epochs: "args gives 'num-train-epochs' and
    'num_train_epochs', one run_clm.py argument; keep one", though each document gave one."""
    path = tmp_path / "sweep.yaml"
    path.write_text("output_dir: out\nargs: {num-train-epochs: 3}\nspans: [score:1000]\nseeds: [0]\n---\n"
                    "args: {num_train_epochs: 5}\nspans: [score:1100]\n")
    runs = pack.plan_runs(pack.load_sweeps(path), {}, check=False)
    assert [(r.args.get("num-train-epochs"), r.args.get("num_train_epochs")) for r in runs] == [("3", None),
                                                                                               (None, "5")]
    path.write_text("output_dir: out\nargs: {num-train-epochs: 3, num_train_epochs: 5}\nspans: [score:1000]\n"
                    "seeds: [0]\n")
    with pytest.raises(ValueError, match="args gives 'num-train-epochs' and 'num_train_epochs'"):  # in one document
        pack.plan_runs(pack.load_sweeps(path), {}, check=False)


def test_run_clm_keeps_a_flag_spelled_with_dashes_over_the_papers_default(tmp_path):
    """--num-train-epochs 5 (HfArgumentParser's alias of --num_train_epochs) trained 50 epochs: the paper's default,
    added after it as --num_train_epochs 50, won; --do-eval false evaluated all the same."""
    *_, training, _, _ = run_clm.parse_args(["--num-train-epochs", "5", "--learning-rate=0.1", "--do-eval", "false",
                                             "--per-device-train-batch-size", "4", "--output_dir", str(tmp_path)])
    assert (training.num_train_epochs, training.learning_rate, training.do_eval, training.eval_strategy.value,
            training.per_device_train_batch_size) == (5, 0.1, False, "no", 4)


def test_a_sweep_shape_replaces_an_argument_of_args_however_either_spells_it(tmp_path):
    """args {num_train_epochs: 3} and a shape {num-train-epochs: 5}: both flags passed, and pack.py's records held
    both; the shape's (its folder's name says 5) won only by its place on the command line."""
    config = {"output_dir": str(tmp_path), "args": {"num_train_epochs": 3, "learning_rate": 0.001}, "spans":
              ["score:1000"], "seeds": [0], "shapes": [{"n_head": 2, "n_layer": 1, "num-train-epochs": 5}]}
    (folder, run_args), = sweep.plan(config, check=False)
    assert folder.parts[-3] == "H2xL1_num-train-epochs=5"
    assert [a for a in run_args if a.startswith(("--num", "--learning"))] == ["--learning_rate=0.001",
                                                                         "--num-train-epochs=5"]


def test_sweep_prunes_a_finished_run_but_leaves_links_put_into_its_folder(tmp_path):
    """A link named checkpoint-N to a folder elsewhere stopped the sweep after its run (rmtree refuses a link)."""
    run, mine = tmp_path / "run", tmp_path / "mine"
    (run / "checkpoint-4").mkdir(parents=True)
    (mine / "checkpoint").mkdir(parents=True)
    (mine / "checkpoint" / "model.safetensors").write_text("kept")
    (mine / "w.bin").write_text("kept")
    (run / "checkpoint-9").symlink_to(mine / "checkpoint")
    (run / "old.bin").symlink_to(mine / "w.bin")
    for name in ("model.safetensors", "metrics.json", "config.json"):
        (run / name).write_text("{}")
    sweep.prune(run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-9", "config.json", "metrics.json", "old.bin"]
    assert (mine / "checkpoint" / "model.safetensors").read_text() == (mine / "w.bin").read_text() == "kept"


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
    with pytest.raises(SystemExit) as err:
        sweep.main([str(path), "--dry_run"])
    assert f"sweep: {path}: " in str(err.value) and message.format(path=path) in str(err.value)


def test_a_sweep_log_that_finds_no_room_is_named_and_its_run_stopped(tmp_path, capsys):
    """A full disk (a file-size limit here) under the sweep's tree: the bare "[Errno 28] No space left on device"."""
    import resource

    log = tmp_path / "train.log"
    command = [sys.executable, "-c", "import time; print('x' * 5000, flush=True); time.sleep(5)"]
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))  # Python ignores SIGXFSZ: writes past it fail
    try:
        with pytest.raises(SystemExit) as err:
            sweep.run_and_log(command, log)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value) == (f"sweep: {log}: cannot be written (File too large); make room there and run the sweep "
                              "again")


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
    ("run_name: [a, b]\n", "{file}: run_name=['a', 'b']: expected text, got list"),  # was: run 'a,b'
    ("data_dir: [a, b]\n", "{file}: data_dir=['a', 'b']: expected text, got list"),
    ("save_strategy: steps\nsave_steps: .inf\n", "{file}: save_steps=inf: past the integers the Trainer counts steps"),
])
def test_a_config_file_value_of_the_wrong_type_is_named(text, message, tmp_path, monkeypatch):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    file = tmp_path / "run.yaml"
    file.write_text(text + f"output_dir: {tmp_path / 'out'}\n")
    with pytest.raises(ValueError) as err:
        run_clm.main([str(file)])
    assert message.replace("{file}", str(file)) in str(err.value)


@pytest.mark.parametrize("key,value,message", [
    ("learning_rate", "x" * 10**5, "learning_rate='xxx"),
    ("do_eval", "x" * 10**5, "do_eval='xxx"),
    ("run_name", ["x" * 10**5], "run_name=['xxx"),
    ("seed", "9" * 5000, "seed='999"),
    ("span_layers", "1," * 10**5, "--span_layers '1,1,"),
    ("lr_scheduler_type", "x" * 10**5, "{file}: xxx"),  # Transformers' message
    ("x" * 10**5, 1, "Some keys are not used by the HfArgumentParser: ['xxx"),  # HfArgumentParser's
])
def test_a_config_file_value_is_named_without_echoing_it_whole(key, value, message, tmp_path, monkeypatch):
    monkeypatch.setattr(run_clm, "load_texts", lambda *a: pytest.fail("data was read"))
    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump({key: value, "output_dir": str(tmp_path / "out")}))
    with pytest.raises(ValueError) as err:
        run_clm.main([str(file)])
    assert message.replace("{file}", str(file)) in str(err.value) and " characters)" in str(err.value)
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("world", ["abc", "", "2.0"])
def test_a_world_size_that_is_not_a_count_is_named(world, tmp_path, monkeypatch):
    """int() said "invalid literal for int() with base 10: 'abc'", naming neither the variable nor what it holds."""
    monkeypatch.setenv("WORLD_SIZE", world)
    error = run_clm.argument_error(["--output_dir", str(tmp_path / "o"), "--tokenizer_name", str(tmp_path)])
    assert error.startswith(f"the environment variable WORLD_SIZE={world!r}: expected the number of processes")


def test_a_config_file_is_read_whatever_the_case_of_its_suffix_and_only_alone(tmp_path):
    """run.YAML and run.yaml --seed 3 were read as the command line: "Some specified arguments are not used by the
    HfArgumentParser: ['run.YAML']"."""
    file = tmp_path / "run.YAML"
    file.write_text(f"span: score:1000\noutput_dir: {tmp_path / 'out'}\n")
    assert run_clm.parse_args([str(file)])[2].span == "score:1000"
    with pytest.raises(ValueError, match=f"{file}: a config file is read alone; put --seed and the rest in it"):
        run_clm.parse_args([str(file), "--seed", "3"])


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


def test_span_arguments_read_by_hf_argument_parser_alone_are_read_as_the_command_line_reads_them(tmp_path):
    """HfArgumentParser's parse_dict, parse_json_file and parse_yaml_file pass values as the file has them: a list
    of layers or of keyframes failed deep inside ('list' object has no attribute 'split'), and "false" turned
    diagnostics per head on."""
    from transformers import HfArgumentParser

    values = {"span": "score:1000", "span_layers": [0, 2], "span_diagnostics_every": "5",
              "span_diagnostics_per_head": "false", "span_schedule": [{"at": 0, "span": "score:1100"}]}
    (tmp_path / "span.json").write_text(json.dumps(values))
    (tmp_path / "span.yaml").write_text(yaml.safe_dump(values))
    parser = HfArgumentParser(run_clm.SpanArguments)
    for span, in (parser.parse_dict(values), parser.parse_json_file(tmp_path / "span.json"),
                  parser.parse_yaml_file(tmp_path / "span.yaml")):
        assert span.config().layers == (0, 2)
        callback = span.callback()
        assert (callback.diagnostics_every, callback.diagnostics_per_head) == (5, False)
        assert [k.span for k in callback.schedule.keyframes] == ["score:1100"]
    with pytest.raises(ValueError, match=r"span_diagnostics_every=2.5: expected an integer"):
        parser.parse_dict({"span_diagnostics_every": 2.5})


def test_span_arguments_in_a_trl_parser_config_file_are_read_as_the_command_line_reads_them(tmp_path):
    """TRL's TrlParser sets a --config file's values as argparse defaults, which argparse does not convert: a list of
    layers failed deep inside ('list' object has no attribute 'split')."""
    trl = pytest.importorskip("trl")
    (tmp_path / "run.yaml").write_text("span: score:1000\nspan_layers: [0, 2]\nspan_diagnostics_every: 2\n"
                                       "span_diagnostics_per_head: 'false'\n")
    span, = trl.TrlParser(run_clm.SpanArguments).parse_args_and_config(["--config", str(tmp_path / "run.yaml")])
    assert span.config().layers == (0, 2) and span.callback().diagnostics_per_head is False


def test_config_file_values_of_list_and_mapping_arguments_are_taken(tmp_path):
    """report_to takes a list and fsdp_config a mapping, as Transformers' own config files write them: both were
    refused as "expected text". A YAML merge key (<<: {...}) was "could not determine a constructor"."""
    file = tmp_path / "run.yaml"
    common = f"tokenizer_name: {DATA / 'gpt2-tokenizer'}\noutput_dir: {tmp_path / 'out'}\n"
    file.write_text(common + "report_to: [tensorboard]\nfsdp_config: {fsdp_version: 2}\n"
                             "<<: {learning_rate: 0.002, span: score:1100}\nspan: score:1000\n")
    model, data, span, training, *_ = run_clm.parse_args([str(file)])
    fsdp_version = training.fsdp_config.get("fsdp_version", training.fsdp_config.get("version"))  # Transformers 4: cut
    assert training.report_to == ["tensorboard"] and fsdp_version == 2
    assert training.learning_rate == 0.002 and span.span == "score:1000"  # the mapping's own key wins, as in YAML
    file.write_text(common + "span_schedule: []\n")
    with pytest.raises(ValueError, match="schedule: needs at least one keyframe"):  # was: "--span_schedule ''"
        run_clm.parse_args([str(file)])


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
     "--num_train_epochs 0.0: expected a number > 0 and < 2^63 (or --max_steps N)"),
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
    (lambda t: run_clm.main(["--train_file", "", "--output_dir", str(t / "o")]),  # was: "--validation_file without"
     "--train_file is empty: give a path, or leave the flag out"),
    (lambda t: run_clm.main(["--train_file", str(t / "file.txt"), "--validation_file", "", "--output_dir",
                             str(t / "o")]), "--validation_file is empty"),  # was: train rows held out, without a word
    (lambda t: run_clm.main(["--data_dir", " ", "--output_dir", str(t / "o")]), "--data_dir is empty"),
    # the optimizer and the Trainer: NaN taken without a word (weights or clipping gone), others refused late
    (lambda t: run_clm.main(["--weight_decay", "nan", "--output_dir", str(t / "o")]), "--weight_decay nan: expected"),
    (lambda t: run_clm.main(["--max_grad_norm", "nan", "--output_dir", str(t / "o")]),
     "--max_grad_norm nan: expected a number"),
    (lambda t: run_clm.main(["--label_smoothing_factor", "nan", "--output_dir", str(t / "o")]),
     "--label_smoothing_factor nan: expected a number"),
    (lambda t: run_clm.main(["--weight_decay", "-0.1", "--output_dir", str(t / "o")]),
     "--weight_decay -0.1: expected a finite number >= 0"),
    (lambda t: run_clm.main(["--adam_beta1", "2", "--output_dir", str(t / "o")]),
     "--adam_beta1 2.0: expected a number from 0 to below 1"),
    (lambda t: run_clm.main(["--label_smoothing_factor", "2", "--output_dir", str(t / "o")]),  # targets weighted -1
     "--label_smoothing_factor 2.0: expected a number from 0 to below 1"),
    (lambda t: run_clm.main(["--eval_accumulation_steps", "0", "--output_dir", str(t / "o")]),  # ZeroDivisionError
     "--eval_accumulation_steps 0: allowed values are >= 1"),  # in the first evaluation, after an epoch of training
    (lambda t: run_clm.main(["--do_eval=maybe", "--output_dir", str(t / "o")]),  # was: "Truthy value expected: got
     "--do_eval maybe: expected true or false"),  # maybe", naming no flag
    (lambda t: run_clm.main(["--num_train_epochs", "1e308", "--output_dir", str(t / "o")]),  # an OverflowError later
     "--num_train_epochs 1e+308: expected a number > 0 and < 2^63 (or --max_steps N)"),
    (lambda t: run_clm.main(["--save_strategy", "steps", "--save_steps", "inf", "--output_dir", str(t / "o")]),
     "--save_steps inf: past the integers the Trainer counts steps in"),  # was: a bare OverflowError
    # an empty path (an unset shell variable) read as the current folder: report.md written over there, results
    # written there, a traceback, or the sweep file's own data taken instead
    (lambda t: merge.main([str(t / "r.jsonl"), "--out", ""]), "argument --out: is empty: give a path"),
    (lambda t: report.main([str(t), "--out", ""]), "argument --out: is empty: give a path"),
    (lambda t: report.main([""]), "argument runs_dir: is empty: give a path"),
    (lambda t: pack.main([str(t / "s.yaml"), "--results", ""]), "argument --results: is empty: give a path"),
    (lambda t: pack.main([str(t / "s.yaml"), "--jsonl", str(t / "r.jsonl"), "--tmp_dir", ""]),
     "argument --tmp_dir: is empty: give a path"),
    (lambda t: sweep.main([str(t / "s.yaml"), "--train_file", ""]), "argument --train_file: is empty: give a path"),
    (lambda t: sweep.main([str(t / "s.yaml"), "--tokenizer_name", " "]), "argument --tokenizer_name: is empty"),
    # a results file merge.py cannot read as lines (or the sweep file itself, which got results appended)
    (lambda t: pack.main([str(t / "s.yaml"), "--jsonl", str(t / "s.yaml")]),
     "--jsonl {tmp}/s.yaml: expected the path of a .jsonl file (JSON Lines, one result a line)"),
    (lambda t: sweep.main([str(t / "s.yaml"), "--launcher", "python '"]),  # was: "ValueError: No closing quotation"
     "--launcher \"python '\": No closing quotation"),
])
def test_unusual_command_line_values_are_named(call, message, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "file.txt").write_text("x")
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
    (json.dumps({**DIAGNOSTIC, "layer": "1"}), "{file}:3: left out: layer='1': expected an integer from 0 to 2^53"),
    (json.dumps({**DIAGNOSTIC, "dq_share": "0.7"}), "{file}:3: left out: dq_share='0.7': expected a list of numbers"),
    (json.dumps({k: v for k, v in DIAGNOSTIC.items() if k != "cos_q"}), "{file}:3: left out: cos_q=None: expected"),
    (json.dumps({**DIAGNOSTIC, "dk_share": []}), "{file}:3: left out: dk_share=[]: expected a list of numbers"),
    (json.dumps({**DIAGNOSTIC, "step": 10**30}),  # was: a TypeError inside matplotlib, for the whole plot
     "{file}:3: left out: step=1000000000000000000000000000000: expected an integer from 0 to 2^53"),
    (json.dumps(DIAGNOSTIC)[:-1] + ', "layer": 1}',
     "{file}:3: left out: the key 'layer' is given twice in one object; keep one"),
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
    ("figure.txt", "-o {tmp}/figure.txt: expected the path of the figure, ending in .png (or one of .avif,"),  # was:
])  # matplotlib's "Format 'txt' is not supported", after reading the records
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


def test_plot_diagnostics_reads_past_a_byte_order_mark(tmp_path, capsys):
    """A file saved by an editor that writes one: its first record was left out as "not a whole JSON record"."""
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    file.write_bytes(codecs.BOM_UTF8 + (json.dumps(DIAGNOSTIC) + "\r\n").encode())
    assert [r["step"] for r in plot_diagnostics.read_records(file)] == [DIAGNOSTIC["step"]]
    assert capsys.readouterr().err == ""


def test_plot_diagnostics_that_finds_no_room_names_the_figure(tmp_path):
    """A full disk (a file-size limit here): matplotlib's bare "[Errno 28] No space left on device"."""
    import resource

    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    file.write_text(json.dumps(DIAGNOSTIC) + "\n")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, limits[1]))  # Python ignores SIGXFSZ: writes past it fail
    try:
        with pytest.raises(SystemExit) as err:
            plot_diagnostics.main([str(file)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert str(err.value) == (f"-o {tmp_path / 'span_diagnostics.png'}: cannot be written (File too large); make "
                              "room there, or give another -o")


def test_plot_diagnostics_draws_the_records_of_a_run_stopped_while_writing(tmp_path, capsys):
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    file.write_text(json.dumps(DIAGNOSTIC) + "\n" + json.dumps({**DIAGNOSTIC, "step": 4})[:30])
    plot_diagnostics.main([str(file)])
    assert f"{file}:2: left out" in capsys.readouterr().err
    assert (tmp_path / "span_diagnostics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_diagnostics_wraps_a_deep_models_layers_into_rows_and_draws_the_layers_asked_for(tmp_path, capsys):
    """Nine layers were one row of panels 3456 pixels wide (a 64-layer model's, 24576, took a minute and more to
    draw): they wrap into rows of --columns layers, and --layers draws only those named."""
    import matplotlib.image
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    file.write_text("".join(json.dumps({**DIAGNOSTIC, "layer": layer, "step": step}) + "\n"
                            for layer in range(9) for step in (2, 4)))
    sizes = {}
    for name, argv in {"all": [], "three": ["--layers", "3,5,7", "--columns", "2"]}.items():
        plot_diagnostics.main([str(file), "-o", str(tmp_path / f"{name}.png"), *argv])
        sizes[name] = matplotlib.image.imread(tmp_path / f"{name}.png").shape[:2]
    panel_width, panel_height = 3.2 * 120, 2.75 * 120
    assert sizes["all"][1] == 8 * panel_width and sizes["all"][0] == 4 * panel_height + 60
    # two columns hold the legend's five entries in two rows (in one it ran past the figure's edges)
    assert sizes["three"][1] == 2 * panel_width and sizes["three"][0] == 4 * panel_height + 60 + 30
    for argv, message in [(["--layers", "3,12"], "--layers: {file} has no records of layer 12; it has layers 0, 1,"),
                          (["--layers", "3,x"], "argument --layers: '3,x': expected comma-separated layer indices"),
                          (["--layers", "-1"], "argument --layers: '-1': expected comma-separated layer indices (0 or "
                                               "more)"),
                          (["--columns", "0"], "argument --columns: '0': expected a whole number of at least 1")]:
        with pytest.raises(SystemExit):
            plot_diagnostics.main([str(file), *argv])
        assert message.format(file=file) in capsys.readouterr().err


def test_plot_diagnostics_names_the_parts_of_every_rule_drawn(tmp_path):
    """A layer trained with simple:10 (parts ∥, ⊥), then score:1000 (orders 0-3), beside one trained with score:
    its ∥ share was drawn and named as order 0, and the legend was that of the first panel alone."""
    import matplotlib.colors
    import plot_diagnostics

    simple = {**DIAGNOSTIC, "span": "simple:10", "dq_share": [0.6, 0.4], "dk_share": [0.5, 0.5]}
    records = [{**simple, "step": 2}, {**DIAGNOSTIC, "step": 4}, {**DIAGNOSTIC, "layer": 1, "step": 2},
               {**DIAGNOSTIC, "layer": 1, "step": 4}]
    fig = plot_diagnostics.figure(records)
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend == ["∥ (Π_K)", "⊥ (Π_K^⊥)", "order 0", "order 1", "order 2", "order 3", "cos(applied, standard)"]
    colours = {}
    for ax in fig.axes:
        for part in ax.collections:
            colour = matplotlib.colors.to_hex(part.get_facecolor()[0])
            assert colours.setdefault(part.get_label(), colour) == colour, part.get_label()  # one colour per part
    assert len(set(colours.values())) == 6
    layer0_dq = fig.axes[0]
    drawn = {part.get_label(): part.get_paths()[0].vertices[:, 0] for part in layer0_dq.collections}
    assert set(drawn["∥ (Π_K)"]) == {2} and set(drawn["order 0"]) == {4}  # each at the steps of its own rule
    assert layer0_dq.get_title() == "layer 0: dq\nsimple:10 → score:1000"  # was the last rule alone


def test_plot_diagnostics_titles_stay_within_their_panels():
    """A layer that ended on the standard rule after a schedule (`score:1111 → … → standard:QKV111`) had its panel's
    title run into the next panel's."""
    import plot_diagnostics

    records = [{**DIAGNOSTIC, "layer": layer, "step": step, "span": span} for layer in (0, 1)
               for step, span in ((1, "score:1111"), (2, "score:1000"), (3, "standard:QKV111"))]
    fig = plot_diagnostics.figure(records)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if ax.get_title():
            assert ax.title.get_window_extent(renderer).width <= ax.get_window_extent(renderer).width, ax.get_title()


def test_plot_diagnostics_draws_a_step_written_twice_from_its_last_record(tmp_path, capsys):
    """Steps 1-4 then 3-4 again (a run resumed from step 2 into a file not cut there): both records of a step were
    drawn at one x, the line going back; the later one is drawn, and the repeat is said."""
    import plot_diagnostics

    file = tmp_path / "span_diagnostics.jsonl"
    rows = [{**DIAGNOSTIC, "step": step, "cos_q": step / 10} for step in (1, 2, 3, 4)]
    rows += [{**DIAGNOSTIC, "step": step, "cos_q": -step / 10} for step in (3, 4)]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = plot_diagnostics.read_records(file)
    assert [(r["step"], r["cos_q"]) for r in records] == [(1, 0.1), (2, 0.2), (3, -0.3), (4, -0.4)]
    assert "steps 3, 4 are written more than once for a layer" in capsys.readouterr().err


def test_plot_diagnostics_draws_each_tower_of_a_composite_model_apart(tmp_path):
    """Layer 0 of an encoder and of a decoder are two layers: a panel each, named by its tower."""
    import plot_diagnostics

    records = [{**DIAGNOSTIC, "tower": tower, "step": step} for tower in ("encoder.layer", "decoder.layers")
               for step in (2, 4)]
    fig = plot_diagnostics.figure(records)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["decoder.layers.0: dq\nscore:1000", "encoder.layer.0: dq\nscore:1000",
                      "decoder.layers.0: dk\nscore:1000", "encoder.layer.0: dk\nscore:1000"]
    for ax in fig.axes[:4]:
        steps = [x for part in ax.collections for x in part.get_paths()[0].vertices[:, 0]]
        assert sorted(set(steps)) == [2, 4]


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
    (["--accum", str(2**64 + 128)], f"--accum {2**64 + 128} must divide 128"),  # was: read as 128 (wrapped), on
    (["--budget", "-1"], "--budget -1: expected a number of seconds >= 0"),  # was: pack.py's, after the installs
    (["--budget", "nan"], "--budget nan: expected a number of seconds >= 0"),
    (["--max_runs", "1.5"], "--max_runs 1.5: expected an integer >= 0"),
    (["--max_runs", "2", "--max_runs", "-1"], "--max_runs -1: expected an integer >= 0"),
    (["--max_runs", ""], "--max_runs empty: expected an integer >= 0"),  # was: no limit
    (["--config", "no such.yaml"], "--config no such.yaml: no such file"),
])
def test_gpu_sweep_script_names_a_bad_option_before_doing_anything(argv, message, tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_sweep.sh"), *argv], capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path / "out")})
    assert result.returncode == 2 and f"gpu_sweep.sh: {message}" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("call", [
    lambda t, name: pack.main([str(t / "s.yaml"), "--results", str(t / name)]),
    lambda t, name: pack.main([str(t / "s.yaml"), "--jsonl", str(t / f"{name}.jsonl")]),
    lambda t, name: pack.main([str(t / "s.yaml"), "--results", str(t / "r"), "--tmp_dir", str(t / name / "x")]),
    lambda t, name: merge.main([str(t / "s.yaml"), "--out", str(t / name)]),
    lambda t, name: run_clm.main(["--output_dir", str(t / name), "--data_dir", TINY["data_dir"],
                                  "--train_file", TINY["train_file"], "--tokenizer_name", TINY["tokenizer_name"]]),
], ids=["pack-results", "pack-jsonl", "pack-tmp_dir", "merge-out", "run_clm-output_dir"])
def test_a_name_too_long_for_a_lock_beside_it_is_named_with_its_argument(call, tmp_path, capsys):
    """A folder name of 252 bytes: "OSError: File name too long" tracebacks (from the lock <name>.lock), after the
    sweep file was read."""
    write_sweep(tmp_path / "s.yaml", ["score:1000"], [0])
    if "merge" in str(call.__code__.co_names):
        (tmp_path / "s.yaml").write_text(json.dumps(a_record()))
    with pytest.raises(SystemExit) as err:
        call(tmp_path, "o" * (256 if "tmp_dir" in str(call.__code__.co_consts) else 252))
    said = str(err.value) + capsys.readouterr().err
    assert re.search(r"(--results|--jsonl|--out|--output_dir) \S+ \(\d+ characters\): a name of 25[28] bytes in it; "
                     r"allowed are 240 \(a lock, <name>.lock", said) or "--tmp_dir" in said and \
        re.search(r"--tmp_dir \S+ \(\d+ characters\): File name too long", said), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


def test_ci_passes_its_arguments_on_to_the_test_script(tmp_path):
    """`bash .ci/run -m slow` ran the default suite without a word."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts" / "test.sh").write_text('printf "%s|" "$@"\n')
    result = subprocess.run(["bash", str(tmp_path / ".ci" / "run"), "-m", "slow", "a b.py"], capture_output=True,
                            text=True, cwd="/")
    assert result.returncode == 0 and result.stdout == "-m|slow|a b.py|"


def test_gpu_check_script_runs_one_part_and_names_more(tmp_path):
    """`gpu_check.sh figures tests` ran the figures alone without a word."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "figures", "tests"], capture_output=True,
                            text=True, env={**os.environ, "OUT": str(tmp_path / "out")})
    assert result.returncode == 2 and "gpu_check.sh: one part at a time, got 2 (figures tests; allowed: all, " \
        "figures, tests)" in result.stderr
    assert not (tmp_path / "out").exists()


FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$FAKE_LOG"
case "$*" in *__version__*) [ "${@: -1}" = "$FAKE_TORCH" ]; exit ;; esac
"""


@pytest.mark.parametrize("installed,installs", [("2.13.0", False), ("2.11.0", True)])
def test_setup_installs_the_pinned_torch_where_another_is_there(installed, installs, tmp_path):
    """Any torch passed: a new TORCH_VERSION was written to the stamp and the old torch kept, without a word."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)  # pip too: nothing is downloaded
    python.chmod(0o755)
    env = {**os.environ, "FAKE_LOG": str(tmp_path / "log"), "FAKE_TORCH": installed, "TORCH_VERSION": "2.13.0"}
    subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], check=True, capture_output=True, env=env)
    calls = (tmp_path / "log").read_text().splitlines()
    assert ("-m pip install -q torch==2.13.0" in calls) == installs and "-m pip install -q -e .[dev]" in calls


@pytest.mark.parametrize("flag,reported", [("--dry", False), ("--dry_ru", False), ("--d", True), ("--dry_runs", True),
                                           ("--help", False), ("-h", False)])
def test_compare_script_takes_an_abbreviated_dry_run_for_one(flag, reported, tmp_path):
    """sweep.py (argparse) reads --dry as --dry_run; the script then ran report.py, which stopped it (no such
    folder); after sweep.py's --help too."""
    for name in ("scripts", "recipes", ".venv/bin"):
        (tmp_path / name).mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "compare.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "recipes" / "sweep.py").write_text("print('listed')\n")
    (tmp_path / "recipes" / "report.py").write_text("print('reported')\n")
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "compare.sh"), flag], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("listed\n") and ("reported" in done.stdout) == reported


@needs_data
@pytest.mark.parametrize("script", ["compare.sh", "fetch_gpu_data.sh"])
def test_scripts_read_a_relative_data_folder_from_where_they_are_called(script, tmp_path):
    """SPANATTN_DATA=shared/data from /work was read from the checkout (cd there first): "cannot stat" or
    "no such file" for a folder that is there."""
    repo = tmp_path / "deeper" / "repo"  # the relative path leads elsewhere from there
    for name in ("scripts", "recipes", ".venv/bin"):
        (repo / name).mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")
    (repo / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (repo / "recipes" / "sweep.py").write_text("import sys; print(sys.argv[1:])\n")
    (repo / "recipes" / "report.py").write_text("\n")
    relative = os.path.relpath(DATA, tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run(["bash", str(repo / "scripts" / script)], capture_output=True, text=True,
                          cwd=tmp_path / "elsewhere", env={**os.environ, "SPANATTN_DATA": relative})
    assert done.returncode == 0, done.stderr
    if script == "compare.sh":
        assert f"'--train_file', '{tmp_path / 'elsewhere' / relative}/wikitext-2-v1/train.txt'" in done.stdout
    else:
        assert (repo / ".data" / "wikitext-2-v1" / "train.txt").stat().st_size == (DATA / "wikitext-2-v1" /
                                                                                   "train.txt").stat().st_size


@needs_data
def test_compare_script_names_spanattn_data_where_it_holds_no_data(tmp_path):
    """SPANATTN_DATA one folder off (../shared for ../shared/data) stopped in sweep.py with "--train_file
    .../wikitext-2-v1/train.txt: no such file", naming a flag the user never gave."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "compare.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    for name in (".venv", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "compare.sh"), "--dry_run"], capture_output=True,
                          text=True, env={**os.environ, "SPANATTN_DATA": str(DATA.parent)})
    assert done.returncode == 2 and done.stderr == (f"compare.sh: SPANATTN_DATA={DATA.parent} holds no wikitext-2-v1/"
                                                    "train.txt: give the folder that holds wikitext-2-v1/ and "
                                                    "gpt2-tokenizer/ (../shared/data, see its README.md)\n")


@needs_data
def test_compare_script_dry_run_lists_the_runs_and_reports_nothing(tmp_path):
    """After sweep.py's list of runs, report.py stopped the script with "runs/quick/runs: no such folder", exit 1."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "compare.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")  # set up already: nothing installed
    for name in (".venv", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "compare.sh"), "--dry_run"], capture_output=True,
                          text=True, env={**os.environ, "SPANATTN_DATA": str(DATA)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[4/4] runs/quick/runs/" in done.stdout and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", ["test.sh", pytest.param("compare.sh", marks=pytest.mark.slow)])
def test_scripts_run_this_checkouts_package_whatever_the_pythonpath(script, tmp_path):
    """PYTHONPATH=<another checkout>/src: the tests ran, and the main job trained, with that checkout's package."""
    repo, other = tmp_path / "repo", tmp_path / "other" / "hf_spanattn"
    for folder in (repo / "scripts", repo / ".venv" / "bin", other):
        folder.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (repo / "src").symlink_to(ROOT / "src")
    shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    (repo / "scripts" / "setup.sh").write_text("exit 0\n")
    (repo / ".venv" / "bin" / "ruff").write_text("#!/bin/sh\n")
    (repo / ".venv" / "bin" / "python").write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import hf_spanattn; print(hf_spanattn.__file__)'\n")
    for name in ("ruff", "python"):
        (repo / ".venv" / "bin" / name).chmod(0o755)
    done = subprocess.run(["bash", str(repo / "scripts" / script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(other.parent)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == str(repo / "src" / "hf_spanattn" / "__init__.py")


def test_setup_puts_pip_into_a_venv_made_without_it(tmp_path):
    """A .venv from `uv venv` or `python -m venv --without-pip`: "No module named pip", and no way on."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    no_pip = 'case "$*" in "-m ensurepip") touch "$FAKE_LOG.pip"; exit ;; "-m pip"*) [ -f "$FAKE_LOG.pip" ] || exit 1;;'
    python.write_text(FAKE_PYTHON.replace('case "$*" in', no_pip))
    python.chmod(0o755)
    env = {**os.environ, "FAKE_LOG": str(tmp_path / "log"), "FAKE_TORCH": "2.13.0", "TORCH_VERSION": "2.13.0"}
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "-m pip install -q -e .[dev]" in (tmp_path / "log").read_text().splitlines()


def fake_python3(tmp_path: Path, cuda: str) -> dict[str, str]:
    """An environment whose python3 answers `cuda` to torch.cuda.is_available() and fails at anything else."""
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python3"
    python.write_text(f'#!/bin/sh\ncase "$*" in *is_available*) echo {cuda} ;; *) exit 3 ;; esac\n')
    python.chmod(0o755)
    return {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}


def test_gpu_sweep_script_says_there_is_no_gpu(tmp_path):
    """On a machine without CUDA: pip's "not a supported wheel on this platform", or a traceback after the installs."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_sweep.sh")], capture_output=True, text=True,
                          env=fake_python3(tmp_path, "False"))
    assert done.returncode == 2 and "gpu_sweep.sh: no GPU here (torch sees no CUDA device)" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cuda", ["False", "True"])
def test_gpu_check_script_says_there_is_no_gpu_and_fails_where_a_step_does(cuda, tmp_path):
    """On a machine without CUDA every step ended in a traceback, and the script in exit status 0; a step that
    failed on a GPU machine left it at 0 too."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "tests"], capture_output=True, text=True,
                          env=fake_python3(tmp_path, cuda))
    if cuda == "False":
        assert done.returncode == 2 and "gpu_check.sh: no GPU here (torch sees no CUDA device)" in done.stderr
        assert not (tmp_path / "out").exists()
    else:
        assert done.returncode == 1 and "## exit status 3" in (tmp_path / "out" / "gpu_check_tests.txt").read_text()


@pytest.mark.parametrize("script", ["setup.sh", "fetch_gpu_wheels.sh", "fetch_gpu_data.sh"])
def test_scripts_without_options_name_an_argument(script, tmp_path):
    """`bash scripts/setup.sh --force` set up as without it (or returned at once), without a word; the fetch scripts
    likewise."""
    repo = tmp_path / "repo"  # a copy: the fetch scripts write beside the checkout
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    done = subprocess.run(["bash", str(repo / "scripts" / script), "--force"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 2 and f"{script}: takes no arguments, got --force" in done.stderr
    assert sorted(p.name for p in repo.iterdir()) == ["scripts"]


SH_IS_BASH = subprocess.run(["sh", "-c", "echo ${BASH_VERSION:-}"], capture_output=True, text=True).stdout != "\n"


@pytest.mark.skipif(SH_IS_BASH, reason="sh is bash here: the scripts would run")
@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").glob("*.sh")))
def test_scripts_run_with_sh_say_they_need_bash(script, tmp_path):
    """`sh scripts/setup.sh` (dash): "set: Illegal option -o pipefail"."""
    done = subprocess.run(["sh", str(ROOT / "scripts" / script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and f"{script}: a bash script: run it as bash scripts/{script}" in done.stderr


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_sweep.sh"])
def test_gpu_scripts_read_a_relative_out_from_where_they_are_called(script, tmp_path):
    """OUT=out from another folder wrote into <checkout>/out."""
    repo = tmp_path / "repo"
    for folder in (repo / "scripts", repo / "recipes" / "configs", tmp_path / "elsewhere"):
        folder.mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / script, repo / "scripts")
    (repo / "recipes" / "configs" / "paper_gpu.yaml").write_text("")
    env = {**fake_python3(tmp_path, "True"), "OUT": "out"}
    subprocess.run(["bash", str(repo / "scripts" / script), *(["tests"] if script == "gpu_check.sh" else [])],
                   capture_output=True, text=True, env=env, cwd=tmp_path / "elsewhere")
    assert (tmp_path / "elsewhere" / "out").is_dir() and not (repo / "out").exists()


def test_a_rerun_whose_logging_dir_differs_is_the_same_run():
    """Transformers 4 sets logging_dir to runs/<time>_<host> by default, so each rerun of one command recorded another
    one and was refused as a run made with other settings instead of resuming."""
    saved = {"training": {"learning_rate": 1e-3, "logging_dir": "out/runs/Nov28_10-09-38_vm"}}
    assert run_identity.differences(saved, {"training": {**saved["training"],
                                                         "logging_dir": "out/runs/Nov28_10-10-02_vm"}}) == []
