#!/usr/bin/env python
"""Run a grid of span labels × seeds × model shapes from one YAML file, resumably.

    python recipes/sweep.py recipes/configs/cpu_scale.yaml
    python recipes/sweep.py recipes/configs/paper.yaml --data_dir ../shared/data/wikitext-2-raw-v1 \\
        --launcher "accelerate launch --num_processes 2"

The YAML holds `output_dir`, `args` (run_clm.py arguments shared by every run), `spans`,
`seeds` and `shapes` (a list of run_clm.py arguments such as {n_head: 4, n_layer: 6}). Each
run lives in <output_dir>/<shape>/<span>/seed<k>: a run with a metrics.json is finished and
skipped; an interrupted one resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import codecs
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from hf_spanattn import SpanAttentionConfig

RUN_CLM = Path(__file__).with_name("run_clm.py")


def shape_name(shape: dict) -> str:
    """H4xL6 for {n_head: 4, n_layer: 6}; other keys are appended as key=value."""
    name = f"H{shape.get('n_head', 4)}xL{shape.get('n_layer', 6)}"
    extra = [f"{k}={v}" for k, v in sorted(shape.items()) if k not in ("n_head", "n_layer")]
    return "_".join([name, *extra])


def span_dir(label: str) -> str:
    return label.replace(":", "-").replace("@", "_").replace("+", "_").replace(",", "_")


def plan(config: dict) -> list[tuple[Path, list[str]]]:
    """(run folder, run_clm.py arguments) for every run of the grid; labels are checked first."""
    for key in ("output_dir", "spans", "seeds"):
        if key not in config:
            raise ValueError(f"sweep config: missing {key!r} (needs output_dir, args, spans, seeds, shapes)")
    for label in config["spans"]:
        SpanAttentionConfig.from_label(label)
    runs = []  # seed-major: an early stop still leaves every span with the same seeds
    for seed in config["seeds"]:
        for shape in config.get("shapes") or [{}]:
            for label in config["spans"]:
                folder = Path(config["output_dir"]) / shape_name(shape) / span_dir(label) / f"seed{seed}"
                args = {**config.get("args", {}), **shape, "span": label, "seed": seed, "output_dir": str(folder)}
                runs.append((folder, [f"--{k}={v}" for k, v in args.items()]))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="sweep YAML file")
    parser.add_argument("--data_dir", help="override args.data_dir (local WikiText-2 text files)")
    parser.add_argument("--train_file", help="override args.train_file (its name inside --data_dir)")
    parser.add_argument("--tokenizer_name", help="override args.tokenizer_name (local tokenizer folder)")
    parser.add_argument("--launcher", default=f"{shlex.quote(sys.executable)}",
                        help="command that runs run_clm.py, e.g. 'accelerate launch --num_processes 2'")
    parser.add_argument("--keep_weights", action="store_true",
                        help="keep each finished run's weights and checkpoints (default: only metrics and logs)")
    parser.add_argument("--dry_run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    config = yaml.safe_load(Path(args.config).read_text())
    for key in ("data_dir", "train_file", "tokenizer_name"):
        if getattr(args, key):
            config.setdefault("args", {})[key] = getattr(args, key)
    runs = plan(config)
    done = sum((folder / "metrics.json").exists() for folder, _ in runs)
    print(f"{len(runs)} runs, {done} finished", flush=True)
    for i, (folder, run_args) in enumerate(runs, 1):
        if (folder / "metrics.json").exists():
            continue
        command = [*shlex.split(args.launcher), str(RUN_CLM), *run_args]
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


def run_and_log(command: list[str], log_path: Path) -> int:
    """Run `command`, its output (progress bars included) to the console and appended to `log_path`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
        while chunk := process.stdout.read1(65536):
            log.write(chunk)
            sys.stdout.write(decoder.decode(chunk))
            sys.stdout.flush()
    return process.wait()


def prune(folder: Path) -> None:
    """Drop a finished run's weights and checkpoints, keeping metrics.json, config.json and the log."""
    for path in folder.iterdir():
        if path.is_dir() and path.name.startswith("checkpoint-"):
            shutil.rmtree(path)
        elif path.suffix in (".safetensors", ".bin", ".pt", ".pth"):
            path.unlink()


if __name__ == "__main__":
    sys.exit(main())
