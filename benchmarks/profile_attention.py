"""Where the time of span_attention's forward + backward goes: torch.profiler per label and backend.

For each label and backend, after warm-up calls, `--calls` forward+backward calls run under
torch.profiler. The table lists, per call, the kernels that took the most self time (CUDA kernels,
copies included, on a GPU; CPU ops on a CPU): µs, launches and share of the total; then the rest
together, and the split between the package's own Triton kernels (`ops/triton/kernels.py`) and
everything else (gemms of the spans, the float64 Cholesky factors, SDPA's kernels, copies).
Causal attention on (B, H, T, D) inputs; on CUDA by default B 16, H 4, T 1024, D 64, bfloat16.

    python -m benchmarks.profile_attention                   # CUDA, three labels on fused and triton
    python -m benchmarks.profile_attention --labels score:1000 --backends triton --top 20
    python -m benchmarks.profile_attention --device cpu      # a check on the CPU: tiny shape, float32,
                                                             # tiles and triton (Triton's interpreter)

On the CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here where it is
not set), which launches nothing: each launch is counted as one op named after its kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import at_least, device_choice, span_label

LABELS = ["standard:QKV101", "score:1000", "score:1111@per_block"]
TRITON_KERNELS = ("forward_kernel", "keys_kernel", "queries_kernel")  # the kernels of ops/triton/kernels.py
DEFAULTS = {"cuda": dict(batch=16, heads=4, seq=1024, dim=64, dtype="bfloat16", backends=["fused", "triton"]),
            "cpu": dict(batch=1, heads=2, seq=32, dim=16, dtype="float32", backends=["tiles", "triton"])}
COLUMNS = ["label", "backend", "kernel", "µs per call", "launches per call", "share"]


def make_step(label: str, backend: str, shape: tuple[int, int, int, int], device: str,
              dtype: torch.dtype) -> Callable[[], None]:
    """One forward + backward call of causal span_attention on fixed random inputs (imported here:
    after TRITON_INTERPRET is set)."""
    from benchmarks.attention import step_on

    return step_on(label, backend, shape, device, dtype)


def self_times(step: Callable[[], None], calls: int, device: str) -> dict[str, tuple[float, int]]:
    """Kernel (CUDA) or op (CPU) name → (self µs, count), summed over `calls` calls of `step`."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        if on_device != (device == "cuda"):
            continue
        total = totals[event.name]
        total[0] += event.time_range.elapsed_us() if on_device else event.self_cpu_time_total
        total[1] += 1
    return {name: (us, count) for name, (us, count) in totals.items()}


def rows(label: str, backend: str, times: dict[str, tuple[float, int]], calls: int, top: int,
         width: int) -> list[list[str]]:
    """The table's rows for one label and backend: the `top` kernels, the others together, the package's
    Triton kernels, everything else and the total, each per call."""
    everything = sum(us for us, _ in times.values()) or 1.0

    def row(name: str, us: float, count: int) -> list[str]:
        return [label, backend, name, f"{us / calls:.1f}", f"{count / calls:g}", f"{100 * us / everything:.1f} %"]

    def summed(names) -> tuple[float, int]:
        return sum(times[n][0] for n in names), sum(times[n][1] for n in names)

    ranked = sorted(times, key=lambda name: -times[name][0])
    ours = [name for name in times if name in TRITON_KERNELS]
    short = lambda name: (name if len(name) <= width else name[:width - 1] + "…").replace("|", "¦")  # noqa: E731
    table = [row(short(name), *times[name]) for name in ranked[:top]]
    if ranked[top:]:
        table.append(row(f"(the other {len(ranked) - top})", *summed(ranked[top:])))
    table.append(row("= the package's Triton kernels", *summed(ours)))
    table.append(row("= everything else", *summed([n for n in times if n not in ours])))
    table.append(row("= total", *summed(times)))
    return table


@contextlib.contextmanager
def interpreted_launches_recorded() -> Iterator[None]:
    """Under Triton's interpreter a kernel launch runs on the host: each is recorded as one op named
    after its kernel while this lasts."""
    from hf_spanattn.ops.triton import kernels

    class Recorded:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                with record_function(self.name):
                    return self.kernel[grid](*args, **kwargs)

            return launch

    originals = {name: getattr(kernels, name) for name in TRITON_KERNELS}
    try:
        for name, kernel in originals.items():
            setattr(kernels, name, Recorded(name, kernel))
        yield
    finally:
        for name, kernel in originals.items():
            setattr(kernels, name, kernel)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_choice, choices=["cpu", "cuda"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--labels", nargs="+", default=LABELS)
    parser.add_argument("--backends", nargs="+", choices=["auto", "tiles", "fused", "triton"],
                        help="default: fused and triton on CUDA, tiles and triton on the CPU")
    parser.add_argument("--batch", type=at_least(1))
    parser.add_argument("--heads", type=at_least(1))
    parser.add_argument("--seq", type=at_least(1))
    parser.add_argument("--dim", type=at_least(1))
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--calls", type=at_least(1), default=5, help="profiled forward+backward calls")
    parser.add_argument("--top", type=at_least(0), default=12, help="kernels listed per label and backend")
    parser.add_argument("--width", type=at_least(1), default=80, help="kernel names cut to this many characters")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import
    from hf_spanattn.ops.triton import missing

    for label in args.labels:  # checked here, after TRITON_INTERPRET is set
        try:
            span_label(label)
        except argparse.ArgumentTypeError as err:
            parser.error(f"argument --labels: {err}")

    interpreted = args.device == "cpu" and "triton" in args.backends and not missing()
    shape = (args.batch, args.heads, args.seq, args.dim)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}, torch {torch.__version__}; causal, B={args.batch}, H={args.heads}, T={args.seq}, "
          f"D={args.dim}, {args.dtype}; {args.calls} forward+backward calls after {args.warmup}, self "
          + ("CUDA time per kernel" if args.device == "cuda" else "CPU time per op") + ", per call")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|---:|---:|---:|")
    with interpreted_launches_recorded() if interpreted else contextlib.nullcontext():
        for label in args.labels:
            for backend in args.backends:
                step = make_step(label, backend, shape, args.device, getattr(torch, args.dtype))
                for _ in range(args.warmup):
                    step()
                times = self_times(step, args.calls, args.device)
                for cells in rows(label, backend, times, args.calls, args.top, args.width):
                    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
