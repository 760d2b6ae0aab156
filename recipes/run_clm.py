#!/usr/bin/env python
"""Train a causal language model with span-decomposed attention gradients: fine-tune a pretrained
model, or train the paper's GPT-2 from scratch.

The conventions of Transformers' examples/pytorch/language-modeling/run_clm.py: argument
dataclasses read by HfArgumentParser (command line, or one .yaml/.json file), the stock
Trainer, plus a span-attention argument group. Without --model_name_or_path or --config_name,
the defaults are the paper's setup: WikiText-2 raw from the Hub with the GPT-2 tokenizer, blocks
of 512 tokens with 50 % overlap, GPT-2 with d = 256, 4 heads, 6 layers, dropout 0.1, effective
batch 128, evaluation every epoch.

    python recipes/run_clm.py --span score:1000 --output_dir runs/score-1000
    python recipes/run_clm.py --model_name_or_path openai-community/gpt2 --span score:1000 \\
        --train_file my.txt --validation_file my_val.jsonl --block_size 256 --num_train_epochs 1 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 1 --output_dir runs/gpt2-score
    python recipes/run_clm.py --train_file ../shared/data/wikitext-2-raw-v1/train.PARTIAL-first-1MB.txt \\
        --validation_file ../shared/data/wikitext-2-raw-v1/validation.txt \\
        --tokenizer_name ../shared/data/gpt2-tokenizer ...

--train_file/--validation_file are paths (.txt: one text per line; .json/.jsonl/.csv: the "text"
column, else the first); without a validation file, --validation_split_percentage of the train
rows is held out. --data_dir D is short for files in D (train.txt and validation.txt unless
--train_file/--validation_file name others there). --do_train and --do_eval both default to true;
--do_train false only evaluates. The model is patched with --span (on --span_layers) and saved
to --output_dir with its tokenizer; hf_spanattn.load_pretrained(output_dir) reloads it patched.

Several processes (DDP; 2 here, the global batch is the sum of the processes' batches):

    torchrun --nproc_per_node 2 recipes/run_clm.py ...                   # GPUs, one per process
    torchrun --nproc_per_node 2 recipes/run_clm.py ... --use_cpu true    # a CPU machine (gloo)
    accelerate launch --multi_gpu --num_processes 2 recipes/run_clm.py ...   # the same; --use_cpu true on CPUs

On a machine without GPUs, `accelerate launch --num_processes 2` (without --multi_gpu, or with
--cpu) starts one process only, and so does a config file (--config_file) with distributed_type
MULTI_CPU but no mpirun_hostfile: write distributed_type MULTI_GPU there and pass --use_cpu true.
Sharded (FSDP2: fully_shard on each decoder layer, parameters resharded after the forward), on GPUs:

    torchrun --nproc_per_node 2 recipes/run_clm.py ... --fsdp --fsdp_config '{"fsdp_version": 2}'

Accelerate shards only on GPUs and other accelerators: on CPUs the Trainer would silently train
such a command as DDP, so run_clm.py refuses --fsdp there.

Writes `metrics.json` (the full configuration, per-epoch losses and learning rates, best
validation loss, perplexity, next-token accuracy, the validation loss of the training tokens'
unigram frequencies, the device, and with --early_stopping_patience whether and at which epoch
training stopped early) into --output_dir. A run resumes the newest complete checkpoint in
--output_dir only where `run_config.json` there records the same settings and the same contents of
the local data files and tokenizer (see run_identity.py), and a finished run (its metrics.json
there) is not run again; while it runs, `<output_dir>.lock` keeps a second run out of the same folder.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import functools
import hashlib
import io
import json
import logging
import math
import os
import platform
import re
import resource
import sys
import time
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import datasets
import evaluate
import numpy
import pyarrow.compute
import torch
import transformers
import yaml
from datasets.fingerprint import Hasher
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    EarlyStoppingCallback,
    GPT2Config,
    HfArgumentParser,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.hf_argparser import string_to_bool

import hf_spanattn
from hf_spanattn import SpanAttentionConfig
from hf_spanattn.integration.adapters import ADAPTER_CONFIG, is_adapter_folder
from hf_spanattn.integration.model_layers import layer_count
from hf_spanattn.integration.stored import config_of
from hf_spanattn.ops import backend_for
from hf_spanattn.ops.inputs import shown
from hf_spanattn.training import Schedule, SpanAttentionCallback

sys.path.insert(0, str(Path(__file__).parent))
from records import MAX_SEED  # noqa: E402
from run_identity import (  # noqa: E402
    RunLock,
    json_value,
    not_a_file,
    read_json,
    read_yaml,
    resume_point,
    write_config,
    write_json,
)

logger = logging.getLogger(__name__)
METRIC_PATH = str(Path(__file__).parent / "metrics" / "next_token")
DEFAULT_TOKENIZER = "openai-community/gpt2"
PAPER_GPT2 = {"n_embd": 256, "n_head": 4, "n_layer": 6, "ffn_mult": 4, "dropout": 0.1}
DTYPES = Literal["auto", "bfloat16", "float16", "float32"]
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv"}
COMMA_SEPARATED = ("span_layers", "config_overrides")  # the text arguments a config file may give as a list
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 1024  # bytes of a path (Linux: 4096)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja")
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")


def home(path: str | None) -> str | None:
    """`path` with a leading ~ read as the home folder, as the shell reads it (a YAML file or --flag=~/x is not)."""
    return os.path.expanduser(path) if path else path


def looks_local(name: str) -> bool:
    """A name that cannot be a Hub repository id ('owner/name'): a path to look for here."""
    return name.startswith((".", "~", os.sep)) or name.count("/") > 1 or os.path.exists(name.split("/")[0])


def no_folder(path: str) -> str:
    """Why the local `path` given for a model or tokenizer folder is none, in words."""
    if os.path.isfile(path):
        return f"a file, not a folder; give the folder that holds it ({os.path.dirname(path) or '.'})"
    return "no such folder (a local path; a Hub id reads 'owner/name')"


def adapter_not_model(path: str) -> str:
    """Why a PEFT adapter's folder, given for a model, is none, in words (Transformers' "Unrecognized model ... Should
    have a `model_type` key in its config.json" names a file the folder does not hold)."""
    try:
        base = json.loads(Path(path, ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    on = f", on the base model {base}" if isinstance(base, str) and base else ""
    return (f"a PEFT adapter ({ADAPTER_CONFIG}{on}), not a model (no config.json); run_clm.py trains every weight of a "
            "model: give the base model, or merge the adapter into it (merge_and_unload, then save_pretrained) and "
            "give that folder")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A pretrained causal language model to fine-tune: a Hub id or a local folder (default: the paper's "
                "GPT-2, built from scratch)."})
    config_name: str | None = field(default=None, metadata={
        "help": "A model config (Hub id or local folder): a model from scratch in that form, or the config to "
                "load --model_name_or_path's weights with."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "Comma-separated key=value settings of the model config, e.g. n_embd=64,resid_pdrop=0.2 "
                "(each key must exist in the config)."})
    dtype: DTYPES | None = field(default=None, metadata={
        "help": "Load or build the model in this dtype (auto: the checkpoint's; default float32)."})
    torch_dtype: DTYPES | None = field(default=None, metadata={"help": "The former name of --dtype."})
    n_embd: int | None = field(default=None, metadata={"help": "From-scratch GPT-2: model dimension d (256)."})
    n_head: int | None = field(default=None, metadata={"help": "From-scratch GPT-2: attention heads (4)."})
    n_layer: int | None = field(default=None, metadata={"help": "From-scratch GPT-2: layers (6)."})
    ffn_mult: int | None = field(default=None, metadata={
        "help": "From-scratch GPT-2: feed-forward width as a multiple of d (4)."})
    dropout: float | None = field(default=None, metadata={
        "help": "From-scratch GPT-2: dropout of embeddings, residuals and attention (0.1)."})

    def __post_init__(self):
        if self.torch_dtype is not None:
            if self.dtype not in (None, self.torch_dtype):
                raise ValueError(f"--dtype {self.dtype} and --torch_dtype {self.torch_dtype}: give one of them")
            self.dtype, self.torch_dtype = self.torch_dtype, None
        for flag in ("model_name_or_path", "config_name"):
            name = home(getattr(self, flag))
            setattr(self, flag, name)
            if name is not None and not name.strip():
                raise ValueError(f"--{flag} is empty: give a Hub id or a local folder, or leave the flag out"
                                 + (" (the paper's GPT-2 from scratch)" if flag == "model_name_or_path" else ""))
            if name is not None and looks_local(name) and not os.path.isdir(name):
                raise ValueError(f"--{flag} {name}: {no_folder(name)}")
            if name is not None and is_adapter_folder(name) and not os.path.isfile(os.path.join(name, "config.json")):
                raise ValueError(f"--{flag} {name}: {adapter_not_model(name)}")
        if self.config_overrides is not None:
            overrides(self.config_overrides)  # the syntax; the keys are checked on the config
        shape = {k: getattr(self, k) for k in PAPER_GPT2}
        if self.model_name_or_path or self.config_name:
            given = [k for k, v in shape.items() if v is not None]
            if given:
                raise ValueError(f"--{given[0]} shapes the from-scratch GPT-2; with --model_name_or_path or "
                                 f"--config_name, change the model config with --config_overrides instead")
            return
        for k, v in PAPER_GPT2.items():
            if shape[k] is None:
                setattr(self, k, v)
        for k in ("n_embd", "n_head", "n_layer", "ffn_mult"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k} {getattr(self, k)}: allowed values are >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout {self.dropout}: allowed values are 0 <= dropout < 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"--n_embd {self.n_embd} must be a multiple of --n_head {self.n_head}")


def overrides(text: str) -> dict[str, str]:
    """--config_overrides 'a=1,b=x' as {'a': '1', 'b': 'x'}."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    bad = [p[0] for p in pairs if len(p) != 2 or not p[0].strip()]
    if bad or not pairs:
        raise ValueError(f"--config_overrides {shown(text)}: expected comma-separated key=value pairs, e.g. "
                         "n_embd=64,resid_pdrop=0.2")
    keys = [k.strip() for k, _ in pairs]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        raise ValueError(f"--config_overrides {shown(text)}: {twice} is given twice; give each setting once")
    return {k.strip(): v.strip() for k, v in pairs}


@dataclass
class DataArguments:
    dataset_name: str = field(default="wikitext", metadata={
        "help": "Hub dataset (not used with --train_file, --validation_file or --data_dir)."})
    dataset_config_name: str | None = field(default="wikitext-2-raw-v1", metadata={
        "help": "Hub dataset configuration."})
    train_file: str | None = field(default=None, metadata={
        "help": "Training data: a .txt (one text per line), .json/.jsonl or .csv file (the 'text' column, else the "
                "first); a path, relative to --data_dir where given."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, as --train_file."})
    data_dir: str | None = field(default=None, metadata={
        "help": "Folder of the data files: relative --train_file/--validation_file paths are in it, and they "
                "default to its train.txt and validation.txt."})
    validation_split_percentage: int = field(default=5, metadata={
        "help": "Without a validation split: the percentage of the train rows (the first ones) held out for it."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": f"Hub name or local folder (default: --model_name_or_path's tokenizer, else {DEFAULT_TOKENIZER})."})
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
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Keep only the first N training blocks (after --max_train_tokens)."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Keep only the first N validation blocks (after --max_eval_tokens)."})

    def __post_init__(self):
        for flag in ("data_dir", "train_file", "validation_file", "tokenizer_name"):
            value = home(getattr(self, flag))
            setattr(self, flag, value)
            if flag != "tokenizer_name" and value is not None and not value.strip():  # an unset shell variable
                raise ValueError(f"--{flag} is empty: give a path, or leave the flag out")
        if not 0 <= self.overlap < 1:
            raise ValueError(f"--overlap {self.overlap}: allowed values are 0 <= overlap < 1")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(f"--validation_split_percentage {self.validation_split_percentage}: allowed values are "
                             "1 to 99")
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise ValueError(f"--data_dir {self.data_dir}: no such folder")
        for split, path in (self.files() or {}).items():
            flag = f"--{split}_file" if getattr(self, f"{split}_file") else "--data_dir"
            if flag == "--data_dir" and not os.path.isfile(path):
                raise ValueError(f"--data_dir {self.data_dir} has no {os.path.basename(path)}; pass --{split}_file")
            if not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: {not_a_file(path)}")
            if Path(path).suffix.lower() not in FILE_BUILDERS:
                raise ValueError(f"{flag} {path}: allowed file types are {', '.join(FILE_BUILDERS)}")
            if os.path.getsize(path) <= 3 and Path(path).read_bytes() in (b"", codecs.BOM_UTF8):
                raise ValueError(f"{path} is empty: a split needs text")
        for flag in ("block_size", "max_train_tokens", "max_eval_tokens"):
            value = getattr(self, flag)
            if value is not None and value < 2:
                raise ValueError(f"--{flag} {value}: expected at least 2 tokens"
                                 + ("" if flag == "block_size" else " (leave it unset for all)"))
        for flag in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, flag)
            if value is not None and value < 1:
                raise ValueError(f"--{flag} {value}: allowed values are >= 1 (leave it unset for all)")

    def files(self) -> dict[str, str] | None:
        """{split: path} of the local data files, or None for the Hub dataset."""
        if self.train_file is None and self.validation_file is None and self.data_dir is None:
            return None
        folder = self.data_dir or ""
        out = {}
        for split in ("train", "validation"):
            name = getattr(self, f"{split}_file") or (f"{split}.txt" if self.data_dir is not None else None)
            if name is not None:
                out[split] = os.path.join(folder, name)
        return out

    def source(self, split: str) -> str:
        files = self.files()
        return files.get(split, f"{files['train']} (held-out rows)") if files else f"{self.dataset_name}[{split}]"


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
        # HfArgumentParser's parse_dict, parse_json_file and parse_yaml_file pass values as the file has them
        for name in (f.name for f in fields(self)):
            setattr(self, name, typed(name, getattr(self, name), "SpanArguments"))
        self.span_schedule = home(self.span_schedule)
        self.config()  # a bad label or schedule fails here, before any data is read
        self.callback()

    def callback(self) -> SpanAttentionCallback | None:
        if self.span_schedule is None and not self.span_diagnostics_every:
            return None
        schedule = None
        if self.span_schedule is not None:
            if self.span_schedule.endswith((".yaml", ".yml", ".json")) and not os.path.isfile(self.span_schedule):
                raise ValueError(f"--span_schedule {self.span_schedule}: {not_a_file(self.span_schedule)}")
            is_file = os.path.isfile(self.span_schedule)
            try:
                keyframes = read_yaml(Path(self.span_schedule).read_text() if is_file else self.span_schedule)
            except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as err:
                where = f" {self.span_schedule}" if is_file else ""
                raise ValueError(f"--span_schedule{where}: not valid YAML/JSON ({type(err).__name__}: {err})") from None
            if not isinstance(keyframes, list):
                raise ValueError(f"--span_schedule {shown(self.span_schedule)}: expected a list of keyframes")
            try:
                schedule = Schedule(keyframes)
            except ValueError as err:
                raise ValueError(f"--span_schedule {shown(self.span_schedule, 120)}: {err}") from None
            self.check_schedule(schedule, n_layers=10**6)  # checked now (a run of 10^6 steps); again with the model
        try:
            return SpanAttentionCallback(schedule, self.span_diagnostics_every, self.span_diagnostics_per_head)
        except ValueError as err:  # named by the flag, not by the callback's argument
            raise ValueError(f"--span_diagnostics_every {self.span_diagnostics_every}: {err}") from None

    def check_schedule(self, schedule: Schedule, n_layers: int) -> None:
        """Refuses, naming --span_schedule, a keyframe that names layers past `n_layers` or steps no run has."""
        try:
            for keyframe in schedule.keyframes:
                keyframe.settings(n_layers=n_layers)
                keyframe.step(max_steps=10**6, steps_per_epoch=1)
        except ValueError as err:
            raise ValueError(f"--span_schedule {shown(self.span_schedule, 120)}: {err}") from None

    def config(self) -> SpanAttentionConfig:
        """The settings of --span, --span_grad and --span_layers; a bad one is named by its flag."""
        try:
            config = SpanAttentionConfig.from_label(self.span)
        except ValueError as err:
            raise ValueError(f"--span: {err}") from None
        if self.span_grad is not None:
            try:
                config = SpanAttentionConfig.from_label(self.span, score_grad=self.span_grad)
            except ValueError as err:
                raise ValueError(f"--span_grad {self.span_grad}: {err}") from None
        if self.span_layers is not None:
            try:
                layers = tuple(int(i) for i in self.span_layers.split(","))
            except ValueError:
                raise ValueError(f"--span_layers {shown(self.span_layers)}: expected comma-separated integers (leave "
                                 "it unset for all layers)") from None
            try:
                config = config.replace(layers=layers)
            except ValueError as err:
                raise ValueError(f"--span_layers {shown(self.span_layers)}: {err}") from None
        return config


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
        if not self.early_stopping_threshold >= 0:  # NaN too
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


PAPER_TRAINING = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 16, "eval_strategy": "epoch",
                  "save_strategy": "epoch", "logging_strategy": "epoch", "num_train_epochs": 50, "learning_rate": 5e-4,
                  "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "save_total_limit": 2,
                  "report_to": "none", "dataloader_pin_memory": torch.cuda.is_available()}  # no pin-memory warning


def defaults_for(given: dict[str, Any]) -> dict[str, Any]:
    """The paper's training setup and this recipe's --do_train/--do_eval (both true unless given) for the
    arguments that `given` (name → value as written) leaves out."""
    out = {k: v for k, v in PAPER_TRAINING.items() if k not in given}
    wanted = {}
    for flag in ("do_train", "do_eval"):
        value = given.get(flag, True)
        try:
            wanted[flag] = value if isinstance(value, bool) else string_to_bool(str(value))
        except argparse.ArgumentTypeError:  # its message named neither the flag nor where
            raise ValueError(f"--{flag} {value}: expected true or false") from None
    train, evaluate_ = wanted["do_train"], wanted["do_eval"]
    if not train and not evaluate_:
        raise ValueError("--do_train false and --do_eval false: nothing to do")
    out.update(do_train=train, do_eval=evaluate_)
    if not evaluate_:  # no evaluation: no schedule of evaluations, no best model to keep
        for key, value in (("eval_strategy", "no"), ("load_best_model_at_end", False)):
            if key not in given:
                out[key] = value
            elif str(given[key]).lower() not in (str(value).lower(), "none"):
                raise ValueError(f"--do_eval false and --{key} {given[key]}: evaluation is off")
        out.pop("metric_for_best_model", None)
    return out


def given_flags(argv: list[str]) -> dict[str, str]:
    """{name: value} of the --name value / --name=value / bare --name flags in `argv`."""
    out = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq:
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
            out[name] = value
    return out


def training_defaults(argv: list[str]) -> list[str]:
    """`argv` completed with `defaults_for` it (--num-train-epochs, as HfArgumentParser takes it too, is
    --num_train_epochs: a default added after it would win)."""
    given = {name.replace("-", "_"): value for name, value in given_flags(argv).items()}
    added = defaults_for(given)
    return [*argv, *(x for k, v in added.items() if k not in given
                     for x in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)))]


def parser_classes() -> tuple[type, ...]:
    """(model, data, span, training, stopping, output) arguments; Transformers 4 has overwrite_output_dir
    on TrainingArguments, which then serves as the output arguments."""
    classes = (ModelArguments, DataArguments, SpanArguments, TrainingArguments, StoppingArguments)
    return classes if hasattr(TrainingArguments, "overwrite_output_dir") else (*classes, OutputArguments)


def launched_processes() -> int:
    """WORLD_SIZE, the number of processes a launcher started (1 where unset)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.strip().isdecimal():
        raise ValueError(f"the environment variable WORLD_SIZE={world!r:.40}: expected the number of processes a "
                         "launcher started (torchrun sets it), or leave it unset")
    return int(world)


def parse_args(argv: list[str] | None = None):
    """The argument dataclasses, from flags or one .yaml/.json file, completed with the paper's defaults
    and checked (a bad value fails here, before any model or data is read)."""
    launched_processes()  # Transformers 4's TrainingArguments reads it first, with int()
    parser = HfArgumentParser(parser_classes())
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-") and argv[0].lower().endswith((".yaml", ".yml", ".json")):
        if len(argv) > 1:
            raise ValueError(f"{argv[0]}: a config file is read alone; put {argv[1]} and the rest in it, or give "
                             "every argument on the command line")
        parsed = parse_file(parser, Path(argv[0]))
    else:
        refuse_unreadable_deepspeed(given_flags(argv).get("deepspeed"), "--deepspeed ")
        try:
            parsed = parser.parse_args_into_dataclasses(args=training_defaults(argv))
        except OverflowError as err:  # TrainingArguments turns some floats into steps: inf, or past int64
            raise ValueError(f"{', '.join(overflowing(given_flags(argv))) or 'a number'}: past the integers the "
                             f"Trainer counts steps in ({err}); give a finite number") from None
    parsed = (*parsed[:5], parsed[5] if len(parsed) > 5 else parsed[3])
    check(*parsed)
    return parsed


def overflowing(given: dict[str, Any], form: str = "--{} {}") -> list[str]:
    """'--name value' (or `form`) of the given numbers that are infinite or past 2^63."""
    out = []
    for name, value in given.items():
        try:
            if not abs(float(value)) < 2**63:
                out.append(form.format(name, value))
        except (ValueError, TypeError, OverflowError):
            continue
    return out


def refuse_unreadable_deepspeed(value: Any, where: str) -> None:
    """A --deepspeed path that exists but is no JSON object is refused naming it: TrainingArguments reads it with
    json.load, whose error names no file ("Expecting value: line 1 column 1"), takes a list for an object
    ("'list' object has no attribute 'get'") and keeps the last of a key given twice. A JSON string, base64 of one
    or a missing path are left to TrainingArguments, which names them."""
    if not isinstance(value, str) or not os.path.exists(value):
        return
    allowed = "DeepSpeed reads its config as JSON: give a .json file, or the JSON itself"
    if not os.path.isfile(value):
        raise ValueError(f"{where}{value}: {not_a_file(value)}; {allowed}")
    try:
        config = json_value(Path(value).read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:  # not JSON (YAML, say), not UTF-8, a key twice, unreadable
        raise ValueError(f"{where}{value}: not valid JSON ({type(err).__name__}: {err}); {allowed}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}{value}: a JSON {type(config).__name__}; expected a JSON object of DeepSpeed "
                         'settings by name ({"zero_optimization": {"stage": 3}, ...})')


def parse_file(parser: HfArgumentParser, path: Path) -> tuple:
    if not path.is_file():
        raise ValueError(f"{path}: {not_a_file(path)}")
    try:
        values = read_yaml(path.read_text())  # YAML reads JSON too
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid YAML/JSON ({err})") from None
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise ValueError(f"{path}: expected a mapping of run_clm.py arguments (name: value)")
    values = {k: typed(k, v, path) for k, v in values.items()}
    refuse_unreadable_deepspeed(values.get("deepspeed"), f"{path}: deepspeed=")
    try:
        return parser.parse_dict({**defaults_for(values), **values})
    except ValueError as err:  # HfArgumentParser's and Transformers' messages hold the values whole
        raise ValueError(f"{path}: {cut_long(str(err))}") from None
    except OverflowError as err:  # as on the command line
        named = ", ".join(overflowing(values, "{}={}")) or "a number"
        raise ValueError(f"{path}: {named}: past the integers the Trainer counts steps in ({err}); give a finite "
                         "number") from None


@functools.cache
def _argument_types() -> dict[str, Any]:
    return {k: v for c in parser_classes() for k, v in typing.get_type_hints(c).items()}


def typed(key: str, value: Any, path: Path | str) -> Any:
    """A value from a config file in the type its argument takes, as the command line would give it: YAML
    reads 1e-3 as text and a bare no as false, and parse_dict converts nothing."""
    hints = _argument_types()
    if key not in hints or value is None:
        return value  # an unknown key: parse_dict names it
    kind = hints[key]
    options = set(typing.get_args(kind)) - {type(None)} if typing.get_origin(kind) in (typing.Union, types.UnionType) \
        else {kind}
    literal = next((typing.get_args(o) for o in options if typing.get_origin(o) is Literal), None)
    where = f"{path}: {key}={shown(value)}"
    bare = " (YAML reads a bare yes/no/on/off as true/false: quote it, as 'no')" if isinstance(value, bool) else ""
    try:
        if options == {bool}:
            return value if isinstance(value, bool) else string_to_bool(str(value))
        if options in ({int}, {float}):
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            number = float(value)
            if options == {int} and not number.is_integer():
                raise ValueError
            return int(number) if options == {int} else number
    except (ValueError, TypeError, OverflowError, argparse.ArgumentTypeError):
        wanted = "an integer" if options == {int} else "a number" if options == {float} else "true or false"
        raise ValueError(f"{where}: expected {wanted}") from None
    if literal is not None:
        if str(value) not in literal:
            raise ValueError(f"{where}: allowed values are {', '.join(literal)}{bare}")
        return str(value)
    if str in options and bool not in options and bare:
        raise ValueError(f"{where}: expected text{bare}")
    if key == "span_schedule" and isinstance(value, list):
        return json.dumps(value)  # the keyframes written out in the file
    if key in COMMA_SEPARATED and isinstance(value, list) and all(isinstance(v, (int, str)) for v in value):
        return ",".join(str(v) for v in value)  # a YAML list for a comma-separated argument
    if options == {str} and isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, tuple({typing.get_origin(o) or o for o in options} & {list, dict})):
        return value  # an argument that takes a list or a mapping (report_to, fsdp_config)
    if str in options and not isinstance(value, str):
        raise ValueError(f"{where}: expected text, got {type(value).__name__}")
    return value


def cut_long(message: str) -> str:
    """`message` with each run of over 1000 characters without a space (a value given whole) cut to 200."""
    return re.sub(r"\S{1001,}", lambda run: f"{run[0][:200]}... ({len(run[0])} characters)", message)


def argument_error(argv: list[str]) -> str | None:
    """What is wrong with these run_clm.py arguments, or None (for sweeps, before any run starts)."""
    console = io.StringIO()
    try:
        with contextlib.redirect_stderr(console):
            parse_args(argv)
    except SystemExit:  # argparse: an unknown flag or a value of the wrong type, said on stderr, the value whole
        return cut_long(console.getvalue().strip().splitlines()[-1].split(": error: ", 1)[-1])
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def check(model: ModelArguments, data: DataArguments, span: SpanArguments, training: TrainingArguments,
          stop: StoppingArguments, output) -> None:
    """Checks across argument groups, and the tokenizer each run uses."""
    if not training.output_dir or not str(training.output_dir).strip():
        raise ValueError("--output_dir is empty: give the folder the run writes into")
    out = Path(training.output_dir)
    if not out.absolute().name:  # its <output_dir>.lock and .replaced-<n> would lie outside any folder
        raise ValueError(f"--output_dir {out}: the root of the file system; give a folder inside it")
    size = len(os.fsencode(out.absolute()))
    if size > PATH_MAX - 100:  # the file system's error names no argument
        raise ValueError(f"--output_dir {shown(str(out), 120)}: a path of {size} bytes; the files a run writes in it "
                         f"(checkpoint-<step>/optimizer.pt, ...) need paths under {PATH_MAX} bytes, this system's "
                         f"limit, so give one of at most {PATH_MAX - 100}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out}: exists and is not a folder")
    if out.is_symlink() and not out.exists():  # else mkdir says only "File exists"
        raise ValueError(f"--output_dir {out}: a link to nothing (to {os.readlink(out)}); make the folder it leads to, "
                         "or give another --output_dir")
    blocking = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"--output_dir {out}: {blocking} is a file, so the folder cannot be made")
    if training.do_train and data.files() is not None and "train" not in data.files():
        raise ValueError("--validation_file without --train_file: training needs --train_file (or --do_train false)")
    if training.fsdp and training.device.type == "cpu":
        raise ValueError("--fsdp: Accelerate shards only on GPUs and other accelerators; on CPUs this would train "
                         "unsharded, as DDP. Drop --fsdp (torchrun --nproc_per_node N gives DDP on CPUs), or run on "
                         "GPUs")
    launched = launched_processes()
    if launched > 1 and training.world_size == 1:
        raise ValueError(f"a launcher started {launched} processes, but the Trainer would run each alone (on a "
                         "machine without GPUs, torchrun needs --use_cpu true)")
    stop.callbacks(training)
    for flag in ("seed", "data_seed"):
        value = getattr(training, flag)
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"--{flag} {value}: allowed values are 0 to {MAX_SEED}")
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "eval_accumulation_steps"):  # the last: a ZeroDivisionError in the first evaluation
        if getattr(training, flag) is not None and getattr(training, flag) < 1:
            raise ValueError(f"--{flag} {getattr(training, flag)}: allowed values are >= 1")
    if training.do_train and not training.max_steps > 0 and not 0 < training.num_train_epochs < 2**63:
        raise ValueError(f"--num_train_epochs {training.num_train_epochs}: expected a number > 0 and < 2^63 (or "
                         "--max_steps N)")  # the Trainer counts its steps in integers
    for flag, low, high in (("learning_rate", 0, math.inf), ("weight_decay", 0, math.inf),  # as the optimizers
                            ("adam_epsilon", 0, math.inf), ("adam_beta1", 0, 1), ("adam_beta2", 0, 1),  # check them
                            ("label_smoothing_factor", 0, 1)):  # past 1, targets of negative weight
        if not low <= getattr(training, flag) < high:
            allowed = f"a finite number >= {low}" if high == math.inf else f"a number from {low} to below {high}"
            raise ValueError(f"--{flag} {getattr(training, flag)}: expected {allowed}")
    nan = next((f"--{f.name}" for group in (model, data, training, stop) for f in fields(group)
                if isinstance(getattr(group, f.name), float) and math.isnan(getattr(group, f.name))), None)
    if nan is not None:  # the Trainer and the optimizer take most of them without a word, and train on NaN
        raise ValueError(f"{nan} nan: expected a number")
    inputs = {"--model_name_or_path": model.model_name_or_path, "--config_name": model.config_name,
              "--tokenizer_name": data.tokenizer_name}
    for flag, name in inputs.items():
        if name and os.path.isdir(name) and os.path.realpath(name) == os.path.realpath(out):
            raise ValueError(f"--output_dir {out} is the folder of {flag}: the run would write its model, tokenizer "
                             "and config over the files it starts from; give another --output_dir")
    if data.tokenizer_name is not None and not data.tokenizer_name.strip():
        raise ValueError("--tokenizer_name is empty: give a Hub id or a local folder, or leave the flag out (the "
                         "model's tokenizer)")
    if data.tokenizer_name is None:
        data.tokenizer_name = model.model_name_or_path or DEFAULT_TOKENIZER
    elif looks_local(data.tokenizer_name) and not os.path.isdir(data.tokenizer_name):
        raise ValueError(f"--tokenizer_name {data.tokenizer_name}: {no_folder(data.tokenizer_name)}")


def load_tokenizer(name: str, model_name_or_path: str | None):
    """The tokenizer of `name` (--tokenizer_name, else the model's folder). Transformers makes one of no words of a
    folder without a vocabulary (a model saved without its tokenizer), which reads every text as no tokens."""
    flag = "--model_name_or_path" if name == model_name_or_path else "--tokenizer_name"
    advice = "pass --tokenizer_name with the folder or Hub id of the model's tokenizer"
    try:
        tokenizer = from_hub(AutoTokenizer.from_pretrained, name)
    # "Couldn't instantiate the backend tokenizer ...", naming no folder; Transformers 4: a TypeError without vocab.json
    except (ValueError, TypeError) as err:
        if not os.path.isdir(name):
            raise
        if isinstance(err, ValueError) or any(os.path.isfile(os.path.join(name, f)) for f in VOCABULARY_FILES):
            raise ValueError(f"{flag} {name}: no tokenizer could be read from it ({str(err).splitlines()[0][:200]}); "
                             f"{advice}") from None
        tokenizer = None
    if tokenizer is None or len(tokenizer.get_vocab()) <= len(set(tokenizer.all_special_ids)):
        raise ValueError(f"{flag} {name}: holds no tokenizer vocabulary (such as {', '.join(TOKENIZER_FILES[:4])}); "
                         f"{advice}")
    return tokenizer


def load_texts(data: DataArguments, splits: Sequence[str]) -> dict[str, datasets.Dataset]:
    """{split: rows with one "text" column} for the wanted splits; without a validation split, the first
    --validation_split_percentage of the train rows."""
    files = data.files()
    if files is None:
        raw = dict(from_hub(datasets.load_dataset, data.dataset_name, data.dataset_config_name))
    else:
        raw = {split: load_file(path, f"--{split}_file") for split, path in files.items()
               if split in splits or (split == "train" and "validation" not in files)}
    if "validation" in splits and "validation" not in raw:
        if "train" not in raw:
            raise ValueError(f"{data.source('train')}: no validation split, and no train split to hold rows out of")
        train = raw["train"]
        held = math.ceil(len(train) * data.validation_split_percentage / 100)
        if held >= len(train):
            raise ValueError(f"{data.source('train')}: its {len(train)} rows leave none for training after --validation"
                             f"_split_percentage {data.validation_split_percentage}; pass --validation_file")
        raw = {"train": train.select(range(held, len(train))), "validation": train.select(range(held))}
    missing = [s for s in splits if s not in raw]
    if missing:
        raise ValueError(f"{data.dataset_name} {data.dataset_config_name}: no {missing[0]} split (it has "
                         f"{', '.join(raw)})")
    # as the Hub's wikitext rows: a whitespace-only line is an empty row
    return {split: raw[split].map(lambda row: {"text": row["text"] if row["text"].strip() else ""})
            for split in splits}


def load_file(path: str, flag: str) -> datasets.Dataset:
    """One data file as rows with a "text" column: the file's "text" column, else its first."""
    builder = FILE_BUILDERS[Path(path).suffix.lower()]
    # text: a byte order mark (as some editors write) is not text; the json and csv loaders read past it too
    extra = {"keep_linebreaks": True, "encoding": "utf-8-sig"} if builder == "text" else {}
    if builder == "csv":  # pandas would read a cell of None, NA, nan, null (words of the text) as a missing value
        extra = {"keep_default_na": False}
    if builder == "json":  # rows: objects or a list; the loader ends the process on a file of null
        with open(path, "rb") as f:
            head = f.read(1 << 16).decode("utf-8-sig", errors="replace").lstrip()
        if head and head[0] not in "[{":
            raise ValueError(f"{flag} {path}: starts with {head.splitlines()[0][:20]!r}; expected rows: one JSON "
                             "object with a 'text' field a line (JSON Lines), or a list of such objects or of strings")
    try:
        rows = datasets.load_dataset(builder, data_files={"train": path}, split="train", cache_dir=cache_of(path),
                                     **extra)
    except Exception as err:  # the loaders raise many types; the message is what counts
        while err.__cause__ is not None or err.__context__ is not None:  # "an error occurred": say which
            err = err.__cause__ or err.__context__
        if "corresponds to no data" in str(err):
            raise ValueError(f"{flag} {path}: holds no rows of text (a split needs text)") from None
        cache = os.path.abspath(datasets.config.HF_DATASETS_CACHE)
        if isinstance(err, OSError) and os.path.abspath(err.filename or "/").startswith(cache):  # not the file's fault
            raise SystemExit(f"{flag} {path}: the datasets cache cannot be written ({err.filename}: {err.strerror}); "
                             "point HF_DATASETS_CACHE (or HF_HOME) to a folder this user can write") from None
        where = json_line_problem(path) if builder == "json" else None
        if where is not None:
            raise ValueError(f"{flag} {path}: could not be read as JSON ({where})") from None
        encoding = " (the file must be UTF-8)" if isinstance(err, UnicodeDecodeError) else ""
        raise ValueError(f"{flag} {path}: could not be read as {builder}{encoding} ({type(err).__name__}: "
                         f"{str(err)[:300]})") from None
    if not rows.column_names:
        raise ValueError(f"{flag} {path}: no columns")
    column = "text" if "text" in rows.column_names else rows.column_names[0]
    if column != "text":
        logger.warning("%s %s: no 'text' column; its first, %s, is read as the text", flag, path, shown(column))
    kind = rows.features[column]
    if getattr(kind, "dtype", None) not in ("string", "large_string", "null"):
        which = f"column {column!r}" if column == "text" else f"no 'text' column, and its first, {shown(column)},"
        raise ValueError(f"{flag} {path}: {which} holds {kind}, not text")
    missing = rows[column].count(None) if builder == "json" else 0
    if missing:
        logger.warning("%s %s: %d of its %d rows have no %r; they count as empty texts", flag, path, missing,
                       len(rows), column)
    rows = rows.select_columns([column]).rename_column(column, "text") if column != "text" else \
        rows.select_columns(["text"])
    return rows.map(lambda row: {"text": row["text"] or ""})  # an empty CSV cell is None


def sha256(path: str) -> str:
    """The sha256 of the file `path`, read once per version of it in a process (a sweep checks every run's data);
    its status-change time tells apart versions written with the same modification time."""
    stat = os.stat(path)
    return file_sha256(os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@functools.lru_cache(maxsize=64)
def file_sha256(path: str, *version: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def input_digests(data: DataArguments) -> dict[str, str] | None:
    """{split: sha256} of the local data files, and {"tokenizer": sha256} of a local tokenizer folder's files: what a
    run's tokens are made of, where its settings name only paths."""
    out = {split: sha256(path) for split, path in (data.files() or {}).items()}
    if data.tokenizer_name and os.path.isdir(data.tokenizer_name):
        files = sorted(name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(data.tokenizer_name, name)))
        out["tokenizer"] = hashlib.sha256(" ".join(
            f"{name}:{sha256(os.path.join(data.tokenizer_name, name))}" for name in files).encode()).hexdigest()
    return out or None


def cache_of(path: str) -> str:
    """The datasets cache folder for the data file `path`, named by its contents: `datasets` tells a local file's
    versions apart by its modification time alone, so a file replaced by another of the same time (cp -p, rsync -t,
    tar) was read from the cache of the one before."""
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "run_clm", sha256(path)[:32])


def json_line_problem(path: str) -> str | None:
    """What keeps a JSON file from being rows, with where ("line 2: ..."): a line of JSON Lines that is not a JSON
    object, or text that is not a character (half a surrogate pair, which the loader refuses). None where there is
    nothing of that kind, or the file is not UTF-8 text."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, ValueError):
        return None
    try:
        values = [("", json_value(text))]  # one JSON value
    except (ValueError, RecursionError):
        values = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                if line.strip():
                    values.append((f"line {number}: ", json_value(line)))
            except (ValueError, RecursionError) as err:
                return f"line {number}: {str(err)[:200]}"
    for where, value in values:
        if where and not isinstance(value, dict):
            return f"{where}{json.dumps(value)[:40]} is not a JSON object with a 'text' field"
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            return f"{where}a \\u escape of half a surrogate pair, which is not a character"
    return None


def from_hub(load, name: str, *args, **kwargs):
    """load(name, *args, **kwargs), with a console message naming the offline route when the Hub cannot be reached."""
    try:
        return load(name, *args, **kwargs)
    except OSError as err:
        if os.path.isdir(name):  # a local folder: its own error says what is wrong
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise SystemExit(f"run_clm.py: could not download {name!r} from the Hugging Face Hub ({reason})\n"
                         f"  To run offline: SPANATTN_DATA=../shared/data bash scripts/compare.sh, or --train_file, "
                         f"--validation_file, --tokenizer_name (and --model_name_or_path) pointing to local copies "
                         f"(see ../shared/data/README.md)") from None


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
    """{split: blocks} for the splits this run uses (train with --do_train, validation with --do_eval)."""
    splits = [s for s, wanted in (("train", training.do_train), ("validation", training.do_eval)) if wanted]
    raw = load_texts(data, splits)
    out = {}
    limits = {"train": data.max_train_tokens, "validation": data.max_eval_tokens}
    samples = {"train": data.max_train_samples, "validation": data.max_eval_samples}
    for split in splits:
        with training.main_process_first(desc=f"tokenizing {split}"):  # cached: later runs read it back
            # not verbose: Transformers warns of "indexing errors" for a text longer than model_max_length, which
            # blocks() cuts into blocks of --block_size
            tokenized = raw[split].map(lambda rows: tokenizer(rows["text"], verbose=False), batched=True,
                                       remove_columns=["text"],
                                       new_fingerprint=tokenized_fingerprint(raw[split], tokenizer))
        ids = pyarrow.compute.list_flatten(tokenized.data.column("input_ids")).to_numpy()
        if limits[split] and data.token_subset == "spread":
            windows = blocks(ids, data.block_size, data.overlap, keep=limits[split] // data.block_size)
        else:
            windows = blocks(ids[: limits[split]], data.block_size, data.overlap)
        if not windows["input_ids"]:
            limit = f" (--{'max_train_tokens' if split == 'train' else 'max_eval_tokens'} {limits[split]})" \
                if limits[split] else ""
            raise ValueError(f"{data.source(split)}: its {len(ids)} {split} tokens{limit} make no block of "
                             f"--block_size {data.block_size}; use more data or a smaller --block_size")
        if samples[split] is not None:
            windows = {k: v[: samples[split]] for k, v in windows.items()}
        out[split] = datasets.Dataset.from_dict(windows).with_format("torch")
    return out


def unigram_loss(train: datasets.Dataset, validation: datasets.Dataset, vocab_size: int) -> float:
    """Validation loss (nats per token) of the training tokens' frequencies, add-½ smoothed: what
    token counts alone reach, without any context."""
    counts = torch.bincount(train[:]["input_ids"].flatten(), minlength=vocab_size).double() + 0.5
    targets = validation[:]["labels"][:, 1:].flatten()
    return -(counts / counts.sum()).log()[targets[targets >= 0]].mean().item()


def build_model(model_args: ModelArguments, data: DataArguments, tokenizer) -> PreTrainedModel:
    """The pretrained model (--model_name_or_path), a model from --config_name, or the paper's GPT-2; with
    --config_overrides applied, in --dtype, its embeddings grown to the tokenizer's vocabulary."""
    if model_args.config_name or model_args.model_name_or_path:
        name = model_args.config_name or model_args.model_name_or_path
        config = from_hub(AutoConfig.from_pretrained, name)
    else:
        m = model_args
        config = GPT2Config(vocab_size=vocab_rows(tokenizer), n_positions=data.block_size, n_embd=m.n_embd,
                            n_head=m.n_head, n_layer=m.n_layer, n_inner=m.ffn_mult * m.n_embd,
                            activation_function="gelu", resid_pdrop=m.dropout, embd_pdrop=m.dropout,
                            attn_pdrop=m.dropout)
    if model_args.config_overrides:
        apply_overrides(config, model_args.config_overrides)
    refuse_quantized(model_args, config)
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions is not None and data.block_size > positions:
        raise ValueError(f"--block_size {data.block_size}: the model reads at most {positions} positions; use "
                         f"--block_size {positions} or less")
    dtype = {None: torch.float32, "auto": "auto"}.get(model_args.dtype) or getattr(torch, model_args.dtype)
    # the attention the config was saved with (flash_attention_2, say, where its package is not installed) is
    # replaced by the patch, so it is not asked for: Transformers' default (SDPA), as for a config saved without one
    config._attn_implementation = None
    causal = AutoModelForCausalLM._model_mapping
    if type(config) not in causal:  # Transformers' error names the config class, not the flag
        flag = "--config_name" if model_args.config_name else "--model_name_or_path"
        raise ValueError(f"{flag} {model_args.config_name or model_args.model_name_or_path}: a {config.model_type} "
                         f"model, which has no causal language model class ({type(config).__name__} is not one of "
                         "AutoModelForCausalLM's); run_clm.py trains causal language models (GPT-2, Llama, ...)")
    if model_args.model_name_or_path:
        try:
            model = from_hub(AutoModelForCausalLM.from_pretrained, model_args.model_name_or_path, config=config,
                             dtype=dtype)
        except SafetensorError as err:  # "incomplete metadata, file not fully covered": names no file
            raise ValueError(f"--model_name_or_path {model_args.model_name_or_path}: its weights could not be read "
                             f"(SafetensorError: {shown(str(err), 200)}); a file cut short or damaged: save or copy "
                             "them again") from None
        except RuntimeError as err:  # Transformers' report names the weights, not the flag that reshaped them
            if "ignore_mismatched_sizes" not in str(err) and "size mismatch" not in str(err):  # Transformers 5, 4
                raise
            if not model_args.config_overrides:  # "You set `ignore_mismatched_sizes` to `False`", which no one did
                name = model_args.config_name or model_args.model_name_or_path
                raise ValueError(f"--model_name_or_path {model_args.model_name_or_path}: its weights do not fit the "
                                 f"config of {name} (the load report above names them): a config.json edited, or one "
                                 "of other weights") from None
            raise ValueError(f"--config_overrides {model_args.config_overrides}: the weights of "
                             f"{model_args.model_name_or_path} do not fit the model it shapes (the load report above "
                             "names them); a setting that shapes the model (widths, layers, heads) needs one from "
                             f"scratch: --config_name {model_args.model_name_or_path} without --model_name_or_path"
                             ) from None
    else:
        try:
            model = AutoModelForCausalLM.from_config(config)
        except (RuntimeError, TypeError, OverflowError) as err:  # a table of positions past memory, or past int64
            if model_args.config_name or positions != data.block_size:
                raise
            raise ValueError(f"--block_size {data.block_size}: a model of that many positions cannot be built here "
                             f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
        if dtype != "auto":
            model.to(dtype)
    rows = vocab_rows(tokenizer)
    if rows > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(rows)
    return stock_causal_lm(model)


def quantization_method(config) -> str | None:
    """The method a quantized model's config names (its `quantization_config`, which Transformers saves with the
    weights of a model it quantized: bitsandbytes, torchao, ...), or None for a model that is not quantized."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method) or "of an unnamed method")


def trains_whole(config) -> bool:
    """Whether Transformers trains a model of this quantization whole, as the Trainer allows (quantization-aware
    training: BitNet's online mode, compressed-tensors decompressed); read from the config, without loading."""
    from transformers.quantizers import AutoHfQuantizer

    try:
        quantizer = AutoHfQuantizer.from_config(config.quantization_config)
    except (ValueError, TypeError, KeyError, ImportError):  # a method unknown here, or its package missing
        return False
    return getattr(quantizer, "is_qat_trainable", False) is True


def refuse_quantized(model_args: ModelArguments, config) -> None:
    """A quantized start fails here, naming the flag: the Trainer refuses a quantized model without trainable
    adapters (also for evaluation alone), and run_clm.py trains every weight. A --config_name of a quantized model
    gives its architecture only: the model built from it (or loaded into it) is not quantized, so its
    quantization_config goes, which would quantize it on load (and the saved model on every reload). A quantization
    that Transformers trains whole (quantization-aware training) stays, as the Trainer takes it."""
    if model_args.config_name and (method := quantization_method(config)) and not trains_whole(config):
        logger.warning("--config_name %s: the config of a quantized model (%s); its quantization_config is dropped, "
                       "and the model is built and saved unquantized", model_args.config_name, method)
        del config.quantization_config
    if not model_args.model_name_or_path:
        return
    own = from_hub(AutoConfig.from_pretrained, model_args.model_name_or_path) if model_args.config_name else config
    if (method := quantization_method(own)) and not trains_whole(own):
        raise ValueError(f"--model_name_or_path {model_args.model_name_or_path}: a quantized model ({method}, the "
                         "quantization_config of its config.json); run_clm.py trains every weight of the model, and "
                         "the Trainer it trains and evaluates with takes a quantized model only with trainable "
                         "adapters on it. Start from the model before quantization (or from this one dequantized: "
                         "model.dequantize(), then save_pretrained), or train adapters on the quantized one with PEFT "
                         "and the stock Trainer (README: With LoRA)")


def vocab_rows(tokenizer) -> int:
    """The embedding rows `tokenizer`'s ids need: len(tokenizer), or more where its ids leave gaps (a vocabulary
    trimmed by hand), whose highest id would index past len(tokenizer) rows."""
    return max(len(tokenizer), 1 + max(tokenizer.get_vocab().values(), default=-1))


def apply_overrides(config, text: str) -> None:
    """--config_overrides on `config`: each key must exist; values are read as the key's current type
    (YAML's reading where the current value is None)."""
    for key, value in overrides(text).items():
        if not hasattr(config, key):
            raise ValueError(f"--config_overrides: {shown(key)} is not a setting of {type(config).__name__}")
        try:
            if getattr(config, key) is None:
                setattr(config, key, yaml.safe_load(value))
            else:
                config.update_from_string(f"{key}={value}")
        except (ValueError, TypeError) as err:
            raise ValueError(f"--config_overrides {key}={value}: {err}") from None


def stock_causal_lm(model: PreTrainedModel) -> PreTrainedModel:
    """GPT2LMHeadModel's class name maps to no loss type in Transformers, which then warns on every loss;
    its tied lm_head.weight is left out of checkpoints, which the Trainer reports as missing on every
    load unless it is listed as a key not saved (then it re-ties it)."""
    model.loss_type = "ForCausalLM"
    tied = getattr(model, "all_tied_weights_keys", None)
    if tied is None:  # Transformers 4: the class's _tied_weights_keys, which name the head also where it is not tied
        tied = model._tied_weights_keys or [] if model.config.get_text_config().tie_word_embeddings else []
    model._keys_to_ignore_on_save = set(tied)
    return model


def patch(model: PreTrainedModel, model_args: ModelArguments, span: SpanAttentionConfig) -> None:
    """Patch `model` with `span`, saying so where it was saved with other settings."""
    saved = config_of(model.config)
    if saved is not None and saved.label != span.label:
        logger.warning("%s was saved with span %s; this run trains it with --span %s", model_args.model_name_or_path,
                       saved.label, span.label)
    try:
        hf_spanattn.patch_model(model, span)
    except ValueError as err:
        raise ValueError(f"--span_layers: {err}" if span.layers is not None else str(err)) from None


def token_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per position: the argmax and the NLL of the next token (keeps evaluation memory O(T)).

    Read on the whole contiguous logits, each row against the label one position on (the last
    column, which has no next token, is dropped): a strided slice of the logits is several times slower.
    """
    targets = labels.roll(-1, dims=1).clamp_min(0)
    nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return torch.stack([logits.argmax(-1).float(), nll.view(targets.shape)], dim=-1)[:, :-1]


def make_compute_metrics():
    try:
        metric = evaluate.load(METRIC_PATH)
    except OSError as err:  # evaluate copies the metric's script into its modules cache first
        cache = os.path.abspath(evaluate.config.HF_MODULES_CACHE)
        if not os.path.abspath(err.filename or "/").startswith(cache):
            raise
        raise SystemExit(f"{METRIC_PATH}: evaluate's modules cache cannot be written ({err.filename}: {err.strerror}); "
                         "point HF_MODULES_CACHE (or HF_HOME) to a folder this user can write") from None

    def compute(eval_pred):
        scores, labels = eval_pred.predictions, eval_pred.label_ids[:, 1:]
        return metric.compute(predictions=scores[..., 0].astype("int64").ravel(),
                              references=labels.ravel(), nlls=scores[..., 1].ravel())

    return compute


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, span_args, training_args, stop_args, output_args = parse_args(argv)
    stop_callbacks = stop_args.callbacks(training_args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO
                        if training_args.should_log else logging.WARNING)
    # as the Trainer: --log_level (--log_level_replica on other processes), else TRANSFORMERS_VERBOSITY, else warnings
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    datasets.disable_progress_bars()  # the Trainer's bars are the ones to watch
    span = span_args.config()
    first = training_args.process_index == 0
    with RunLock(training_args.output_dir) if first else contextlib.nullcontext():
        return run(model_args, data_args, span_args, training_args, stop_args, output_args, span, stop_callbacks)


def run(model_args, data_args, span_args, training_args, stop_args, output_args, span, stop_callbacks) -> dict:
    all_args = (model_args, data_args, span_args, training_args, stop_args)
    config = run_config(all_args, training_args.world_size, mixed_precision(training_args))
    with training_args.main_process_first(desc="checking the output dir"):  # only the first moves or writes
        first = training_args.local_process_index == 0
        resume = resume_point(training_args.output_dir, config, training_args.resume_from_checkpoint,
                              output_args.overwrite_output_dir and first, first=first)
        finished = Path(training_args.output_dir) / "metrics.json"
        if finished.is_file() and not training_args.resume_from_checkpoint:  # these settings, run to the end
            logger.warning("%s: this run is finished, so it is not run again (--overwrite_output_dir moves it to "
                           "%s.replaced-<n> and runs it afresh)", finished, training_args.output_dir)
            return read_json(finished)
        if first:
            try:
                write_config(Path(training_args.output_dir), config)
            except OSError as err:  # a folder this user cannot write into, a full disk
                raise SystemExit(f"--output_dir {training_args.output_dir}: {err.strerror}") from None
    if not training_args.do_train:
        resume = None
    set_seed(training_args.seed)
    tokenizer = load_tokenizer(data_args.tokenizer_name, model_args.model_name_or_path)
    model = build_model(model_args, data_args, tokenizer)
    patch(model, model_args, span)
    callback = span_args.callback()  # it moves an earlier start's diagnostics aside, and keeps a resumed run's
    if callback is not None and callback.schedule is not None:  # layers past the model's, before the data is read
        span_args.check_schedule(callback.schedule, layer_count(model))
    splits = build_datasets(data_args, tokenizer, training_args)
    logger.info("span %s, %s blocks of %d tokens", span.label,
                " and ".join(f"{len(d)} {s}" for s, d in splits.items()), data_args.block_size)

    trainer = Trainer(model=model, args=training_args, train_dataset=splits.get("train"),
                      eval_dataset=splits.get("validation"), data_collator=default_data_collator,
                      compute_metrics=make_compute_metrics(), preprocess_logits_for_metrics=token_scores,
                      callbacks=stop_callbacks)
    if callback is not None:
        callback.add_to(trainer)
    start = time.time()
    with room_named(training_args.output_dir):
        train_result = trainer.train(resume_from_checkpoint=resume) if training_args.do_train else None
        if training_args.do_eval and not evaluated_to_the_end(trainer):
            trainer.evaluate()
        metrics = summarize(trainer, train_result, span, all_args, time.time() - start, resumed_from=resume)
        metrics["unigram_val_loss"] = unigram_loss(splits["train"], splits["validation"], vocab_rows(tokenizer)) \
            if len(splits) == 2 else None
        if trainer.is_world_process_zero():
            if training_args.do_train:
                trainer.save_model()
                tokenizer.save_pretrained(training_args.output_dir)
            write_json(Path(training_args.output_dir) / "metrics.json", metrics)
    return metrics


def evaluated_to_the_end(trainer: Trainer) -> bool:
    """Whether the run has every evaluation it was to make. A run stopped after its last checkpoint, which the Trainer
    saves before the last evaluation, resumes there with nothing left to train: that evaluation was missing."""
    state, strategy = trainer.state, trainer.args.eval_strategy
    evaluated = {h["step"] for h in state.log_history if "eval_loss" in h}
    due = strategy == "epoch" or strategy == "steps" and state.eval_steps and state.global_step % state.eval_steps == 0
    return bool(evaluated) and (not due or state.global_step in evaluated)


@contextlib.contextmanager
def room_named(output_dir: str) -> Iterator[None]:
    """A save into `output_dir` that fails for want of room (a full disk, a file-size limit) says so: torch's own
    error names neither ("unexpected pos 4160 vs 4052"), safetensors' and the operating system's no file."""
    try:
        yield
    except Exception as err:  # OSError, torch's RuntimeError, safetensors' SafetensorError
        why = no_room(output_dir, err)
        if why is None:
            raise
        raise SystemExit(f"--output_dir {output_dir}: a save failed: {why[0]} ({type(err).__name__}: "
                         f"{shown(str(err), 200)}). {why[1]}, then run the same command again: it resumes from its "
                         "last complete checkpoint, if any") from err


def no_room(output_dir: str, err: BaseException) -> tuple[str, str] | None:
    """(why a save into `output_dir` that raised `err` found no room, what to do), in words; None where it did not.
    safetensors gives the cause in its message alone, torch not at all (then the file left, or the disk, shows it)."""
    said = {code for code in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)
            if getattr(err, "errno", None) == code or os.strerror(code) in str(err)}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and (errno.EFBIG in said or any(
            p.is_file() and p.stat().st_size >= limit for p in Path(output_dir).rglob("*"))):
        return f"a file reached this process's file-size limit of {limit} bytes", "Raise the limit (`ulimit -f`)"
    try:
        free = os.statvfs(output_dir).f_bavail * os.statvfs(output_dir).f_frsize
    except OSError:
        return None
    if said & {errno.ENOSPC, errno.EDQUOT} or free < 2**20:
        return f"its disk is full ({free} bytes free)", "Make room"
    return None


def summarize(trainer, train_result, span, all_args, seconds, resumed_from) -> dict:
    history = trainer.state.log_history
    train = [{"epoch": h.get("epoch"), "step": h["step"], "loss": h["loss"], "learning_rate": h.get("learning_rate")}
             for h in history if "loss" in h]
    evals = [{"epoch": h.get("epoch"), "step": h["step"], "loss": h["eval_loss"], "accuracy": h.get("eval_accuracy"),
              "perplexity": h.get("eval_perplexity")} for h in history if "eval_loss" in h]
    best = min(evals, key=lambda e: e["loss"]) if evals else {}
    model_args, data_args, span_args, training_args, stop_args = all_args
    final_train = train[-1]["loss"] if train else train_result.training_loss if train_result else None
    return {
        "span": span.label,
        "span_config": span.to_dict(),
        "final_train_loss": final_train,
        "min_val_loss": best.get("loss"),
        "best_epoch": best.get("epoch"),
        "val_perplexity": best.get("perplexity"),
        "val_accuracy": best.get("accuracy"),
        "train_history": train,
        "eval_history": evals,
        "train_runtime_s": seconds,
        "resumed_from": resumed_from,
        "world_size": training_args.world_size,
        "device": device_name(training_args.device),
        "backend": backend_for(training_args.device.type, {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            mixed_precision(training_args), torch.float32)),
        "early_stopping": early_stopping(trainer, stop_args),
        "config": run_config(all_args, training_args.world_size, mixed_precision(training_args)),
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


def mixed_precision(training: TrainingArguments) -> str:
    """The mixed precision the Trainer trains in: --bf16/--fp16, else Accelerate's (`accelerate launch
    --mixed_precision` or its config file's mixed_precision, which reach the Trainer as ACCELERATE_MIXED_PRECISION
    and not through --bf16)."""
    return "bf16" if training.bf16 else "fp16" if training.fp16 else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


def run_config(all_args, world_size: int | None, precision: str | None = None) -> dict:
    """Everything that configures a run (run_identity.py says which parts make its result), the contents of its
    data files and tokenizer included: a file edited between a run and its rerun makes another run. `world_size` and
    `precision` (`mixed_precision`) are the launcher's, None where not known."""
    model_args, data_args, span_args, training_args, stop_args = all_args
    return {"model": asdict(model_args), "data": asdict(data_args), "span": asdict(span_args),
            "training": training_args.to_dict(), "stopping": asdict(stop_args), "world_size": world_size,
            "mixed_precision": precision,
            "data_sha256": input_digests(data_args),
            "hf_spanattn": hf_spanattn.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__}


if __name__ == "__main__":
    main()
