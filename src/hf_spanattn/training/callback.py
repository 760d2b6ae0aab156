"""`SpanAttentionCallback`: α schedules and per-layer tables during training, and diagnostics."""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import warnings
import weakref
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import has_length

from hf_spanattn.integration.patch import base_model
from hf_spanattn.integration.registry import OVERRIDE_ATTR, PROBE_ATTR, attention_modules, config_of, settings_for
from hf_spanattn.training.diagnostics import OrderRecorder
from hf_spanattn.training.schedule import Schedule

DIAGNOSTICS_FILE = "span_diagnostics.jsonl"
logger = logging.getLogger(__name__)
# callback handlers whose SpanAttentionCallback was put first by `add_to`: a copy that the Trainer
# rebuilds from a checkpoint's trainer_state.json (restore_callback_states_from_checkpoint) is appended
# last, and moves itself back to the front when training starts
_FIRST_IN: weakref.WeakSet = weakref.WeakSet()


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
            A resumed run first drops the records past the step it resumes from.

    Settings are validated when training starts. The schedule is a function of the global step,
    so a run resumed from a checkpoint continues it at the same point. For TensorBoard or W&B
    to receive the diagnostics as well, add the callback with `callback.add_to(trainer)`.
    """

    def __init__(self, schedule: Schedule | list | None = None, diagnostics_every: int = 0,
                 diagnostics_per_head: bool = False, diagnostics_file: str | None = None) -> None:
        if isinstance(schedule, (list, tuple)):
            schedule = Schedule(list(schedule))
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ValueError(f"schedule={schedule!r}: expected a Schedule or a list of keyframes")
        if not isinstance(diagnostics_every, numbers.Integral) or isinstance(diagnostics_every, bool) \
                or diagnostics_every < 0:
            raise ValueError(f"diagnostics_every={diagnostics_every!r}: expected an integer >= 0 (0 = off)")
        if not isinstance(diagnostics_per_head, bool):
            raise ValueError(f"diagnostics_per_head={diagnostics_per_head!r}: expected True or False")
        if diagnostics_file is not None and not isinstance(diagnostics_file, (str, os.PathLike)):
            raise ValueError(f"diagnostics_file={diagnostics_file!r}: expected a file name (a path relative to the "
                             "Trainer's output_dir) or None")
        self.schedule = schedule
        self.diagnostics_every = int(diagnostics_every)
        self.diagnostics_per_head = diagnostics_per_head
        self.diagnostics_file = None if diagnostics_file is None else os.fspath(diagnostics_file)  # JSON in the state
        self._frames: list | None = None
        self._layers: dict[int, list] = {}
        self._applied: dict | None = None
        self._recorders: dict[int, OrderRecorder] = {}
        self._pending: dict[str, float] = {}
        self._path: str | None = None
        self.last_step = 0

    def add_to(self, trainer: Any) -> SpanAttentionCallback:
        """Put this callback first, so that the reporting callbacks also see its diagnostics (it stays
        first when a checkpoint's callback state is restored)."""
        trainer.callback_handler.callbacks.insert(0, self)
        _FIRST_IN.add(trainer.callback_handler)
        return self

    # -- the Trainer's events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._move_first()
        base = base_model(model)
        self._layers = attention_modules(base)
        if config_of(base.config) is None:
            raise ValueError("SpanAttentionCallback: the model is not patched; call hf_spanattn.patch_model(model, "
                             "config) before training")
        if self.schedule is not None:
            n_layers = base.config.get_text_config().num_hidden_layers
            steps_per_epoch = None  # as the Trainer counts them: a last partial accumulation is a step
            if train_dataloader is not None and has_length(train_dataloader):
                steps_per_epoch = max(math.ceil(len(train_dataloader) / args.gradient_accumulation_steps), 1)
            self._frames = self.schedule.resolve(state.max_steps, steps_per_epoch, n_layers)
        self._path = _inside(args.output_dir, self.diagnostics_file or DIAGNOSTICS_FILE)
        if self.diagnostics_every and state.is_world_process_zero:
            _drop_records_after(self._path, state.global_step)
        self._apply(state.global_step)

    def _move_first(self) -> None:
        for handler in list(_FIRST_IN):
            callbacks = handler.callbacks
            if any(c is self for c in callbacks) and callbacks[0] is not self:
                callbacks.remove(self)  # safe while the handler iterates: only earlier entries shift
                callbacks.insert(0, self)

    def on_step_begin(self, args, state, control, **kwargs):
        self._apply(state.global_step)
        if self.diagnostics_every and state.global_step % self.diagnostics_every == 0:
            self._recorders = {}
            for index, modules in self._layers.items():
                self._recorders[index] = OrderRecorder()
                for module in modules:
                    setattr(module, PROBE_ATTR, self._recorders[index])

    def on_step_end(self, args, state, control, **kwargs):
        self.last_step = state.global_step
        if not self._recorders:
            return
        for modules in self._layers.values():
            for module in modules:
                module.__dict__.pop(PROBE_ATTR, None)
        records = []
        for index, recorder in sorted(self._recorders.items()):
            summary = recorder.summary(self.diagnostics_per_head)
            if not summary:
                continue  # a layer that kept stock gradients this step
            label = settings_for(self._layers[index][0]).label
            records.append({"step": state.global_step, "epoch": state.epoch, "layer": index, "span": label, **summary})
            for side in ("dq", "dk"):
                for order, share in enumerate(summary[f"{side}_share"]):
                    self._pending[f"span/layer{index}/{side}_share{order}"] = share
            self._pending.update({f"span/layer{index}/{k}": summary[k] for k in ("cos_q", "cos_k", "rank_k", "rank_v")})
        self._recorders = {}
        if records and state.is_world_process_zero:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            with open(self._path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        control.should_log = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._pending:
            logs.update(self._pending)
            self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        for modules in self._layers.values():
            for module in modules:
                module.__dict__.pop(OVERRIDE_ATTR, None)
                module.__dict__.pop(PROBE_ATTR, None)
        self._applied = None

    # -- schedule ---------------------------------------------------------------------------
    def settings_at(self, step: int) -> dict:
        """Per-layer settings the schedule sets at `step` (empty without a schedule)."""
        return Schedule.at_step(self._frames, step) if self._frames else {}

    def _apply(self, step: int) -> None:
        settings = self.settings_at(step)
        if settings == self._applied:
            return
        for index, modules in self._layers.items():
            for module in modules:
                if index in settings:
                    setattr(module, OVERRIDE_ATTR, settings[index])
                else:
                    module.__dict__.pop(OVERRIDE_ATTR, None)
        self._applied = settings

    # -- checkpoints ------------------------------------------------------------------------
    def state(self) -> dict:
        keyframes = [vars(k) for k in self.schedule.keyframes] if self.schedule else None
        return {"args": {"schedule": keyframes, "diagnostics_every": self.diagnostics_every,
                         "diagnostics_per_head": self.diagnostics_per_head,
                         "diagnostics_file": self.diagnostics_file},
                "attributes": {"last_step": self.last_step}}



def _inside(output_dir: str, path: str) -> str:
    """`path` relative to `output_dir`; an absolute path outside it keeps only its file name there."""
    root = os.path.abspath(output_dir)
    full = os.path.abspath(os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        warnings.warn(f"SpanAttentionCallback: diagnostics_file={path!r} lies outside the output dir {root}; "
                      f"writing {os.path.basename(full)} there instead", stacklevel=3)
        full = os.path.join(root, os.path.basename(full))
    return full


def _drop_records_after(path: str, step: int) -> None:
    """Keep the records up to `step` (where a resumed run starts), so that no step is written twice."""
    if step == 0 or not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # a line cut short when the run was stopped
    if len(kept) != len(lines):
        logger.info("%s: dropped %d records past step %d, where training resumes", path, len(lines) - len(kept),
                    step)
        with open(path, "w") as f:
            f.writelines(kept)
