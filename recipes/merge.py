#!/usr/bin/env python
"""Fold the result JSON of many recipes/pack.py commands into one runs tree, and report on it.

    python recipes/merge.py /work/.device/.../results.jsonl runs/pack --out results/paper

Each input is a folder of <name>.json, a .json file or a .jsonl file. Every record goes to
<out>/runs/<shape>/<span>/seed<k>/metrics.json, the tree recipes/sweep.py and recipes/report.py
use (and in which recipes/pack.py skips finished runs). A record already there is left as it
is; a different one for the same run stops the merge before anything is written, unless
--replace. Then recipes/report.py writes <out>/report.md, report.csv and the figures (mean ± std
over seeds, Δ % against standard:QKV111 with the seed spread, loss curves, improvement bars), and
a section on the runs follows in report.md: data, devices and time per epoch, early stopping.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import report
from pack import load_records
from records import metrics_problems
from run_identity import RunLock, data_source, json_file, move_aside, path_argument, span_dir, write_whole

from hf_spanattn import SpanAttentionConfig


def destination(runs_dir: Path, record: dict) -> Path:
    """<runs>/<shape>/<span folder>/seed<k>/metrics.json of a checked record (load_records checks the fields
    that become folder names), and never a path outside `runs_dir`."""
    label = SpanAttentionConfig.from_label(record["span"]).label
    dest = runs_dir / record["shape"] / span_dir(label) / f"seed{record['seed']}" / "metrics.json"
    try:
        resolved = dest.resolve()
        inside = resolved.is_relative_to(runs_dir.resolve())
    except (RuntimeError, OSError) as err:  # a link that leads to itself
        raise ValueError(f"{dest}, where {record['name']} goes, cannot be followed ({err}); move the link away") \
            from None
    if not inside:  # the fields are folder names: a link in the tree
        raise ValueError(f"{dest}, where {record['name']} goes, leads outside {runs_dir} through a link (to "
                         f"{resolved}); move the link away")
    return dest


def at(where: tuple[Path, str]) -> str:
    """A record's place, as load_records(located=True) gives it, in words: the file, and its line where it has one."""
    return f"{where[0]} {where[1]}".rstrip()


def merge(inputs: list[Path], runs_dir: Path, replace: bool = False, write: bool = True) -> tuple[int, int]:
    """Write the inputs' records into the tree: (written, already there). Checks everything before writing; with
    `write` false, only checks."""
    chosen: dict[Path, tuple[dict, tuple[Path, str]]] = {}
    for path in inputs:
        for where, record in load_records(path, located=True):
            dest = destination(runs_dir, record)
            if dest in chosen and chosen[dest][0] != record:
                (file, place), (first_file, first_place) = where, chosen[dest][1]
                if file == first_file:  # two edits of one run side by side
                    raise ValueError(f"{file} holds two different results for {record['name']} ({first_place} and "
                                     f"{place}); keep one of them")
                raise ValueError(f"{at(chosen[dest][1])} and {at(where)} hold different results for {record['name']}; "
                                 "keep one of them")
            chosen[dest] = (record, where)
    writes = []
    for dest, (record, where) in chosen.items():
        blocking = next((p for p in dest.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise ValueError(f"{blocking} is a file where the folder of {record['name']} goes; move it out of "
                             f"{runs_dir}")
        if dest.exists():
            try:
                there = json_file(dest)
                whole = not metrics_problems(there)
            except (OSError, ValueError, RecursionError):  # not JSON, not UTF-8, numbers past Python's limits
                there, whole = None, False
            if there == record:
                continue
            if whole and not replace:
                raise ValueError(f"{dest} already holds another result for {record['name']} (new one from "
                                 f"{at(where)}); pass --replace to put it in place of that one")
        writes.append((dest, record))
    for dest, record in writes if write else []:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():  # replaced, or not a whole result: kept beside the new one
            print(f"{dest} moved to {move_aside(dest, 'replaced')}", flush=True)
        write_whole(dest, json.dumps(record, indent=1) + "\n")  # a full disk leaves no empty result in the tree
    return len(writes), len(chosen) - len(writes)


def notes(runs: dict[str, dict[str, dict[int, dict]]]) -> str:
    """Data, devices and time per epoch, and early stopping, of every run in the tree."""
    keyed = [(shape, span, seed, m) for shape, spans in runs.items() for span, seeds in spans.items()
             for seed, m in seeds.items()]
    records = [m for *_, m in keyed]
    data, speed = defaultdict(int), defaultdict(list)
    for m in records:
        data[data_source(m["config"].get("data") or {})] += 1
        epochs = m.get("epochs_run") or (m["eval_history"][-1].get("epoch") if m.get("eval_history") else 0)
        if epochs and m.get("train_runtime_s") is not None:
            key = (m.get("device") or "?", m.get("backend") or "not recorded", m.get("parallel") or 1)
            speed[key].append(m["train_runtime_s"] / epochs)
    stopped = [(shape, span, seed, m) for shape, span, seed, m in keyed
               if (m.get("early_stopping") or {}).get("stopped_early")]
    lines = ["## Runs", "", "Data: " + "; ".join(f"{k} ({n} runs)" for k, n in sorted(data.items())) + ".", "",
             "| device | attention backend | runs at once | runs | s per epoch of a run (train + eval) "
             "| epochs per s on the device |",
             "|---|---|---:|---:|---:|---:|"]
    for (device, backend, parallel), per_epoch in sorted(speed.items()):
        mean = statistics.fmean(per_epoch)
        rate = f"{parallel / mean:.3f}" if mean else "–"  # a run that recorded no time
        device, backend = (" ".join(cell.replace("|", "/").split()) for cell in (device, backend))  # one cell each
        lines.append(f"| {device} | {backend} | {parallel} | {len(per_epoch)} | {mean:.1f} | {rate} |")
    patience = sorted({(m["early_stopping"]["patience"], m["early_stopping"]["num_train_epochs"])
                       for m in records if m.get("early_stopping")})
    lines.append("")
    if not patience:
        lines.append("Early stopping: off; every run trained for all its epochs.")
        return "\n".join(lines) + "\n"
    lines += ["Early stopping: " + "; ".join(f"patience {p} (stop {p} evaluations after the best validation loss), "
                                          f"the learning-rate schedule of all {e:g} epochs kept"
                                          for p, e in patience) + ". "
              f"{len(stopped)} of {len(records)} runs stopped early:", ""]
    if stopped:
        lines += ["| shape | span | seed | best epoch | stopped at epoch |", "|---|---|---:|---:|---:|"]
        lines += [f"| {shape} | {span} | {seed} | {m['best_epoch']:g} | {m['early_stopping']['stopped_at_epoch']:g} |"
                  for shape, span, seed, m in stopped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", type=path_argument, nargs="+", help="folders of <name>.json, .json or .jsonl files")
    parser.add_argument("--out", type=path_argument, default=Path("results/paper"), help="default: results/paper")
    parser.add_argument("--replace", action="store_true", help="overwrite a different result of the same run")
    args = parser.parse_args(argv)
    blocking = next((p for p in (args.out / "runs", *(args.out / "runs").parents) if p.exists() and not p.is_dir()),
                    None)
    if blocking is not None:
        parser.error(f"--out {args.out}: {blocking} is a file, not a folder")
    runs_dir = args.out / "runs"
    try:
        merge(args.inputs, runs_dir, args.replace, write=False)  # nothing made, not even the lock, for bad inputs
        with RunLock(args.out, "--out"):  # a second merge would write its report over this one's, runs left out
            written, kept = merge(args.inputs, runs_dir, args.replace)
            print(f"{written} results written, {kept} already there, under {runs_dir}")
            if not runs_dir.is_dir():
                raise SystemExit(f"merge: no results in {', '.join(map(str, args.inputs))}, and none under {runs_dir} "
                                 "to report on")
            report.main([str(runs_dir), "--out", str(args.out)])
            with open(args.out / "report.md", "a") as f:
                f.write("\n" + notes(report.load_runs(runs_dir)))
    except ValueError as err:
        raise SystemExit(f"merge: {err}") from None


if __name__ == "__main__":
    main()
