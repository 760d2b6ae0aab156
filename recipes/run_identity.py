"""A run's identity: the settings that make its result, checked before a run is resumed or reused.

run_clm.py writes `run_config.json` into its output dir when it starts (metrics.json holds the same
configuration under "config"). A checkpoint is resumed, and sweep.py reuses a finished run, only
where that configuration matches the new one. Settings that change only speed, logging to the
console, where files go or how often checkpoints are kept are not part of the identity.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RUN_CONFIG = "run_config.json"
# TrainingArguments that do not change what a run computes
NOT_IDENTITY = {
    "output_dir", "overwrite_output_dir", "run_name", "resume_from_checkpoint", "disable_tqdm", "report_to",
    "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "save_strategy", "save_steps",
    "save_total_limit", "save_on_each_node", "save_only_model", "push_to_hub", "hub_model_id", "hub_strategy",
    "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "log_level", "log_level_replica",
    "log_on_each_node", "dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_persistent_workers",
    "dataloader_pin_memory", "dataloader_multiprocessing_context", "per_device_eval_batch_size",
    "eval_accumulation_steps", "skip_memory_metrics", "local_rank", "ddp_timeout", "torch_empty_cache_steps",
}


def span_dir(label: str) -> str:
    """The folder name of a span label in a sweep's tree (score:1000@per_block → score-1000_per_block)."""
    return label.replace(":", "-").replace("@", "_").replace("+", "_").replace(",", "_")


def read_json(path: Path) -> Any:
    """The JSON in `path`; a file that is not valid JSON (cut short, say) gives an error naming it."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); was the run stopped while writing it?") from None


def identity(config: dict) -> dict:
    """The part of a run configuration (metrics.json's "config") that makes its result."""
    from hf_spanattn import SpanAttentionConfig

    groups = {g: dict(config.get(g) or {}) for g in ("model", "data", "span", "training", "stopping")}
    for key in NOT_IDENTITY:
        groups["training"].pop(key, None)
    data, span = groups["data"], groups["span"]
    if data.get("data_dir"):
        data["data_dir"] = os.path.abspath(data["data_dir"])
    if data.get("tokenizer_name") and os.path.isdir(data["tokenizer_name"]):
        data["tokenizer_name"] = os.path.abspath(data["tokenizer_name"])
    if span.get("span"):
        span["span"] = SpanAttentionConfig.from_label(span["span"]).label
    schedule = span.get("span_schedule")
    if schedule and os.path.isfile(schedule):
        span["span_schedule"] = Path(schedule).read_text()
    if config.get("world_size") is not None:
        groups["world_size"] = config["world_size"]
    return groups


def differences(saved: dict, wanted: dict, limit: int = 6) -> list[str]:
    """'group.key: saved → wanted' for each setting that differs (world_size only where both record it)."""
    a, b = identity(saved), identity(wanted)
    if "world_size" not in a or "world_size" not in b:
        a.pop("world_size", None)
        b.pop("world_size", None)
    out = []
    for group in sorted(set(a) | set(b)):
        x, y = a.get(group), b.get(group)
        if not isinstance(x, dict) or not isinstance(y, dict):
            if x != y:
                out.append(f"{group}: {x!r} → {y!r}")
            continue
        out += [f"{group}.{k}: {x.get(k, '(unset)')!r} → {y.get(k, '(unset)')!r}"
                for k in sorted(set(x) | set(y)) if x.get(k, "(unset)") != y.get(k, "(unset)")]
    return out if len(out) <= limit else [*out[:limit], f"and {len(out) - limit} more"]


def checkpoints(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("checkpoint-*") if p.is_dir()) if folder.is_dir() else []


def saved_config(folder: Path) -> tuple[dict | None, bool]:
    """(the configuration recorded in `folder`, whether the folder holds a run at all)."""
    for name, key in ((RUN_CONFIG, None), ("metrics.json", "config")):
        path = folder / name
        if path.is_file():
            data = read_json(path)
            data = data.get(key) if key and isinstance(data, dict) else data
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a run configuration (a JSON object), got {type(data).__name__}")
            return data, True
    return None, bool(checkpoints(folder))


def write_config(folder: Path, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (RUN_CONFIG + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, default=str) + "\n")
    tmp.replace(folder / RUN_CONFIG)


def move_aside(folder: Path) -> Path:
    """Rename `folder` to `<folder>.replaced-<n>` (the first n free); nothing in it is deleted."""
    folder = folder.resolve()
    if Path.cwd().resolve().is_relative_to(folder):
        raise ValueError(f"{folder}: cannot move aside the current directory or one above it; "
                         "choose another --output_dir")
    n = 1
    while folder.with_name(f"{folder.name}.replaced-{n}").exists():
        n += 1
    target = folder.with_name(f"{folder.name}.replaced-{n}")
    folder.rename(target)
    return target


def resume_point(output_dir: str, config: dict, resume_from_checkpoint: str | None, overwrite: bool) -> str | None:
    """The checkpoint a run with `config` resumes from, or None to start afresh.

    Raises ValueError where `output_dir` (or the folder of `resume_from_checkpoint`) holds a run
    made with other settings, or one whose settings were not recorded. With `overwrite`, a run
    in `output_dir` is moved to `<output_dir>.replaced-<n>` and training starts afresh.
    """
    out = Path(output_dir)
    saved, has_run = saved_config(out)
    if overwrite and has_run and not resume_from_checkpoint:
        moved = move_aside(out)
        print(f"--overwrite_output_dir: the run that was in {out} is now in {moved}", flush=True)
        return None
    folder = Path(resume_from_checkpoint).parent if resume_from_checkpoint else out
    if resume_from_checkpoint:
        saved, has_run = saved_config(folder)
        has_run = True
    if not has_run:
        return None
    afresh = ("Start afresh with a new --output_dir, or with --overwrite_output_dir (which moves the old run "
              f"to {out}.replaced-<n>).")
    if saved is None:
        raise ValueError(f"{folder} holds checkpoints but no {RUN_CONFIG} recording the settings that made them, "
                         f"so they are not resumed. {afresh}")
    diffs = differences(saved, config)
    if diffs:
        raise ValueError(f"{folder} holds a run made with other settings ({'; '.join(diffs)}), so it is not "
                         f"resumed. {afresh}")
    from transformers.trainer_utils import get_last_checkpoint

    return resume_from_checkpoint or (get_last_checkpoint(str(out)) if out.is_dir() else None)
