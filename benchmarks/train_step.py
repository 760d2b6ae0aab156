"""Train step (forward + backward) of a patched GPT-2 at the paper's shape vs the stock model.

GPT-2 with n_embd 256, 4 heads, 6 layers, T = 512, vocab 50257, batch 4, fp32 on the CPU.
The stock model runs with its default attention (sdpa) and with eager; every patched variant
starts from the same weights. Prints median time (steady heap, see `rerun_with_steady_heap`) and
peak memory, ratios from one run.

    python -m benchmarks.train_step
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.common import peak_bytes_since, peak_in_subprocess, rerun_with_steady_heap, reset_peak, time_interleaved
from hf_spanattn import patch_model

METHODS = ["score:1000", "score:1100", "reductionistic:1100", "simple:10", "score:1000@per_block",
           "score:1100@per_block", "score:1111@per_block"]


def build(name: str, seq: int, batch: int):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=256, n_head=4, n_layer=6, n_positions=seq, vocab_size=50257)
    model = GPT2LMHeadModel(config)
    if name == "eager":
        model.set_attn_implementation("eager")
    elif name != "sdpa":
        patch_model(model, name)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        step = build(args.peak, args.seq, args.batch)
        step()
        baseline = reset_peak()
        step()
        print(json.dumps({"peak": peak_bytes_since(baseline)}))
        return

    rerun_with_steady_heap("benchmarks.train_step")
    names = ["sdpa", "eager", *args.methods]
    times = time_interleaved({n: build(n, args.seq, args.batch) for n in names}, args.repeats)
    size = ["--seq", str(args.seq), "--batch", str(args.batch)]
    peaks = {n: peak_in_subprocess("benchmarks.train_step", ["--peak", n, *size]) for n in names}
    print(f"GPT-2 n_embd 256, 4 heads, 6 layers, T={args.seq}, batch {args.batch}, vocab 50257, fp32, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; median of {args.repeats} train steps, "
          "steady heap")
    print("| model | step s | × sdpa | × eager | peak MiB | mem × sdpa |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        print(f"| {n} | {times[n]:.2f} | {times[n] / times['sdpa']:.3f} | {times[n] / times['eager']:.3f} | "
              f"{peaks[n] / 2**20:.0f} | {peaks[n] / peaks['sdpa']:.3f} |")


if __name__ == "__main__":
    main()
