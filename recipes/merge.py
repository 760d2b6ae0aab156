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
from run_identity import span_dir


def destination(runs_dir: Path, record: dict) -> Path:
    return runs_dir / record["shape"] / span_dir(record["span"]) / f"seed{record['seed']}" / "metrics.json"


def merge(inputs: list[Path], runs_dir: Path, replace: bool = False) -> tuple[int, int]:
    """Write the inputs' records into the tree: (written, already there). Checks everything before writing."""
    chosen: dict[Path, tuple[dict, Path]] = {}
    for path in inputs:
        for record in load_records(path):
            dest = destination(runs_dir, record)
            if dest in chosen and chosen[dest][0] != record:
                raise ValueError(f"{path} and {chosen[dest][1]} hold different results for {record['name']}")
            chosen[dest] = (record, path)
    writes = []
    for dest, (record, path) in chosen.items():
        if dest.exists():
            try:
                same = json.loads(dest.read_text()) == record
            except json.JSONDecodeError:
                same = False
            if same:
                continue
            if not replace:
                raise ValueError(f"{dest} already holds another result for {record['name']} (new one from {path}); "
                                 "pass --replace to overwrite it")
        writes.append((dest, record))
    for dest, record in writes:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(record, indent=1) + "\n")
    return len(writes), len(chosen) - len(writes)


def notes(runs: dict[str, dict[str, dict[int, dict]]]) -> str:
    """Data, devices and time per epoch, and early stopping, of every run in the tree."""
    keyed = [(shape, span, seed, m) for shape, spans in runs.items() for span, seeds in spans.items()
             for seed, m in seeds.items()]
    records = [m for *_, m in keyed]
    data, speed = defaultdict(int), defaultdict(list)
    for m in records:
        d = m["config"]["data"]
        data[f"{d.get('data_dir') or d.get('dataset_config_name')}: {d['train_file']}, {d['validation_file']}"] += 1
        epochs = m.get("epochs_run") or (m["eval_history"][-1]["epoch"] if m["eval_history"] else 0)
        if epochs:
            speed[(m.get("device") or "?", m.get("parallel") or 1)].append(m["train_runtime_s"] / epochs)
    stopped = [(shape, span, seed, m) for shape, span, seed, m in keyed
               if (m.get("early_stopping") or {}).get("stopped_early")]
    lines = ["## Runs", "", "Data: " + "; ".join(f"{k} ({n} runs)" for k, n in sorted(data.items())) + ".", "",
             "| device | runs at once | runs | s per epoch of a run (train + eval) | epochs per s on the device |",
             "|---|---:|---:|---:|---:|"]
    for (device, parallel), per_epoch in sorted(speed.items()):
        mean = statistics.fmean(per_epoch)
        lines.append(f"| {device} | {parallel} | {len(per_epoch)} | {mean:.1f} | {parallel / mean:.3f} |")
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
    parser.add_argument("inputs", type=Path, nargs="+", help="folders of <name>.json, .json or .jsonl files")
    parser.add_argument("--out", type=Path, default=Path("results/paper"), help="default: results/paper")
    parser.add_argument("--replace", action="store_true", help="overwrite a different result of the same run")
    args = parser.parse_args(argv)
    runs_dir = args.out / "runs"
    try:
        written, kept = merge(args.inputs, runs_dir, args.replace)
    except ValueError as err:
        raise SystemExit(f"merge: {err}") from None
    print(f"{written} results written, {kept} already there, under {runs_dir}")
    report.main([str(runs_dir), "--out", str(args.out)])
    with open(args.out / "report.md", "a") as f:
        f.write("\n" + notes(report.load_runs(runs_dir)))


if __name__ == "__main__":
    main()
