#!/usr/bin/env python
"""Pack as many whole runs of a sweep as fit into a wall-clock budget, each writing one small JSON.

    python recipes/pack.py recipes/configs/paper_gpu.yaml --budget 540 --jsonl $OUT/results.jsonl
    python recipes/pack.py recipes/configs/cpu_scale.yaml --results runs/pack --parallel 2

The YAML is a sweep in recipes/sweep.py's format (output_dir, args, spans, seeds, shapes); a
file of several YAML documents runs them in order, each later document taking the keys it
leaves out from the one before (its `args` merged key by key), and a run planned twice runs
once. Each run is recipes/run_clm.py in a process of its own, in a temporary folder deleted
afterwards (no checkpoint or weight is kept; one that a killed command left behind is deleted by
the next command on the same results); `--parallel N` runs N at once on the one device.
A finished run writes one JSON (`result_record`) as <results>/<name>.json and/or one line of
--jsonl; with both, --jsonl first gets the line of each finished run in --results that it lacks (a command
stopped between the two writes, or one without --jsonl, left it there alone), said, without running it again.
A run is skipped when its JSON is in --results, its line in --jsonl, or its
metrics.json in the sweep's tree (<output_dir>/<shape>/<span>/seed<k>, where recipes/merge.py
puts merged results), made with the settings this command gives it; a finished run made with
other settings (another --set, an edited sweep file) stops the command before anything runs,
naming the run and the settings, unless --keep_other_settings. A new run starts only while the
budget left is at least the longest run this command has finished (or --estimate before one
has); the first run always starts.
While it runs, `<results>.lock` and `<jsonl>.lock` keep a second command off the same results; a
kill (SIGTERM, as `timeout` sends) stops its runs too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml
from records import integer, metrics_problems, record_problems, seed_of
from run_identity import (
    RunLock,
    differences,
    json_file,
    json_value,
    move_aside,
    not_a_file,
    path_argument,
    read_yaml,
    stopped_as_by_ctrl_c,
    too_long,
    write_json,
    write_whole,
)
from sweep import argument_name, names_flag, plan

from hf_spanattn import SpanAttentionConfig
from hf_spanattn.ops.inputs import shown

RUN_CLM = Path(__file__).with_name("run_clm.py")
REQUIRED = ("name", "shape", "span", "seed", "config", "train_history", "eval_history", "final_train_loss",
            "min_val_loss", "best_epoch", "epochs_run", "early_stopping", "train_runtime_s", "wall_s", "device")
TRAINING_KEYS = ("seed", "data_seed", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
                 "weight_decay", "max_grad_norm", "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "bf16", "fp16",
                 "tf32", "eval_strategy", "metric_for_best_model")


@dataclass
class Run:
    name: str
    folder: Path  # the run's place in the sweep's tree
    args: dict[str, str]  # run_clm.py arguments, output_dir left out

    @property
    def shape(self) -> str:
        return self.folder.parts[-3]


@dataclass
class Started:
    run: Run
    process: subprocess.Popen
    tmp: Path
    start: float


@dataclass
class Tally:
    finished: list[float] = field(default_factory=list)  # wall seconds of this command's finished runs
    failed: list[str] = field(default_factory=list)
    launched: int = 0


def load_sweeps(path: Path) -> list[dict]:
    """The YAML documents of a sweep file, each later one completed by the one before."""
    if not path.is_file():
        raise ValueError(f"sweep config {path}: {not_a_file(path)}")
    try:
        documents = [d for d in read_yaml(path.read_text(), documents=True) if d is not None]
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"sweep config {path}: not valid YAML ({type(err).__name__}: {err})") from None
    sweeps, previous = [], {}
    for i, document in enumerate(documents, 1):
        if not isinstance(document, dict):
            raise ValueError(f"sweep config {path}, document {i}: expected a mapping of output_dir, args, spans, ...")
        if not isinstance(document.get("args") or {}, dict):
            raise ValueError(f"sweep config {path}, document {i}: args={shown(document['args'])}: expected a mapping "
                             "of run_clm.py arguments")
        given = document.get("args") or {}
        named = {argument_name(k) for k in given}  # num-train-epochs here replaces num_train_epochs there
        inherited = {k: v for k, v in (previous.get("args") or {}).items() if argument_name(k) not in named}
        current = {**previous, **document, "args": {**inherited, **given}}
        sweeps.append(current)
        previous = current
    if not sweeps:
        raise ValueError(f"sweep config {path}: empty")
    return sweeps


MAX_NAME = 230  # a result's file name, <name>.json.invalid-<n> (or its temporary folder's), within 255 bytes


def result_name(folder: Path) -> str:
    """<shape>__<span>__seed<k> from the run's folder, in letters, digits, '.', '_' and '-' only."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", "__".join(folder.parts[-3:]))


def plan_runs(sweeps: list[dict], overrides: dict[str, str], check: bool = True) -> list[Run]:
    """The runs of the sweep documents, each once (as its first document plans it; a later one that gives it other
    arguments is told); with `check`, run_clm.py's arguments are checked here (data files, too: the machine that
    plans is the one that runs)."""
    runs: dict[str, Run] = {}
    document: dict[str, int] = {}  # the document that planned each run first
    overrides = {argument_name(k): v for k, v in overrides.items()}
    for i, sweep in enumerate(sweeps, 1):
        kept = {k: v for k, v in (sweep.get("args") or {}).items() if argument_name(k) not in overrides}
        try:
            planned = plan({**sweep, "args": {**kept, **overrides}}, check)
        except ValueError as err:  # a value from --set, not from the sweep file
            key = next((k for k in overrides if names_flag(str(err), k)), None)
            raise ValueError(f"{err} (given by --set {shown(f'{key}={overrides[key]}')})" if key else str(err)) \
                from None
        for folder, run_args in planned:
            args = dict(a[2:].split("=", 1) for a in run_args)
            args.pop("output_dir")
            run = Run(result_name(folder), folder, args)
            if len(run.name) > MAX_NAME:
                raise ValueError(f"the run {folder} has the result name {shown(run.name, 80)}: more than the "
                                 f"{MAX_NAME} characters a result file's name may have here; give the shape's "
                                 "longer arguments in args, or shorter ones")
            first = runs.setdefault(run.name, run)
            document.setdefault(run.name, i)
            if first.folder != folder:
                raise ValueError(f"runs {first.folder} and {folder} have the same result name {run.name}")
            given, again = ({argument_name(k): v for k, v in r.args.items()} for r in (first, run))
            if given != again:  # a result is named by shape, span and seed alone: one of them runs
                changed = "; ".join(f"{k}: " + " → ".join("(unset)" if v is None else shown(v, 60)
                                                          for v in (given.get(k), again.get(k)))
                                    for k in sorted(set(given) | set(again)) if given.get(k) != again.get(k))
                print(f"sweep config, document {i}: {run.name} is planned by document {document[run.name]} "
                      f"already, which it runs with its own arguments, not these ({changed}); a run of other "
                      "arguments needs a sweep file and results of its own", flush=True)
    return list(runs.values())


def read_records(path: Path, located: bool = False) -> tuple[list, list[str]]:
    """(the records, what is wrong with the others) in a folder of <name>.json, a .json file (one record or
    a list) or a .jsonl file, the suffixes in any case; a record that is not a whole, well-formed result is
    left out and named. With `located`, each record comes as ((its file, its line or place in a list there, or
    ''), the record)."""
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.suffix.lower() in (".json", ".jsonl") and f.is_file())
        if not files:
            raise ValueError(f"{path}: no result files (*.json, *.jsonl)")
        found = [read_records(f, located) for f in files]
        return [r for records, _ in found for r in records], [p for _, problems in found for p in problems]
    if not path.is_file():
        raise ValueError(f"{path}: " + ("not a file or folder (a pipe or a device?)" if path.exists() else
                                        "a link to nothing (or to itself)" if path.is_symlink() else
                                        "no such file or folder"))
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    lines = text.split("\n")  # JSON Lines ends a line at \n alone: U+2028 and the like may stand inside a string
    if path.suffix.lower() == ".jsonl":
        pieces = [(f"line {i}", line) for i, line in enumerate(lines, 1) if line.strip()]
    else:
        pieces = [("", text)]
    records, problems = [], []
    for place, piece in pieces:
        where = f"{path} {place}".rstrip()
        try:
            value = json_value(piece)
        except (ValueError, RecursionError) as err:  # a key given twice, numbers or nesting past Python's limits
            cut = path.suffix.lower() == ".jsonl" and where.endswith(f" {len(lines)}") and not text.endswith("\n")
            problems.append(f"{where}: not valid JSON ({err})" + ("; cut short, as by a command stopped while "
                                                                  "writing it" if cut else ""))
            continue
        listed = isinstance(value, list)
        for i, record in enumerate(value if listed else [value], 1):
            wrong = record_problems(record)
            if wrong:
                problems.append(f"{where}: not a result of recipes/pack.py: {'; '.join(wrong)}")
            else:
                records.append(((path, f"{place}, record {i} of a list".lstrip(", ") if listed else place), record)
                               if located else record)
    return records, problems


def load_records(path: Path, located: bool = False) -> list:
    """The records of `path` (see read_records); any that is not well-formed is an error naming it, except
    a .jsonl file's last line cut short (a command stopped while appending it), which is skipped and named."""
    records, problems = read_records(path, located)
    for problem in problems:
        if not problem.endswith("stopped while writing it"):
            raise ValueError(problem)
        print(f"skipping {problem}", file=sys.stderr, flush=True)
    return records


def result_record(run: Run, metrics: dict, wall_s: float, parallel: int) -> dict:
    """The small JSON of one finished run, from run_clm.py's metrics.json."""
    config = metrics["config"]
    training = {k: config["training"].get(k) for k in TRAINING_KEYS}
    return {
        "name": run.name, "shape": run.shape, "span": metrics["span"], "seed": int(run.args["seed"]),
        "config": {"args": run.args, "model": config["model"], "data": config["data"], "span": config["span"],
                   "training": training, "span_config": metrics["span_config"],
                   "versions": {k: config[k] for k in ("hf_spanattn", "transformers", "torch")}},
        "final_train_loss": metrics["final_train_loss"], "min_val_loss": metrics["min_val_loss"],
        "best_epoch": metrics["best_epoch"], "val_perplexity": metrics["val_perplexity"],
        "val_accuracy": metrics["val_accuracy"],
        "epochs_run": metrics["eval_history"][-1]["epoch"] if metrics["eval_history"] else 0,
        "early_stopping": metrics.get("early_stopping"),
        "train_history": metrics["train_history"], "eval_history": metrics["eval_history"],
        "train_runtime_s": metrics["train_runtime_s"], "wall_s": wall_s, "parallel": parallel,
        "device": metrics.get("device"), "backend": metrics.get("backend"),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_record(record: dict, results: Path | None, jsonl: Path | None) -> None:
    if results is not None:  # whole or absent, even if killed mid-write
        write_whole(results / f"{record['name']}.json", json.dumps(record, indent=1) + "\n")
    if jsonl is not None:
        with open(jsonl, "a+b", buffering=0) as f:  # unbuffered: nothing left to fail again on close
            end = f.seek(0, os.SEEK_END)
            line = (json.dumps(record) + "\n").encode()
            if end and f.seek(end - 1) >= 0 and f.read(1) != b"\n":
                line = b"\n" + line  # a line cut short by a stopped command stays a line of its own
            try:
                while line:
                    line = line[f.write(line):]
                os.fsync(f.fileno())
            except OSError as err:  # a full disk: no line cut short, which merge.py would refuse once inside the file
                f.truncate(end)
                raise OSError(err.errno, f"{jsonl}: cannot be written ({err.strerror})") from None


def add_missing_lines(finished: list[Run], results: Path, jsonl: Path) -> None:
    """Append to `jsonl` the line of each finished run whose result is in `results` alone (a command stopped
    between write_record's two writes, or one without --jsonl, left it so), from that result: the two hold the same
    finished runs, as merge.py may be given either."""
    listed = {r["name"] for r in read_records(jsonl)[0]} if jsonl.exists() else set()
    for run in finished:
        path = results / f"{run.name}.json"
        if run.name in listed or not path.is_file():
            continue
        try:
            record = json_file(path)
        except (OSError, ValueError, RecursionError):
            continue
        if not record_problems(record, run.name):
            write_record(record, None, jsonl)
            print(f"{jsonl}: added the line of {run.name} from {path}, a finished run it lacked", flush=True)


def not_of(run: Run, metrics: dict) -> list[str]:
    """[] where whole `metrics` are of `run`'s span and seed (a file moved or copied by hand may hold another's)."""
    span, seed = SpanAttentionConfig.from_label(metrics["span"]).label, seed_of(metrics)
    if span == run.args["span"] and seed == int(run.args["seed"]):
        return []
    return [f"it holds span {shown(metrics['span'])} with seed {seed}, not {run.args['span']} with seed "
            f"{run.args['seed']}"]


PRECISION = ("bf16", "fp16", "tf32")  # left to the machine that runs (see sweep.check_args), compared as given
# Settings that change how a step is computed but not what a run measures: the split of an optimizer step's
# batch into accumulated micro-batches (the same sequences, the same mean gradient up to rounding and dropout's
# draws). scripts/gpu_sweep.sh --accum changes it between commands to fit the memory. Evaluation and logging
# cadence are not among them: min_val_loss is the least of the evaluations made, final_train_loss the mean
# since the last log, and early stopping counts evaluations.
BATCH_SPLIT = ("per_device_train_batch_size", "gradient_accumulation_steps")
# Settings of what a run keeps beside its result and pack.py deletes with its folder: whether the diagnostics
# file holds norms per head. span_diagnostics_every is not among them: a diagnostics step makes the Trainer log,
# which adds an entry to train_history and starts the mean that final_train_loss is over afresh.
UNKEPT = ("span_diagnostics_per_head",)
MAX_ARGS = 1000  # more than run_clm.py has; argparse takes time quadratic in their number to refuse more


@functools.cache
def configuration(args: tuple[tuple[str, str], ...], folder: str) -> dict:
    """run_clm.py's configuration of a run with these arguments (see run_identity.identity), with its batch
    split folded into the batch of one optimizer step. Raises ValueError where run_clm.py refuses them."""
    import run_clm
    from sweep import expected_config

    argv = [f"--{k}={v}" for k, v in args if argument_name(k) not in PRECISION] + [f"--output_dir={folder}"]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            config = expected_config(argv)
    except (SystemExit, ValueError, TypeError):  # argparse's exit, or run_clm.py's check: its message
        raise ValueError(run_clm.argument_error(argv)) from None
    training = config["training"]
    for key, value in args:
        if argument_name(key) in PRECISION:
            try:
                training[argument_name(key)] = run_clm.string_to_bool(value)
            except argparse.ArgumentTypeError:
                training[argument_name(key)] = value
    return folded(config)


def folded(config: dict) -> dict:
    """`config` with the batch split (BATCH_SPLIT) replaced by the batch of one optimizer step, their product."""
    training = dict(config.get("training") or {}) if isinstance(config.get("training") or {}, dict) else None
    if training is None:
        return config
    split = [training.pop(key, None) for key in BATCH_SPLIT]
    if all(integer(n, 1) for n in split):
        training[" × ".join(BATCH_SPLIT)] = split[0] * split[1]
    else:  # a hand edit: compared as recorded
        training.update((key, n) for key, n in zip(BATCH_SPLIT, split) if n is not None)
    return {**config, "training": training}


def unkept_dropped(config: dict) -> dict:
    """`config` without the settings of what pack.py does not keep (UNKEPT)."""
    span = config.get("span")
    if not isinstance(span, dict):
        return config
    return {**config, "span": {k: v for k, v in span.items() if k not in UNKEPT}}


def other_settings(run: Run, data: dict) -> list[str]:
    """How the settings recorded with a finished result of `run` differ from the ones this command runs it with
    ('group.key: recorded → wanted', at most 3), apart from the batch split; [] where they do not. A pack.py
    record keeps the run's arguments (config.args), run_clm.py's metrics.json its whole configuration."""
    try:
        wanted = configuration(tuple(run.args.items()), str(run.folder))
    except ValueError as err:  # a dry run, whose arguments plan_runs did not check
        raise ValueError(f"the arguments of {run.name}: {err}") from None
    config = data["config"]
    if "args" not in config:
        saved = folded(config)
    elif not isinstance(config["args"], dict) or len(config["args"]) > MAX_ARGS or not all(
            isinstance(v, (str, int, float, bool)) for v in config["args"].values()):
        return [f"config.args={shown(config['args'])}: not the run's arguments as recipes/pack.py records them"]
    else:
        recorded = {str(k): str(v) for k, v in config["args"].items()}
        try:
            saved = configuration(tuple(recorded.items()), str(run.folder))
        except ValueError as err:
            changed = [f"{k}: " + " → ".join("(unset)" if v is None else shown(v) for v in (recorded.get(k),
                                                                                           run.args.get(k)))
                       for k in sorted(set(recorded) | set(run.args)) if recorded.get(k) != run.args.get(k)]
            return [f"its arguments are refused by run_clm.py now ({str(err)[:200]})", *changed[:3]]
    try:
        return differences(*(unkept_dropped(c) for c in (saved, wanted)), limit=3)
    except (ValueError, TypeError, AttributeError) as err:  # a hand edit: a group, path or label wrong
        return [f"its configuration is not one run_clm.py records ({str(err)[:200]})"]


def finished_names(runs: list[Run], results: Path | None, jsonl: Path | None, say=print,
                   keep_other_settings: bool = False) -> set[str]:
    """The runs with a well-formed result in the sweep's tree, in --results or in --jsonl. A result that is
    not (partial, hand-edited, hostile) is named through `say`, and its run counts as not finished. A result made
    with other settings than the run's (other_settings) is a ValueError naming them all, or with
    `keep_other_settings` is named through `say` and counts as finished."""
    done, found = set(), []
    for run in runs:
        places = [(run.folder / "metrics.json", lambda data, run=run: metrics_problems(data) or not_of(run, data))]
        if results is not None:
            places.append((results / f"{run.name}.json", lambda data, name=run.name: record_problems(data, name)))
        for path, check in places:
            if not path.exists():
                continue
            try:
                data = json_file(path)
                problems = check(data)
            except (OSError, ValueError, RecursionError) as err:
                problems = [f"not valid JSON ({type(err).__name__}: {str(err)[:200]})"]
            if problems:
                say(f"{path}: not a finished run's result ({'; '.join(problems)}); the run is redone", flush=True)
            else:
                found.append((str(path), run, data))
    if jsonl is not None and jsonl.exists():
        records, problems = read_records(jsonl, located=True)
        for problem in problems:
            say(f"{problem}; the line is ignored", flush=True)
        by_name = {run.name: run for run in runs}
        found += [(f"{path} {place}", by_name[r["name"]], r) for (path, place), r in records if r["name"] in by_name]
    unlike, compared = [], True
    for where, run, data in found:
        try:
            diffs = other_settings(run, data)
        except ValueError as err:  # a dry run's arguments, unchecked (its data elsewhere, say): as before
            if compared:
                say(f"the settings of finished runs are not compared ({err})", flush=True)
            compared, diffs = False, []
        if diffs and keep_other_settings:
            say(f"{where}: {run.name} was made with other settings ({'; '.join(diffs)}); counted finished "
                "(--keep_other_settings)", flush=True)
        elif diffs:
            unlike.append(f"{where} holds {run.name} made with other settings than this command's "
                          f"({'; '.join(diffs)})")
            continue
        done.add(run.name)
    if unlike:
        more = f"; and {len(unlike) - 5} more" if len(unlike) > 5 else ""
        raise ValueError(f"{'; '.join(unlike[:5])}{more}. Nothing was run: one results folder would mix settings. "
                         "To run them with this command's settings, give another --results folder or --jsonl file "
                         "(for a result in the sweep's tree, another output_dir in the sweep file), or move those "
                         "results away (nothing here deletes them); to count them finished as they are, give "
                         "--keep_other_settings")
    return done


LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1


def killed_with(parent: int) -> None:
    """In a run's process, before run_clm.py starts (Linux): a kill of pack.py kills the run too, even SIGKILL, which
    no handler sees; else the run went on unseen in its temporary folder, and a rerun started it again beside it."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # pack.py ended before the line above
        os._exit(1)


OWNER = ".pack-command.json"  # in a run's temporary folder: the pack command (and run) it belongs to, and its results


def results_of(args: argparse.Namespace) -> list[str]:
    """The results a pack command writes (--results, --jsonl), each by its real path."""
    return [os.path.realpath(p) for p in (args.results, args.jsonl) if p is not None]


def start(run: Run, args: argparse.Namespace) -> Started:
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{run.name}-", dir=args.tmp_dir))
    except OSError as err:  # a folder that takes no files, a full disk: named, not the run's folder in it
        where = f"--tmp_dir {args.tmp_dir}" if args.tmp_dir else f"the temporary folder {tempfile.gettempdir()}"
        raise SystemExit(f"pack: {where}: a run's folder cannot be made there ({err.strerror}); make it writable or "
                         "make room there, or give another --tmp_dir") from None
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "results": results_of(args)}
    write_json(tmp / OWNER, owner)
    command = [sys.executable, str(RUN_CLM), *(f"--{k}={v}" for k, v in run.args.items()), f"--output_dir={tmp}"]
    with open(tmp / "train.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
                                   preexec_fn=functools.partial(killed_with, os.getpid()) if LIBC else None)
    write_json(tmp / OWNER, {**owner, "run_pid": process.pid})
    return Started(run, process, tmp, time.monotonic())


def left_by_a_dead_command(folder: Path, results: list[str]) -> int | None:
    """The process id of the pack command on the same `results` that made the temporary folder `folder` and was
    killed (SIGKILL reaches no handler), where its OWNER file proves that and that the command and its run are
    gone; else None (another command's folder, a live one, or one that cannot be told)."""
    try:
        owner = json_file(folder / OWNER)
        pids = [owner["pid"], owner.get("run_pid", owner["pid"])]
        ours = isinstance(owner["results"], list) and set(owner["results"]) & set(results)
        mine = owner["host"] == socket.gethostname() and all(integer(p, 1, 2**31 - 1) for p in pids)
    except (OSError, ValueError, RecursionError, TypeError, KeyError):
        return None
    if not (ours and mine) or any(RunLock.running(p, owner["host"]) for p in pids):
        return None
    return pids[0]


def clear_dead_folders(args: argparse.Namespace) -> None:
    """Remove the temporary folders that killed pack commands on these results left (see left_by_a_dead_command)."""
    root = Path(args.tmp_dir or tempfile.gettempdir())
    try:
        folders = [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for folder in folders:
        pid = left_by_a_dead_command(folder, results_of(args))
        if pid is not None:
            shutil.rmtree(folder, ignore_errors=True)
            print(f"{folder}: removed, the temporary folder of a run of a pack command on these results that was "
                  f"killed (process {pid})", flush=True)


def may_start(tally: Tally, left: float, estimate: float | None) -> tuple[bool, float | None]:
    """(start another run?, the run-time estimate used): the longest finished run, else --estimate."""
    guess = max(tally.finished) if tally.finished else estimate
    return tally.launched == 0 or guess is None or left >= guess, guess


def collect(job: Started, args: argparse.Namespace, tally: Tally) -> None:
    wall = time.monotonic() - job.start
    log = job.tmp / "train.log"
    try:
        if job.process.returncode != 0:
            tally.failed.append(job.run.name)
            tail = log.read_text(errors="replace").splitlines()[-40:]
            print(f"FAILED {job.run.name} (exit code {job.process.returncode}, {wall:.0f} s); end of its log:\n  "
                  + "\n  ".join(tail), flush=True)
            return
        try:
            record = result_record(job.run, json.loads((job.tmp / "metrics.json").read_text()), wall, args.parallel)
            problems = record_problems(record)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
            problems = [f"{type(err).__name__}: {err}"]
        if problems:
            tally.failed.append(job.run.name)
            print(f"FAILED {job.run.name}: it ended without a whole result ({'; '.join(problems)})", flush=True)
            return
        write_record(record, args.results, args.jsonl)
        tally.finished.append(wall)
        stop = record["early_stopping"] or {}
        note = f", stopped early at epoch {stop['stopped_at_epoch']:g}" if stop.get("stopped_early") else ""
        print(f"done {job.run.name} in {wall:.0f} s: min val loss {record['min_val_loss']:.4f} at epoch "
              f"{record['best_epoch']:g} of {record['epochs_run']:g}{note}", flush=True)
    finally:
        shutil.rmtree(job.tmp, ignore_errors=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=path_argument, help="sweep YAML file (one or more documents)")
    parser.add_argument("--budget", type=float, help="wall-clock seconds for this command (default: no limit)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once on the one device (default 1)")
    parser.add_argument("--results", type=path_argument, help="folder for one <name>.json per finished run")
    parser.add_argument("--jsonl", type=path_argument,
                        help="file to which each finished run appends its JSON as one line")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a run_clm.py argument of every run, e.g. --set per_device_train_batch_size=64")
    parser.add_argument("--estimate", type=float, help="seconds per run assumed until a run of this command ends")
    parser.add_argument("--max_runs", type=int, help="start at most this many runs")
    parser.add_argument("--tmp_dir", type=path_argument,
                        help="where the runs' temporary folders go (default: the system's)")
    parser.add_argument("--keep_other_settings", action="store_true",
                        help="count a finished run made with other settings as finished (default: stop, naming it)")
    parser.add_argument("--dry_run", action="store_true", help="list the runs to do and exit")
    args = parser.parse_args(argv)
    if args.results is None and args.jsonl is None:
        parser.error("give --results FOLDER and/or --jsonl FILE: where finished runs write their JSON")
    if args.parallel < 1:
        parser.error(f"--parallel {args.parallel}: allowed values are >= 1")
    for item in args.set:
        if "=" not in item or argument_name(item.split("=")[0]) in ("", "output_dir", "span", "seed"):
            parser.error(f"--set {item!r}: expected KEY=VALUE with a run_clm.py argument other than output_dir, span "
                         "and seed (the sweep file's spans and seeds give those)")
    for flag in ("budget", "estimate", "max_runs"):
        value = getattr(args, flag)
        if value is not None and not value >= 0:  # NaN too
            parser.error(f"--{flag} {value}: allowed values are numbers >= 0")
    for flag, path, folder in (("--results", args.results, True), ("--jsonl", args.jsonl, False),
                               ("--tmp_dir", args.tmp_dir, True)):
        if path is None:
            continue
        if flag != "--tmp_dir" and too_long(path):
            parser.error(f"{flag} {shown(str(path), 120)}: {too_long(path)}")
        try:
            if folder and path.is_symlink() and not path.exists():
                parser.error(f"{flag} {path}: a link to nothing (or to itself); expected a folder")
            exists = path.exists()
        except OSError as err:  # a name past the file system's limit
            parser.error(f"{flag} {shown(str(path), 120)}: {err.strerror}")
        if exists and path.is_dir() != folder:
            parser.error(f"{flag} {path}: " + ("exists and is not a folder" if folder else "is a folder; expected the "
                                                                                           "path of a .jsonl file"))
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            parser.error(f"{flag} {path}: {blocking} is a file, so it cannot be made")
    if args.jsonl is not None and args.jsonl.suffix.lower() != ".jsonl":  # merge.py reads others as one JSON value
        parser.error(f"--jsonl {args.jsonl}: expected the path of a .jsonl file (JSON Lines, one result a line)")
    if args.tmp_dir is not None and not args.tmp_dir.is_dir():
        parser.error(f"--tmp_dir {args.tmp_dir}: no such folder")
    return args


def run_all(todo: list[Run], limit: int, args: argparse.Namespace, began: float) -> tuple[Tally, str]:
    """Start the first `limit` runs of `todo` as the budget allows, `args.parallel` at once, and collect each:
    (the tally, why no more were started)."""
    tally, running, reason = Tally(), [], "all runs started"
    try:
        while True:
            while len(running) < args.parallel and tally.launched < limit and not tally.failed:
                left = float("inf") if args.budget is None else args.budget - (time.monotonic() - began)
                ok, guess = may_start(tally, left, args.estimate)
                if not ok:
                    reason = f"{left:.0f} s of the budget left, a run takes about {guess:.0f} s"
                    break
                run = todo[tally.launched]
                tally.launched += 1
                print(f"[{tally.launched}/{len(todo)}] start {run.name} at {time.monotonic() - began:.0f} s",
                      flush=True)
                running.append(start(run, args))
            if not running:
                break
            time.sleep(0.2)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                collect(job, args, tally)
    finally:
        for job in running:  # interrupted: leave no run behind
            job.process.kill()
            job.process.wait()
            shutil.rmtree(job.tmp, ignore_errors=True)
    return tally, reason


def main(argv: list[str] | None = None) -> int:
    began = time.monotonic()
    args = parse(argv)
    with contextlib.ExitStack() as locks:  # a second command on the same results would run the same runs again
        for flag, path, kind in (("--results", args.results, "folder"), ("--jsonl", args.jsonl, "file")):
            if path is not None and not args.dry_run:
                locks.enter_context(RunLock(path, flag, kind))
        return run_sweeps(args, began)


def run_sweeps(args: argparse.Namespace, began: float) -> int:
    """The sweep's runs not finished in the results, as many as the budget allows: 0, or 1 where one failed."""
    try:
        runs = plan_runs(load_sweeps(args.config), dict(item.split("=", 1) for item in args.set),
                         check=not args.dry_run)
        done = finished_names(runs, args.results, args.jsonl, keep_other_settings=args.keep_other_settings)
    except ValueError as err:
        raise SystemExit(f"pack: {err}") from None
    todo = [r for r in runs if r.name not in done]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} finished before, {len(todo)} to do", flush=True)
    if args.dry_run:
        print("\n".join(f"  {r.name}" for r in todo))
        return 0
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        for run in todo:  # a result file that is not whole: kept, out of the way of the new one
            path = args.results / f"{run.name}.json"
            if path.exists():
                print(f"{path} moved to {move_aside(path, 'invalid')}", flush=True)
    if args.jsonl is not None:
        args.jsonl.parent.mkdir(parents=True, exist_ok=True)
    if args.results is not None and args.jsonl is not None:
        add_missing_lines([r for r in runs if r.name in done], args.results, args.jsonl)
    clear_dead_folders(args)
    limit = len(todo) if args.max_runs is None else min(args.max_runs, len(todo))
    with stopped_as_by_ctrl_c():  # a kill of this command stops its runs too
        tally, reason = run_all(todo, limit, args, began)
    if tally.failed:
        reason = f"a run failed: {', '.join(tally.failed)}"
    elif tally.launched == limit < len(todo):
        reason = f"--max_runs {args.max_runs}"
    print(f"{len(tally.finished)} runs finished in {time.monotonic() - began:.0f} s, "
          f"{len(todo) - tally.launched} left for another command ({reason})", flush=True)
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
