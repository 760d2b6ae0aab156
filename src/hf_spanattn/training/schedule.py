"""α schedules over training: keyframes of settings, piecewise or linearly ramped, per layer.

    Schedule([Keyframe(0, "standard:QKV111"), Keyframe("20%", "score:1000")])      # switch at 20 %
    Schedule([Keyframe(0, "score:1111"), Keyframe(500, "score:1000", ramp=True)])  # α ramp to step 500
    Schedule([Keyframe(0, {"0-2": "standard:QKV111", "3-5": "score:1000"})])       # a layer table

`at` is a step (int), a share of training ("20%") or an epoch ("2ep"). A keyframe's `span` is a
label (all layers) or a table {layers: label} with layers as "3-5", "0,2" or "*"; layers a
table leaves out keep the setting an earlier keyframe gave them, else the model config's. With
`ramp=True`, every α moves linearly from the previous keyframe's setting to this one's, which
requires the same rule per layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hf_spanattn.config import SpanAttentionConfig
from hf_spanattn.ops.inputs import as_float, as_int, shown

LayerSettings = dict[int, SpanAttentionConfig]


@dataclasses.dataclass(frozen=True)
class Keyframe:
    """One point of a schedule: from `at` (a step, a share of training "20%" or an epoch "2ep") the layers
    train with `span` (a label for every layer, or a {layers: label} table); with `ramp=True` the α move
    linearly from the previous keyframe's setting to reach it at `at`."""

    at: int | str
    span: str | dict[str, str]
    ramp: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.ramp, bool):
            raise ValueError(f"keyframe ramp={shown(self.ramp)}: expected True or False")
        if as_int(self.at) is not None:
            object.__setattr__(self, "at", as_int(self.at))  # a NumPy integer or 0-d tensor too; the state is JSON
        if isinstance(self.span, dict):  # layer keys as JSON keys too (the Trainer's checkpoint failed on np.int64)
            for key in self.span:
                if as_int(key) is None and not isinstance(key, str):
                    raise ValueError(f"keyframe span={shown(self.span)}: layer key {shown(key)} "
                                     f"({type(key).__name__}): expected a layer index (int) or a string of them "
                                     "('*', '0-3', '0,2')")
            object.__setattr__(self, "span", {k if isinstance(k, str) else as_int(k): v for k, v in self.span.items()})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Keyframe:
        if not isinstance(data, dict) or set(data) - {"at", "span", "ramp"} or not {"at", "span"} <= set(data):
            raise ValueError(f"schedule keyframe {shown(data)}: expected keys 'at', 'span' and optionally 'ramp'")
        return cls(**data)

    def step(self, max_steps: int, steps_per_epoch: int | None) -> int:
        """The optimizer step at which this keyframe is reached, a share or an epoch rounded to the nearest step (a
        half up) (`steps_per_epoch`: optimizer steps in one pass over the training data, gradient accumulation
        included; None where the data has no length)."""
        _check_counts("keyframe", max_steps=max_steps, steps_per_epoch=steps_per_epoch)
        at = self.at.strip() if isinstance(self.at, str) else self.at  # spaces around, as a label takes them
        epoch = isinstance(at, str) and at.endswith("ep")
        try:
            if isinstance(at, str) and at.endswith("%"):
                value = float(at[:-1]) / 100 * max_steps
            elif epoch:
                value = float(at[:-2])
            elif isinstance(at, int) and not isinstance(at, bool):
                value = at
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"keyframe at={shown(at)}: expected a step (int), a share ('20%') or an epoch ('2ep')") \
                from None
        if epoch:
            if steps_per_epoch is None:
                raise ValueError(f"keyframe at={shown(at)}: an epoch keyframe needs training data with a length (the "
                                 "steps per epoch are unknown); give a step or a share ('20%') instead")
            value *= steps_per_epoch
        if not 0 <= value < math.inf:
            raise ValueError(f"keyframe at={shown(at)}: must be finite and not negative")
        if isinstance(at, str) and at.endswith("%") and value > max_steps:  # training would end first
            raise ValueError(f"keyframe at={shown(at)}: a share of training is at most '100%'")
        # a half up: round() takes it to even, which puts '15%' and '25%' of 10 steps both on step 2
        return value if isinstance(value, int) else math.floor(value + 0.5)

    def settings(self, n_layers: int) -> LayerSettings:
        """The setting of each layer this keyframe names, in a model of `n_layers` (every layer for a label)."""
        _check_counts("keyframe", n_layers=n_layers)
        if isinstance(self.span, str):
            config = self._config(self.span)
            return dict.fromkeys(range(n_layers), config)
        if not isinstance(self.span, dict):
            label = f" (a SpanAttentionConfig: its .label, {self.span.label!r})" \
                if isinstance(self.span, SpanAttentionConfig) and self.span.layers is None else ""
            raise ValueError(f"keyframe span={shown(self.span)}: expected a label{label} or a {{layers: label}} table")
        table: LayerSettings = {}
        named_by: dict[int, Any] = {}
        for layers, indices in self.entries(n_layers).items():
            config = self._config(self.span[layers])
            for index in indices:
                if index in named_by:
                    by = (f"{shown(layers)} names layer {index} twice" if named_by[index] == layers else
                          f"layer {index} is named by both {named_by[index]!r} and {shown(layers)}")
                    raise ValueError(f"keyframe span={shown(self.span)}: {by}; name each layer once")
                table[index], named_by[index] = config, layers
        return table

    def entries(self, n_layers: int) -> dict[Any, list[int]]:
        """The layer indices each key of the layer table names ({} for a label, which sets every layer)."""
        _check_counts("keyframe", n_layers=n_layers)
        if not isinstance(self.span, dict):
            return {}
        try:
            return {layers: _layer_list(str(layers), n_layers) for layers in self.span}
        except ValueError as err:  # one layer spec of many keyframes: named by its keyframe
            raise ValueError(f"keyframe at={shown(self.at)} span={shown(self.span)}: {err}") from None

    def _config(self, label: Any) -> SpanAttentionConfig:
        """A label of this keyframe parsed; a bad one names the keyframe (one of many)."""
        try:
            return SpanAttentionConfig.from_label(label)
        except ValueError as err:
            raise ValueError(f"keyframe at={shown(self.at)} span={shown(self.span)}: {err}") from None


def _check_counts(where: str, **counts: Any) -> None:
    """max_steps and n_layers: ints ≥ 0; steps_per_epoch: an int ≥ 1 or None (NumPy and 0-d tensor ints too)."""
    for name, value in counts.items():
        least = 1 if name == "steps_per_epoch" else 0
        if (value is not None or name != "steps_per_epoch") and (as_int(value) is None or as_int(value) < least):
            raise ValueError(f"{where}: {name}={shown(value)}: expected an int ≥ {least}"
                             + (" or None (training data without a length)" if name == "steps_per_epoch" else ""))


def _layer_list(spec: str, n_layers: int) -> list[int]:
    if spec.strip() == "*":
        return list(range(n_layers))
    ranges = []
    try:
        for part in spec.split(","):
            lo, dash, hi = part.partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            if last < first:
                raise ValueError
            ranges.append((first, last))
    except ValueError:
        raise ValueError(f"layer spec {shown(spec)}: expected '*', 'a-b' with a <= b, or 'a,b,c'") from None
    bad = [f"{a}-{b}" if a != b else str(a) for a, b in ranges if a < 0 or b >= n_layers]
    if bad:  # said before the ranges are counted out, which a hand-edited '0-99999999999' would make endless
        raise ValueError(f"layer spec {shown(spec)}: layers {', '.join(bad)} are outside 0..{n_layers - 1}")
    return [i for first, last in ranges for i in range(first, last + 1)]


@dataclasses.dataclass
class Schedule:
    """The keyframes of one training run (`Keyframe`s or dicts with `at`, `span`, `ramp`), checked as given;
    `resolve` places them on the steps of a run and `at_step` gives the settings in force at a step."""

    keyframes: list[Keyframe]

    def __post_init__(self):
        if not isinstance(self.keyframes, (list, tuple)):
            raise ValueError(f"schedule: expected a list of keyframes (Keyframe or dicts with 'at', 'span'), got "
                             f"{shown(self.keyframes)}")
        self.keyframes = [k if isinstance(k, Keyframe) else Keyframe.from_dict(k) for k in self.keyframes]
        for keyframe in self.keyframes:
            keyframe.__post_init__()  # again: a keyframe's table may have been changed since it was made
        if not self.keyframes:
            raise ValueError("schedule: needs at least one keyframe")

    def resolve(self, max_steps: int, steps_per_epoch: int | None,
                n_layers: int) -> list[tuple[int, LayerSettings, bool]]:
        """(step, per-layer settings, ramp) per keyframe, validated; raises ValueError with the cause."""
        _check_counts("schedule", max_steps=max_steps, steps_per_epoch=steps_per_epoch, n_layers=n_layers)
        frames = [(k.step(max_steps, steps_per_epoch), k.settings(n_layers), k.ramp) for k in self.keyframes]
        for (s0, _, _), (s1, _, _), k0, k1 in zip(frames, frames[1:], self.keyframes, self.keyframes[1:]):
            if s1 < s0:
                raise ValueError(f"schedule: keyframes must be in order of time, got step {shown(s1)} after "
                                 f"{shown(s0)}")
            if s1 == s0:  # the later one would replace the earlier one unseen
                raise ValueError(f"schedule: keyframes at={shown(k0.at)} and at={shown(k1.at)} both fall on step "
                                 f"{shown(s0)} (max_steps={max_steps}); give each step one keyframe")
        in_force: LayerSettings = {}  # a layer the previous keyframe leaves out keeps the setting of an earlier one
        for i, (step, table, ramp) in enumerate(frames):
            if ramp and i == 0:
                raise ValueError("schedule: the first keyframe cannot ramp (there is nothing to ramp from)")
            if ramp:
                for layer, config in table.items():
                    before = in_force.get(layer)
                    if before is None or (before.method, before.score_grad) != (config.method, config.score_grad):
                        raise ValueError(f"schedule: keyframe at step {shown(step)} ramps layer {layer} from "
                                         f"{before.label if before else 'the model setting'} to {config.label}; "
                                         "a ramp needs the same method and score_grad on both ends")
            in_force = {**in_force, **table}
        return frames

    def unreached(self, frames: list[tuple[int, LayerSettings, bool]], max_steps: int) -> list[str]:
        """What training that ends after `max_steps` optimizer steps leaves out: a keyframe at step `max_steps`
        or later is never in force (steps 0..max_steps-1 train); a ramp towards one is cut short."""
        notes = []
        for i, (keyframe, (step, _, ramp)) in enumerate(zip(self.keyframes, frames)):
            if step < max_steps or (ramp and i and frames[i - 1][0] >= max_steps):
                continue  # in force, or a ramp from a keyframe that is itself never reached (said there)
            if ramp and step > max_steps:
                start = frames[i - 1][0]
                notes.append(f"keyframe at={shown(keyframe.at)} (step {shown(step)}) is never reached: training ends "
                             f"after max_steps={max_steps}, so its ramp stops "
                             f"{(max_steps - 1 - start) / (step - start):.0%} of the way there")
            elif not ramp:
                notes.append(f"keyframe at={shown(keyframe.at)} (step {shown(step)}) is never reached: training ends "
                             f"after max_steps={max_steps} (steps 0..{max_steps - 1})")
        return notes

    @staticmethod
    def at_step(frames: list[tuple[int, LayerSettings, bool]], step: float | None = None) -> LayerSettings:
        """The per-layer settings in force at `step` (layers no keyframe names are absent), from the `frames` that
        `resolve` gives: `Schedule.at_step(schedule.resolve(max_steps, steps_per_epoch, n_layers), step)`."""
        if not isinstance(frames, (list, tuple)) or not all(isinstance(f, tuple) and len(f) == 3 for f in frames):
            raise TypeError(f"Schedule.at_step: frames={shown(frames)}: expected the keyframes that Schedule.resolve "
                            "gives; call Schedule.at_step(schedule.resolve(max_steps, steps_per_epoch, n_layers), "
                            "step)")
        number = as_int(step) if as_int(step) is not None else as_float(step)  # NumPy and 0-d tensor numbers too
        if number is None or number != number:
            raise TypeError(f"Schedule.at_step: step={shown(step)}: expected the optimizer step (a number)")
        step = number
        current: LayerSettings = {}
        for i, (start, table, ramp) in enumerate(frames):
            if start <= step:
                current = {**current, **table}
                continue
            if ramp:  # on the way from the previous keyframe to this one
                t = (step - frames[i - 1][0]) / (start - frames[i - 1][0])
                current = {**current, **{layer: _mix(current[layer], config, t) for layer, config in table.items()}}
            break
        return current


def _mix(a: SpanAttentionConfig, b: SpanAttentionConfig, t: float) -> SpanAttentionConfig:
    """Linear interpolation of the alphas (and the QKV multipliers) of two settings of one rule."""
    lerp = lambda x, y: tuple(u + t * (v - u) for u, v in zip(x, y))  # noqa: E731  (an α equal on both ends stays)
    return b.replace(alphas=lerp(a.alphas, b.alphas), qkv_alphas=lerp(a.qkv_alphas, b.qkv_alphas))
