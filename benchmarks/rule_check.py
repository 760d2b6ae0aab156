"""A span rule against the standard gradient on the paper's GPT-2, and its backends against float64.

GPT-2 with d 256, 4 heads, 6 layers, T 512 (or --dim/--heads/--layers/--seq), on blocks of WikiText-2:

- by default, after --warm standard AdamW steps, the rule's gradients of W_Q, W_K and W_V per layer
  on one batch: their norm and cosine against the standard gradient's, then each backend's worst
  relative error (over layers) against the float64 tiles backend's. bf16 autocast on CUDA, fp32 on
  the CPU, no dropout; the float64 reference runs on the same device.
- `--race STEPS`: the stock model and the rule on each backend trained from one start on the same
  batches (attention dropout 0.1, AdamW at 5e-4, bf16 autocast on CUDA), each for at most STEPS
  steps or --seconds; the validation loss every --every steps.

    python -m benchmarks.rule_check --device cuda
    python -m benchmarks.rule_check --device cuda --race 100000 --seconds 62 --batch 64
    python -m benchmarks.rule_check --data ../shared/data --backends fused --batch 2   # on the CPU
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from benchmarks.common import at_least, backend_variable_kept, device_choice, span_label
from hf_spanattn import patch_model
from hf_spanattn.ops.attention import BACKENDS


def blocks(path: Path, tokenizer, seq: int, chars: int, device: str) -> torch.Tensor:
    """The first `chars` characters of a text file as rows of `seq` GPT-2 tokens."""
    ids = torch.tensor(tokenizer(path.read_text(encoding="utf-8")[:chars])["input_ids"])
    return ids[: ids.numel() // seq * seq].view(-1, seq).to(device)


def qkv_gradients(model: GPT2LMHeadModel, batch: torch.Tensor, autocast: bool) -> list[list[torch.Tensor]]:
    """Per layer, the float64 gradients of W_Q, W_K and W_V (GPT-2's c_attn holds them side by side)."""
    model.zero_grad()
    with torch.autocast(batch.device.type, torch.bfloat16, enabled=autocast):
        model(batch, labels=batch).loss.backward()
    return [list(block.attn.c_attn.weight.grad.double().chunk(3, dim=1)) for block in model.transformer.h]


def gradients(args: argparse.Namespace, model: GPT2LMHeadModel, train: torch.Tensor) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    picks = torch.Generator().manual_seed(1)
    for _ in range(args.warm):  # so that attention has left its uniform start
        batch = train[torch.randint(args.batch, len(train), (args.batch,), generator=picks)]
        with torch.autocast(args.device, torch.bfloat16, enabled=args.autocast):
            model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    batch = train[: args.batch]
    standard = qkv_gradients(model, batch, args.autocast)
    reference = GPT2LMHeadModel(model.config).to(args.device, torch.float64)
    reference.load_state_dict(model.state_dict())
    patch_model(reference, args.rule)
    os.environ["HF_SPANATTN_BACKEND"] = "tiles"
    exact = qkv_gradients(reference, batch, autocast=False)
    print(f"{args.rule} against the standard gradient after {args.warm} standard steps (float64 tiles, "
          f"batch {args.batch}):\n\n| layer | ‖dW_Q‖/std | ‖dW_K‖/std | ‖dW_V‖/std | cos dW_Q | cos dW_K | cos dW_V |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for layer, (rule, std) in enumerate(zip(exact, standard)):
        ratios = [f"{(r.norm() / s.norm()).item():.4f}" for r, s in zip(rule, std)]
        cosines = [f"{torch.nn.functional.cosine_similarity(r.flatten(), s.flatten(), 0).item():.4f}"
                   for r, s in zip(rule, std)]
        print(f"| {layer} | " + " | ".join(ratios + cosines) + " |")
    patch_model(model, args.rule)
    print(f"\n| backend | dW_Q | dW_K | dW_V |  (worst relative error over layers against float64 tiles, "
          f"{'bf16 autocast' if args.autocast else 'fp32'})\n|---|---:|---:|---:|")
    for backend in args.backends:
        os.environ["HF_SPANATTN_BACKEND"] = backend
        got = qkv_gradients(model, batch, args.autocast)
        worst = [max(((g[i] - e[i]).norm() / e[i].norm()).item() for g, e in zip(got, exact)) for i in range(3)]
        print(f"| {backend} | " + " | ".join(f"{w:.2e}" for w in worst) + " |")


def race(args: argparse.Namespace, start: dict, config: GPT2Config, train: torch.Tensor,
         validation: torch.Tensor) -> None:
    print(f"validation loss (step: loss) of models trained from one start, batch {args.batch}, "
          f"at most {args.seconds:g} s each:\n")
    for label in ["stock"] + [f"{args.rule} on {b}" for b in args.backends]:
        model = GPT2LMHeadModel(config).to(args.device)
        model.load_state_dict(start)
        if label != "stock":
            patch_model(model, args.rule)
            os.environ["HF_SPANATTN_BACKEND"] = label.rsplit(" ", 1)[1]
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
        picks, began, points = torch.Generator().manual_seed(1), time.monotonic(), []
        for step in range(1, args.race + 1):
            batch = train[torch.randint(0, len(train), (args.batch,), generator=picks)]
            with torch.autocast(args.device, torch.bfloat16, enabled=args.autocast):
                model(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out_of_time = time.monotonic() - began > args.seconds
            if step % args.every == 0 or out_of_time or step == args.race:
                points.append(f"{step}: {validation_loss(model, validation, args.autocast):.3f}")
            if out_of_time:
                break
        print(f"{label:28s} " + ", ".join(points) + f"  ({time.monotonic() - began:.0f} s)", flush=True)


@torch.no_grad()
def validation_loss(model: GPT2LMHeadModel, validation: torch.Tensor, autocast: bool) -> float:
    model.eval()
    with torch.autocast(validation.device.type, torch.bfloat16, enabled=autocast):
        losses = [model(rows, labels=rows).loss.item() for rows in validation.split(16)]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", type=device_choice, choices=["cpu", "cuda"])
    parser.add_argument("--rule", type=span_label, default="score:1000")
    parser.add_argument("--backends", default=None, help="comma-separated (default: triton,fused on CUDA, tiles)")
    parser.add_argument("--data", type=Path, default=Path(".data"),
                        help="a folder with gpt2-tokenizer/ and wikitext-2-v1/{train,validation}.txt")
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--warm", type=at_least(0), default=200,
                        help="standard steps before the gradients are compared")
    parser.add_argument("--race", type=at_least(0), default=0, help="train for at most this many steps instead")
    parser.add_argument("--seconds", type=at_least(0, float), default=60.0)
    parser.add_argument("--every", type=at_least(1), default=100)
    parser.add_argument("--chars", type=at_least(1), default=None,
                        help="characters of the train split to read (default: 2 M, or 12 M, the whole, for --race)")
    parser.add_argument("--seq", type=at_least(1), default=512)
    parser.add_argument("--dim", type=at_least(1), default=256)
    parser.add_argument("--heads", type=at_least(1), default=4)
    parser.add_argument("--layers", type=at_least(1), default=6)
    args = parser.parse_args(argv)
    given = args.backends
    args.backends = (args.backends or ("triton,fused" if args.device == "cuda" else "tiles")).split(",")
    args.autocast = args.device == "cuda"
    unknown = [name for name in args.backends if name not in ("auto", *BACKENDS)]
    if unknown:  # else named only after the runs before it
        parser.error(f"--backends {given!r:.80}: {', '.join(repr(name)[:40] for name in unknown)}: allowed are auto, "
                     f"{', '.join(BACKENDS)} (comma-separated)")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim}: expected a multiple of --heads {args.heads}")
    if not (args.data / "gpt2-tokenizer").is_dir():
        parser.error(f"--data {args.data}: no gpt2-tokenizer folder in it (see scripts/fetch_gpu_data.sh)")
    for name in ("train.txt", "validation.txt") if args.race else ("train.txt",):
        if not (args.data / "wikitext-2-v1" / name).is_file():
            parser.error(f"--data {args.data}: no wikitext-2-v1/{name} in it (see scripts/fetch_gpu_data.sh)")
    tokenizer = AutoTokenizer.from_pretrained(args.data / "gpt2-tokenizer")
    text = args.data / "wikitext-2-v1"
    chars = args.chars or (12_000_000 if args.race else 2_000_000)
    train = blocks(text / "train.txt", tokenizer, args.seq, chars, args.device)
    if len(train) <= args.batch:  # the warm-up draws from the rows after the compared batch
        parser.error(f"--chars {chars}: {len(train)} rows of --seq {args.seq} tokens; --batch {args.batch} needs more "
                     "than that many")
    torch.manual_seed(0)
    dropout = 0.1 if args.race else 0.0
    config = GPT2Config(n_embd=args.dim, n_head=args.heads, n_layer=args.layers, n_positions=args.seq,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).to(args.device)
    with backend_variable_kept():
        if args.race:
            validation = blocks(text / "validation.txt", tokenizer, args.seq, 400_000, args.device)[:64]
            race(args, model.state_dict(), config, train, validation)
        else:
            gradients(args, model, train)


if __name__ == "__main__":
    main()
