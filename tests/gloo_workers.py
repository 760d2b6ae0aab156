"""Two CPU processes with a gloo process group: `spawn` and the code each rank runs.

The workers live here, not in a test module, so that the spawned interpreters import only this file.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from models import VOCAB, tiny

from hf_spanattn import patch_model
from hf_spanattn.integration.model_layers import attention_modules
from hf_spanattn.integration.registry import PROBE_ATTR
from hf_spanattn.training.diagnostics import OrderRecorder, reduce_over_ranks

BATCH = torch.randint(1, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
LABELS = BATCH.masked_fill(torch.arange(16) == 0, -100)  # equal token counts in every row


class Rows(torch.utils.data.Dataset):
    """The 4 rows of BATCH: a global batch of 4 takes them all, in any order and over any number of ranks."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": BATCH[i], "labels": LABELS[i]}


def spawn(worker, world_size: int, *args) -> None:
    """Run worker(*args) in `world_size` fresh processes that find the process group through the environment
    variables torchrun sets; a failure in any of them raises here with its traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(world_size, port, worker, args), nprocs=world_size, start_method="spawn")


def _run(rank: int, world_size: int, port: int, worker, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    worker(*args)


def train_with_diagnostics(output_dir: str, per_device: int, max_steps: int, zero_stage: int | None = None,
                           schedule: list | None = None) -> list[dict]:
    """Train a patched tiny GPT-2 with the Trainer (DDP over gloo where started by `spawn`, or DeepSpeed ZeRO
    `zero_stage` on DeepSpeed's CPU backend), recording the diagnostics every step; returns the log history and writes
    it to log_history-{rank}.json. Where a schedule is given, the model is saved at the end (`Trainer.save_model`)."""
    from transformers import Trainer, TrainingArguments

    from hf_spanattn.training import SpanAttentionCallback

    deepspeed = None if zero_stage is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,  # the Trainer's torch AdamW
        "zero_optimization": {"stage": zero_stage, "stage3_gather_16bit_weights_on_model_save": True,
                              "stage3_param_persistence_threshold": 0}}  # ZeRO-3 partitions even a tiny model
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=max_steps,
                             learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, ddp_find_unused_parameters=False, disable_tqdm=True,
                             seed=0, deepspeed=deepspeed)
    trainer = Trainer(model=patch_model(tiny("gpt2"), "score:1100"), args=args, train_dataset=Rows(),
                      callbacks=[SpanAttentionCallback(schedule, diagnostics_every=1)])
    trainer.train()
    if schedule is not None:
        trainer.save_model()
    history = trainer.state.log_history
    (Path(output_dir) / f"log_history-{trainer.args.process_index}.json").write_text(json.dumps(history))
    return history


def fsdp_gradients_and_diagnostics(output_dir: str) -> None:
    """Rank r of 2 trains rows 2r, 2r+1 of BATCH on a tiny Llama (grouped-query) sharded with FSDP2's
    `fully_shard`; rank 0 saves the full parameter gradients and the diagnostics reduced over the ranks."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = patch_model(tiny("llama"), "score:1100")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    gradients, diagnostics = one_step(model, BATCH[2 * rank:2 * rank + 2], LABELS[2 * rank:2 * rank + 2])
    gradients = {name: grad.full_tensor() for name, grad in gradients.items()}
    if rank == 0:
        torch.save({"gradients": gradients, "diagnostics": diagnostics}, Path(output_dir) / "fsdp.pt")
    dist.destroy_process_group()


def one_step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[dict, dict]:
    """The parameter gradients and the per-layer diagnostics (reduced over ranks) of one forward and backward."""
    layers = attention_modules(model)
    recorders = {index: OrderRecorder() for index in layers}
    for index, modules in layers.items():
        for module in modules:
            setattr(module, PROBE_ATTR, recorders[index])
    model.train()
    model(ids, labels=labels).loss.backward()
    reduce_over_ranks([recorders[index] for index in sorted(recorders)])
    gradients = {name: p.grad for name, p in model.named_parameters()}
    return gradients, {index: recorder.summary(per_head=True) for index, recorder in recorders.items()}


def ranks_that_differ(output_dir: str) -> None:
    """Rank r of 2 meets what a data-parallel run refuses where the ranks differ, and writes what each raised (the
    exception's type and message, or None) to refused-{r}.json: Trainer.train over a model patched on rank 0 alone,
    a SpanAttentionCallback with other diagnostics on each rank, a diagnostics file whose lock another run holds
    (which rank 0 alone reads), diagnostics sums of one size but other heads and
    orders, and a second reduction of recorders already reduced."""
    from transformers import Trainer, TrainingArguments

    from hf_spanattn.training import SpanAttentionCallback

    def raised(call) -> list | None:
        try:
            call()
        except (ValueError, RuntimeError) as err:
            return [type(err).__name__, str(err)]
        return None

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    rank = dist.get_rank()
    model = tiny("gpt2", layers=1)
    patched = patch_model(tiny("gpt2", layers=1), "score:1100")
    got = {"unpatched rank": raised(Trainer(model=patched if rank == 0 else model, args=args,
                                            train_dataset=Rows()).train),
           "callbacks": raised(Trainer(model=patched, args=args, train_dataset=Rows(), callbacks=[
               SpanAttentionCallback(diagnostics_every=rank + 1)]).train)}
    held = Path(output_dir) / "held"
    if rank == 0:  # the lock of a run going on: the parent process's
        held.mkdir()
        lock = {"pid": os.getppid(), "host": socket.gethostname()}
        (held / "span_diagnostics.jsonl.lock").write_text(json.dumps(lock))
    args.output_dir = str(held)
    got["lock held"] = raised(Trainer(model=patched, args=args, train_dataset=Rows(), callbacks=[
        SpanAttentionCallback(diagnostics_every=1)]).train)
    recorders = [_recorded(4, 2) if rank == 0 else _recorded(2, 7)]  # 2 x (heads x (orders + 3)) = 40 sums each
    got["layouts"] = raised(lambda: reduce_over_ranks(recorders))
    recorders = [_recorded(4, 2)]
    reduce_over_ranks(recorders)
    got["twice"] = raised(lambda: reduce_over_ranks(recorders))
    (Path(output_dir) / f"refused-{rank}.json").write_text(json.dumps(got))


def sums_past_1e154(output_dir: str) -> None:
    """Rank r of 2 records one call of the parts of `_recorded` times RECORD_SCALES[r] and writes the summary of its
    recorder, reduced over the ranks, to summary-{r}.json."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    recorder = _recorded(2, 2, RECORD_SCALES[rank])
    reduce_over_ranks([recorder])
    (Path(output_dir) / f"summary-{rank}.json").write_text(json.dumps(recorder.summary(per_head=True)))
    dist.destroy_process_group()


RECORD_SCALES = (1e200, 3e199)


def _recorded(heads: int, orders: int, *scales: float) -> OrderRecorder:
    """A recorder that has recorded a call of `heads` heads and `orders` orders per scale (one if none is given),
    each part a 1..6 ramp times the scale."""
    recorder = OrderRecorder()
    ramp = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(1, 1, 1, 3, 2).repeat(1, heads, 1, 1, 1)
    for part in (ramp * scale for scale in scales or (1.0,)):
        recorder({"dq": part, "dk": part, "dq_orders": [part] * orders, "dk_orders": [part] * orders,
                  "dq_standard": part, "dk_standard": part, "rank_k": torch.ones(1, heads),
                  "rank_v": torch.ones(1, heads)})
    return recorder


def ddp_patched_after_wrapping(output_dir: str) -> None:
    """Rank r of 2 wraps a float64 tiny GPT-2 in DistributedDataParallel, patches the wrapper (as after
    `accelerator.prepare`) and trains rows 2r, 2r+1 of BATCH once; rank 0 saves the parameter gradients."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny("gpt2").double()
    wrapper = patch_model(DistributedDataParallel(model), "score:1100")
    wrapper(BATCH[2 * rank:2 * rank + 2], labels=LABELS[2 * rank:2 * rank + 2]).loss.backward()
    if rank == 0:
        torch.save({name: p.grad for name, p in model.named_parameters()}, Path(output_dir) / "ddp.pt")
    dist.barrier()
    del wrapper  # before the process group: its reducer holds the group
    dist.destroy_process_group()


def deepspeed_engine_patched(output_dir: str) -> None:
    """Patch the DeepSpeedEngine around a tiny GPT-2 (ZeRO-3, DeepSpeed's CPU backend), as one patches what
    `accelerator.prepare` returns, and save the full parameter gradients of one backward over BATCH's first 2 rows."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    model = tiny("gpt2")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
                                                                         "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    patch_model(engine, "score:1100")
    engine.backward(engine(BATCH[:2], labels=LABELS[:2]).loss)
    gradients = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    torch.save(gradients, Path(output_dir) / "deepspeed.pt")
