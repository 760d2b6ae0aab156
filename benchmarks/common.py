"""Shared helpers for the benchmark scripts: interleaved timing and peak-memory probes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterator


def time_interleaved(steps: dict[str, Callable[[], None]], repeats: int, warmup: int = 1,
                     device: str = "cpu") -> dict[str, float]:
    """Median seconds per call; the candidates take turns so machine noise hits all alike. On CUDA
    each call is timed with CUDA events around it."""
    samples = time_rounds(steps, repeats, warmup, device)
    return {name: statistics.median(s) for name, s in samples.items()}


def time_rounds(steps: dict[Hashable, Callable[[], None]], repeats: int, warmup: int = 1, device: str = "cpu",
                shuffle: bool = False) -> dict[Hashable, list[float]]:
    """Seconds per call of each step in each of `repeats` rounds, in which every step runs once (in a new random
    order with `shuffle`), after `warmup` calls of each."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples: dict[Hashable, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(repeats):
        if shuffle:
            random.shuffle(order)
        for name in order:
            samples[name].append(_seconds(steps[name], device))
    return samples


def _seconds(step: Callable[[], None], device: str) -> float:
    if device == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_time = time.perf_counter()
    step()
    return time.perf_counter() - start_time


def cuda_peak_bytes(step: Callable[[], None]) -> int:
    """Peak CUDA memory a call allocates above what was allocated before it (after one warm-up call)."""
    import torch

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def at_least(minimum: float, kind: type = int) -> Callable[[str], float]:
    """argparse's type of a count (kind int) or a number (kind float) from `minimum` up; NaN is none."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value >= minimum:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r:.40}: expected {what} >= {minimum}")
        return value

    return parse


def probability(text: str) -> float:
    """argparse's type of a probability, from 0 to 1 (NaN is none)."""
    value = at_least(0, float)(text)
    if not value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r:.40}: expected a number from 0 to 1")
    return value


def span_label(text: str) -> str:
    """argparse's type of a span attention label ('score:1000'), checked before anything runs."""
    from hf_spanattn import SpanAttentionConfig

    try:
        SpanAttentionConfig.from_label(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def device_choice(text: str) -> str:
    """argparse's type of --device: cpu, or cuda where torch sees a CUDA device."""
    import torch

    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("'cuda': torch sees no CUDA device here; expected cpu")
    return text


@contextlib.contextmanager
def backend_variable_kept() -> Iterator[None]:
    """Leave HF_SPANATTN_BACKEND as it was found: the benchmarks pick each backend through it."""
    chosen = os.environ.get("HF_SPANATTN_BACKEND")
    try:
        yield
    finally:
        if chosen is None:
            os.environ.pop("HF_SPANATTN_BACKEND", None)
        else:
            os.environ["HF_SPANATTN_BACKEND"] = chosen


STEADY_HEAP = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def rerun_with_steady_heap(module: str) -> None:
    """Re-run `python -m module` with this process's arguments under glibc settings that keep freed
    memory in the process, unless they are set already. Timings need it: with glibc's defaults a
    candidate that allocates large tensors per call pays page faults on them, by an amount that
    depends on what else the process allocated. Taking turns in one process, the stock eager
    attention at T = 256 then measures 10–18 ms, against 10.4 ms alone or without the faults,
    which flatters every ratio to it. With these settings times compare the computation alone."""
    if any(os.environ.get(key) != value for key, value in STEADY_HEAP.items()):
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], dict(os.environ, **STEADY_HEAP))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Reset the resident-memory high-water mark (Linux ≥ 4.0) and return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_bytes_since(baseline: int) -> int:
    """High-water mark of resident memory since `reset_peak`, above its `baseline`."""
    return _status_kib("VmHWM") * 1024 - baseline


def peak_in_subprocess(module: str, args: list[str]) -> int:
    """Run `python -m module args...` alone; it prints {"peak": bytes} as its last line.

    Memory is measured in a fresh process so that one candidate's high-water mark cannot hide
    another's; a fixed mmap threshold makes every large tensor return to the OS when freed.
    """
    env = {key: value for key, value in os.environ.items() if key not in STEADY_HEAP}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, "-m", module, *args], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]
