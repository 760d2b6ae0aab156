"""Checks of the JSON the recipes read back: run_clm.py's metrics.json and pack.py's result records.

A record may be partial (a run stopped while writing it, a hand edit) or hostile (a name holding a
path). Each check returns what is wrong, field by field, so that the caller can name the file and
skip the record, redo its run, or refuse it; [] means the record can be used.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from run_identity import span_dir

PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._=+-]{0,199}")  # one folder or file name: no '/', no leading '.'


def path_part(value: Any, field: str) -> list[str]:
    """[] where `value` can be one folder or file name (nothing that climbs out of a folder)."""
    if isinstance(value, str) and PART.fullmatch(value):
        return []
    return [f"{field}={value!r}"[:80] + ": expected a folder name of letters, digits and '._=+-' (no '/', no leading "
            "'.')"]


MAX_SEED = 2**32 - 1  # the largest seed NumPy takes (run_clm.py's --seed)


def finite(value: Any) -> bool:
    """A JSON number that is finite, and one of bounded size (an integer of 400 digits is not a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def integer(value: Any, minimum: int = 0, maximum: float = math.inf) -> bool:
    """A JSON integer (not a bool) from `minimum` to `maximum`."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def number(value: Any, field: str, minimum: float | None = None) -> list[str]:
    if not finite(value):
        what = "missing" if value is None else f"{value!r}"[:40]
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
        step = entry.get("step")
        problems = [] if integer(step) else [f"{field}[{i}].step={step!r}"[:80] + ": expected an integer >= 0"]
        problems += number(entry.get("loss"), f"{field}[{i}].loss", 0)
        if entry.get("epoch") is not None:  # merge.py divides by the last one
            problems += number(entry["epoch"], f"{field}[{i}].epoch", 0)
        if problems:
            return problems
    return []


def span_label(value: Any, field: str = "span") -> list[str]:
    from hf_spanattn import SpanAttentionConfig

    try:
        SpanAttentionConfig.from_label(value)
        return []
    except (ValueError, TypeError, AttributeError) as err:
        return [f"{field}={value!r}"[:80] + f": not a span label ({str(err)[:200]})"]


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
    elif not integer(seed_of(data), -math.inf):
        problems.append(f"config.training.seed is {seed_of(data)!r}"[:80] + ": expected an integer")
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
    if isinstance(data.get("config"), dict):
        problems += config_problems(data["config"])
    if data.get("world_size") is not None and not integer(data["world_size"], 1):
        problems.append(f"world_size={data['world_size']!r}"[:80] + ": expected an integer >= 1 (processes)")
    if data.get("unigram_val_loss") is not None:
        problems += number(data["unigram_val_loss"], "unigram_val_loss", 0)
    return problems + run_problems(data)


def run_problems(data: dict) -> list[str]:
    """What is wrong with the fields on how a run went that merge.py's notes read (a pack.py record has them all;
    run_clm.py's metrics.json has early_stopping and device; each is checked where it is given)."""
    problems = []
    for key in ("best_epoch", "epochs_run", "wall_s"):
        if key in data and (data[key] is not None or key != "best_epoch"):
            problems += number(data[key], key, 0)
    if data.get("parallel") is not None and not integer(data["parallel"], 1, 2**63 - 1):
        problems.append(f"parallel={data['parallel']!r}"[:80] + ": expected an integer from 1 to 2^63 - 1 (runs at "
                        "once on the device)")
    if data.get("device") is not None and not isinstance(data["device"], str):
        problems.append(f"device={data['device']!r}"[:80] + ": expected the device's name or null")
    if data.get("backend") is not None and not isinstance(data["backend"], str):
        problems.append(f"backend={data['backend']!r}"[:60] + ": expected the attention backend's name or null")
    problems += stopping_problems(data.get("early_stopping"))
    if isinstance(data.get("early_stopping"), dict) and data["early_stopping"].get("stopped_early") is True:
        problems += number(data.get("best_epoch"), "best_epoch", 0)  # the table of runs that stopped early shows it
    return list(dict.fromkeys(problems))


# the settings a report reads from a run's configuration: counts (integers >= 1), numbers >= 0 and text
COUNTS = (("data", "block_size"), ("training", "per_device_train_batch_size"),
          ("training", "gradient_accumulation_steps"))
NUMBERS = (("training", "num_train_epochs"),)
TEXTS = tuple(("data", key) for key in ("dataset_name", "dataset_config_name", "data_dir", "train_file",
                                        "validation_file", "token_subset"))


def config_problems(config: dict) -> list[str]:
    """What is wrong with the groups of a recorded configuration that a report reads."""
    problems = [f"config.{group} is {type(config[group]).__name__}: expected an object"
                for group in ("model", "data", "training") if config.get(group) is not None
                and not isinstance(config[group], dict)]
    for group, key in (*COUNTS, *NUMBERS, *TEXTS):
        value = (config.get(group) if isinstance(config.get(group), dict) else {}).get(key)
        where = f"config.{group}.{key}"
        if value is None:
            continue
        if (group, key) in COUNTS and not integer(value, 1, 2**63 - 1):
            problems.append(f"{where}={value!r}"[:80] + ": expected an integer from 1 to 2^63 - 1")
        elif (group, key) in NUMBERS:
            problems += number(value, where, 0)
        elif (group, key) in TEXTS and not isinstance(value, str):
            problems.append(f"{where}={value!r}"[:80] + ": expected text or null")
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
    seed = data["seed"]
    if not integer(seed, 0, MAX_SEED):
        problems.append(f"seed={seed!r}"[:60] + f": expected an integer from 0 to {MAX_SEED}")
    elif seed_of(data) is not None and seed_of(data) != seed:
        problems.append(f"seed={seed!r}: config.training.seed is {seed_of(data)!r:.40}, the seed the run was made with")
    if not problems and not span_label(data["span"]):
        expected = result_name(data["shape"], data["span"], seed)
        if data["name"] != expected:
            problems.append(f"name={data['name']!r}: the shape, span and seed make {expected!r}")
    if name is not None and data["name"] != name:
        problems.append(f"name={data['name']!r}"[:80] + f": expected {name!r}")
    if data["best_epoch"] is None:  # metrics_problems allows it where no evaluation stopped the run
        problems += number(None, "best_epoch", 0)
    return problems


def stopping_problems(value: Any) -> list[str]:
    """[] for null (no early stopping) or an object as run_clm.py's early_stopping writes it."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"early_stopping={value!r}"[:80] + ": expected an object or null"]
    patience = value.get("patience")
    problems = [] if integer(patience, 1) else [f"early_stopping.patience={patience!r}"[:80] + ": expected an integer "
                                                ">= 1"]
    problems += number(value.get("num_train_epochs"), "early_stopping.num_train_epochs", 0)
    if not isinstance(value.get("stopped_early"), bool):
        problems.append(f"early_stopping.stopped_early={value.get('stopped_early')!r}"[:80] + ": expected true or "
                        "false")
    elif value["stopped_early"]:
        problems += number(value.get("stopped_at_epoch"), "early_stopping.stopped_at_epoch", 0)
    return problems


def result_name(shape: str, span: str, seed: int) -> str:
    """<shape>__<span folder>__seed<k>: the name recipes/pack.py gives the run of a sweep's tree folder."""
    from pack import result_name as name_of_folder

    from hf_spanattn import SpanAttentionConfig

    return name_of_folder(Path(shape) / span_dir(SpanAttentionConfig.from_label(span).label) / f"seed{seed}")
