"""Forward + backward of span_attention vs the stock eager attention and vs SDPA.

Causal, 4 heads, D = 64, B·T = 2048 tokens, fp32 on the CPU. Prints median time and peak
memory per method and T, with ratios to eager measured side by side in one run. Times are
taken under a steady heap (see `rerun_with_steady_heap`), peak memory in a fresh process each.

    python -m benchmarks.attention                 # the full table
    python -m benchmarks.attention --seq 256 512   # some T only
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from benchmarks.common import peak_bytes_since, peak_in_subprocess, rerun_with_steady_heap, reset_peak, time_interleaved
from hf_spanattn import SpanAttentionConfig, span_attention

HEADS, HEAD_DIM, TOKENS = 4, 64, 2048
METHODS = ["score:1000", "score:1100", "score:1111", "reductionistic:1100", "simple:10",
           "score:1000@per_block", "score:1100@per_block", "score:1111@per_block"]


def eager(q, k, v):
    """The stock eager attention: scale·QKᵀ, causal mask, softmax, ·V, all under autograd."""
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]))
    causal = torch.full((t, t), float("-inf")).triu(1)
    return torch.softmax(scores + causal, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attention_fn(name: str):
    if name == "eager":
        return eager
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    config = SpanAttentionConfig.from_label(name)
    return lambda q, k, v: span_attention(q, k, v, is_causal=True, config=config)


def make_step(name: str, seq: int):
    gen = torch.Generator().manual_seed(0)
    shape = (TOKENS // seq, HEADS, seq, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_(True) for _ in range(3))
    weight = torch.randn(shape, generator=gen)
    fn = attention_fn(name)

    def step():
        for x in (q, k, v):
            x.grad = None
        (fn(q, k, v) * weight).sum().backward()

    return step


def _peak_main(name: str, seq: int) -> None:
    step = make_step(name, seq)
    step()  # first call: lazy initialisation and allocator warm-up
    baseline = reset_peak()
    step()
    print(json.dumps({"peak": peak_bytes_since(baseline)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--peak", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        return _peak_main(args.peak[0], int(args.peak[1]))
    rerun_with_steady_heap("benchmarks.attention")

    names = ["eager", "sdpa", *args.methods]
    print(f"causal, {HEADS} heads, D={HEAD_DIM}, B*T={TOKENS}, fp32, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; median of {args.repeats}, forward+backward; steady heap")
    print("| T | method | time ms | × eager | × sdpa | peak MiB | mem × eager |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        times = time_interleaved({n: make_step(n, seq) for n in names}, args.repeats)
        peaks = {n: peak_in_subprocess("benchmarks.attention", ["--peak", n, str(seq)]) for n in names}
        for n in names:
            print(f"| {seq} | {n} | {times[n] * 1e3:.1f} | {times[n] / times['eager']:.2f} | "
                  f"{times[n] / times['sdpa']:.2f} | {peaks[n] / 2**20:.0f} | {peaks[n] / peaks['eager']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
