#!/usr/bin/env python
"""Run a grid of span labels × seeds × model shapes from one YAML file, resumably.

    python recipes/sweep.py recipes/configs/cpu_scale.yaml
    python recipes/sweep.py recipes/configs/paper.yaml --train_file ../shared/data/wikitext-2-v1/train.txt \\
        --validation_file ../shared/data/wikitext-2-v1/validation.txt --launcher "torchrun --nproc_per_node 2"

The YAML holds `output_dir`, `args` (run_clm.py arguments shared by every run), `spans`,
`seeds` and `shapes` (a list of run_clm.py arguments such as {n_head: 4, n_layer: 6}), each key
once; the sweep gives each run its span, seed and output_dir, so args and shapes do not. An
argument set to null is left out (run_clm.py's default); a list is passed comma-separated, a
mapping (or a list of them) as JSON. Each
run lives in <output_dir>/<shape>/<span>/seed<k>: a run with a metrics.json is finished and
skipped; an interrupted one resumes from its last checkpoint. Both only where the run's recorded
configuration (model, data source and token limits, span settings, training arguments; see
run_identity.py) equals the one this sweep would run: a folder holding a run made otherwise is
moved to <folder>.replaced-<n> and the run is redone. Labels are read as settings: `score:1,0,0,0`
and `score:1000` are one setting, run once, in a folder named after its canonical label. The
arguments of every shape are checked before the first run starts; a run folder another run is
writing into (its `<folder>.lock` held) stops the sweep; a metrics.json that is not whole is moved
to metrics.json.invalid-<n> and its run redone.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from hf_spanattn import SpanAttentionConfig
from hf_spanattn.ops.inputs import shown

sys.path.insert(0, str(Path(__file__).parent))
from records import MAX_SEED, path_part  # noqa: E402
from run_identity import (  # noqa: E402
    NO_ROOM,
    RunLock,
    differences,
    move_aside,
    nonempty,
    not_a_file,
    read_json,
    read_yaml,
    saved_config,
    span_dir,
    stopped_as_by_ctrl_c,
)

RUN_CLM = Path(__file__).with_name("run_clm.py")
KEYS = ("output_dir", "args", "spans", "seeds", "shapes")


def shape_name(shape: dict) -> str:
    """H4xL6 for {n_head: 4, n_layer: 6}; other keys are appended as key=value."""
    name = f"H{shape.get('n_head', 4)}xL{shape.get('n_layer', 6)}"
    extra = [f"{k}={v}" for k, v in sorted(shape.items()) if k not in ("n_head", "n_layer")]
    return "_".join([name, *extra])


def _list_of(config: dict, key: str, kind: type, what: str) -> list:
    value = config[key]
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise ValueError(f"sweep config: {key}={shown(value)}: expected a list of {what}")
    if not value:
        raise ValueError(f"sweep config: {key} is empty: expected a list of {what}")
    return value


def _once(items: list, key, what: str) -> list:
    """`items` without repeats of the same `key(item)`, saying which were dropped."""
    seen: dict = {}
    for item in items:
        if key(item) in seen:
            print(f"sweep config: {what} {item!r} is the same setting as {seen[key(item)]!r}; it runs once", flush=True)
        else:
            seen[key(item)] = item
    return list(seen.values())


def grid(config: object) -> tuple[list[str], list[int], list[dict]]:
    """The sweep file's spans (canonical labels), seeds and shapes, checked and without repeats."""
    if not isinstance(config, dict):
        raise ValueError(f"sweep config: expected a mapping with output_dir, args, spans, seeds and shapes, got "
                         f"{'an empty file' if config is None else type(config).__name__}")
    for key in ("output_dir", "spans", "seeds"):
        if key not in config:
            raise ValueError(f"sweep config: missing {key!r} (needs output_dir, args, spans, seeds, shapes)")
    unknown = sorted(str(k) for k in config if k not in KEYS)
    if unknown:
        raise ValueError(f"sweep config: unknown key {shown(unknown[0])}; allowed keys are {', '.join(KEYS)}")
    if not isinstance(config["output_dir"], str) or not config["output_dir"] or "\0" in config["output_dir"]:
        raise ValueError(f"sweep config: output_dir={shown(config['output_dir'])}: expected a folder path")
    if not isinstance(config.get("args") or {}, dict):
        raise ValueError(f"sweep config: args={shown(config['args'])}: expected a mapping of run_clm.py arguments")
    shapes = config.get("shapes") if isinstance(config.get("shapes"), list) else []
    for where, given in (("args", config.get("args") or {}),
                         *((f"shapes[{i}]", shape) for i, shape in enumerate(shapes) if isinstance(shape, dict))):
        names: dict[str, object] = {}
        for key in given:  # --num_train_epochs and --num-train-epochs are one argument; argparse takes the last
            if argument_name(key) in names:
                raise ValueError(f"sweep config: {where} gives {shown(names[argument_name(key)])} and {shown(key)}, "
                                 "one run_clm.py argument; keep one")
            names[argument_name(key)] = key
        taken = [key for key in ("span", "seed", "output_dir") if key in names]
        if taken:
            raise ValueError(f"sweep config: {where} sets {taken[0]}, which the sweep gives each run (from spans, "
                             "seeds and output_dir); remove it there")
        held = next((key for key, value in given.items() if "\0" in flag(str(key), value)), None)
        if held is not None:
            raise ValueError(f"sweep config: {where}: {shown(held)} holds a NUL character, which no command line "
                             "can pass")
    labels = _list_of(config, "spans", str, "span labels, e.g. [standard:QKV111, score:1000]")
    try:
        canonical = {label: SpanAttentionConfig.from_label(label).label for label in labels}
    except ValueError as err:
        raise ValueError(f"sweep config: spans: {err}") from None
    spans = [canonical[label] for label in _once(labels, canonical.get, "span")]
    seeds = _once(_list_of(config, "seeds", int, "integer seeds, e.g. [0, 1, 2]"), lambda s: s, "seed")
    bad = next((s for s in seeds if not 0 <= s <= MAX_SEED), None)
    if bad is not None:
        raise ValueError(f"sweep config: seeds: {bad}: allowed seeds are 0 to {MAX_SEED}")
    shapes = _list_of(config, "shapes", dict, "mappings such as {n_head: 4, n_layer: 6}") \
        if config.get("shapes") is not None else [{}]
    for shape in shapes:
        if path_part(shape_name(shape), "name"):
            raise ValueError(f"sweep config: shapes: {shown(shape)}: its folder name {shown(shape_name(shape))} is "
                             "not one folder name (letters, digits and '._=+-'); give such values in args")
    return spans, seeds, _once(shapes, shape_name, "shape")


def plan(config: dict, check: bool = True) -> list[tuple[Path, list[str]]]:
    """(run folder, run_clm.py arguments) for every run of the grid; the grid is checked first, and with
    `check` run_clm.py's arguments of each shape (labels and seeds are checked by the grid)."""
    spans, seeds, shapes = grid(config)
    runs = []  # seed-major: an early stop still leaves every span with the same seeds
    for seed in seeds:
        for shape in shapes:
            for label in spans:
                folder = Path(os.path.expanduser(config["output_dir"])) / shape_name(shape) / span_dir(label) / \
                    f"seed{seed}"
                args = {**shared(config.get("args") or {}, shape), **shape, "span": label, "seed": seed,
                        "output_dir": str(folder)}
                runs.append((folder, [flag(k, v) for k, v in args.items() if v is not None]))  # null: unset
    if check:
        for shape, (folder, run_args) in zip(shapes, runs[: len(shapes) * len(spans) : len(spans)]):
            given = {**shared(config.get("args") or {}, shape), **shape}
            check_args(folder, run_args, {k for k, v in given.items() if isinstance(v, bool)})
    return runs


def shared(args: dict, shape: dict) -> dict:
    """The sweep's args that `shape` leaves to it: a shape's value replaces theirs, however either spells the
    argument (num-train-epochs, num_train_epochs)."""
    named = {argument_name(k) for k in shape}
    return {k: v for k, v in args.items() if argument_name(k) not in named}


def argument_name(key: object) -> str:
    """The name of run_clm.py's argument --key: num-train-epochs and num_train_epochs are one."""
    return str(key).replace("-", "_")


def flag(key: str, value: object) -> str:
    """--key=value as run_clm.py reads it from the command line: a mapping, or a list holding them, as JSON
    (span_schedule, fsdp_config), another list comma-separated (span_layers)."""
    if isinstance(value, dict) or isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        value = json.dumps(value)
    elif isinstance(value, list):
        value = ",".join(map(str, value))
    return f"--{key}={value}"


def names_flag(error: str, key: str) -> bool:
    """Whether `error` names the argument --key (not merely one whose name starts so)."""
    return re.search(rf"--{re.escape(key)}(?![\w-])", error) is not None


def check_args(folder: Path, run_args: list[str], yaml_bools: set[str] = frozenset()) -> None:
    """run_clm.py's verdict on a run's arguments (precision flags are left to the machine that runs);
    `yaml_bools`: the arguments the sweep file gives as true/false, which a hint may blame on YAML."""
    import run_clm

    error = run_clm.argument_error([a for a in run_args if not a.startswith(("--bf16=", "--fp16=", "--tf32="))])
    if error is None:
        return
    if any(names_flag(error, key) for key in yaml_bools):  # not pack.py's --set, which gives text as typed
        error += " (YAML reads a bare yes/no/on/off as true/false: quote it, as 'no')"
    raise ValueError(f"sweep config: the arguments of {folder.parent.parent}: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=nonempty, help="sweep YAML file")
    parser.add_argument("--data_dir", type=nonempty, help="override args.data_dir (the folder of local data files)")
    parser.add_argument("--train_file", type=nonempty,
                        help="override args.train_file (a path, relative to data_dir where given)")
    parser.add_argument("--validation_file", type=nonempty, help="override args.validation_file (as --train_file)")
    parser.add_argument("--tokenizer_name", type=nonempty, help="override args.tokenizer_name (local tokenizer folder)")
    parser.add_argument("--launcher", default=f"{shlex.quote(sys.executable)}",
                        help="command that runs run_clm.py, e.g. 'accelerate launch --num_processes 2'")
    parser.add_argument("--keep_weights", action="store_true",
                        help="keep each finished run's weights and checkpoints (default: only metrics and logs)")
    parser.add_argument("--dry_run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    try:
        launcher = shlex.split(args.launcher)
    except ValueError as err:  # a quote left open
        parser.error(f"--launcher {args.launcher!r}: {err} (read as a shell reads it)")
    if not launcher:
        parser.error("--launcher is empty: give the command that runs run_clm.py, e.g. python")
    if shutil.which(launcher[0]) is None and Path(args.config).is_file():
        parser.error(f"--launcher {args.launcher!r}: no command {launcher[0]!r} here")
    try:
        runs = plan(read_sweep(args))
        states = [state(folder, run_args) for folder, run_args in runs]
    except ValueError as err:
        raise SystemExit(f"sweep: {err}") from None
    print(f"{len(runs)} runs, {states.count('finished')} finished", flush=True)
    with stopped_as_by_ctrl_c():  # a kill of the sweep stops its run too
        for i, ((folder, run_args), status) in enumerate(zip(runs, states), 1):
            if status == "finished":
                continue
            holder = RunLock.holder(RunLock(folder).path)
            if holder is not None:
                print(f"  {folder}: another run is writing into it ({holder}); stopping", flush=True)
                return 1
            if status.startswith("metrics.json"):
                print(f"  {folder}: {status}; " + ("it would be moved aside" if args.dry_run else
                      f"moved to {move_aside(folder / 'metrics.json', 'invalid')}") + ", the run is redone", flush=True)
            elif status != "new":
                print(f"  {folder} holds a run made with other settings ({status}); "
                      + ("it would be moved aside" if args.dry_run else f"moved to {move_aside(folder)}"), flush=True)
            command = [*launcher, str(RUN_CLM), *run_args]
            print(f"[{i}/{len(runs)}] {folder}", flush=True)
            if args.dry_run:
                print("  " + shlex.join(command))
                continue
            folder.mkdir(parents=True, exist_ok=True)
            returncode = run_and_log(command, folder / "train.log")
            if returncode != 0:
                print(f"  failed with exit code {returncode} (its last lines above); full log: {folder / 'train.log'}",
                      flush=True)
                return returncode
            if not args.keep_weights:
                prune(folder)
    return 0


def read_sweep(args: argparse.Namespace) -> object:
    """The one YAML document of the sweep file, with the data and tokenizer paths the command line overrides."""
    if not Path(args.config).is_file():
        raise ValueError(f"{args.config}: {not_a_file(args.config)}")
    try:
        documents = read_yaml(Path(args.config).read_text(), documents=True)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{args.config}: not valid YAML ({type(err).__name__}: {err})") from None
    if len(documents) > 1:
        raise ValueError(f"{args.config}: {len(documents)} YAML documents; sweep.py runs one (recipes/pack.py runs "
                         "a file of several in order)")
    config = documents[0] if documents else None
    for key in ("data_dir", "train_file", "validation_file", "tokenizer_name"):
        if getattr(args, key) and isinstance(config, dict) and isinstance(config.get("args") or {}, dict):
            config["args"] = {**(config.get("args") or {}), key: getattr(args, key)}
    return config


def state(folder: Path, run_args: list[str]) -> str:
    """'finished', 'new' (nothing yet, or an interrupted run of these settings), or what differs."""
    saved, has_run = saved_config(folder)
    if not has_run:
        return "new"
    if saved is None:
        return "its settings are not recorded"
    diffs = differences(saved, expected_config(run_args))
    if diffs:
        return "; ".join(diffs)
    if not (folder / "metrics.json").exists():
        return "new"
    try:
        metrics = read_json(folder / "metrics.json")
    except ValueError as err:
        return f"metrics.json is not whole ({err})"
    if not isinstance(metrics, dict) or not isinstance(metrics.get("config"), dict) or "span" not in metrics:
        return "metrics.json is not a finished run's (no span or config)"
    return "finished"


def expected_config(run_args: list[str]) -> dict:
    """The configuration run_clm.py records for these arguments (without the launcher's world size)."""
    import run_clm

    *all_args, _ = run_clm.parse_args(run_args)  # the last: output arguments
    return run_clm.run_config(all_args, world_size=None)


def run_and_log(command: list[str], log_path: Path) -> int:
    """Run `command`, its output (progress bars included) to the console and appended to `log_path`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       env=os.environ.copy())
            try:
                while chunk := process.stdout.read1(65536):
                    log.write(chunk)
                    log.flush()  # here, where the run is stopped and the log named if it fails
                    sys.stdout.write(decoder.decode(chunk))
                    sys.stdout.flush()
            finally:
                if process.poll() is None:  # the sweep was stopped: so is its run, which the next sweep resumes
                    process.terminate()
                    process.wait()
    except OSError as err:  # a full disk: the run is stopped (the next sweep resumes it), the log named
        room = "make room there" if err.errno in NO_ROOM else "make its folder writable"
        raise SystemExit(f"sweep: {log_path}: cannot be written ({err.strerror}); {room} and run the sweep again") \
            from None
    return process.wait()


def prune(folder: Path) -> None:
    """Drop a finished run's weights, tokenizer files and checkpoints, keeping metrics.json, config.json and
    the log."""
    from run_clm import TOKENIZER_FILES

    for path in folder.iterdir():
        if path.is_symlink():  # put there by hand: what it leads to is not the run's to delete
            continue
        if path.is_dir() and path.name.startswith("checkpoint-"):
            shutil.rmtree(path)
        elif path.suffix in (".safetensors", ".bin", ".pt", ".pth") or path.name in TOKENIZER_FILES:
            path.unlink()


if __name__ == "__main__":
    sys.exit(main())
