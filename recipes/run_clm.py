#!/usr/bin/env python
"""Train a GPT-2 language model from scratch on WikiText-2 with span-decomposed attention gradients.

The conventions of Transformers' examples/pytorch/language-modeling/run_clm.py: argument
dataclasses read by HfArgumentParser (command line, or one .yaml/.json file), the stock
Trainer, plus a span-attention argument group. Defaults are the paper's setup: WikiText-2 raw
with the GPT-2 tokenizer, blocks of 512 tokens with 50 % overlap, GPT-2 with d = 256,
4 heads, 6 layers, dropout 0.1, effective batch 128, evaluation every epoch.

    python recipes/run_clm.py --span score:1000 --output_dir runs/score-1000
    python recipes/run_clm.py --data_dir ../shared/data/wikitext-2-raw-v1 \\
        --train_file train.PARTIAL-first-1MB.txt --tokenizer_name ../shared/data/gpt2-tokenizer ...
    accelerate launch --num_processes 2 recipes/run_clm.py ...

Writes `metrics.json` (the full configuration, per-epoch losses and learning rates, best
validation loss, perplexity, next-token accuracy, the validation loss of the training tokens'
unigram frequencies, the device, and with --early_stopping_patience whether and at which epoch
training stopped early) into --output_dir. A run resumes the last
checkpoint in --output_dir only where `run_config.json` there records the same settings (see
run_identity.py).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import datasets
import evaluate
import numpy
import pyarrow.compute
import torch
import transformers
import yaml
from datasets.fingerprint import Hasher
from transformers import (
    AutoTokenizer,
    EarlyStoppingCallback,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

import hf_spanattn
from hf_spanattn import SpanAttentionConfig
from hf_spanattn.training import Schedule, SpanAttentionCallback

sys.path.insert(0, str(Path(__file__).parent))
from run_identity import resume_point, write_config  # noqa: E402

logger = logging.getLogger(__name__)
METRIC_PATH = str(Path(__file__).parent / "metrics" / "next_token")


@dataclass
class ModelArguments:
    n_embd: int = field(default=256, metadata={"help": "Model dimension d."})
    n_head: int = field(default=4, metadata={"help": "Attention heads."})
    n_layer: int = field(default=6, metadata={"help": "Transformer layers."})
    ffn_mult: int = field(default=4, metadata={"help": "Feed-forward width as a multiple of d."})
    dropout: float = field(default=0.1, metadata={"help": "Dropout of embeddings, residuals and attention."})

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"--n_embd {self.n_embd} must be a multiple of --n_head {self.n_head}")


@dataclass
class DataArguments:
    dataset_name: str = field(default="wikitext", metadata={"help": "Hub dataset (ignored with --data_dir)."})
    dataset_config_name: str = field(default="wikitext-2-raw-v1", metadata={"help": "Hub dataset configuration."})
    data_dir: str | None = field(default=None, metadata={"help": "Folder with local text files (offline)."})
    train_file: str = field(default="train.txt", metadata={"help": "Train file name inside --data_dir."})
    validation_file: str = field(default="validation.txt", metadata={"help": "Validation file inside --data_dir."})
    tokenizer_name: str = field(default="openai-community/gpt2", metadata={"help": "Hub name or local folder."})
    block_size: int = field(default=512, metadata={"help": "Sequence length T."})
    overlap: float = field(default=0.5, metadata={"help": "Overlap of consecutive blocks (stride = T·(1−overlap))."})
    max_train_tokens: int | None = field(default=None, metadata={
        "help": "Use only N train tokens (see --token_subset)."})
    max_eval_tokens: int | None = field(default=None, metadata={
        "help": "Use only N validation tokens (see --token_subset)."})
    token_subset: Literal["first", "spread"] = field(default="first", metadata={
        "help": "Which tokens --max_train_tokens and --max_eval_tokens keep: the first N of the split, or N tokens' "
                "worth of blocks spread evenly over the whole split (every part of the text, at the cost of "
                "tokenizing all of it)."})

    def __post_init__(self):
        if not 0 <= self.overlap < 1:
            raise ValueError(f"--overlap {self.overlap}: allowed values are 0 <= overlap < 1")
        if self.data_dir is not None:
            for name in (self.train_file, self.validation_file):
                if not os.path.isfile(os.path.join(self.data_dir, name)):
                    raise ValueError(f"--data_dir {self.data_dir} has no {name}; pass --train_file/--validation_file")
                if os.path.getsize(os.path.join(self.data_dir, name)) == 0:
                    raise ValueError(f"{os.path.join(self.data_dir, name)} is empty: a split needs text")
        for flag in ("block_size", "max_train_tokens", "max_eval_tokens"):
            value = getattr(self, flag)
            if value is not None and value < 2:
                raise ValueError(f"--{flag} {value}: expected at least 2 tokens"
                                 + ("" if flag == "block_size" else " (leave it unset for all)"))


@dataclass
class SpanArguments:
    span: str = field(default="standard:QKV111", metadata={
        "help": "Gradient rule in the paper's labels: standard:QKV111, score:1000, reductionistic:1100, simple:10, "
                "score:1000@per_block, ..."})
    span_grad: Literal["exact", "per_block"] | None = field(default=None, metadata={
        "help": "Reading of dL/dS^B for the score rule (overrides the label's)."})
    span_layers: str | None = field(default=None, metadata={"help": "Comma-separated layer indices (default all)."})
    span_schedule: str | None = field(default=None, metadata={
        "help": "α schedule: a YAML/JSON file or inline JSON list of keyframes {at, span, ramp}, e.g. "
                '\'[{"at": 0, "span": "standard:QKV111"}, {"at": "20%%", "span": "score:1000"}]\'; a keyframe\'s '
                'span may be a per-layer table {"3-5": "score:1000"}.'})
    span_diagnostics_every: int = field(default=0, metadata={
        "help": "Every N steps, log per-order norms and shares of dQ, dK per layer (0 = off)."})
    span_diagnostics_per_head: bool = field(default=False, metadata={"help": "Diagnostics per head too."})

    def __post_init__(self):
        self.config()  # a bad label or schedule fails here, before any data is read
        self.callback()

    def callback(self) -> SpanAttentionCallback | None:
        if self.span_schedule is None and not self.span_diagnostics_every:
            return None
        schedule = None
        if self.span_schedule is not None:
            text = Path(self.span_schedule).read_text() if os.path.isfile(self.span_schedule) else self.span_schedule
            try:
                keyframes = yaml.safe_load(text)
            except yaml.YAMLError as err:
                raise ValueError(f"--span_schedule: not valid YAML/JSON ({err})") from None
            if not isinstance(keyframes, list):
                raise ValueError(f"--span_schedule {self.span_schedule!r}: expected a list of keyframes")
            schedule = Schedule(keyframes)
            for keyframe in schedule.keyframes:  # labels and tables checked now; steps when training starts
                keyframe.settings(n_layers=10**6)
        return SpanAttentionCallback(schedule, self.span_diagnostics_every, self.span_diagnostics_per_head)

    def config(self) -> SpanAttentionConfig:
        overrides = {}
        if self.span_grad is not None:
            overrides["score_grad"] = self.span_grad
        if self.span_layers:
            try:
                overrides["layers"] = tuple(int(i) for i in self.span_layers.split(","))
            except ValueError:
                raise ValueError(f"--span_layers {self.span_layers!r}: expected comma-separated integers") from None
        return SpanAttentionConfig.from_label(self.span, **overrides)


@dataclass
class StoppingArguments:
    early_stopping_patience: int | None = field(default=None, metadata={
        "help": "Stop N evaluations after the best validation loss (Transformers' EarlyStoppingCallback); the "
                "learning-rate schedule stays that of the full --num_train_epochs."})
    early_stopping_threshold: float = field(default=0.0, metadata={
        "help": "How much an evaluation must lower the best validation loss to count as better."})

    def __post_init__(self):
        if self.early_stopping_patience is not None and self.early_stopping_patience < 1:
            raise ValueError(f"--early_stopping_patience {self.early_stopping_patience}: allowed values are >= 1")
        if self.early_stopping_threshold < 0:
            raise ValueError(f"--early_stopping_threshold {self.early_stopping_threshold}: allowed values are >= 0")

    def callbacks(self, training: TrainingArguments) -> list[EarlyStoppingCallback]:
        if self.early_stopping_patience is None:
            return []
        if training.eval_strategy == "no":
            raise ValueError("--early_stopping_patience needs evaluations: --eval_strategy epoch or steps")
        return [EarlyStoppingCallback(self.early_stopping_patience, self.early_stopping_threshold)]


@dataclass
class OutputArguments:
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start afresh where --output_dir holds another run: that run is moved to <output_dir>.replaced-<n>."})


def parse_args(argv: list[str] | None = None):
    """(model, data, span, training, stopping, output) arguments; Transformers 4 has overwrite_output_dir
    on TrainingArguments, which then serves as the output arguments."""
    classes = (ModelArguments, DataArguments, SpanArguments, TrainingArguments, StoppingArguments)
    if not hasattr(TrainingArguments, "overwrite_output_dir"):
        classes += (OutputArguments,)
    parser = HfArgumentParser(classes)
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml")):
        parsed = parser.parse_yaml_file(os.path.abspath(argv[0]))
    elif len(argv) == 1 and argv[0].endswith(".json"):
        parsed = parser.parse_json_file(os.path.abspath(argv[0]))
    else:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    return (*parsed[:5], parsed[5] if len(parsed) > 5 else parsed[3])


def training_defaults(argv: list[str]) -> list[str]:
    """The paper's training setup where the command line does not say otherwise."""
    defaults = {"--per_device_train_batch_size": "8", "--gradient_accumulation_steps": "16",
                "--eval_strategy": "epoch", "--save_strategy": "epoch", "--logging_strategy": "epoch",
                "--num_train_epochs": "50", "--learning_rate": "5e-4", "--load_best_model_at_end": "true",
                "--metric_for_best_model": "eval_loss", "--save_total_limit": "2", "--report_to": "none",
                "--dataloader_pin_memory": str(torch.cuda.is_available()).lower()}  # no pin-memory warning on CPUs
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    return [*argv, *(x for k, v in defaults.items() if k not in given for x in (k, v))]


def load_texts(data: DataArguments) -> datasets.DatasetDict:
    if data.data_dir is None:
        return from_hub(datasets.load_dataset, data.dataset_name, data.dataset_config_name)
    files = {"train": os.path.join(data.data_dir, data.train_file),
             "validation": os.path.join(data.data_dir, data.validation_file)}
    raw = datasets.load_dataset("text", data_files=files, keep_linebreaks=True)
    # as the Hub's wikitext rows: a whitespace-only line is an empty row
    return raw.map(lambda row: {"text": row["text"] if row["text"].strip() else ""})


def from_hub(load, name: str, *args):
    """load(name, *args), with a console message naming the offline route when the Hub cannot be reached."""
    try:
        return load(name, *args)
    except OSError as err:
        if os.path.isdir(name):  # a local folder: its own error says what is wrong
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise SystemExit(f"run_clm.py: could not download {name!r} from the Hugging Face Hub ({reason})\n"
                         f"  To run offline: SPANATTN_DATA=../shared/data bash scripts/compare.sh, or --data_dir and "
                         f"--tokenizer_name pointing to local copies (see ../shared/data/README.md)") from None


def blocks(ids: Sequence[int], size: int, overlap: float, keep: int | None = None) -> dict[str, list[list[int]]]:
    """Windows of `size` tokens every size·(1 − overlap) tokens; labels are the inputs. With `keep`,
    only that many of them, evenly spaced from the first on.

    The first label, which no position predicts, is -100: the Trainer counts the labels it
    averages over before the model shifts them, so the losses are exact token means.
    """
    stride = max(1, int(size * (1 - overlap)))
    starts = range(0, len(ids) - size + 1, stride)
    if keep is not None and keep < len(starts):
        starts = [starts[i * len(starts) // keep] for i in range(keep)]
    windows = [numpy.asarray(ids[s : s + size]).tolist() for s in starts]
    return {"input_ids": windows, "labels": [[-100, *w[1:]] for w in windows]}


def tokenized_fingerprint(texts: datasets.Dataset, tokenizer) -> str | None:
    """The cache key of `texts` tokenized: the texts' and the tokenizer's own definitions. A fast
    tokenizer's JSON is hashed in milliseconds, where `datasets` would pickle the whole object
    (seconds); for another tokenizer `datasets` does that (None)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return Hasher.hash([texts._fingerprint, backend.to_str(), tokenizer.__class__.__name__])


def build_datasets(data: DataArguments, tokenizer, training: TrainingArguments) -> dict[str, datasets.Dataset]:
    raw = load_texts(data)
    out = {}
    limits = {"train": data.max_train_tokens, "validation": data.max_eval_tokens}
    files = {"train": data.train_file, "validation": data.validation_file}
    for split in ("train", "validation"):
        with training.main_process_first(desc=f"tokenizing {split}"):  # cached: later runs read it back
            tokenized = raw[split].map(lambda rows: tokenizer(rows["text"]), batched=True, remove_columns=["text"],
                                       new_fingerprint=tokenized_fingerprint(raw[split], tokenizer))
        ids = pyarrow.compute.list_flatten(tokenized.data.column("input_ids")).to_numpy()
        if limits[split] and data.token_subset == "spread":
            windows = blocks(ids, data.block_size, data.overlap, keep=limits[split] // data.block_size)
        else:
            windows = blocks(ids[: limits[split]], data.block_size, data.overlap)
        if not windows["input_ids"]:
            source = os.path.join(data.data_dir, files[split]) if data.data_dir else f"{data.dataset_name}[{split}]"
            limit = f" (--{'max_train_tokens' if split == 'train' else 'max_eval_tokens'} {limits[split]})" \
                if limits[split] else ""
            raise ValueError(f"{source}: its {len(ids)} {split} tokens{limit} make no block of --block_size "
                             f"{data.block_size}; use more data or a smaller --block_size")
        out[split] = datasets.Dataset.from_dict(windows).with_format("torch")
    return out


def unigram_loss(train: datasets.Dataset, validation: datasets.Dataset, vocab_size: int) -> float:
    """Validation loss (nats per token) of the training tokens' frequencies, add-½ smoothed: what
    token counts alone reach, without any context."""
    counts = torch.bincount(train[:]["input_ids"].flatten(), minlength=vocab_size).double() + 0.5
    targets = validation[:]["labels"][:, 1:].flatten()
    return -(counts / counts.sum()).log()[targets[targets >= 0]].mean().item()


def build_model(model_args: ModelArguments, data: DataArguments, vocab_size: int) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=vocab_size, n_positions=data.block_size, n_embd=model_args.n_embd, n_head=model_args.n_head,
        n_layer=model_args.n_layer, n_inner=model_args.ffn_mult * model_args.n_embd, activation_function="gelu",
        resid_pdrop=model_args.dropout, embd_pdrop=model_args.dropout, attn_pdrop=model_args.dropout,
    )
    return stock_causal_lm(GPT2LMHeadModel(config))


def stock_causal_lm(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    """GPT2LMHeadModel's class name maps to no loss type in Transformers, which then warns on every loss;
    its tied lm_head.weight is left out of checkpoints, which the Trainer reports as missing on every
    load unless it is listed as a key not saved (then it re-ties it)."""
    model.loss_type = "ForCausalLM"
    model._keys_to_ignore_on_save = set(model.all_tied_weights_keys)
    return model


def token_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per position: the argmax and the NLL of the next token (keeps evaluation memory O(T)).

    Read on the whole contiguous logits, each row against the label one position on (the last
    column, which has no next token, is dropped): a strided slice of the logits is several times slower.
    """
    targets = labels.roll(-1, dims=1).clamp_min(0)
    nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return torch.stack([logits.argmax(-1).float(), nll.view(targets.shape)], dim=-1)[:, :-1]


def make_compute_metrics():
    metric = evaluate.load(METRIC_PATH)

    def compute(eval_pred):
        scores, labels = eval_pred.predictions, eval_pred.label_ids[:, 1:]
        return metric.compute(predictions=scores[..., 0].astype("int64").ravel(),
                              references=labels.ravel(), nlls=scores[..., 1].ravel())

    return compute


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not (len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json"))):
        argv = training_defaults(argv)
    model_args, data_args, span_args, training_args, stop_args, output_args = parse_args(argv)
    stop_callbacks = stop_args.callbacks(training_args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO
                        if training_args.should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
    datasets.disable_progress_bars()  # the Trainer's bars are the ones to watch
    span = span_args.config()
    set_seed(training_args.seed)

    tokenizer = from_hub(AutoTokenizer.from_pretrained, data_args.tokenizer_name)
    splits = build_datasets(data_args, tokenizer, training_args)
    model = build_model(model_args, data_args, len(tokenizer))
    hf_spanattn.patch_model(model, span)
    logger.info("span %s, %d train and %d validation blocks of %d tokens", span.label, len(splits["train"]),
                len(splits["validation"]), data_args.block_size)

    trainer = Trainer(model=model, args=training_args, train_dataset=splits["train"],
                      eval_dataset=splits["validation"], data_collator=default_data_collator,
                      compute_metrics=make_compute_metrics(), preprocess_logits_for_metrics=token_scores,
                      callbacks=stop_callbacks)
    callback = span_args.callback()
    if callback is not None:
        callback.add_to(trainer)
    config = run_config((model_args, data_args, span_args, training_args, stop_args), training_args.world_size)
    with training_args.main_process_first(desc="checking the output dir"):  # only the first moves or writes
        first = training_args.local_process_index == 0
        resume = resume_point(training_args.output_dir, config, training_args.resume_from_checkpoint,
                              output_args.overwrite_output_dir and first)
        if first:
            write_config(Path(training_args.output_dir), config)
    start = time.time()
    train_result = trainer.train(resume_from_checkpoint=resume)
    if not any("eval_loss" in h for h in trainer.state.log_history):
        trainer.evaluate()
    metrics = summarize(trainer, train_result, span, (model_args, data_args, span_args, training_args, stop_args),
                        time.time() - start, resumed_from=resume)
    metrics["unigram_val_loss"] = unigram_loss(splits["train"], splits["validation"], len(tokenizer))
    if trainer.is_world_process_zero():
        trainer.save_model()
        with open(os.path.join(training_args.output_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


def summarize(trainer, train_result, span, all_args, seconds, resumed_from) -> dict:
    history = trainer.state.log_history
    train = [{"epoch": h["epoch"], "step": h["step"], "loss": h["loss"], "learning_rate": h.get("learning_rate")}
             for h in history if "loss" in h]
    evals = [{"epoch": h["epoch"], "step": h["step"], "loss": h["eval_loss"], "accuracy": h.get("eval_accuracy"),
              "perplexity": h.get("eval_perplexity")} for h in history if "eval_loss" in h]
    best = min(evals, key=lambda e: e["loss"])
    model_args, data_args, span_args, training_args, stop_args = all_args
    return {
        "span": span.label,
        "span_config": span.to_dict(),
        "final_train_loss": train[-1]["loss"] if train else train_result.training_loss,
        "min_val_loss": best["loss"],
        "best_epoch": best["epoch"],
        "val_perplexity": best["perplexity"],
        "val_accuracy": best["accuracy"],
        "train_history": train,
        "eval_history": evals,
        "train_runtime_s": seconds,
        "resumed_from": resumed_from,
        "world_size": training_args.world_size,
        "device": device_name(training_args.device),
        "early_stopping": early_stopping(trainer, stop_args),
        "config": run_config(all_args, training_args.world_size),
    }


def early_stopping(trainer, stop: StoppingArguments) -> dict | None:
    """Whether the run stopped before its last step, and at which epoch (None without --early_stopping_patience)."""
    if stop.early_stopping_patience is None:
        return None
    stopped = trainer.state.global_step < trainer.state.max_steps
    return {"patience": stop.early_stopping_patience, "threshold": stop.early_stopping_threshold,
            "stopped_early": stopped, "stopped_at_epoch": trainer.state.epoch if stopped else None,
            "num_train_epochs": trainer.args.num_train_epochs}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} ({platform.machine()})"


def run_config(all_args, world_size: int | None) -> dict:
    """Everything that configures a run (run_identity.py says which parts make its result)."""
    model_args, data_args, span_args, training_args, stop_args = all_args
    return {"model": asdict(model_args), "data": asdict(data_args), "span": asdict(span_args),
            "training": training_args.to_dict(), "stopping": asdict(stop_args), "world_size": world_size,
            "hf_spanattn": hf_spanattn.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__}


if __name__ == "__main__":
    main()
