"""`SpanAttentionConfig`: which gradient rule the backward pass applies, and with which α.

The paper's labels name a setting in one string, and round-trip through `from_label`/`label`:

    score:1000            score rule, α0..α3 = (1, 0, 0, 0)    (exact reading of ∂L/∂S^B)
    score:1000@per_block  the same α, the paper's per-block hook reading
    reductionistic:1100   Σ α_i Π_i on the standard dQ, dK
    simple:10             α∥ Π_K + α⊥ Π_K^⊥ on the standard dQ, dK
    standard:QKV101       no decomposition; (α_Q, α_K, α_V) = (1, 0, 1)
    score:1000+QKV110     any rule with the baseline multipliers on top

Alphas that are not single digits are written with commas, each as Python's shortest exact
form (`repr`), so that every label reads back as the same setting: `score:1,0.5,0,0`,
`score:1e-05,0,0,0`. A setting has one label: `score:1,0,0,0` reads as `score:1000`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import difflib
import inspect
import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any, TextIO

from packaging.version import Version

from hf_spanattn.ops.inputs import as_float, as_int, shown, user_stacklevel
from hf_spanattn.ops.rules import RULES, Rule

CONFIG_NAME = "span_attention_config.json"
VERSION_KEY = "hf_spanattn_version"
METHODS = tuple(dict.fromkeys(method for method, _ in RULES))
SCORE_GRADS = tuple(dict.fromkeys(grad for _, grad in RULES))

_NUMBERS = r"[0-9.,eE+-]"  # digits, or comma-separated numbers with exponents ('1e-05', '1e+20')
_LABEL = re.compile(rf"^(?P<method>[a-z]+):(?P<alphas>{_NUMBERS}*?)(?:\+?QKV(?P<qkv>{_NUMBERS}+))?"
                    r"(?:@(?P<grad>[a-z_]+))?$")


def _alphas_field(name: str, value: Any, count: int, what: str) -> tuple[float, ...]:
    alphas = None
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping, Set)):  # a set has no order
        try:
            alphas = tuple(float(a) if isinstance(a, decimal.Decimal) else as_float(a) for a in value)
        except (TypeError, ValueError):  # iterable by type only (a 0-d tensor or array), a Decimal sNaN
            alphas = None
    if alphas is None or None in alphas:
        raise ValueError(f"{name}={shown(value)}: expected a sequence of {count} numbers ({what})") from None
    if len(alphas) != count:
        raise ValueError(f"{name}={shown(value)}: expected {count} values ({what}), got {len(alphas)}")
    for a in alphas:
        if not math.isfinite(a) or a < 0:
            raise ValueError(f"{name}={shown(value)}: every value must be a finite number >= 0, got {a}")
    return alphas


def _format_alphas(alphas: Sequence[float]) -> str:
    if all(a.is_integer() and 0 <= a <= 9 for a in alphas):
        return "".join(str(int(a)) for a in alphas)
    return ",".join(str(int(a)) if a.is_integer() and a < 1e16 else repr(a) for a in alphas)


def _parse_alphas(text: str, label: str) -> tuple[float, ...]:
    try:
        return tuple(float(a) for a in text.split(",")) if "," in text else tuple(float(c) for c in text)
    except ValueError:
        raise ValueError(f"label={shown(label)}: {shown(text)} is not a list of numbers; write single digits "
                         "('1000') or comma-separated numbers ('1,0.5,0,1e-05')") from None


def _layers_field(value: Any) -> tuple[int, ...] | None:
    """Layer indices as sorted distinct ints (NumPy integers and 0-d tensors included), or None if they are not
    that."""
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes, Mapping)):
        return None
    try:
        layers = list(value)
    except (TypeError, OverflowError, MemoryError):  # iterable by type only (a 0-d tensor), a range too long for a list
        return None
    indices = [as_int(i) for i in layers]
    if None in indices or min(indices, default=0) < 0:
        return None
    return tuple(sorted(set(indices)))


def _version_field(value: Any, source: str) -> None:
    """The version that wrote the settings: a version string; one newer than this package warns."""
    from hf_spanattn import __version__

    try:
        written = Version(value) if isinstance(value, str) else None
    except ValueError:  # InvalidVersion, or a number past Python's digit limit
        written = None
    if written is None:
        raise ValueError(f"{source}{VERSION_KEY}={shown(value)}: expected the version string of the hf_spanattn that "
                         f"wrote the settings, such as {__version__!r} (or no {VERSION_KEY} entry)")
    if written > Version(__version__):
        shown_version = value if len(value) <= 60 else shown(value)
        warnings.warn(f"{source}{VERSION_KEY}={shown(value)}: the settings were written by hf_spanattn "
                      f"{shown_version}, newer than the installed {__version__}; a setting that version added would be "
                      "ignored or refused here: upgrade hf_spanattn to read them as written",
                      stacklevel=user_stacklevel())


def as_config(config: Any, caller: str, none: str) -> SpanAttentionConfig | None:
    """A `config` argument as `patch_model` and `span_attention` take it: a SpanAttentionConfig, a label such
    as 'score:1000', or None (whose meaning for the caller `none` states)."""
    if config is None or isinstance(config, SpanAttentionConfig):
        return config
    if isinstance(config, str):
        return SpanAttentionConfig.from_label(config)
    if type(config).__qualname__ == SpanAttentionConfig.__qualname__ and type(config).__module__ == __name__:
        return SpanAttentionConfig.from_dict(config.to_dict())  # made by an earlier import of this module (reloaded)
    hint = " (for a dict of fields: SpanAttentionConfig.from_dict(...))" if isinstance(config, Mapping) else ""
    raise TypeError(f"{caller}: config={shown(config)} ({type(config).__name__}): expected a SpanAttentionConfig, a "
                    f"label string such as 'score:1000', or None ({none}){hint}")


class KeyGivenTwice(ValueError):
    """A key given twice in one JSON object (see `unique_keys`)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a key given twice in one object (a hand edit) is an error, where json would keep
    the last one silently."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise KeyGivenTwice(f"the key {key!r:.80} is given twice in one object; keep one")  # a huge key cut
        data[key] = value
    return data


def _read_json(path: str) -> Any:
    """A JSON file as written by hand too: UTF-8 with or without a byte order mark (or UTF-16/32, which
    `json.loads` tells from its first bytes); a key given twice is refused rather than the first one dropped."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(), object_pairs_hook=unique_keys)
    except KeyGivenTwice as err:
        raise ValueError(f"{path}: {err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({type(err).__name__}: {err})") from None


def write_whole(path: str, write: Callable[[TextIO], Any]) -> None:
    """The file at `path` as `write(f)` writes it, whole or not at all: a save cut short leaves the file saved
    before it whole, and two processes saving at once each replace it whole (each writes its own partial file
    beside it first). A symbolic link stays one (the file it points to is replaced) and the file keeps its
    permissions. Text is UTF-8; bytes that are not pass through as `surrogateescape` escapes."""
    target = os.path.realpath(path)
    if not os.path.isdir(os.path.dirname(target)):  # else the error would name the partial file
        link = f" (a symbolic link to {target})" if target != os.path.abspath(path) else ""
        raise FileNotFoundError(f"{path}{link}: the folder {os.path.dirname(target)} does not exist")
    path = target
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
            write(f)
        if os.path.exists(path):
            shutil.copymode(path, partial)
        os.replace(partial, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.remove(partial)
        if isinstance(err, OSError) and err.filename in (partial, None):  # the file saved, not the partial one
            when = "" if err.filename2 else f" when writing {partial} beside it first"  # else when replacing it
            raise type(err)(err.errno, f"{path}: cannot be saved ({err.strerror}{when})") from None
        raise


def _path_argument(value: Any, caller: str, name: str, expected: str) -> str:
    """A path argument as a string: a non-empty str or os.PathLike without NUL characters."""
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path or "\0" in path:
        raise TypeError(f"{caller}: {name}={shown(value)}: expected {expected}")
    return path


def _looks_local(path: str) -> bool:
    """A name that cannot be a Hub repository id ('owner/name'), or whose folder exists here."""
    if path.startswith((".", "~", os.sep)) or (os.altsep and os.altsep in path) or path.count("/") > 1:
        return True
    return "/" in path and os.path.isdir(path.split("/")[0])


@dataclasses.dataclass(frozen=True)
class SpanAttentionConfig:
    """Settings of span-decomposed attention gradients (forward pass unchanged).

    Args:
        method: `"standard"` (the paper's QKV baseline), `"simple"` (α∥Π_K + α⊥Π_K^⊥),
            `"reductionistic"` (Σ α_i Π_i with Π_0 = Π_KΠ_VΠ_K, ..., Π_3 = Π_K^⊥Π_V^⊥Π_K^⊥) or
            `"score"` (the 8 score blocks S^B, weighted by the order of span violation, with
            the paper's K cross terms).
        alphas: α0..α3 for reductionistic and score, (α∥, α⊥) for simple, () for standard.
            None takes the paper's best setting for the method ([1000], or (1, 0) for simple).
        score_grad: `"exact"`: every block receives the true ∂L/∂S, so alphas (1,1,1,1) give
            the standard gradient; `"per_block"`: block B's gradient through its own
            softmax(mask(S^B))·V, the paper's hook procedure. Only used by `score`.
        qkv_alphas: (α_Q, α_K, α_V) multiplying dQ, dK, dV on top of any method.
        layers: decoder layer indices that use span gradients; None means all. Only read when
            a model is patched.
    """

    method: str = "score"
    alphas: tuple[float, ...] | None = None
    score_grad: str = "exact"
    qkv_alphas: tuple[float, float, float] = (1.0, 1.0, 1.0)
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("method", METHODS), ("score_grad", SCORE_GRADS)):
            value = getattr(self, name)  # a str (a 0-d NumPy array of one compares equal, but is no key of RULES)
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"{name}={shown(value)}: allowed values are {', '.join(allowed)}"
                                 + ("" if isinstance(value, str) else ", as a str"))
            object.__setattr__(self, name, allowed[allowed.index(value)])  # the plain str (np.str_ saves as one)
        if (self.method, self.score_grad) not in RULES:
            readers = " or ".join(f"method={method!r}" for method, grad in RULES if grad == self.score_grad)
            allowed = ", ".join(repr(grad) for method, grad in RULES if method == self.method)
            raise ValueError(f"score_grad={shown(self.score_grad)}: only {readers} reads it; "
                             f"method={shown(self.method)} allows only {allowed}")
        rule = self.rule
        what = ", ".join(rule.alpha_names) or f"{self.method} takes no alphas"
        alphas = rule.default_alphas if self.alphas is None else self.alphas
        object.__setattr__(self, "alphas", _alphas_field("alphas", alphas, len(rule.alpha_names), what))
        qkv = _alphas_field("qkv_alphas", self.qkv_alphas, 3, "α_Q, α_K, α_V")
        object.__setattr__(self, "qkv_alphas", qkv)
        if self.layers is not None:
            layers = _layers_field(self.layers)
            if layers is None:
                raise ValueError(f"layers={shown(self.layers)}: expected None (all layers) or a sequence "
                                 "of non-negative integer layer indices")
            if not layers:
                raise ValueError(f"layers={shown(self.layers)} selects no layer: expected None (all layers) or at "
                                 "least one layer index (hf_spanattn.unpatch_model removes span gradients)")
            object.__setattr__(self, "layers", layers)

    @property
    def rule(self) -> Rule:
        """The registry entry of this method and score reading (`ops.rules.RULES`)."""
        return RULES[self.method, self.score_grad]

    @property
    def label(self) -> str:
        """The paper's label, e.g. `score:1000`, `standard:QKV101`, `score:1000@per_block`."""
        qkv = "QKV" + _format_alphas(self.qkv_alphas)
        if self.method == "standard":
            text = f"standard:{qkv}"
        else:
            text = f"{self.method}:{_format_alphas(self.alphas)}"
            if self.qkv_alphas != (1.0, 1.0, 1.0):
                text += f"+{qkv}"
        return text + ("@per_block" if self.score_grad == "per_block" else "")

    @classmethod
    def from_label(cls, label: str, **overrides: Any) -> SpanAttentionConfig:
        """Parse a label such as `score:1000`; keyword arguments set the remaining fields (one the label sets too
        must agree with it)."""
        match = _LABEL.match(label.strip()) if isinstance(label, str) else None
        if match is None:
            raise ValueError(
                f"label={shown(label)}: expected '<method>:<alphas>[+QKV<abc>][@per_block]' with method in "
                f"{', '.join(METHODS)}, e.g. 'score:1000', 'reductionistic:1100', 'simple:10', "
                "'standard:QKV101'"
            )
        method = match["method"]
        fields: dict[str, Any] = {"method": method}
        if match["alphas"]:
            fields["alphas"] = _parse_alphas(match["alphas"], label)
        elif method != "standard":
            raise ValueError(f"label={shown(label)}: method {shown(method)} needs its alphas after the colon")
        if match["qkv"]:
            fields["qkv_alphas"] = _parse_alphas(match["qkv"], label)
        if match["grad"]:
            fields["score_grad"] = match["grad"]
        try:
            written = cls(**fields)
        except ValueError as err:  # named by the label the user wrote, not by the fields read from it
            raise ValueError(f"label={shown(label)}: {err}") from None
        for name in sorted(overrides.keys() & fields.keys()):  # a keyword would silently replace the label's value
            if getattr(written.replace(**{name: overrides[name]}), name) != getattr(written, name):
                raise ValueError(f"label={shown(label)} sets {name}={shown(getattr(written, name))}, and the keyword "
                                 f"argument gives {name}={shown(overrides[name])}: give {name} in one of them")
        return cls(**{**fields, **overrides})

    def replace(self, **changes: Any) -> SpanAttentionConfig:
        """A copy with some fields changed (and validated). A new method without `alphas` takes its default
        alphas (those of another method mean other things); the same method keeps them."""
        if "method" in changes and "alphas" not in changes and changes["method"] != self.method:
            changes["alphas"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (tuples as lists) and the package version that wrote them."""
        from hf_spanattn import __version__

        data = {f.name: (list(v) if isinstance(v, tuple) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}
        return {**data, VERSION_KEY: __version__}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> SpanAttentionConfig:
        """Inverse of `to_dict`. Keys this version does not know (from a newer one) warn and are ignored,
        as PEFT does; settings written by a newer version warn. `source` (the file and field the dict
        was read from) is named in errors and warnings."""
        where = f"{source}: " if source else ""
        known = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, Mapping):
            raise TypeError(f"{where or 'SpanAttentionConfig.from_dict: '}expected a dict with keys among {known}, "
                            f"got {type(data).__name__} {shown(data)}")
        if VERSION_KEY in data:
            _version_field(data[VERSION_KEY], where)
        fields = {k: v for k, v in data.items() if k != VERSION_KEY}
        unknown = [k for k in fields if k not in known]
        if unknown:
            close = {k: difflib.get_close_matches(str(k), known, n=1) for k in unknown}
            hints = "".join(f"; did you mean {m[0]!r} for {k!r}?" for k, m in close.items() if m)
            version = data.get(VERSION_KEY, "?")
            version = version if isinstance(version, str) and len(version) <= 60 else shown(version, 60)  # a hand edit
            warnings.warn(f"{where}SpanAttentionConfig: ignoring unknown fields {shown(unknown)} (written by "
                          f"hf_spanattn {version}; known fields are {known}){hints}", stacklevel=user_stacklevel())
        try:
            return cls(**{k: v for k, v in fields.items() if k in known})
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}{err}") from None

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **hub_kwargs: Any) -> str:
        """Write `span_attention_config.json` into `save_directory`; returns its path. With `push_to_hub=True` it is
        also uploaded, as `push_to_hub` does, to `repo_id=` or else a repository named as the folder (as Transformers'
        save_pretrained names it), with the other keyword arguments of `push_to_hub`."""
        folder = _path_argument(save_directory, "SpanAttentionConfig.save_pretrained", "save_directory",
                                f"a folder (created if missing; {CONFIG_NAME} is written into it)")
        if not isinstance(push_to_hub, bool):
            raise TypeError(f"SpanAttentionConfig.save_pretrained: push_to_hub={shown(push_to_hub)}: expected True or "
                            "False")
        if os.path.lexists(folder) and not os.path.isdir(folder):
            what = "a file" if os.path.exists(folder) else "a symbolic link to nothing"
            raise FileExistsError(f"SpanAttentionConfig.save_pretrained: save_directory={shown(folder)} is {what}; "
                                  f"expected a folder ({CONFIG_NAME} is written into it)")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, CONFIG_NAME)

        def write(f: TextIO) -> None:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

        write_whole(path, write)
        if push_to_hub:
            self.push_to_hub(hub_kwargs.pop("repo_id", os.path.basename(os.path.abspath(save_directory))), **hub_kwargs)
        return path

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs: Any) -> SpanAttentionConfig:
        """Read the settings from a local folder (or file), or from a Hub repository."""
        path = _path_argument(name_or_path, "SpanAttentionConfig.from_pretrained", "name_or_path",
                              f"a folder, a {CONFIG_NAME} file or a Hub repository id ('owner/name')")
        from huggingface_hub import hf_hub_download

        allowed = set(inspect.signature(hf_hub_download).parameters) - {"repo_id", "filename"}
        unknown = sorted(str(k) for k in hub_kwargs if k not in allowed)
        if unknown:  # read locally they would be ignored: a misspelt subfolder would read the folder's own settings
            raise TypeError(f"SpanAttentionConfig.from_pretrained: unexpected keyword argument(s) {shown(unknown)}; "
                            f"expected those of huggingface_hub.hf_hub_download: {', '.join(sorted(allowed))}")
        if hub_kwargs.get("subfolder") and os.path.isdir(path):  # as PEFT and Transformers read a local folder
            path = os.path.join(path, _path_argument(hub_kwargs["subfolder"], "SpanAttentionConfig.from_pretrained",
                                                     "subfolder", f"a folder inside {path}"))
            if not os.path.isdir(path):
                raise FileNotFoundError(f"{path}: no such folder (name_or_path with subfolder=...)")
        if os.path.isdir(path):
            if os.path.lexists(os.path.join(path, CONFIG_NAME)) and not os.path.isfile(os.path.join(path, CONFIG_NAME)):
                raise FileNotFoundError(f"{os.path.join(path, CONFIG_NAME)}: not a file (a folder, a pipe or a "
                                        "symbolic link to nothing); expected the settings save_pretrained writes")
            if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
                model = " (a saved model keeps its settings in config.json: hf_spanattn.load_pretrained reads them)" \
                    if os.path.isfile(os.path.join(path, "config.json")) else ""
                raise FileNotFoundError(f"{path}: the folder has no {CONFIG_NAME} (written by save_pretrained){model}")
            path = os.path.join(path, CONFIG_NAME)
        elif os.path.exists(path) and not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: not a file or a folder; expected a folder or a {CONFIG_NAME} file")
        elif not os.path.isfile(path):
            if _looks_local(path):
                raise FileNotFoundError(f"{path}: no such file or folder (a local path; a Hub repository id "
                                        "reads 'owner/name')")
            try:
                path = hf_hub_download(path, CONFIG_NAME, **hub_kwargs)
            except (OSError, ValueError, TypeError) as err:  # not found, offline, not a repository id, a bad argument
                given = ", ".join(f"{k}={'<hidden>' if k == 'token' else shown(v, 60)}" for k, v in hub_kwargs.items())
                given = f" with {given}" if given else ""
                raise OSError(f"{path}: no such local file or folder, and {CONFIG_NAME} could not be fetched from a "
                              f"Hub repository of that name{given} ({type(err).__name__}: {err})") from err
        data = _read_json(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of SpanAttentionConfig fields, got {shown(data)}")
        if {"model_type", "architectures", "span_attention"} & data.keys():
            raise ValueError(f"{path}: a model's config, not a {CONFIG_NAME}; a saved model keeps its settings in "
                             "the field 'span_attention' of its config.json, which hf_spanattn.load_pretrained "
                             "reads (with the model)")
        return cls.from_dict(data, source=path)

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                    commit_message: str = "Upload span attention config", revision: str | None = None) -> str:
        """Upload `span_attention_config.json` to a Hub repository (created if missing). Returns the commit URL."""
        from huggingface_hub import HfApi

        if not isinstance(repo_id, str) or not repo_id.strip():
            raise TypeError(f"SpanAttentionConfig.push_to_hub: repo_id={shown(repo_id)}: expected a Hub repository id "
                            "('owner/name', or 'name' in your own namespace)")
        if private is not None and not isinstance(private, bool):
            raise TypeError(f"SpanAttentionConfig.push_to_hub: private={shown(private)}: expected True, False or None")
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        payload = (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()
        info = api.upload_file(path_or_fileobj=payload, path_in_repo=CONFIG_NAME, repo_id=repo_id,
                               commit_message=commit_message, revision=revision)
        return str(info)
