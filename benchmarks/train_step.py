"""Train step of a patched GPT-2 at the paper's shape vs the stock model.

GPT-2 with n_embd 256, 4 heads, 6 layers, T = 512, vocab 50257. On the CPU: batch 4, fp32,
forward + backward, times under a steady heap (see `rerun_with_steady_heap`) and peak memory in a
fresh process each. On CUDA: batch 16, bf16 autocast, forward + backward + AdamW step, CUDA
events and the allocator's peak. The stock model runs with its default attention (sdpa) and with
eager; every patched variant starts from the same weights, on each backend asked for (the
environment variable HF_SPANATTN_BACKEND during its steps). Attention dropout is GPT-2's 0.1 unless
--attn-dropout says otherwise. Prints median time and peak memory, ratios from one run.

    python -m benchmarks.train_step
    python -m benchmarks.train_step --device cuda                       # fused and triton
    python -m benchmarks.train_step --device cuda --attn-dropout 0
    TRITON_INTERPRET=1 python -m benchmarks.train_step --backends triton --seq 16 --batch 1 --repeats 1 \
        --methods score:1000                                            # the Triton kernels on the CPU (a check)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.common import (
    at_least,
    backend_variable_kept,
    cuda_peak_bytes,
    device_choice,
    peak_bytes_since,
    peak_in_subprocess,
    probability,
    rerun_with_steady_heap,
    reset_peak,
    span_label,
    time_interleaved,
)
from hf_spanattn import patch_model

METHODS = ["score:1000", "score:1100", "reductionistic:1100", "simple:10", "score:1000@per_block",
           "score:1100@per_block", "score:1111@per_block"]
DEFAULTS = {"cpu": dict(batch=4, repeats=5, backends=["auto"]), "cuda": dict(batch=16, repeats=20,
                                                                            backends=["fused", "triton"])}


def build(name: str, seq: int, batch: int, device: str, attn_dropout: float = 0.1):
    """One train step of model `name`: "sdpa", "eager", or a label on a backend ("score:1000 [triton]")."""
    torch.manual_seed(0)
    config = GPT2Config(n_embd=256, n_head=4, n_layer=6, n_positions=seq, vocab_size=50257, attn_pdrop=attn_dropout)
    model = GPT2LMHeadModel(config).to(device)
    label, _, backend = name.partition(" [")
    backend = backend.rstrip("]") or "auto"
    if name == "eager":
        model.set_attn_implementation("eager")
    elif name != "sdpa":
        patch_model(model, label)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if device == "cuda" else None

    def step():
        os.environ["HF_SPANATTN_BACKEND"] = backend
        model.zero_grad(set_to_none=True)
        autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_choice, choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--methods", type=span_label, nargs="+", default=METHODS)
    parser.add_argument("--seq", type=at_least(1), default=512)
    parser.add_argument("--batch", type=at_least(1))
    parser.add_argument("--repeats", type=at_least(1))
    parser.add_argument("--backends", nargs="+", choices=["auto", "tiles", "fused", "triton"],
                        help="default: auto on the CPU, fused and triton on CUDA")
    parser.add_argument("--attn-dropout", type=probability, default=0.1, help="GPT-2's attn_pdrop (default 0.1)")
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    with backend_variable_kept():
        measure(args)


def measure(args: argparse.Namespace) -> None:
    if args.peak:
        step = build(args.peak, args.seq, args.batch, args.device, args.attn_dropout)
        step()
        baseline = reset_peak()
        step()
        print(json.dumps({"peak": peak_bytes_since(baseline)}))
        return

    names = ["sdpa", "eager", *(m if b == "auto" else f"{m} [{b}]" for m in args.methods for b in args.backends)]
    if args.device == "cpu":
        rerun_with_steady_heap("benchmarks.train_step")
        times = time_interleaved({n: build(n, args.seq, args.batch, "cpu", args.attn_dropout) for n in names},
                                 args.repeats)
        size = ["--seq", str(args.seq), "--batch", str(args.batch), "--attn-dropout", str(args.attn_dropout)]
        peaks = {n: peak_in_subprocess("benchmarks.train_step", ["--peak", n, *size]) for n in names}
        setup = f"fp32, forward+backward, {torch.get_num_threads()} threads; steady heap"
    else:
        print(f"device: {torch.cuda.get_device_name()}")
        steps = {n: build(n, args.seq, args.batch, "cuda", args.attn_dropout) for n in names}
        times = time_interleaved(steps, args.repeats, warmup=3, device="cuda")
        peaks = {n: cuda_peak_bytes(step) for n, step in steps.items()}
        setup = "bf16 autocast, forward+backward+AdamW; CUDA events"
    print(f"GPT-2 n_embd 256, 4 heads, 6 layers, T={args.seq}, batch {args.batch}, vocab 50257, "
          f"attention dropout {args.attn_dropout}, {setup}, "
          f"torch {torch.__version__}; median of {args.repeats} train steps")
    print("| model | step ms | × sdpa | × eager | peak MiB | mem × sdpa |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        print(f"| {n} | {times[n] * 1e3:.1f} | {times[n] / times['sdpa']:.3f} | {times[n] / times['eager']:.3f} | "
              f"{peaks[n] / 2**20:.0f} | {peaks[n] / peaks['sdpa']:.3f} |")


if __name__ == "__main__":
    main()
