"""Train-step time of a patched GPT-2 with SpanAttentionCallback diagnostics every N steps vs off.

GPT-2 n_embd 256, 4 heads, 2 layers, T = 256, batch 4, vocab 50257, fp32 on the CPU, the stock
Trainer. Rows: no callback, the callback with diagnostics off, diagnostics every 10 steps
(mean over the steps, so a recorded step's cost is spread over 10), under a steady heap (see
`rerun_with_steady_heap`).

    python -m benchmarks.diagnostics
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from benchmarks.common import at_least, rerun_with_steady_heap, span_label
from hf_spanattn import patch_model
from hf_spanattn.training import SpanAttentionCallback


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int):
        self.ids = torch.randint(0, 50257, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], 0.0

    def on_step_begin(self, *args, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run(variant: str, steps: int, seq: int, label: str) -> float:
    torch.manual_seed(0)
    model = patch_model(GPT2LMHeadModel(GPT2Config(n_embd=256, n_head=4, n_layer=2, n_positions=seq)), label)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, per_device_train_batch_size=4, max_steps=steps, report_to=[], use_cpu=True,
                                 save_strategy="no", logging_steps=10, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=Blocks(4 * steps, seq), callbacks=[timer])
        if variant != "none":
            SpanAttentionCallback(diagnostics_every=10 if variant == "every 10" else 0).add_to(trainer)
        trainer.train()
    return sum(timer.times[1:]) / len(timer.times[1:])  # the first step warms up


def step_count(text: str) -> int:
    """argparse's type of --steps: 1 + a multiple of 10, so that the timed steps after the first hold every 10th,
    the steps the diagnostics record, in its share."""
    value = at_least(1)(text)
    if value < 11 or (value - 1) % 10:
        raise argparse.ArgumentTypeError(f"{text!r:.40}: expected 1 + a multiple of 10 (11, 21, 31, ...): the first "
                                         "step warms up, and the diagnostics record every 10th of the others")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=step_count, default=31,
                        help="1 + a multiple of 10 (11, 21, ...); the first warms up and is not counted")
    parser.add_argument("--seq", type=at_least(1), default=256)
    parser.add_argument("--span", type=span_label, default="score:1100")
    args = parser.parse_args()
    rerun_with_steady_heap("benchmarks.diagnostics")
    variants = ["none", "off", "every 10"]
    times = {v: [] for v in variants}
    for _ in range(2):  # interleaved rounds against machine noise
        for v in variants:
            times[v].append(run(v, args.steps, args.seq, args.span))
    best = {v: min(t) for v, t in times.items()}
    print(f"{args.span}, GPT-2 d=256 4 heads 2 layers T={args.seq} batch 4, {args.steps} steps, "
          f"{torch.get_num_threads()} threads; mean step time, best of 2 rounds, steady heap")
    print("| callback | step ms | × no callback |")
    print("|---|---:|---:|")
    for v in variants:
        print(f"| {v} | {best[v] * 1e3:.0f} | {best[v] / best['none']:.3f} |")


if __name__ == "__main__":
    main()
