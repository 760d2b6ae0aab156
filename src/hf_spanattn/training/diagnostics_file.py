"""The diagnostics file that `SpanAttentionCallback` writes: where its records land, the lock that keeps a second
run out of it, and where a resumed run takes it up."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import stat
import sys
import threading
import time
import warnings
import weakref
from typing import Any

from transformers import TrainerCallback

from hf_spanattn.config import write_whole
from hf_spanattn.integration.registry import trainer_on_stack
from hf_spanattn.ops.inputs import user_stacklevel

logger = logging.getLogger(__name__)
# the diagnostics locks this process holds: real path -> (thread id, callback) of the run that took it
_held: dict[str, tuple[int, weakref.ref]] = {}
_held_guard = threading.Lock()
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, the file-size limit


def log_prefix(layer: int, tower: str = "") -> str:
    """Where a layer's diagnostics go in the logs: span/layer3/ (span/encoder.layer.3/ in a tower of a composite
    model)."""
    return f"span/{tower}.{layer}/" if tower else f"span/layer{layer}/"


def names_a_folder(path: str) -> bool:
    """Whether a file name can only be a folder: '.', '..', or one that ends with a separator."""
    return path.endswith(("/", os.sep)) or os.path.basename(path) in ("", ".", "..")


def inside(output_dir: str, path: str) -> str:
    """`path` relative to `output_dir`; an absolute path outside it keeps only its file name there."""
    root = os.path.abspath(output_dir)
    full = os.path.abspath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        warnings.warn(f"SpanAttentionCallback: diagnostics_file={path!r} lies outside the output dir {root}; "
                      f"writing {os.path.basename(full)} there instead", stacklevel=user_stacklevel())
        full = os.path.join(root, os.path.basename(full))
    return full


def append(path: str, text: str) -> None:
    """`text` appended to the diagnostics file `path`, whole or not at all: a write that fails (a full disk) leaves the
    file as it was and names it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab", buffering=0) as f:  # unbuffered: nothing left to fail again on close
        end, data = f.seek(0, os.SEEK_END), memoryview(text.encode())
        try:
            while data:
                data = data[f.write(data):]
        except OSError as err:
            with contextlib.suppress(OSError):
                f.truncate(end)
            room = "make room there, or " if err.errno in _NO_ROOM else ""
            raise OSError(err.errno, f"SpanAttentionCallback: {path}: cannot write the diagnostics ({err.strerror}); "
                                     f"{room}name another diagnostics_file (diagnostics_every=0 writes none)") from None


def start_records(path: str, step: int, log_history: list) -> None:
    """Where training starts at `step`, so that no step is written twice and nothing else is lost. A fresh run
    (step 0) moves an earlier run's records aside, to <file>.replaced-<n>; so does a resumed run whose records up
    to its step are not those its checkpoint logged (`log_history`): the file is another run's. Otherwise a resumed
    run drops the records past its step (with a line a stop cut short), and keeps every line that is not a record
    as it is, saying so. The file is cut or replaced whole, never left half-written. A file that holds lines but no
    record is refused: it is not a diagnostics file (a name given by mistake), and is left as it is."""
    if not os.path.isfile(path) or (step == 0 and not os.path.getsize(path)):
        return
    with open(path, "rb") as f:
        whole = f.read()
    lines = whole.splitlines(keepends=True)
    parsed = [_json_line(line) for line in lines]
    records = [r if isinstance(r, dict) and _is_step(r.get("step")) else None for r in parsed]
    # a last line without its line end that is not JSON: a record a stop cut short (a whole JSON value is kept)
    cut = len(lines) - 1 if lines and not lines[-1].endswith((b"\n", b"\r")) and parsed[-1] is _NOT_JSON else None
    if not any(records) and any(line.strip() for n, line in enumerate(lines) if n != cut):
        raise ValueError(f"SpanAttentionCallback: {path} holds no diagnostics records (no line is a JSON object with "
                         "a 'step'), so it is not a diagnostics file; name another diagnostics_file (a path relative "
                         "to the Trainer's output_dir) or move the file away")
    if step == 0:
        _move_aside(path, "holds the diagnostics of an earlier run; this run starts at step 0")
        return
    foreign = _not_logged(step, [r for r in records if r is not None and r["step"] <= step], log_history)
    if foreign is not None:
        _move_aside(path, f"holds diagnostics that this run's checkpoint did not log (step {foreign}), so they are "
                          f"another run's; this run resumes at step {step}")
        return
    other = [n + 1 for n, (line, r) in enumerate(zip(lines, records)) if r is None and line.strip() and n != cut]
    kept = [line for n, (line, r) in enumerate(zip(lines, records)) if n != cut and (r is None or r["step"] <= step)]
    if kept and not kept[-1].endswith((b"\n", b"\r")):
        kept[-1] += b"\n"  # the next record goes on a line of its own
    data = b"".join(kept)
    if other:
        warnings.warn(f"SpanAttentionCallback: {path}: line(s) {', '.join(map(str, other[:10]))}"
                      f"{' ...' if len(other) > 10 else ''} are not diagnostics records; kept as they are",
                      stacklevel=user_stacklevel())
    if data != whole:
        logger.info("%s: dropped %d records past step %d, where training resumes", path,
                    len(lines) - len(kept), step)
        if whole.startswith(data):
            os.truncate(path, len(data))  # one step: a stop leaves the file whole
        else:
            write_whole(path, lambda f: f.write(data.decode("utf-8", "surrogateescape")))


def take_lock(path: str, owner: TrainerCallback) -> None:
    """`<path>.lock`, holding the process id, while a run writes diagnostics into `path`: a second run writing into
    the same file (a second Trainer on the same output dir, in another process or another thread) would mix its
    records with the first's and move them aside. A lock whose process is gone, or that this process left (a run
    stopped midway in a notebook: no training of its callback is going on), is taken over; a file of that name that
    is no lock is left as it is."""
    lock = f"{path}.lock"
    with _held_guard:  # threads of this process: one at a time sees who holds the lock and takes it
        _take_lock_file(path, lock)
        _held[os.path.realpath(lock)] = (threading.get_ident(), weakref.ref(owner))


def _take_lock_file(path: str, lock: str) -> None:
    try:
        os.makedirs(os.path.dirname(lock), exist_ok=True)
    except OSError as err:  # a file where a folder goes (FileExistsError, which the loop takes for a lock taken)
        raise OSError(f"SpanAttentionCallback: {path}: cannot make the folder of the diagnostics file "
                      f"({type(err).__name__}: {err.strerror}; is a file in its way?); name another diagnostics_file") \
            from None
    for _ in range(3):
        try:
            holder = _lock_holder(lock)
            if holder is not None:
                raise ValueError(f"SpanAttentionCallback: {path}: another run is writing diagnostics into this file "
                                 f"({holder}, see {lock}); name another diagnostics_file or output_dir, or wait for "
                                 f"it to end. If no such run is going on, delete {lock}")
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)  # gone, or a lock left by a process that is
            with open(lock, "x") as f:
                try:
                    json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                               "process_start": process_start(os.getpid())}, f)
                    f.flush()
                except OSError:  # a full disk: an empty lock left would hold the file as "a process starting now"
                    os.remove(lock)
                    raise
            return
        except FileExistsError:
            continue  # another run took it meanwhile: see who
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and os.access(path, os.W_OK):
                warnings.warn(f"SpanAttentionCallback: {lock}: cannot write the lock of the diagnostics file "
                              f"({err.strerror}); {path} is written without it, so a second run writing into it at "
                              "the same time would not be stopped", stacklevel=user_stacklevel())
                return
            room = "make room there, or " if err.errno in _NO_ROOM else ""
            raise OSError(f"SpanAttentionCallback: {lock}: cannot write the lock of the diagnostics file "
                          f"({type(err).__name__}: {err.strerror}); {room}name another diagnostics_file") from None
    raise ValueError(f"SpanAttentionCallback: {lock}: could not take the lock of the diagnostics file")


def _lock_holder(lock: str) -> str | None:
    """Who holds the diagnostics lock `lock` ("process N on host H"), or None where nobody does (no file, or a lock
    whose process is gone). A file there that is not a lock is refused, not deleted."""
    not_a_lock = ValueError(f"SpanAttentionCallback: {lock} is where the lock of the diagnostics file goes, but it is "
                            "not a lock file; move it away, or name another diagnostics_file")
    if os.path.islink(lock) or os.path.lexists(lock) and not os.path.isfile(lock):
        raise not_a_lock
    try:
        with open(lock, "rb") as f:
            text = f.read(1025)
    except FileNotFoundError:
        return None
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):  # being written, or cut short by a kill: stale once it is old
        if not (b'{"pid": '.startswith(text[:8]) and len(text) < 1024 and b"\n" not in text):
            raise not_a_lock from None
        with contextlib.suppress(FileNotFoundError):
            if abs(time.time() - os.path.getmtime(lock)) < 10:  # a time in the future (a clock set back) is not now
                return "a process starting now"
        return None
    pid, host = (info.get("pid"), info.get("host")) if isinstance(info, dict) else (None, None)
    if not (isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 2**31 and isinstance(host, str)):
        raise not_a_lock
    if host == socket.gethostname():
        if pid == os.getpid():
            thread = _training_thread(lock)
            return None if thread is None else f"thread {thread!r} of this process, {pid}, on {host[:100]}"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
        if info.get("process_start") is not None and process_start(pid) not in (None, info["process_start"]):
            return None  # the id was given to another process since
    return f"process {pid} on {host[:100]}"


def process_start(pid: int) -> str | None:
    """When process `pid` started (Linux: the boot and the clock ticks since it), telling it from a later process given
    the same id; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = f.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{ticks}"
    except (OSError, IndexError):
        return None


def is_a_pipe(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode) or stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _training_thread(lock: str) -> str | None:
    """The name of the thread of this process whose training run holds `lock`, or None where the run that took it
    has stopped or runs on this thread (`running_in`)."""
    ident, owner = _held.get(os.path.realpath(lock), (None, lambda: None))
    return running_in(ident, owner())


def running_in(ident: Any, owner: TrainerCallback | None) -> str | None:
    """The name of thread `ident` where a Trainer holding `owner` is training, or None where none is (the run
    stopped midway, its callback is gone) or `ident` is this thread (which trains one run at a time)."""
    if owner is None or not isinstance(ident, int) or ident == threading.get_ident():
        return None
    trainer = trainer_on_stack(sys._current_frames().get(ident))
    if trainer is None or not any(c is owner for c in trainer.callback_handler.callbacks):
        return None
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


def release_lock(path: str, owner: TrainerCallback) -> None:
    lock = f"{path}.lock"
    with _held_guard:
        held = _held.get(os.path.realpath(lock), (None, lambda: None))[1]
        if held() is not owner:  # another run of this process took it over
            return
        del _held[os.path.realpath(lock)]
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, RecursionError):
        with open(lock) as f:
            mine = json.load(f).get("pid") == os.getpid()
        if mine:
            os.remove(lock)


_NOT_JSON = object()


def _json_line(line: bytes) -> Any:
    """A line of the diagnostics file as JSON (a record is an object with a step: `_is_step`), or _NOT_JSON."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _is_step(step: Any) -> bool:
    """Whether a value read from a file is a step: an int (of any size) or a finite float, not a bool."""
    return (isinstance(step, int) and not isinstance(step, bool)) or (isinstance(step, float) and math.isfinite(step))


def _not_logged(step: int, records: list[dict], log_history: list) -> Any:
    """The step of the first record whose dq shares differ from those `log_history` holds for its step and layer,
    or None (records the history does not mention are taken as they are)."""
    logged: dict[Any, dict] = {}
    for entry in log_history if isinstance(log_history, list) else ():
        if isinstance(entry, dict) and _is_step(entry.get("step")):
            logged.setdefault(entry["step"], {}).update(entry)
    for record in records:
        shares = record.get("dq_share")
        entry = logged.get(record["step"], {})
        tower = record.get("tower")
        prefix = log_prefix(record.get("layer"), tower if isinstance(tower, str) else "")
        for order, share in enumerate(shares if isinstance(shares, list) else ()):
            figure = entry.get(f"{prefix}dq_share{order}")
            if figure is not None and figure != share and not (figure != figure and share != share):  # NaN = NaN
                return record["step"]
    return None


def _move_aside(path: str, why: str) -> None:
    n = 1
    while os.path.lexists(f"{path}.replaced-{n}"):
        n += 1
    os.replace(path, f"{path}.replaced-{n}")
    warnings.warn(f"SpanAttentionCallback: {path} {why}, so they are moved to {path}.replaced-{n} and this run "
                  "writes its own", stacklevel=user_stacklevel())
