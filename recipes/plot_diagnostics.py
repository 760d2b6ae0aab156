#!/usr/bin/env python
"""Draw span diagnostics over training: one panel per layer, the order shares of dQ stacked
(and of dK in a second row), with the cosine between applied and standard gradient on top.

    python recipes/plot_diagnostics.py runs/x/span_diagnostics.jsonl -o diagnostics.png

A deep model's layers wrap into rows of --columns (8); --layers 0,11 draws only those.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import integer  # noqa: E402
from run_identity import NO_ROOM, KeyGivenTwice, json_value, path_argument  # noqa: E402

ORDER_NAMES = {2: ["∥ (Π_K)", "⊥ (Π_K^⊥)"], 4: ["order 0", "order 1", "order 2", "order 3"]}


def line_problems(record: Any) -> list[str]:
    """What keeps a line of span_diagnostics.jsonl (as SpanAttentionCallback writes it) out of the plot."""
    if not isinstance(record, dict):
        return [f"expected a JSON object, got {type(record).__name__}"]
    problems = []
    for key in ("step", "layer"):
        value = record.get(key)
        if not integer(value, 0, 2**53):  # a float's integers: matplotlib draws steps as floats
            problems.append(f"{key}={value!r}"[:80] + ": expected an integer from 0 to 2^53")
    if not isinstance(record.get("span"), str):
        problems.append(f"span={record.get('span')!r}: expected a span label")
    if not isinstance(record.get("tower", ""), str):
        problems.append(f"tower={record.get('tower')!r}"[:80] + ": expected the path of a composite model's layers")
    for key in ("dq_share", "dk_share"):
        value = record.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                               for x in value):
            problems.append(f"{key}={value!r}: expected a list of numbers (the share of each order)")
    for key in ("cos_q", "cos_k"):
        if isinstance(record.get(key), bool) or not isinstance(record.get(key), (int, float)):
            problems.append(f"{key}={record.get(key)!r}: expected a number")
    return problems


def read_records(path: Path) -> list[dict]:
    """The records of a diagnostics file. A line cut short (a run stopped while writing it) or one that is not a
    whole record (a hand edit) is left out and named, as the callback itself leaves it out on resuming. A step
    written again for a layer (a run resumed from an earlier step into a file that was not cut there, or files
    joined) keeps its later record, as a resumed run's records replace those past its checkpoint; said once."""
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # after a byte order mark, as editors may save
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"{path}: cannot read the diagnostics file ({type(err).__name__}: {err})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json_value(line)
        except KeyGivenTwice as err:
            print(f"{path}:{number}: left out: {err}", file=sys.stderr)
            continue
        except (ValueError, RecursionError):
            print(f"{path}:{number}: left out: not a whole JSON record (a line cut short when the run was stopped?)",
                  file=sys.stderr)
            continue
        problems = line_problems(record)
        if problems:
            print(f"{path}:{number}: left out: {'; '.join(problems)}", file=sys.stderr)
            continue
        records.append(record)
    latest = {(r.get("tower", ""), r["layer"], r["step"]): n for n, r in enumerate(records)}
    if len(latest) < len(records):
        again = sorted({r["step"] for n, r in enumerate(records) if latest[r.get("tower", ""), r["layer"], r["step"]]
                        != n})
        print(f"{path}: steps {', '.join(map(str, again[:10]))}{' ...' if len(again) > 10 else ''} are written more "
              "than once for a layer (a run resumed from an earlier step, or files joined); drawn from their last "
              "records", file=sys.stderr)
        records = [r for n, r in enumerate(records) if latest[r.get("tower", ""), r["layer"], r["step"]] == n]
    return records


def plot(records: list[dict], out: Path, columns: int = 8) -> Path:
    """The figure in `out`: per layer a dQ panel above a dK panel, `columns` layers to a row."""
    fig = figure(records, columns)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def figure(records: list[dict], columns: int = 8) -> plt.Figure:
    """Per layer (of each tower of a composite model) a dQ panel above a dK panel, `columns` layers to a row. A
    layer whose rule changes between ones of 2 parts (∥, ⊥) and of 4 (orders 0-3) draws each stretch with its own
    parts; each part has one colour in every panel, and the legend names every part drawn."""
    by_layer: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in records:
        by_layer[r.get("tower", ""), r["layer"]].append(r)
    layers = sorted(by_layer)
    columns = min(columns, len(layers))
    groups = -(-len(layers) // columns)
    fig, axes = plt.subplots(2 * groups, columns, figsize=(3.2 * columns, 2.75 * 2 * groups + 0.5), sharex=True,
                             sharey=True, squeeze=False)
    for col in range(len(layers) - (groups - 1) * columns, columns):  # the last row's panels past the last layer
        axes[-2][col].set_visible(False)
        axes[-1][col].set_visible(False)
    colours: dict[str, Any] = {}  # part name -> its colour, in every panel
    handles: dict[str, Any] = {}
    for index, (tower, layer) in enumerate(layers):
        group, col = divmod(index, columns)
        rows = sorted(by_layer[tower, layer], key=lambda r: r["step"])
        steps = [r["step"] for r in rows]
        for row, side in enumerate(("dq", "dk")):
            ax = axes[2 * group + row][col]
            for stretch in _stretches(rows, f"{side}_share"):
                shares = list(zip(*(r[f"{side}_share"] for r in stretch)))
                names = ORDER_NAMES.get(len(shares), [f"part {i}" for i in range(len(shares))])
                for name in names:
                    colours.setdefault(name, f"C{len(colours) % 10}")
                drawn = ax.stackplot([r["step"] for r in stretch], *shares, labels=names, alpha=0.85,
                                     colors=[colours[name] for name in names])
                handles.update((name, patch) for name, patch in zip(names, drawn) if name not in handles)
            twin = ax.twinx()
            twin.plot(steps, [r[f"cos_{side[1]}"] for r in rows], color="black", linewidth=1.2)
            twin.set_ylim(-1.05, 1.05)
            if col < columns - 1 and index < len(layers) - 1:
                twin.set_yticklabels([])
            ax.set_title(f"{f'{tower}.{layer}' if tower else f'layer {layer}'}: {side}\n{_rules(rows)}", fontsize=9)
            ax.set_ylim(0, 1)
            if row == 1:
                ax.set_xlabel("step")
                ax.xaxis.set_tick_params(labelbottom=True)
            if col == 0:
                ax.set_ylabel("share of order norms")
    ncol = min(len(handles) + 1, max(1, int(fig.get_figwidth() / 1.6)))  # entries of about 1.6 in to a row
    legend_rows = -(-(len(handles) + 1) // ncol)
    fig.set_figheight(fig.get_figheight() + 0.25 * (legend_rows - 1))
    fig.legend([*handles.values(), plt.Line2D([], [], color="black")], [*handles, "cos(applied, standard)"],
               loc="lower center", ncol=ncol, fontsize=8)
    fig.tight_layout(rect=(0, (0.25 + 0.25 * legend_rows) / fig.get_figheight(), 1, 1))
    return fig


def _rules(rows: list[dict]) -> str:
    """The rules a layer trained with, in order: "score:1000", "simple:10 → score:1000", "a → … → z"."""
    rules = [r["span"] for n, r in enumerate(rows) if n == 0 or r["span"] != rows[n - 1]["span"]]
    return " → ".join(rules if len(rules) <= 2 else [rules[0], "…", rules[-1]])


def _stretches(rows: list[dict], key: str) -> list[list[dict]]:
    """`rows` cut where the number of parts of `key` changes (the rule of the layer changed)."""
    stretches: list[list[dict]] = []
    for r in rows:
        if stretches and len(stretches[-1][-1][key]) == len(r[key]):
            stretches[-1].append(r)
        else:
            stretches.append([r])
    return stretches


def layer_list(text: str) -> list[int]:
    """--layers: comma-separated layer indices."""
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        layers = [-1]
    if any(layer < 0 for layer in layers):
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: expected comma-separated layer indices (0 or more), such as "
                                         "0,5,11")
    return layers


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: expected a whole number of at least 1")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", type=path_argument)
    parser.add_argument("-o", "--output", type=path_argument, help="PNG path (default: next to the JSONL)")
    parser.add_argument("--layers", type=layer_list, help="only these layers, comma-separated (default: all)")
    parser.add_argument("--columns", type=positive, default=8, help="layers to a row of panels (default: 8)")
    args = parser.parse_args(argv)
    out = args.output or args.jsonl.with_suffix(".png")
    formats = sorted(plt.figure().canvas.get_supported_filetypes())
    plt.close("all")
    if out.is_dir() or out.suffix[1:].lower() not in formats:  # no suffix: matplotlib adds .png; another: an error
        others = ", ".join(f".{f}" for f in formats if f != "png")
        parser.error(f"-o {out}: expected the path of the figure, ending in .png (or one of {others})")
    records = read_records(args.jsonl)
    if not records:
        raise SystemExit(f"{args.jsonl}: no diagnostics records")
    if args.layers is not None:
        missing = sorted(set(args.layers) - {r["layer"] for r in records})
        if missing:
            parser.error(f"--layers: {args.jsonl} has no records of layer {', '.join(map(str, missing))}; it has "
                         f"layers {', '.join(map(str, sorted({r['layer'] for r in records})))}")
        records = [r for r in records if r["layer"] in args.layers]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(plot(records, out, args.columns))
    except OSError as err:  # matplotlib's error names no file (a full disk, a folder that takes no files)
        room = "make room there" if err.errno in NO_ROOM else "make its folder writable"
        raise SystemExit(f"-o {out}: cannot be written ({err.strerror}); {room}, or give another -o") from None


if __name__ == "__main__":
    main()
