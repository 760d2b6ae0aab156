"""Forward + backward of span_attention in two or more versions of the package, side by side in one process.

Each version is a folder that holds `src/hf_spanattn` (a `git archive <commit> | tar -x -C <folder>`, or a
clone); the first is the baseline. Each round calls every (version, label) once, in a random order; a cell
is the median over rounds of the version's time over the baseline's in the same round, so that the
machine's drift hits both alike. Causal (with --no-causal: no mask), 4 heads, D = 64, float32, the CPU,
under a steady heap (see `rerun_with_steady_heap`; --default-heap: glibc's defaults, as a user's process has them).

    mkdir -p /tmp/v/old /tmp/v/new
    git archive c3b5304 | tar -x -C /tmp/v/old && git archive HEAD | tar -x -C /tmp/v/new
    python -m benchmarks.versions /tmp/v/old /tmp/v/new --tokens 512 --seq 128 256 512 \
        --methods score:1000 score:1111 standard:QKV101 score:1000@per_block --repeats 11
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
from collections.abc import Callable

import torch

from benchmarks.common import STEADY_HEAP, at_least, rerun_with_steady_heap, span_label, time_rounds

HEADS, HEAD_DIM = 4, 64


def load(folder: str) -> Callable[..., torch.Tensor]:
    """`span_attention` of the version in `folder`, its modules kept apart from the other versions': each call
    puts them back in sys.modules first, for the imports a version makes inside its functions."""
    src = os.path.join(os.path.abspath(folder), "src")
    if not os.path.isfile(os.path.join(src, "hf_spanattn", "__init__.py")):
        raise SystemExit(f"versions: {folder}: holds no src/hf_spanattn (a git archive of the repository)")
    for name in [m for m in sys.modules if m.split(".")[0] == "hf_spanattn"]:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        attention = importlib.import_module("hf_spanattn.ops.attention")
        config_class = importlib.import_module("hf_spanattn.config").SpanAttentionConfig
    finally:
        sys.path.remove(src)
    modules = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "hf_spanattn"}

    def call(*args, config: str, **kwargs) -> torch.Tensor:
        sys.modules.update(modules)
        return attention.span_attention(*args, config=config_class.from_label(config), **kwargs)

    return call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", help="a folder per version (src/hf_spanattn inside); the first is "
                                                   "the baseline")
    parser.add_argument("--tokens", type=at_least(1), default=8192, help="B·T (B = max(1, B·T // T))")
    parser.add_argument("--seq", type=at_least(1), nargs="+", default=[256, 1024])
    parser.add_argument("--methods", type=span_label, nargs="+", default=["score:1000", "score:1111"])
    parser.add_argument("--repeats", type=at_least(1), default=11)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--default-heap", action="store_true",
                        help="glibc's default heap, as a user's process has it (large tensors then pay their page "
                             "faults on every call), instead of the steady heap that times the computation alone")
    args = parser.parse_args(argv)
    if len(args.folders) < 2:
        parser.error("give at least two folders: the baseline and a version to compare with it")
    if argv is None and not args.default_heap:
        rerun_with_steady_heap("benchmarks.versions")
    ours = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "hf_spanattn"}
    try:
        run(args, [load(folder) for folder in args.folders])
    finally:  # this process's own package, as it was
        for name in [m for m in sys.modules if m.split(".")[0] == "hf_spanattn"]:
            del sys.modules[name]
        sys.modules.update(ours)


def run(args: argparse.Namespace, versions: list[Callable[..., torch.Tensor]]) -> None:
    """The table: a row per (T, method), a column per version after the baseline."""
    heap = "steady" if all(os.environ.get(key) == value for key, value in STEADY_HEAP.items()) else "default"
    print(f"{'causal' if args.causal else 'no mask'}, {HEADS} heads, D={HEAD_DIM}, B*T={args.tokens}, float32, "
          f"cpu, {torch.get_num_threads()} CPU threads, {heap} heap, torch {torch.__version__}; time × "
          f"{args.folders[0]}, median of {args.repeats} paired ratios")
    print("| T | method | baseline ms | " + " | ".join(args.folders[1:]) + " |")
    print("|---:|---|---:|" + "---:|" * (len(versions) - 1))
    gen = torch.Generator().manual_seed(0)
    for t in args.seq:
        b = max(1, args.tokens // t)
        q, k, v = (torch.randn(b, HEADS, t, HEAD_DIM, generator=gen).requires_grad_() for _ in range(3))
        d_out = torch.randn(b, HEADS, t, HEAD_DIM, generator=gen)

        steps = {(i, label): functools.partial(_step, version, (q, k, v), d_out, args.causal, label)
                 for i, version in enumerate(versions) for label in args.methods}
        times = time_rounds(steps, args.repeats, shuffle=True)
        for label in args.methods:
            base = times[0, label]
            ratios = [statistics.median(a / b for a, b in zip(times[i, label], base)) for i in range(1, len(versions))]
            print(f"| {t} | {label} | {statistics.median(base) * 1e3:.1f} | "
                  + " | ".join(f"{r:.3f}" for r in ratios) + " |", flush=True)



def _step(version: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], d_out: torch.Tensor, causal: bool,
          label: str) -> None:
    out = version(*inputs, is_causal=causal, config=label)
    torch.autograd.grad(out, inputs, d_out)


if __name__ == "__main__":
    main()
