"""Forward + backward of span_attention vs the stock eager attention and vs SDPA.

Causal (with --no-causal: no mask), 4 heads, D = 64. On the CPU: B·T = 2048 tokens, fp32, times
under a steady heap (see `rerun_with_steady_heap`) and peak memory in a fresh process each. On
CUDA: B·T = 16384 tokens, bf16, CUDA events and the allocator's peak. Prints the median time and
peak memory per method, backend and T, with ratios measured side by side in one run.

    python -m benchmarks.attention                                    # CPU, the full table
    python -m benchmarks.attention --seq 256 512 --backends tiles fused
    python -m benchmarks.attention --seq 256 512 1024 2048 4096 8192 --tokens 8192 --backends tiles fused
    python -m benchmarks.attention --seq 1024 8192 --tokens 8192 --memory  # peak memory only (no timing)
    python -m benchmarks.attention --seq 256 512 1024 --tokens 8192 --memory --no-causal  # every key attended
    python -m benchmarks.attention --device cuda --dtype bfloat16     # GPU, T = 512 … 4096, fused and triton
    TRITON_INTERPRET=1 python -m benchmarks.attention --seq 32 --tokens 64 --backends triton --repeats 1
                                                                      # the Triton kernels on the CPU (a check)
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from benchmarks.common import (
    at_least,
    cuda_peak_bytes,
    device_choice,
    peak_bytes_since,
    peak_in_subprocess,
    rerun_with_steady_heap,
    reset_peak,
    span_label,
    time_interleaved,
)
from hf_spanattn import SpanAttentionConfig, span_attention
from hf_spanattn.ops.attention import BACKENDS

HEADS, HEAD_DIM = 4, 64
METHODS = ["standard:QKV101", "score:1000", "score:1100", "score:1111", "reductionistic:1100", "simple:10",
           "score:1000@per_block", "score:1100@per_block", "score:1111@per_block"]
DEFAULTS = {"cpu": dict(tokens=2048, seq=[256, 512, 1024, 2048], dtype="float32", repeats=7, backends=["auto"]),
            "cuda": dict(tokens=16384, seq=[512, 1024, 2048, 4096], dtype="bfloat16", repeats=10,
                         backends=["fused", "triton"])}


def eager(q, k, v, causal: bool = True):
    """The stock eager attention: scale·QKᵀ, causal mask, softmax, ·V, all under autograd."""
    t = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]))
    if causal:
        scores = scores + torch.full((t, t), float("-inf"), device=q.device, dtype=scores.dtype).triu(1)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attention_fn(name: str, backend: str, causal: bool = True):
    if name == "eager":
        return lambda q, k, v: eager(q, k, v, causal)
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    config = SpanAttentionConfig.from_label(name)
    return lambda q, k, v: span_attention(q, k, v, is_causal=causal, config=config, backend=backend)


def make_step(name: str, backend: str, seq: int, tokens: int, device: str, dtype: torch.dtype, causal: bool = True):
    return step_on(name, backend, (max(1, tokens // seq), HEADS, seq, HEAD_DIM), device, dtype, causal)


def step_on(name: str, backend: str, shape: tuple[int, ...], device: str, dtype: torch.dtype, causal: bool = True):
    """One forward + backward call of `name` on fixed random (B, H, T, D) inputs of `shape`."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(True) for _ in range(3))
    weight = torch.randn(shape, generator=gen).to(device, dtype)
    fn = attention_fn(name, backend, causal)

    def step():
        for x in (q, k, v):
            x.grad = None
        (fn(q, k, v) * weight).sum().backward()

    return step


def candidates(methods: list[str], backends: list[str]) -> list[tuple[str, str]]:
    """(method, backend) pairs: the stock attentions, then each method on each backend."""
    return [("eager", "-"), ("sdpa", "-"), *((m, b) for m in methods for b in backends)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_choice, choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=at_least(1), help="B·T (default 2048 on the CPU, 16384 on CUDA)")
    parser.add_argument("--seq", type=at_least(1), nargs="+")
    parser.add_argument("--methods", type=span_label, nargs="+", default=METHODS)
    parser.add_argument("--backends", nargs="+", choices=["auto", *BACKENDS],
                        help="default: auto on the CPU, fused and triton on CUDA")
    parser.add_argument("--repeats", type=at_least(1))
    parser.add_argument("--memory", action="store_true", help="peak memory only: no timing")
    parser.add_argument("--no-causal", dest="causal", action="store_false", help="no mask: every key attended")
    parser.add_argument("--peak", nargs=3, metavar=("METHOD", "BACKEND", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dtype = getattr(torch, args.dtype)
    if args.peak:
        step = make_step(args.peak[0], args.peak[1], int(args.peak[2]), args.tokens, args.device, dtype, args.causal)
        step()  # first call: lazy initialisation and allocator warm-up
        baseline = reset_peak()
        step()
        print(json.dumps({"peak": peak_bytes_since(baseline)}))
        return
    if args.device == "cpu":
        rerun_with_steady_heap("benchmarks.attention")
    else:
        print(f"device: {torch.cuda.get_device_name()}")

    names = candidates(args.methods, args.backends)
    print(f"{'causal' if args.causal else 'no mask'}, {HEADS} heads, D={HEAD_DIM}, B*T={args.tokens} "
          f"(B = max(1, B*T // T)), {args.dtype}, "
          f"{args.device}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}; "
          + ("peak memory only" if args.memory else f"median of {args.repeats}")
          + ", forward+backward" + ("; steady heap" if args.device == "cpu" else "; CUDA events"))
    print("| T | method | backend | time ms | × sdpa | × eager | peak MiB | mem × sdpa |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        steps = {n: make_step(*n, seq, args.tokens, args.device, dtype, args.causal) for n in names}
        times = ({n: math.nan for n in names} if args.memory
                 else time_interleaved(steps, args.repeats, device=args.device))
        if args.device == "cuda":
            peaks = {n: cuda_peak_bytes(step) for n, step in steps.items()}
        else:
            size = ["--tokens", str(args.tokens), "--dtype", args.dtype, *([] if args.causal else ["--no-causal"])]
            peaks = {n: peak_in_subprocess("benchmarks.attention", ["--peak", *n, str(seq), *size]) for n in names}
        sdpa, eager_ = ("sdpa", "-"), ("eager", "-")
        for n in names:
            timing = ("- | - | -" if args.memory else
                      f"{times[n] * 1e3:.2f} | {times[n] / times[sdpa]:.2f} | {times[n] / times[eager_]:.2f}")
            print(f"| {seq} | {n[0]} | {n[1]} | {timing} | {peaks[n] / 2**20:.1f} | {peaks[n] / peaks[sdpa]:.2f} |",
                  flush=True)
        del steps


if __name__ == "__main__":
    main()
