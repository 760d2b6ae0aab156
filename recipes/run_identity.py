"""A run's identity: the settings that make its result, checked before a run is resumed or reused.

run_clm.py writes `run_config.json` into its output dir when it starts (metrics.json holds the same
configuration under "config"). A checkpoint is resumed, and sweep.py reuses a finished run, only
where that configuration matches the new one. Settings that change only speed, logging to the
console, where files go or how often checkpoints are kept are not part of the identity.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hf_spanattn.config import KeyGivenTwice, unique_keys
from hf_spanattn.ops.inputs import shown
from hf_spanattn.training.diagnostics_file import process_start

RUN_CONFIG = "run_config.json"
# recorded by some runs only (earlier ones lack them): compared only where both runs hold them
RECORDED_BY_SOME = ("world_size", "data_sha256", "mixed_precision")
# TrainingArguments that do not change what a run computes
NOT_IDENTITY = {
    "output_dir", "overwrite_output_dir", "run_name", "resume_from_checkpoint", "disable_tqdm", "report_to",
    "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "save_strategy", "save_steps",
    "save_total_limit", "save_on_each_node", "save_only_model", "push_to_hub", "hub_model_id", "hub_strategy",
    "hub_token", "hub_private_repo", "hub_always_push", "hub_revision", "log_level", "log_level_replica",
    "log_on_each_node", "dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_persistent_workers",
    "dataloader_pin_memory", "dataloader_multiprocessing_context", "per_device_eval_batch_size",
    "eval_accumulation_steps", "skip_memory_metrics", "local_rank", "ddp_timeout", "torch_empty_cache_steps",
    "logging_dir",  # Transformers 4 stamps its default with the time: each rerun would be another run
}


def span_dir(label: str) -> str:
    """The folder name of a span label in a sweep's tree (score:1000@per_block → score-1000_per_block)."""
    return label.replace(":", "-").replace("@", "_").replace("+", "_").replace(",", "_")


def nonempty(text: str) -> str:
    """argparse's type of a path or name: an empty one (an unset shell variable) is an error, where Path('') would be
    the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path, or leave the option out")
    return text


def path_argument(text: str) -> Path:
    """argparse's type of a path (see nonempty)."""
    return Path(nonempty(text))


def not_a_file(path: str | Path) -> str:
    """Why `path`, which is not a file, is not one, in words: there is nothing there, a link to nothing, a folder, or
    something else (a pipe, a device)."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return "a link to nothing (or to itself)"
    if not path.exists():
        return "no such file"
    return "not a file: a folder" if path.is_dir() else "not a file (a pipe or a device?)"


def json_value(text: str) -> Any:
    """The JSON in `text` (see unique_keys)."""
    return json.loads(text, object_pairs_hook=unique_keys)


def json_file(path: Path) -> Any:
    """The JSON in the file `path` (see unique_keys); a UTF-8 byte order mark before it, as some editors write, is
    read past. Raises OSError or ValueError."""
    return json_value(Path(path).read_text(encoding="utf-8-sig"))


def read_json(path: Path) -> Any:
    """The JSON in `path` (see json_file); a file that is not valid JSON (cut short, say) gives an error naming it."""
    try:
        return json_file(path)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); was the run stopped while writing it?") from None
    except KeyGivenTwice as err:
        raise ValueError(f"{path}: {err}") from None
    except (ValueError, RecursionError) as err:  # not UTF-8, a number or a nesting past Python's limits
        raise ValueError(f"{path}: not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None
    except OSError as err:  # a folder of that name, say
        raise ValueError(f"{path}: cannot be read ({type(err).__name__}: {err.strerror})") from None


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe reading, except that a key given twice in one mapping is an error (plain YAML keeps the last
    silently), naming the key and the line of each."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *defaults, whose keys this mapping may override
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader names it
                break
            if first is not None:
                lines = f"lines {first + 1} and {key_node.start_mark.line + 1}"
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice ({lines})",
                                                        key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(text: str, documents: bool = False) -> Any:
    """The YAML (or JSON) `text` read as UniqueKeyLoader reads it; with `documents`, the list of its documents.
    Raises yaml.YAMLError."""
    return list(yaml.load_all(text, UniqueKeyLoader)) if documents else yaml.load(text, UniqueKeyLoader)


@contextlib.contextmanager
def stopped_as_by_ctrl_c() -> Iterator[None]:
    """Inside: SIGTERM (kill, timeout, a batch system) ends this process as Ctrl-C does, raising in the main thread,
    so that `finally` stops the runs it started; Python's default would end it at once and leave them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_whole(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all: written to a new hidden file beside it, then renamed over it (a run
    stopped while writing leaves the old file), with the old file's permissions. A file left at that hidden name by
    a stopped write is written over; a folder or link there, put by hand, is left as it is and another name taken."""
    for n in itertools.count():
        tmp = path.with_name(f".{path.name}.tmp" + (f"-{n}" if n else ""))
        try:
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink(missing_ok=True)
            with open(tmp, "x") as f:  # never through a link, nor into a file another writer has open
                try:
                    f.write(text)
                    f.flush()
                except OSError:
                    tmp.unlink(missing_ok=True)
                    raise
            break
        except FileExistsError:
            continue
        except OSError as err:  # a full disk, a folder that takes no files: named, not the hidden file
            raise OSError(err.errno, f"{path}: cannot be written ({err.strerror} when writing {tmp.name} beside it "
                                     "first)") from None
    try:
        if path.exists():  # a file made private (or shared) by hand stays so
            shutil.copymode(path, tmp)
        tmp.replace(path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"{path}: cannot be written ({err.strerror})") from None


def write_json(path: Path, data: Any) -> None:
    """`data` as JSON in `path`, whole or not at all (see write_whole)."""
    write_whole(path, json.dumps(data, indent=2, default=str) + "\n")


def data_files(data: dict, recorded_before_pretrained: bool) -> dict[str, str]:
    """{train_file, validation_file: absolute path} of a recorded data group ({} for a Hub dataset), as
    run_clm.py's DataArguments.files reads them. Records made before paths were accepted (they have no
    validation_split_percentage) always name files, which were used only with a data_dir."""
    folder = data.get("data_dir")
    if recorded_before_pretrained and not folder:
        return {}
    out = {}
    for split in ("train", "validation"):
        name = data.get(f"{split}_file") or (f"{split}.txt" if folder else None)
        if name:
            out[f"{split}_file"] = os.path.abspath(os.path.join(folder or "", os.path.expanduser(name)))
    return out


def data_source(data: dict) -> str:
    """Where a recorded data group's text came from, in words."""
    files = data_files(data, "validation_split_percentage" not in data)
    if files:
        return ", ".join(p if os.path.relpath(p).startswith("..") else os.path.relpath(p) for p in files.values())
    return " ".join(str(x) for x in (data.get("dataset_name"), data.get("dataset_config_name"), "from the Hub") if x)


def identity(config: dict) -> dict:
    """The part of a run configuration (metrics.json's "config") that makes its result. An unset setting
    and one set to None are the same; local paths are made absolute."""
    from hf_spanattn import SpanAttentionConfig

    wrong = next((g for g in ("model", "data", "span", "training", "stopping")
                  if not isinstance(config.get(g) or {}, dict)), None)
    if wrong is not None:
        raise ValueError(f"{wrong}={config[wrong]!r}"[:80] + ": expected an object of settings")
    groups = {g: {k: v for k, v in (config.get(g) or {}).items() if v is not None}
              for g in ("model", "data", "span", "training", "stopping")}
    for key in NOT_IDENTITY:
        groups["training"].pop(key, None)
    data, span = groups["data"], groups["span"]
    recorded = config.get("data") or {}
    before = "validation_split_percentage" not in recorded
    if before:  # recorded before --do_train/--do_eval were read: such runs always trained and evaluated
        groups["training"].update(do_train=True, do_eval=True)
        data.setdefault("validation_split_percentage", 5)
    if "train_file" in recorded or "validation_file" in recorded:
        files = data_files(recorded, before)
        for key in ("data_dir", "train_file", "validation_file", *(("dataset_name", "dataset_config_name")
                                                                   if files else ())):
            data.pop(key, None)
        data.update(files)
    elif data.get("data_dir"):
        data["data_dir"] = os.path.abspath(data["data_dir"])
    for group, key in (("data", "tokenizer_name"), ("model", "model_name_or_path"), ("model", "config_name")):
        name = groups[group].get(key)
        if name and os.path.isdir(name):
            groups[group][key] = os.path.abspath(name)
    if span.get("span"):
        span["span"] = SpanAttentionConfig.from_label(span["span"]).label
    schedule = span.get("span_schedule")
    if schedule and os.path.isfile(schedule):
        span["span_schedule"] = Path(schedule).read_text()
    for key in RECORDED_BY_SOME:
        if config.get(key) is not None:
            groups[key] = config[key]
    return groups


def differences(saved: dict, wanted: dict, limit: int = 6) -> list[str]:
    """'group.key: saved → wanted' for each setting that differs (world_size, mixed_precision and the data files'
    contents only where both record them)."""
    a, b = identity(saved), identity(wanted)
    for key in RECORDED_BY_SOME:
        if key not in a or key not in b:
            a.pop(key, None)
            b.pop(key, None)
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
    """(the configuration recorded in `folder`, whether the folder holds a run at all: a metrics.json or a
    checkpoint; a run_config.json alone is left by a start that failed or was stopped before its first
    checkpoint, and holds nothing to resume)."""
    has_run = (folder / "metrics.json").is_file() or bool(checkpoints(folder))
    for name, key in ((RUN_CONFIG, None), ("metrics.json", "config")):
        path = folder / name
        if path.is_file():
            data = read_json(path)
            data = data.get(key) if key and isinstance(data, dict) else data
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a run configuration (a JSON object), got {type(data).__name__}")
            try:
                identity(data)
            except (ValueError, TypeError, AttributeError) as err:  # a hand edit: a group, path or label wrong
                raise ValueError(f"{path}: not a run configuration as run_clm.py records it ({err})") from None
            return data, has_run
    return None, has_run


def write_config(folder: Path, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / RUN_CONFIG, config)


def move_aside(folder: Path, suffix: str = "replaced") -> Path:
    """Rename `folder` (or a file) to `<folder>.<suffix>-<n>` (the first n free); nothing in it is deleted."""
    folder = folder.parent.resolve() / folder.name  # a symlink is moved itself, not what it points to
    if Path.cwd().resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{folder}: cannot move aside the current directory or one above it; "
                         "choose another --output_dir")
    n = 1
    while folder.with_name(f"{folder.name}.{suffix}-{n}").exists():
        n += 1
    target = folder.with_name(f"{folder.name}.{suffix}-{n}")
    folder.rename(target)
    return target


CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def complete(checkpoint: Path) -> bool:
    """Whether the Trainer finished writing `checkpoint`: trainer_state.json, which it writes last, is there."""
    try:
        return isinstance(json.loads((checkpoint / "trainer_state.json").read_text()), dict)
    except (OSError, ValueError):
        return False


def last_checkpoint(folder: Path, first: bool) -> str | None:
    """The newest complete checkpoint in `folder`. Half-written ones (a run stopped while saving) are
    skipped; the first process moves each out of the Trainer's way, to incomplete-checkpoint-<n>, and
    says so. Nothing is deleted."""
    found = sorted((int(m[1]), p) for p in checkpoints(folder) if (m := CHECKPOINT.fullmatch(p.name)))
    usable = [p for _, p in found if complete(p)]
    for _, path in found:
        if first and not complete(path):
            n, target = 1, path.with_name(f"incomplete-{path.name}")
            while target.exists():  # a name the Trainer's checkpoint rotation does not match
                n += 1
                target = path.with_name(f"incomplete-{path.name}-{n}")
            path.rename(target)
            print(f"{path}: a checkpoint left half-written (no trainer_state.json: the run was stopped while "
                  f"saving it); not resumed, kept as {target}", file=sys.stderr, flush=True)
    return str(usable[-1]) if usable else None


def resume_point(output_dir: str, config: dict, resume_from_checkpoint: str | None, overwrite: bool,
                 first: bool = True) -> str | None:
    """The checkpoint a run with `config` resumes from, or None to start afresh.

    Raises ValueError where `output_dir` (or the folder of `resume_from_checkpoint`) holds a run
    made with other settings, or one whose settings were not recorded. With `overwrite`, a run
    in `output_dir` is moved to `<output_dir>.replaced-<n>` and training starts afresh. The
    newest complete checkpoint is resumed (see last_checkpoint; `first`: the process that moves files).
    """
    out = Path(output_dir)
    if resume_from_checkpoint and not complete(Path(resume_from_checkpoint)):
        raise ValueError(f"--resume_from_checkpoint {resume_from_checkpoint}: "
                         + ("not a complete checkpoint (it has no trainer_state.json, which the Trainer writes last)"
                            if Path(resume_from_checkpoint).is_dir() else "no such folder"))
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
        if saved is not None and differences(saved, config):
            print(f"{out / RUN_CONFIG}: a start with other settings that made no checkpoint; this run starts afresh "
                  "and records its own settings there", flush=True)
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
    return resume_from_checkpoint or last_checkpoint(out, first)


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, the file-size limit
MAX_NAME_BYTES = 240  # of a folder or file that RunLock guards: 255, the most file systems allow, less suffixes


def too_long(path: Path) -> str | None:
    """What in `path` is too long a name for a folder or file with a lock beside it (see MAX_NAME_BYTES), or None;
    the file system would say "File name too long", naming no argument."""
    size = max(len(os.fsencode(part)) for part in Path(path).parts) if Path(path).parts else 0
    if size <= MAX_NAME_BYTES:
        return None
    return (f"a name of {size} bytes in it; allowed are {MAX_NAME_BYTES} (a lock, <name>.lock, and what is moved "
            "aside, <name>.replaced-<n>, go beside it)")


class RunLock:
    """`<folder>.lock`, holding the process id, while a run writes into `folder`: a second run on the same
    folder stops at once and says which process holds it. A lock whose process is gone (a killed run) is
    taken over."""

    def __init__(self, folder: str | Path, flag: str = "--output_dir", kind: str = "folder"):
        folder = Path(os.path.realpath(folder))  # one lock for every path to the folder (a symlink, ..)
        self.path = folder.with_name(folder.name + ".lock")
        self.flag, self.kind = flag, kind  # what a second run is told to change: the flag, a folder or a file

    @staticmethod
    def holder(path: Path) -> str | None:
        """Who holds the lock file `path` ("process N on host H since T"), or None where nobody does."""
        try:
            info = json.loads(path.read_text())
            pid, host = info["pid"], str(info["host"])
            if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31:  # -1, 0: groups of processes
                raise ValueError(f"pid {pid!r} is not a process id")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError):  # being written, cut short, edited: stale once it is old
            try:  # a time in the future (a clock set back) is not "now" either
                return None if abs(time.time() - path.stat().st_mtime) > 10 else f"a process starting now ({path})"
            except FileNotFoundError:
                return None
        if not RunLock.running(pid, host, info.get("process_start")):
            return None
        started = info.get("started", "?")
        return "process {} on {} since {}".format(pid, *(x if isinstance(x, str) and len(x) <= 200 else shown(x)
                                                          for x in (host, started)))  # as edited, cut

    @staticmethod
    def running(pid: int, host: str, since: Any = None) -> bool:
        """Whether process `pid` of `host` may be running: False only where it is provably gone (on this host), or
        dead and not yet reaped (Linux: a killed process whose parent was killed too, where nothing reaps it), or
        where `since` (its process_start) is given and the process of that id started at another time (the id
        reused)."""
        if host == socket.gethostname():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            if since is not None and process_start(pid) not in (None, since):
                return False
            with contextlib.suppress(OSError, IndexError):
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        return True

    def __enter__(self) -> RunLock:
        long = too_long(self.path.with_suffix(""))
        if long:
            raise SystemExit(f"{self.flag} {shown(str(self.path.with_suffix('')), 120)}: {long}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self.unwritable(err) from None
        if self.path.is_symlink() or self.path.exists() and not self.path.is_file():
            raise SystemExit(f"{self.path} is where the lock of {self.path.with_suffix('')} goes, but it is not a lock "
                             f"file this recipe wrote; move it away, or choose another {self.flag}")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": sys.argv,
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "process_start": process_start(os.getpid())}
        for _ in range(5):
            try:
                with open(self.path, "x") as f:
                    try:
                        json.dump(info, f)
                        f.flush()
                    except OSError:  # a full disk: an empty lock left would hold the folder as "a process starting"
                        self.path.unlink(missing_ok=True)
                        raise
                return self
            except FileExistsError:
                holder = self.holder(self.path)
                if holder is not None:
                    raise SystemExit(f"{self.path.with_suffix('')}: another run is writing into this {self.kind} "
                                     f"({holder}); wait for it to end, or choose another {self.flag}. If no "
                                     f"such run is going on, delete {self.path}") from None
                print(f"{self.path}: taking over the lock of a run that ended without removing it", file=sys.stderr)
                self.path.unlink(missing_ok=True)
            except OSError as err:
                raise self.unwritable(err) from None
        raise SystemExit(f"{self.path}: could not take the lock")

    def unwritable(self, err: OSError) -> SystemExit:
        """The error of a lock that cannot be written (a full disk, a folder this user cannot write into)."""
        room = "make room there" if err.errno in NO_ROOM else "make its folder writable"
        return SystemExit(f"{self.flag} {self.path.with_suffix('')}: its lock {self.path} cannot be written "
                          f"({type(err).__name__}: {err.strerror}); {room}, or choose another {self.flag}")

    def __exit__(self, *exc) -> None:
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError):
            pass
