#!/usr/bin/env python
"""Tables and figures from sweep runs, in the paper's form.

    python recipes/report.py results/cpu_scale/runs --out results/cpu_scale

Reads every <runs>/<shape>/<span>/seed<k>/metrics.json and writes, per model shape:
report.md and report.csv (final train loss, minimum validation loss, Δ % against the
standard:QKV111 baseline of the same shape with its spread over seeds, runs counted, and
what the comparison can and cannot show at that size), loss_curves_<shape>.png (losses over
steps, and each run's validation Δ % against the baseline run of the same seed, around a zero
line), improvements_<shape>.png (Δ % of minimum validation loss, bars with the seed spread on
an axis no narrower than the paper's effect, so that noise is not blown up) and, for runs made
with --span_diagnostics_every, diagnostics_<shape>_<span>.png (the per-order shares of dQ, dK).
Δ % is (baseline − value) / baseline · 100: positive is better, as in the paper.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pack import TRAINING_KEYS, folded  # noqa: E402
from plot_diagnostics import plot as plot_diagnostics  # noqa: E402
from plot_diagnostics import read_records as read_diagnostics  # noqa: E402
from records import metrics_problems  # noqa: E402
from run_identity import NO_ROOM, data_source, differences, path_argument, read_json, span_dir, write_whole  # noqa: E402

from hf_spanattn import SpanAttentionConfig  # noqa: E402
from hf_spanattn.ops.inputs import shown  # noqa: E402

BASELINE = "standard:QKV111"
PAPER_DELTA = 0.56  # Δ % of score:1000 in the paper (GPT-2 d = 256, 6 layers, 50 epochs of WikiText-2)
PAPER_SCALE = "50 epochs of a GPT-2 with d = 256, T = 512 and batch 128"


def load_runs(runs_dir: Path, say=print) -> dict[str, dict[str, dict[int, dict]]]:
    """{shape: {span label: {seed: metrics}}}; two runs of one setting and seed are an error naming both. A
    metrics.json that a report cannot use (partial, hand-edited, a run without evaluation) is named
    through `say`, with what is wrong, and left out."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    paths: dict = {}
    for path in sorted(folder / "metrics.json" for folder in runs_dir.glob("*/*/seed*/")):
        if not re.fullmatch(r"seed\d+", path.parent.name):
            continue  # a run moved aside by sweep.py (seed0.replaced-1), made with other settings
        if not (path.exists() or path.is_symlink()):  # a link to nothing is named below; glob passed it by
            continue
        data = read_json(path)
        problems = metrics_problems(data)
        if problems:
            say(f"report: leaving out {path}: {'; '.join(problems)}", file=sys.stderr, flush=True)
            continue
        label = SpanAttentionConfig.from_label(data["span"]).label  # score:1,0,0,0 is score:1000
        metrics = {"train_history": [], "eval_history": [], **data, "span": label, "_dir": path.parent}
        seed = metrics["config"]["training"]["seed"]
        key = (path.parts[-4], label, seed)
        if key in paths:
            raise ValueError(f"{paths[key]} and {path} are both span {key[1]} with seed {seed} in shape {key[0]}; "
                             "move one of them out of the runs folder")
        paths[key] = path
        runs[key[0]][key[1]][seed] = metrics
    return runs


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard deviation; one value has no deviation (None)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def delta(baseline: float, value: float) -> float | None:
    """Δ % against `baseline`; None where the baseline is 0, against which no percentage exists, or where the
    percentage is past what a float holds."""
    if not baseline:
        return None
    percent = (baseline - value) / baseline * 100
    return percent if math.isfinite(percent) else None


def table(spans: dict[str, dict[int, dict]]) -> list[dict]:
    """One row per span; Δ % of each seed against the baseline run of the same seed where there is one."""
    base = spans.get(BASELINE, {})
    base_val = statistics.fmean(m["min_val_loss"] for m in base.values()) if base else None
    base_train = statistics.fmean(m["final_train_loss"] for m in base.values()) if base else None
    rows = []
    for label, seeds in sorted(spans.items(), key=lambda kv: (kv[0] != BASELINE, kv[0])):
        val = [m["min_val_loss"] for m in seeds.values()]
        train = [m["final_train_loss"] for m in seeds.values()]
        paired = [d for s, m in seeds.items() if s in base
                  if (d := delta(base[s]["min_val_loss"], m["min_val_loss"])) is not None]
        row = {"span": label, "runs": len(seeds), "seeds": sorted(seeds)}
        row["train_mean"], row["train_std"] = mean_std(train)
        row["val_mean"], row["val_std"] = mean_std(val)
        row["train_delta"] = delta(base_train, row["train_mean"]) if base else None
        row["val_delta"] = delta(base_val, row["val_mean"]) if base else None
        if base and row["val_delta"] is None:
            why = "is 0" if not base_val else f"is {base_val:g} and {label}'s {row['val_mean']:g}"
            print(f"report: the {BASELINE} runs' validation loss {why}, so {label} has no Δ % against them",
                  file=sys.stderr)
        row["val_delta_std"] = mean_std(paired)[1] if paired else None
        row["val_delta_paired"] = paired
        rows.append(row)
    return rows


def perplexity(loss: float) -> str:
    return f"{math.exp(loss):.0f}" if loss < 709 else f"e^{loss:.0f}"  # math.exp overflows past 709.78


def fmt(x: float | None, digits: int = 4, signed: bool = False) -> str:
    return "–" if x is None else (f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}")


def pm(mean: float, std: float | None) -> str:
    return fmt(mean) if std is None else f"{fmt(mean)} ± {fmt(std)}"


def markdown(shape: str, rows: list[dict]) -> str:
    lines = [f"### {shape}", "",
             "| span | runs | final train loss | Δ % | min val loss | Δ % ± seed std | Δ % per seed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        per_seed = ", ".join(f"{d:+.3f}" for d in r["val_delta_paired"]) if r["span"] != BASELINE else ""
        spread = f" ± {fmt(r['val_delta_std'], 3)}" if r["span"] != BASELINE and r["val_delta_std"] is not None else ""
        lines.append(f"| {r['span']} | {r['runs']} | {pm(r['train_mean'], r['train_std'])} | "
                     f"{fmt(r['train_delta'], 3, True)} | {pm(r['val_mean'], r['val_std'])} | "
                     f"{fmt(r['val_delta'], 3, True)}{spread} | {per_seed} |")
    return "\n".join(lines) + "\n"


def delta_limit(rows: list[dict]) -> float:
    """Half-height of the Δ % axis: what the bars, seeds and error bars need, and never less than the
    paper's effect, so that a difference of a few parts per million does not fill the plot."""
    extent = [abs(r["val_delta"]) + (r["val_delta_std"] or 0) for r in rows if r["val_delta"] is not None]
    extent += [abs(d) for r in rows for d in r["val_delta_paired"]]
    return 1.15 * max([PAPER_DELTA, *extent])


def plot(shape: str, spans: dict[str, dict[int, dict]], rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = spans.get(BASELINE, {})
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, seeds in sorted(spans.items(), key=lambda kv: kv[0] != BASELINE):
        style = dict(linestyle="--", color="black") if label == BASELINE else {}
        train, evals = defaultdict(list), defaultdict(list)
        for m in seeds.values():
            for h in m["train_history"]:
                train[h["step"]].append(h["loss"])
            for e in m["eval_history"]:
                evals[e["step"]].append(e["loss"])
        line, = ax.plot(sorted(train), [statistics.fmean(train[s]) for s in sorted(train)], linewidth=1,
                        alpha=0.7, label=f"{label} train", **style)
        ax.plot(sorted(evals), [statistics.fmean(evals[s]) for s in sorted(evals)], marker="o",
                color=line.get_color(), linestyle=style.get("linestyle", "-"), label=f"{label} validation")
        if label == BASELINE:
            continue
        for i, (seed, m) in enumerate(sorted(seeds.items())):
            reference = {e["step"]: e["loss"] for e in base.get(seed, {}).get("eval_history", [])}
            points = [(e["step"], delta(reference[e["step"]], e["loss"])) for e in m["eval_history"]
                      if reference.get(e["step"])]
            if points:
                dax.plot(*zip(*points), marker="o", color=line.get_color(), linestyle=("-", "--", ":", "-.")[i % 4],
                         label=f"{label} seed {seed}")
    ax.set(xlabel="optimizer step", ylabel="loss (mean over seeds)", title=f"{shape}: training and validation loss")
    ax.legend(fontsize=8)
    dax.axhline(0, color="black", linewidth=0.8)
    dax.set_ylim(-delta_limit(rows), delta_limit(rows))
    dax.set(xlabel="optimizer step", ylabel="Δ % validation loss vs QKV111, same seed",
            title="each seed against its baseline run (higher is better)")
    if dax.lines[1:]:
        dax.legend(fontsize=8)
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
    ax.axhline(PAPER_DELTA, color="gray", linestyle=":", linewidth=1)
    ax.annotate(f"paper's score:1000, +{PAPER_DELTA} %", (-0.45, PAPER_DELTA), fontsize=7, color="gray",
                va="bottom")
    ax.set_ylim(-delta_limit(rows), delta_limit(rows))
    ax.set_xlim(-0.5, max(len(others), 1) - 0.5)
    ax.set_xticks(range(len(others)), [r["span"] for r in others], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="Δ % min validation loss vs QKV111 (higher is better)",
           title=f"{shape}: mean over seeds ± std (dots: seeds)")
    fig.tight_layout()
    bars = out / f"improvements_{shape}.png"
    fig.savefig(bars, dpi=120)
    plt.close(fig)

    figures = [curves, bars]
    for label, seeds in sorted(spans.items()):
        first = seeds[min(seeds)]
        jsonl = first.get("_dir", Path()) / "span_diagnostics.jsonl"
        recorded = (first["config"].get("span") or {}).get("span_diagnostics_every")  # else the file is another start's
        if recorded and jsonl.is_file():
            records = read_diagnostics(jsonl)  # lines cut short or edited by hand are named and left out
            if records:
                name = span_dir(label)
                figures.append(plot_diagnostics(records, out / f"diagnostics_{shape}_{name}.png"))
    return figures


def paper_scale(metrics: dict) -> bool:
    """Whether a run had the paper's training: d = 256, T = 512, batch 128, 50 epochs (any heads × layers)."""
    config = metrics["config"]
    model, data, training = config.get("model") or {}, config.get("data") or {}, config["training"]
    batch = [training.get("per_device_train_batch_size"), training.get("gradient_accumulation_steps"),
             metrics.get("world_size") or 1]
    return (model.get("n_embd") == 256 and data.get("block_size") == 512 and None not in batch
            and math.prod(batch) == 128 and training.get("num_train_epochs") == 50)


def setting(metrics: dict) -> dict:
    """The settings of a run other than its span and seed that make its result, as a configuration
    run_identity.differences compares (a pack.py record keeps the training arguments in TRAINING_KEYS), the
    batch split aside as pack.py sets it aside (folded)."""
    config = metrics["config"]
    training = config.get("training") or {}
    return folded({"model": config.get("model") or {}, "data": config.get("data") or {},
                   "training": {k: training.get(k) for k in TRAINING_KEYS if k not in ("seed", "data_seed")},
                   "data_sha256": config.get("data_sha256")})


def verdict(shape: str, spans: dict[str, dict[int, dict]], rows: list[dict]) -> str:
    """What the comparison can and cannot show, from its own numbers."""
    runs = [m for seeds in spans.values() for m in seeds.values()]
    first = spans[BASELINE][min(spans[BASELINE])] if BASELINE in spans else runs[0]  # the one described
    training, data = first["config"]["training"], first["config"].get("data") or {}
    steps = max((h["step"] for h in first["train_history"] + first["eval_history"]), default=0)
    sizes = (training.get("per_device_train_batch_size"), training.get("gradient_accumulation_steps"),
             first.get("world_size") or 1, data.get("block_size"))
    tokens = f"about {steps * math.prod(sizes):,} tokens" if None not in sizes else "tokens"
    source = data_source(data)
    spread_over = ", spread evenly over the whole split" if data.get("token_subset") == "spread" else ""
    times = [m["train_runtime_s"] for m in runs if "train_runtime_s" in m]
    full_scale = all(paper_scale(m) for m in runs)
    lines = [f"**What this comparison can and cannot show.** Each run trained {steps} optimizer steps on "
             f"{tokens} of {source} (blocks of {data.get('block_size')}{spread_over})"
             + (f", {statistics.fmean(times):.0f} s of training per run on this machine." if times else ".")]
    unlike = [f"{label} seed {seed} ({'; '.join(diffs)})" for label, seeds in sorted(spans.items())
              for seed, m in sorted(seeds.items()) if (diffs := differences(setting(first), setting(m), limit=3))]
    if unlike:  # merged from commands of other settings, say: their Δ % is not the span's alone
        lines.append(f"**Not like the others:** these runs differ from {first['span']} seed "
                     f"{first['config']['training']['seed']} in more than the span, so their Δ % measures that "
                     f"too: {', '.join(unlike)}.")
        print(f"report: {shape}: runs of other settings than the span: {', '.join(unlike)}", file=sys.stderr)
    base = next((r for r in rows if r["span"] == BASELINE), None)
    if base is not None:
        spread = ("one seed, so no seed-to-seed spread" if base["val_std"] is None
                  else f"its seed-to-seed spread is ±{base['val_std']:.4f}" if not base["val_mean"]
                  else f"its seed-to-seed spread is ±{base['val_std'] / base['val_mean'] * 100:.3f} %")
        unigram = [m["unigram_val_loss"] for m in spans[BASELINE].values() if m.get("unigram_val_loss") is not None]
        against = (f", against {statistics.fmean(unigram):.3f} from the training tokens' frequencies alone (a "
                   "unigram model, which reads no context)" if unigram else "")
        lines.append(f"The baseline reached validation loss {base['val_mean']:.3f} (perplexity "
                     f"{perplexity(base['val_mean'])}){against}; {spread}.")
    for r in rows:
        if r["span"] == BASELINE or r["val_delta"] is None:
            continue
        spread = r["val_delta_std"]
        if spread is None:
            lines.append(f"{r['span']}: Δ = {r['val_delta']:+.3f} % from one seed, with no spread to judge it by.")
            continue
        judged = ("within twice its seed spread: this run cannot tell the two rules apart"
                  if abs(r["val_delta"]) <= 2 * spread else
                  f"beyond twice its seed spread over {len(r['val_delta_paired'])} seeds"
                  + ("" if full_scale else ": a hint at this size, not a result"))
        lines.append(f"{r['span']}: Δ = {r['val_delta']:+.3f} % ± {spread:.3f} % ({judged}).")
    if full_scale:
        lines.append(f"These runs have the paper's training ({PAPER_SCALE}), so their Δ stands beside the "
                     f"paper's +{PAPER_DELTA} % for score:1000 at 4 heads × 6 layers; the data may differ ({source}).")
    else:
        lines.append(f"The paper's +{PAPER_DELTA} % for score:1000 came from {PAPER_SCALE}; a model this small and "
                     "this briefly trained can neither confirm nor refute it. It does show both rules training the "
                     "same model end to end, and the diagnostics figures show how much of dQ and dK each order of "
                     "span violation carries.")
    return " ".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs_dir", type=path_argument)
    parser.add_argument("--out", type=path_argument, help="output folder (default: the parent of runs_dir)")
    args = parser.parse_args(argv)
    out = args.out or args.runs_dir.parent
    if not args.runs_dir.is_dir():
        what = "not a folder" if args.runs_dir.exists() else "no such folder"
        raise SystemExit(f"report: {args.runs_dir}: {what}")
    if out.exists() and not out.is_dir():
        raise SystemExit(f"report: --out {out}: exists and is not a folder")
    left_out = []

    def say(message: str, **kwargs) -> None:
        print(message, **kwargs)
        left_out.append(message.removeprefix("report: leaving out "))

    try:
        runs = load_runs(args.runs_dir, say)
    except ValueError as err:
        raise SystemExit(f"report: {err}") from None
    if not runs:
        raise SystemExit(f"report: no usable metrics.json under {args.runs_dir}/<shape>/<span>/seed<k>/")
    outputs = ["report.md", "report.csv", *(f"{kind}_{shape}.png" for shape in runs for kind in ("loss_curves",
                                                                                                  "improvements")),
               *(f"diagnostics_{shape}_{span_dir(label)}.png" for shape, spans in runs.items() for label in spans)]
    for path in map(out.joinpath, outputs):  # found before anything is written
        if len(os.fsencode(path.name)) > 255:  # the most a file system allows: matplotlib's "File name too long"
            raise SystemExit(f"report: {shown(str(path), 120)}: a file name of {len(os.fsencode(path.name))} bytes, "
                             "past the 255 a file system allows; give the shape's folder under the runs a shorter name")
        if path.is_dir() or (path.is_symlink() and not path.exists()):
            what = "a folder" if path.is_dir() else "a link to nothing"
            raise SystemExit(f"report: {path} is {what}, where the report writes a file; move it away")
    try:
        text = write_report(runs, out, left_out)
    except OSError as err:  # matplotlib and the OS name no file, or the figure alone
        where = f"{err.filename}: " if err.filename else ""
        room = "make room there" if err.errno in NO_ROOM else "make it writable"
        raise SystemExit(f"report: --out {out}: {where}cannot be written ({err.strerror}); {room}, or give another "
                         "--out") from None
    print("\n".join(text))


def write_report(runs: dict, out: Path, left_out: Sequence[str] = ()) -> list[str]:
    """report.md, report.csv and the figures of `runs` in `out`; the lines of report.md, which end with the runs
    `left_out` ('path: why'; a diverged run, its losses NaN, among them). Each of the two files is written whole or
    not at all (a full disk leaves the report before)."""
    out.mkdir(parents=True, exist_ok=True)
    text, records = ["## Results", "", "Δ %: (baseline − value) / baseline · 100 against standard:QKV111 of the "
                     "same shape (positive is better); ± is the standard deviation over seeds.", ""], []
    for shape, spans in sorted(runs.items()):
        rows = table(spans)
        text.append(markdown(shape, rows))
        text.append(verdict(shape, spans, rows))
        figures = plot(shape, spans, rows, out)
        text.extend(f"![{f.stem}]({f.name})" for f in figures)
        text.append("")
        records += [{"shape": shape, **{k: v for k, v in r.items() if k != "val_delta_paired"}} for r in rows]
    if left_out:
        text += ["**Left out** (a metrics.json the report cannot use):", "", *(f"- {why}" for why in left_out), ""]
    table_text = io.StringIO(newline="")
    writer = csv.DictWriter(table_text, fieldnames=list(records[0]))
    writer.writeheader()
    writer.writerows(records)
    write_whole(out / "report.md", "\n".join(text) + "\n")
    write_whole(out / "report.csv", table_text.getvalue())
    return text


if __name__ == "__main__":
    main()
