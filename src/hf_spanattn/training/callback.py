"""`SpanAttentionCallback`: α schedules and per-layer tables during training, and diagnostics."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import sys
import threading
import uuid
import warnings
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import CallbackHandler, ExportableState
from transformers.trainer_utils import _re_checkpoint, has_length
from transformers.utils import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from hf_spanattn.config import CONFIG_NAME as SETTINGS_NAME
from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.integration.model_layers import attention_modules, calls_the_registry, layer_count, layer_index
from hf_spanattn.integration.patch import base_model
from hf_spanattn.integration.registry import OVERRIDE_ATTR, OWNER_ATTR, PROBE_ATTR, settings_for
from hf_spanattn.integration.stored import config_of
from hf_spanattn.integration.structure import refuse_layers_without_attention
from hf_spanattn.integration.train_checks import from_rank_zero, same_on_every_rank
from hf_spanattn.ops.inputs import as_int, shown, user_stacklevel
from hf_spanattn.training.diagnostics import OrderRecorder, reduce_over_ranks
from hf_spanattn.training.diagnostics_file import (
    append,
    inside,
    is_a_pipe,
    log_prefix,
    names_a_folder,
    release_lock,
    running_in,
    start_records,
    take_lock,
)
from hf_spanattn.training.schedule import Schedule

DIAGNOSTICS_FILE = "span_diagnostics.jsonl"
logger = logging.getLogger(__name__)
_PATH_MAX = 4096  # Linux's limit on a path, in bytes (macOS's is 1024)
_SAVED = ("last_step",)  # the attributes `state` writes into trainer_state.json
# what the Trainer writes into its output dir (save_model, save_state, save_metrics, create_model_card), over a
# diagnostics file of the same name; under DeepSpeed ZeRO-3 without stage3_gather_16bit_weights_on_model_save,
# save_model writes DeepSpeed's checkpoint: its tag file `latest` and the scripts that gather the weights
TRAINER_FILES = {CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                 WEIGHTS_INDEX_NAME, ADAPTER_CONFIG_NAME, ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME,
                 SETTINGS_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME, "README.md", "all_results.json",
                 "train_results.json", "eval_results.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "latest", "zero_to_fp32.py", "zero_to_torch.py"}


class SpanAttentionCallback(TrainerCallback, ExportableState):
    """Change the span settings as training goes, and log what each order of dQ, dK contributes.

    Args:
        schedule: a `Schedule`, or a list of keyframes (`Keyframe` or dicts with `at`, `span`,
            `ramp`); see `hf_spanattn.training.schedule`. None keeps the model's settings.
        diagnostics_every: every N optimizer steps, record per layer the norm and share of each
            order component of dQ and dK, the cosine between the applied and the standard
            gradient, and the ranks of Π_K and Π_V. 0 (the default) records nothing and costs
            nothing; a recorded step costs one extra rule evaluation per order in the backward.
        diagnostics_per_head: also record the norms per head.
        diagnostics_file: JSONL output, a path relative to the Trainer's output_dir (default
            span_diagnostics.jsonl). The file always lies in the output dir: an absolute path outside it
            (as one read back from the trainer_state.json of a run that has moved) keeps only its file name.
            A file that the Trainer writes (README.md, config.json, ...: `TRAINER_FILES`) or deletes (one
            in a checkpoint folder) is refused, symbolic links followed.
            A resumed run first drops the records past the step it resumes from. While a run writes it,
            `<file>.lock` (the process id) stops a second run, in another process or thread, from writing into it.

    Settings are validated when training starts. The schedule is a function of the global step,
    so a run resumed from a checkpoint continues it at the same point.

    Logs: each step the Trainer logs gets the α in force (`span/alpha0`.., `span/alpha_q`, `_k`, `_v`;
    per layer as `span/layer{i}/alpha0`.. where the model's `layers` or a schedule's layer table sets
    layers apart), and each recorded step its diagnostics (`span/layer{i}/dq_share0`.., `cos_q`,
    `rank_k`, ...; in a composite model, such as an encoder-decoder, each tower's layer apart, named by the path
    of its list of layers: `span/encoder.encoder.layer.{i}/dq_share0`, and "tower" in the JSONL). They go
    through the Trainer's own logging, so they reach `state.log_history`,
    `trainer_state.json` in checkpoints, TensorBoard, W&B and any other `report_to`, whether the
    callback is given as `Trainer(callbacks=[cb])`, added with `trainer.add_callback(cb)` or with
    `cb.add_to(trainer)`. Two things stand in the way, and are handled so:

    - The Trainer appends a copy of the logs to `log_history` before it calls `on_log`, so `on_log`
      adds the figures both to the logs and to that entry (the last one, at the same step, holding
      the same values); checkpoints are saved after `on_log`, so `trainer_state.json` has them.
    - Callbacks run in list order, and `callbacks=[cb]` comes after the reporting integrations, which
      would have written their logs before `on_log` adds anything. So at `on_train_begin` the callback
      moves itself to the front of the `CallbackHandler` running the event (callbacks are not handed
      the handler; it is the caller of the event, found on the call stack by type and by holding this
      callback in its `callbacks` list); a copy that the Trainer restores from a checkpoint moves
      itself first the same way. Where no handler is found (a trainer that dispatches events
      otherwise), the callback warns, and the figures reach log_history and the callbacks after it.
      This is preferred over overriding `Trainer.log`, which needs a Trainer subclass, and over
      writing to TensorBoard or W&B directly, which would bypass `report_to`.

    Under DDP and FSDP the diagnostics are reduced over the ranks (`reduce_over_ranks`): every rank
    logs the figures of the global batch, the same as one process over that batch.
    """

    def __init__(self, schedule: Schedule | list | None = None, diagnostics_every: int = 0,
                 diagnostics_per_head: bool = False, diagnostics_file: str | None = None) -> None:
        # diagnostics_file: kept as a string, JSON in the state
        self.schedule, self.diagnostics_every, self.diagnostics_per_head, self.diagnostics_file = _checked(
            schedule, diagnostics_every, diagnostics_per_head, diagnostics_file)
        self._start_afresh()
        self.last_step = 0

    def _start_afresh(self) -> None:
        """The state of one training run, set anew when it starts (a checkpoint's trainer_state.json, which the
        Trainer may restore this callback from, sets any attribute it names)."""
        self._frames: list | None = None
        self._layers: dict[int, list] = {}
        self._unnumbered: list = []  # attention without a layer index beside attention with one (a vision tower)
        self._towers: dict[tuple[int, str], list] = {}  # the modules of each layer, per tower (`_towers`)
        self._per_layer = False
        self._applied: tuple | None = None  # the settings of the numbered layers, and of the others
        self._label_frames: list = []  # the frames of the schedule's labels, which attention without an index follows
        self._recorders: dict[tuple[int, str], OrderRecorder] = {}
        self._pending: dict[str, float] = {}
        self._alphas_logged_at: int | None = None
        self._path: str | None = None
        setattr(self, OWNER_ATTR, uuid.uuid4().hex)  # marks what this run sets on the layers (a string: it pickles)

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuses a value that is no code for a method or a special attribute of the callback (`{"on_step_begin": 5}`):
        the Trainer restores a checkpoint's callback by setting every attribute its trainer_state.json names."""
        found = next((vars(k)[name] for k in type(self).__mro__ if name in vars(k)), None)
        if not callable(value) and (inspect.isroutine(found) or isinstance(found, (classmethod, staticmethod))
                                    or hasattr(type(found), "__set__")):  # a method, a property, __class__, __dict__
            raise AttributeError(
                f"SpanAttentionCallback: {shown(name)} = {shown(value)}: {shown(name)} is a method or a special "
                "attribute of the callback, not a setting (as a checkpoint's trainer_state.json, field "
                "stateful_callbacks, SpanAttentionCallback, attributes, sets it when resuming with "
                f"restore_callback_states_from_checkpoint=True); the attributes it saves are {list(_SAVED)}")
        super().__setattr__(name, value)

    def add_to(self, trainer: Any) -> SpanAttentionCallback:
        """Add this callback to `trainer` in front of the others (the same as `trainer.add_callback(callback)`
        or `Trainer(callbacks=[callback])`, which move it there when training starts)."""
        if not isinstance(getattr(trainer, "callback_handler", None), CallbackHandler):
            raise TypeError(f"SpanAttentionCallback.add_to: trainer={type(trainer).__name__}: expected a transformers "
                            "Trainer (or a subclass, such as TRL's SFTTrainer)")
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    # -- the Trainer's events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        thread = running_in(getattr(self, "_thread", None), self)
        if thread is not None:  # starting afresh would take the layers, settings and records from under that run
            raise ValueError(f"SpanAttentionCallback: this callback is in a training run going on in thread "
                             f"{thread!r}; give each Trainer a SpanAttentionCallback of its own")
        self._thread = threading.get_ident()
        self._check()
        saved = self.state()["args"]  # those that set the α and when the ranks reduce the diagnostics
        same_on_every_rank("SpanAttentionCallback settings", json.dumps(
            {k: saved[k] for k in ("schedule", "diagnostics_every")}, sort_keys=True, default=repr), "",
            "A schedule sets the α of the gradient averaged over the ranks, and the ranks reduce the diagnostics "
            "together at the steps diagnostics_every names")
        _say_if_resumed_with_another_schedule(saved["schedule"], state)
        if isinstance(getattr(state, "stateful_callbacks", None), dict):  # a checkpoint trained without this callback
            state.stateful_callbacks.setdefault(type(self).__name__, self.state())  # where the Trainer saves it
        self._start_afresh()
        self._move_first()
        base = base_model(model, "SpanAttentionCallback")
        self._layers = attention_modules(base)
        numbered = {id(module) for modules in self._layers.values() for module in modules}
        self._unnumbered = [module for module in base.modules() if id(module) not in numbered
                            and layer_index(module) is None and calls_the_registry(module)]
        self._towers = _towers(base, self._layers, self._unnumbered)
        config = config_of(base.config)
        if config is None:
            towers = list(_towers_patched_alone(base))
            alone = (f", only its tower{'s' if len(towers) > 1 else ''} {', '.join(towers)} (patch_model given the "
                     "tower), and the callback sets the layers of a patched model" if towers else "")
            again = (f" (then patch_model(model.{towers[0]}, ...) again for a tower of settings of its own)"
                     if towers else "")
            raise ValueError(f"SpanAttentionCallback: the model is not patched{alone}; call "
                             f"hf_spanattn.patch_model(model, config) before training{again}")
        for module in self._modules():  # what a training run stopped midway left on the layers
            module.__dict__.pop(PROBE_ATTR, None)
        self._applied, self._recorders = None, {}
        self._per_layer = config.layers is not None or (
            self.schedule is not None and any(isinstance(k.span, dict) for k in self.schedule.keyframes))
        if self.schedule is not None:
            n_layers = layer_count(base)
            steps_per_epoch = None  # as the Trainer counts them: a last partial accumulation is a step
            if train_dataloader is not None and has_length(train_dataloader):
                steps_per_epoch = max(math.ceil(len(train_dataloader) / args.gradient_accumulation_steps), 1)
            self._frames = self.schedule.resolve(state.max_steps, steps_per_epoch, n_layers)
            self._label_frames = _label_frames(self.schedule, self._frames)
            for keyframe in self.schedule.keyframes if self._layers else ():  # else numbered nowhere (said on use)
                for layers, indices in keyframe.entries(n_layers).items():
                    refuse_layers_without_attention(base, indices, f"SpanAttentionCallback: keyframe "
                                                    f"at={shown(keyframe.at)} span={shown(keyframe.span)}: layers "
                                                    f"{shown(layers)}", every=False)
            labels = [k for k in self.schedule.keyframes if isinstance(k.span, str)]
            if self._unnumbered and any(isinstance(k.span, dict) for k in self.schedule.keyframes):
                kinds = sorted({type(module).__name__ for module in self._unnumbered})
                follow = (f"follow the schedule's labels (keyframes at={', '.join(shown(k.at) for k in labels)}), "
                          "keeping the setting the last one gave them while a table is in force" if labels else
                          "keep the model's settings throughout (a label sets them too)")
                warnings.warn(f"SpanAttentionCallback: {len(self._unnumbered)} attention modules of the model "
                              f"({', '.join(kinds)}) carry no layer index, so a layer table cannot name them; they "
                              f"{follow}", stacklevel=user_stacklevel())
            own = {name: settings for name, settings in _towers_patched_alone(base).items() if settings != config}
            if labels and own:
                towers = ", ".join(f"{name} ({settings.label})" for name, settings in own.items())
                warnings.warn(f"SpanAttentionCallback: the schedule's labels (keyframes at="
                              f"{', '.join(shown(k.at) for k in labels)}) set every layer, also those of the towers "
                              f"patched with settings of their own, {towers}, while they are in force; a layer table "
                              "sets only the layers it names", stacklevel=user_stacklevel())
            notes = self.schedule.unreached(self._frames, state.max_steps)
            for note in notes[:5]:
                warnings.warn(f"SpanAttentionCallback: {note}", stacklevel=user_stacklevel())
            if len(notes) > 5:
                warnings.warn(f"SpanAttentionCallback: {len(notes) - 5} more keyframes are never reached: training "
                              f"ends after max_steps={state.max_steps}", stacklevel=user_stacklevel())
        self._path = inside(args.output_dir, self.diagnostics_file or DIAGNOSTICS_FILE)
        if self.diagnostics_every and os.path.isdir(self._path):
            raise ValueError(f"SpanAttentionCallback: diagnostics_file={self.diagnostics_file!r}: {self._path} is a "
                             "folder; expected the name of the JSONL file to write")
        if self.diagnostics_every and is_a_pipe(self._path):  # writing would wait for a reader for ever
            raise ValueError(f"SpanAttentionCallback: diagnostics_file={self.diagnostics_file!r}: {self._path} is a "
                             "pipe or a socket; expected the name of the JSONL file to write")
        # where the records land, symbolic links followed (a link in the output dir may lead into a checkpoint)
        landing = os.path.relpath(os.path.realpath(self._path), os.path.realpath(args.output_dir))
        through = f" (through a symbolic link: {landing})" if landing != os.path.relpath(self._path, args.output_dir) \
            else ""
        checkpoint = next((part for part in landing.split(os.sep)[:-1] if _re_checkpoint.search(part)), None)
        if self.diagnostics_every and checkpoint is not None:
            raise ValueError(f"SpanAttentionCallback: diagnostics_file={self.diagnostics_file!r}{through} lies in the "
                             f"folder {checkpoint}, a checkpoint that the Trainer writes over or deletes "
                             "(save_total_limit); name a file outside the checkpoint folders")
        if self.diagnostics_every and landing in TRAINER_FILES:
            raise ValueError(f"SpanAttentionCallback: diagnostics_file={self.diagnostics_file!r}{through} is a file "
                             "that the Trainer writes into its output_dir (saving the model, its state, its metrics or "
                             "its card), over the records; name another file")
        if self.diagnostics_every:
            self._start_file(state)
        self._apply(state.global_step)

    def _start_file(self, state) -> None:
        """Rank 0 (the one process without data parallelism) takes the lock of the diagnostics file and starts its
        records; where it refuses, every rank does, with its message."""
        refused = None
        if state.is_world_process_zero:
            try:
                take_lock(self._path, self)
                start_records(self._path, state.global_step, state.log_history)
            except (OSError, ValueError) as err:
                refused = err
        said = from_rank_zero("diagnostics file", "" if refused is None else f"{type(refused).__name__}: {refused}")
        if refused is not None:
            raise refused
        if said:
            raise ValueError(f"SpanAttentionCallback: rank 0, which writes the diagnostics, refused them: {said}")

    def _move_first(self) -> None:
        """Put this callback first in the handler running the event (see the class docstring)."""
        callbacks = _calling_handler_callbacks(self)
        others = [c for c in callbacks or () if isinstance(c, SpanAttentionCallback) and c is not self]
        if others:  # each sets the overrides and probes of every layer: the last one to run would win
            raise ValueError(f"SpanAttentionCallback: the trainer holds {len(others) + 1} of them; their schedules and "
                             "diagnostics would overwrite each other. Give the trainer one SpanAttentionCallback "
                             "(one schedule can hold every keyframe, and a layer table per keyframe)")
        if callbacks is None:
            warnings.warn("SpanAttentionCallback: found no transformers CallbackHandler calling it, so callbacks "
                          "listed before it (TensorBoard, W&B, ...) do not receive its logs; put it first in the "
                          "trainer's callbacks", stacklevel=user_stacklevel())
        elif callbacks[0] is not self:
            callbacks.remove(self)  # safe while the handler iterates: only earlier entries shift
            callbacks.insert(0, self)

    def on_step_begin(self, args, state, control, **kwargs):
        self._apply(state.global_step)
        if self.diagnostics_every and state.global_step % self.diagnostics_every == 0:
            self._recorders = {}
            for key, modules in self._towers.items():
                self._recorders[key] = OrderRecorder()
                for module in modules:
                    setattr(module, PROBE_ATTR, self._recorders[key])
                    setattr(module, OWNER_ATTR, getattr(self, OWNER_ATTR))

    def on_step_end(self, args, state, control, **kwargs):
        self.last_step = state.global_step
        if not self._recorders:
            return
        for module in self._modules():
            module.__dict__.pop(PROBE_ATTR, None)
        reduce_over_ranks([self._recorders[key] for key in sorted(self._recorders)])
        records = []
        for (index, tower), recorder in sorted(self._recorders.items()):
            summary = recorder.summary(self.diagnostics_per_head)
            if not summary:
                continue  # a layer that kept stock gradients this step
            label = settings_for(self._towers[index, tower][0]).label
            records.append({"step": state.global_step, "epoch": state.epoch, "layer": index,
                            **({"tower": tower} if tower else {}), "span": label, **summary})
            prefix = log_prefix(index, tower)
            for side in ("dq", "dk"):
                for order, share in enumerate(summary[f"{side}_share"]):
                    self._pending[f"{prefix}{side}_share{order}"] = share
            self._pending.update({f"{prefix}{k}": summary[k] for k in ("cos_q", "cos_k", "rank_k", "rank_v")})
        self._recorders = {}
        if records and state.is_world_process_zero:
            append(self._path, "".join(json.dumps(r) + "\n" for r in records))
        control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        figures, self._pending = self._pending, {}
        if self._layers and state.global_step != self._alphas_logged_at:  # the α once per logged step
            figures = {**self._alphas_in_force(), **figures}
            self._alphas_logged_at = state.global_step
        if not figures:
            return
        entry = state.log_history[-1] if state.log_history else {}
        if entry.get("step") == state.global_step and all(k in logs and (logs[k] is v or logs[k] == v)
                                                          for k, v in entry.items() if k != "step"):
            entry.update(figures)  # the Trainer's copy of these logs
        logs.update(figures)

    def _alphas_in_force(self) -> dict[str, float]:
        """The α each layer trains with now, as log entries (stock layers: α_Q = α_K = α_V = 1): once for all layers,
        or per layer (of each tower) where the model's `layers` or a layer table sets layers apart, or they differ
        (the decoder of an encoder-decoder patched otherwise)."""
        stock = SpanAttentionConfig.from_label("standard:QKV111")
        settings = {key: settings_for(modules[0]) or stock for key, modules in sorted(self._towers.items())}
        per_layer = self._per_layer or len({config.label for config in settings.values()}) > 1
        figures = {}
        for (index, tower), config in settings.items():
            prefix = log_prefix(index, tower) if per_layer else "span/"
            figures.update({f"{prefix}alpha{i}": a for i, a in enumerate(config.alphas)})
            figures.update({f"{prefix}alpha_{n}": a for n, a in zip("qkv", config.qkv_alphas)})
            if not per_layer:
                break
        return figures

    def on_train_end(self, args, state, control, **kwargs):
        for module in self._modules():
            for name in (OVERRIDE_ATTR, PROBE_ATTR, OWNER_ATTR):
                module.__dict__.pop(name, None)
        self._applied = None
        # the model's modules let go: a callback kept for the next run (a search's trials) holds no model
        self._layers, self._unnumbered, self._towers, self._recorders = {}, [], {}, {}
        if self._path is not None:
            release_lock(self._path, self)

    # -- schedule ---------------------------------------------------------------------------
    def settings_at(self, step: int) -> dict:
        """Per-layer settings the schedule sets at `step` in the training run that started last (empty without a
        schedule)."""
        if self.schedule is not None and self._frames is None:  # its shares and epochs are counted out at the start
            raise ValueError("SpanAttentionCallback.settings_at: the schedule's steps are known once training starts "
                             "(a share or an epoch needs the Trainer's max_steps and steps per epoch); before, call "
                             "Schedule.at_step(callback.schedule.resolve(max_steps, steps_per_epoch, n_layers), step)")
        return Schedule.at_step(self._frames, step) if self._frames else {}

    def _apply(self, step: int) -> None:
        settings = self.settings_at(step)
        everywhere = Schedule.at_step(self._label_frames, step).get(0) if self._label_frames else None
        if (settings, everywhere) == self._applied:
            return
        for index, modules in self._layers.items():
            for module in modules:
                if index in settings:
                    setattr(module, OVERRIDE_ATTR, settings[index])
                    setattr(module, OWNER_ATTR, getattr(self, OWNER_ATTR))
                else:
                    module.__dict__.pop(OVERRIDE_ATTR, None)
        for module in self._unnumbered:
            if everywhere is not None:
                setattr(module, OVERRIDE_ATTR, everywhere)
                setattr(module, OWNER_ATTR, getattr(self, OWNER_ATTR))
            else:
                module.__dict__.pop(OVERRIDE_ATTR, None)
        self._applied = (settings, everywhere)

    def _modules(self) -> list:
        """Every attention module of the model in training."""
        return [module for modules in self._layers.values() for module in modules] + self._unnumbered

    def _check(self) -> None:
        """The settings checked again: code may have set them since, and so may a checkpoint's trainer_state.json
        that the Trainer restored this callback from."""
        try:
            self.schedule, self.diagnostics_every, self.diagnostics_per_head, self.diagnostics_file = _checked(
                self.schedule, self.diagnostics_every, self.diagnostics_per_head, self.diagnostics_file)
        except ValueError as err:
            raise ValueError(f"SpanAttentionCallback: {err} (an attribute set after the callback was made, or "
                             "restored from a checkpoint's trainer_state.json, field stateful_callbacks)") from None

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> dict:
        self._check()  # the Trainer asks for it before training starts, and writes it into trainer_state.json
        keyframes = [vars(k) for k in self.schedule.keyframes] if self.schedule else None
        return {"args": {"schedule": keyframes, "diagnostics_every": self.diagnostics_every,
                         "diagnostics_per_head": self.diagnostics_per_head,
                         "diagnostics_file": self.diagnostics_file},
                "attributes": {name: getattr(self, name) for name in _SAVED}}


def _checked(schedule: Any, every: Any, per_head: Any, file: Any) -> tuple[Schedule | None, int, bool, str | None]:
    """The callback's settings, validated: (schedule, diagnostics_every, diagnostics_per_head, diagnostics_file)."""
    if isinstance(schedule, (list, tuple)):
        schedule = Schedule(list(schedule))
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ValueError(f"schedule={shown(schedule)}: expected a Schedule or a list of keyframes")
    if schedule is not None:
        schedule.__post_init__()  # its keyframes checked again, in place: the list may have been changed since
    if as_int(every) is None or as_int(every) < 0:
        raise ValueError(f"diagnostics_every={shown(every)}: expected an integer >= 0 (0 = off)")
    if not isinstance(per_head, bool):
        raise ValueError(f"diagnostics_per_head={shown(per_head)}: expected True or False")
    if file is not None and (not isinstance(file, (str, os.PathLike)) or not isinstance(os.fspath(file), str)
                             or (os.fspath(file) and names_a_folder(os.fspath(file))) or "\0" in os.fspath(file)):
        raise ValueError(f"diagnostics_file={shown(file)}: expected a file name (a path relative to the Trainer's "
                         "output_dir) or None")
    if file is not None and len(os.fsencode(file)) >= _PATH_MAX:  # which no system opens, and messages would repeat
        raise ValueError(f"diagnostics_file={shown(os.fspath(file))}: longer than a path may be ({_PATH_MAX} bytes); "
                         "expected a file name (a path relative to the Trainer's output_dir)")
    return schedule, as_int(every), per_head, None if file is None else os.fspath(file)


def _towers(model: torch.nn.Module, layers: dict[int, list], unnumbered: list) -> dict[tuple[int, str], list]:
    """The attention modules of each layer, per tower: (index, tower) -> modules. A model with one list of layers
    has one tower, named ""; in a composite model (an encoder and a decoder, a vision and a text model) layer i of
    each tower is another layer, named by the path of its list of layers ("encoder.encoder.layer"). A module that
    carries no layer index (`unnumbered`) is numbered by its entry in the list; one in no list is left out."""
    named = dict(model.named_modules())
    names = {id(module): name for name, module in named.items()}
    towers: dict[tuple[int, str], list] = {}
    for index, module in [(i, m) for i, modules in layers.items() for m in modules] + [(None, m) for m in unnumbered]:
        parts = names.get(id(module), "").split(".")
        # the list of layers it lies in: the first ModuleList in its path whose entry (`index`) holds it
        entries = [(int(part), ".".join(parts[:n])) for n, part in enumerate(parts) if part.isdigit()]
        entry, tower = next(((i, path) for i, path in entries if index in (None, i)
                             and isinstance(named.get(path), torch.nn.ModuleList)), (index, ""))
        if entry is not None:
            towers.setdefault((entry, tower), []).append(module)
    if len({tower for _, tower in towers}) == 1:
        return {(index, ""): modules for (index, _), modules in towers.items()}
    return towers


def _say_if_resumed_with_another_schedule(schedule: list | None, state: Any) -> None:
    """Warn where a run resumed from a checkpoint (its trainer_state.json, field stateful_callbacks) follows another
    schedule than the one the checkpoint was trained with: the Trainer restores a callback only where asked."""
    saved = (getattr(state, "stateful_callbacks", None) or {}).get(SpanAttentionCallback.__name__)
    saved = saved[0] if isinstance(saved, list) and saved else saved
    if not state.global_step or not isinstance(saved, dict) or not isinstance(saved.get("args"), dict):
        return
    was, now = saved["args"].get("schedule"), json.loads(json.dumps(schedule, default=repr))  # keys as JSON's
    if was != now:
        named = lambda keyframes: "no schedule" if keyframes is None else f"the schedule {shown(keyframes, 300)}"  # noqa: E731
        warnings.warn(f"SpanAttentionCallback: the run resumes at step {state.global_step} from a checkpoint trained "
                      f"with {named(was)}, and follows this callback's, {named(now)}, from "
                      "there; to continue the checkpoint's, give the callback that one (or "
                      "TrainingArguments(restore_callback_states_from_checkpoint=True))", stacklevel=user_stacklevel())


def _label_frames(schedule: Schedule, frames: list) -> list:
    """The frames of `schedule` (`Schedule.resolve`'s) as attention that carries no layer index follows them: its
    setting as "layer 0" at each label (which sets every layer), none at a table (which cannot name it). A ramp to the
    first label, from a table, has no start for it: it takes that label at its step."""
    labels = [(at, {0: next(iter(table.values()))} if isinstance(k.span, str) and table else {}, ramp)
              for k, (at, table, ramp) in zip(schedule.keyframes, frames)]
    first = next((i for i, (_, table, _) in enumerate(labels) if table), None)
    if first is not None and labels[first][2]:
        labels[first] = (*labels[first][:2], False)
    return labels


def _towers_patched_alone(model: torch.nn.Module) -> dict[str, SpanAttentionConfig]:
    """The towers of a composite model that hold settings (the outermost model of each), by path, with those
    settings: those patched alone, and those patch_model gave the model's."""
    named = {name: config_of(module.config) for name, module in model.named_modules()
             if getattr(module, "config", model.config) is not model.config and config_of(module.config) is not None}
    return {name: settings for name, settings in named.items()
            if not any(name.startswith(f"{other}.") for other in named)}


def _calling_handler_callbacks(callback: SpanAttentionCallback) -> list | None:
    """The callback list of the `CallbackHandler` on the call stack that holds `callback`, or None."""
    frame = sys._getframe(1)
    for _ in range(10):  # the handler's call_event is two or three frames up
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and any(c is callback for c in owner.callbacks):
            return owner.callbacks
        frame = frame.f_back
    return None


