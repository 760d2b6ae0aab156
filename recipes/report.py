#!/usr/bin/env python
"""Tables and figures from sweep runs, in the paper's form.

    python recipes/report.py results/cpu_scale/runs --out results/cpu_scale

Reads every <runs>/<shape>/<span>/seed<k>/metrics.json and writes, per model shape:
report.md and report.csv (final train loss, minimum validation loss, Δ % against the
standard:QKV111 baseline of the same shape, mean ± std over seeds, runs counted),
loss_curves.png (validation loss per epoch, mean over seeds, the baseline dashed) and
improvements.png (Δ % of minimum validation loss over the baseline, bars with seed spread).
Δ % is (baseline − value) / baseline · 100: positive is better, as in the paper.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_identity import read_json  # noqa: E402

BASELINE = "standard:QKV111"


def load_runs(runs_dir: Path) -> dict[str, dict[str, dict[int, dict]]]:
    """{shape: {span label: {seed: metrics}}}; two runs of one setting and seed are an error naming both."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    paths: dict = {}
    for path in sorted(runs_dir.glob("*/*/seed*/metrics.json")):
        if not re.fullmatch(r"seed\d+", path.parent.name):
            continue  # a run moved aside by sweep.py (seed0.replaced-1), made with other settings
        metrics = read_json(path)
        seed = metrics["config"]["training"]["seed"]
        key = (path.parts[-4], metrics["span"], seed)
        if key in paths:
            raise ValueError(f"{paths[key]} and {path} are both span {key[1]} with seed {seed} in shape {key[0]}; "
                             "move one of them out of the runs folder")
        paths[key] = path
        runs[key[0]][key[1]][seed] = metrics
    return runs


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def delta(baseline: float, value: float) -> float:
    return (baseline - value) / baseline * 100


def table(spans: dict[str, dict[int, dict]]) -> list[dict]:
    """One row per span; Δ % of each seed against the baseline run of the same seed where there is one."""
    base = spans.get(BASELINE, {})
    base_val = statistics.fmean(m["min_val_loss"] for m in base.values()) if base else None
    base_train = statistics.fmean(m["final_train_loss"] for m in base.values()) if base else None
    rows = []
    for label, seeds in sorted(spans.items(), key=lambda kv: (kv[0] != BASELINE, kv[0])):
        val = [m["min_val_loss"] for m in seeds.values()]
        train = [m["final_train_loss"] for m in seeds.values()]
        paired = [delta(base[s]["min_val_loss"], m["min_val_loss"]) for s, m in seeds.items() if s in base]
        row = {"span": label, "runs": len(seeds), "seeds": sorted(seeds)}
        row["train_mean"], row["train_std"] = mean_std(train)
        row["val_mean"], row["val_std"] = mean_std(val)
        row["train_delta"] = delta(base_train, row["train_mean"]) if base else None
        row["val_delta"] = delta(base_val, row["val_mean"]) if base else None
        row["val_delta_std"] = mean_std(paired)[1] if paired else None
        row["val_delta_paired"] = paired
        rows.append(row)
    return rows


def fmt(x: float | None, digits: int = 4, signed: bool = False) -> str:
    return "–" if x is None else (f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}")


def markdown(shape: str, rows: list[dict]) -> str:
    lines = [f"### {shape}", "",
             "| span | runs | final train loss | Δ % | min val loss | Δ % | Δ % per seed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        per_seed = ", ".join(f"{d:+.2f}" for d in r["val_delta_paired"]) if r["span"] != BASELINE else ""
        lines.append(f"| {r['span']} | {r['runs']} | {fmt(r['train_mean'])} ± {fmt(r['train_std'])} | "
                     f"{fmt(r['train_delta'], 3, True)} | {fmt(r['val_mean'])} ± {fmt(r['val_std'])} | "
                     f"{fmt(r['val_delta'], 3, True)} | {per_seed} |")
    return "\n".join(lines) + "\n"


def plot(shape: str, spans: dict[str, dict[int, dict]], rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, seeds in sorted(spans.items()):
        by_epoch = defaultdict(list)
        for m in seeds.values():
            for e in m["eval_history"]:
                by_epoch[e["epoch"]].append(e["loss"])
        epochs = sorted(by_epoch)
        style = dict(linestyle="--", color="black", linewidth=2) if label == BASELINE else {}
        ax.plot(epochs, [statistics.fmean(by_epoch[e]) for e in epochs], marker="o", label=label, **style)
    ax.set(xlabel="epoch", ylabel="validation loss (mean over seeds)", title=f"{shape}: validation loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    curves = out / f"loss_curves_{shape}.png"
    fig.savefig(curves, dpi=120)
    plt.close(fig)

    others = [r for r in rows if r["span"] != BASELINE and r["val_delta"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(range(len(others)), [r["val_delta"] for r in others],
           yerr=[r["val_delta_std"] or 0 for r in others], capsize=4, color="tab:blue", alpha=0.8)
    for i, r in enumerate(others):
        ax.scatter([i] * len(r["val_delta_paired"]), r["val_delta_paired"], color="black", s=12, zorder=3)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(others)), [r["span"] for r in others], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="Δ % min validation loss vs QKV111 (higher is better)",
           title=f"{shape}: improvement over the standard gradient (dots: seeds)")
    fig.tight_layout()
    bars = out / f"improvements_{shape}.png"
    fig.savefig(bars, dpi=120)
    plt.close(fig)
    return [curves, bars]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", type=Path)
    parser.add_argument("--out", type=Path, help="output folder (default: the parent of runs_dir)")
    args = parser.parse_args(argv)
    out = args.out or args.runs_dir.parent
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(args.runs_dir)
    if not runs:
        raise SystemExit(f"no metrics.json under {args.runs_dir}/<shape>/<span>/seed<k>/")
    text, records = ["## Results", "", "Δ %: (baseline − value) / baseline · 100 against standard:QKV111 of the "
                     "same shape (positive is better); ± is the standard deviation over seeds.", ""], []
    for shape, spans in sorted(runs.items()):
        rows = table(spans)
        text.append(markdown(shape, rows))
        figures = plot(shape, spans, rows, out)
        text.extend(f"![{f.stem}]({f.name})" for f in figures)
        text.append("")
        records += [{"shape": shape, **{k: v for k, v in r.items() if k != "val_delta_paired"}} for r in rows]
    (out / "report.md").write_text("\n".join(text) + "\n")
    with open(out / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    print("\n".join(text))


if __name__ == "__main__":
    main()
