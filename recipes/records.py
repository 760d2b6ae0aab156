"""Checks of the JSON the recipes read back: run_clm.py's metrics.json and pack.py's result records.

A record may be partial (a run stopped while writing it, a hand edit) or hostile (a name holding a
path). Each check returns what is wrong, field by field, so that the caller can name the file and
skip the record, redo its run, or refuse it; [] means the record can be used.
"""

from __future__ import annotations

import math
import re
from typing import Any

PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+-]{0,199}")  # one folder or file name: no '/', no leading '.'


def path_part(value: Any, field: str) -> list[str]:
    """[] where `value` can be one folder or file name (nothing that climbs out of a folder)."""
    if isinstance(value, str) and PART.fullmatch(value):
        return []
    return [f"{field}={value!r}: expected a folder name of letters, digits and '._=+-' (no '/', no leading '.')"]


def number(value: Any, field: str, minimum: float | None = None) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        what = "missing" if value is None else f"{value!r}"
        return [f"{field} is {what}: expected a finite number"]
    if minimum is not None and value < minimum:
        return [f"{field}={value!r}: expected a number >= {minimum}"]
    return []


def history(value: Any, field: str) -> list[str]:
    """[] for a list of {step, loss, ...} entries (as run_clm.py writes train_history and eval_history)."""
    if not isinstance(value, list):
        return [f"{field}: expected a list of {{step, loss, ...}} entries, got {type(value).__name__}"]
    for i, entry in enumerate(value):
        if not isinstance(entry, dict):
            return [f"{field}[{i}]: expected an object with step and loss"]
        problems = number(entry.get("step"), f"{field}[{i}].step", 0)
        problems += number(entry.get("loss"), f"{field}[{i}].loss", 0)
        if problems:
            return problems
    return []


def span_label(value: Any, field: str = "span") -> list[str]:
    from hf_spanattn import SpanAttentionConfig

    try:
        SpanAttentionConfig.from_label(value)
        return []
    except (ValueError, TypeError, AttributeError) as err:
        return [f"{field}={value!r}: not a span label ({err})"]


def seed_of(data: dict) -> Any:
    config = data.get("config")
    training = config.get("training") if isinstance(config, dict) else None
    return training.get("seed") if isinstance(training, dict) else None


def metrics_problems(data: Any) -> list[str]:
    """What keeps a run's metrics (run_clm.py's metrics.json, or a pack.py record) out of a report."""
    if not isinstance(data, dict):
        return [f"expected a JSON object, got {type(data).__name__}"]
    problems = span_label(data.get("span"))
    if not isinstance(data.get("config"), dict):
        problems.append("config is missing: expected the run's configuration (config.training.seed at least)")
    elif isinstance(seed_of(data), bool) or not isinstance(seed_of(data), int):
        problems.append(f"config.training.seed is {seed_of(data)!r}: expected an integer")
    for key in ("min_val_loss", "final_train_loss"):
        if data.get(key) is None and key in data:
            problems.append(f"{key} is null: the run recorded no {'evaluation' if key[0] == 'm' else 'training'}")
        else:
            problems += number(data.get(key), key, 0)
    for key in ("train_history", "eval_history"):
        if key in data:
            problems += history(data[key], key)
    if "train_runtime_s" in data:
        problems += number(data["train_runtime_s"], "train_runtime_s", 0)
    return problems


def record_problems(data: Any, name: str | None = None) -> list[str]:
    """metrics_problems and pack.py's own fields; `name`: the one its file or planned run has."""
    from pack import REQUIRED

    problems = metrics_problems(data)
    if not isinstance(data, dict):
        return problems
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        return [f"missing {', '.join(missing)} (not a whole result of recipes/pack.py)", *problems]
    problems += path_part(data["name"], "name") + path_part(data["shape"], "shape")
    if isinstance(data["seed"], bool) or not isinstance(data["seed"], int) or data["seed"] < 0:
        problems.append(f"seed={data['seed']!r}: expected an integer >= 0")
    if name is not None and data["name"] != name:
        problems.append(f"name={data['name']!r}: expected {name!r}")
    problems += number(data["epochs_run"], "epochs_run", 0) + number(data["wall_s"], "wall_s", 0)
    if not isinstance(data["early_stopping"], (dict, type(None))):
        problems.append(f"early_stopping={data['early_stopping']!r}: expected an object or null")
    return problems
