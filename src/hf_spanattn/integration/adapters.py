"""PEFT adapters carry the settings.

A PEFT adapter folder (and a Trainer checkpoint of a PEFT model, which is one) holds the adapter's
weights and `adapter_config.json`, not the base model's config, so the settings on
`config.span_attention` would be lost. PEFT offers no hook for extra files, so when PEFT is
installed `install` wraps two of its methods, calling each through unchanged:

- `PeftModel.save_pretrained` also writes `span_attention_config.json` into each adapter's folder
  when the base model carries settings, before PEFT's files: a save stopped between the two leaves
  a folder that is no adapter, not an adapter without its settings (which would load with the base
  model's or the default settings); over an earlier adapter, a mark file stays until PEFT's save is
  done, and `load_pretrained` refuses a folder that has it;
- `PeftModel.load_adapter` (which `PeftModel.from_pretrained` calls) warns when a local adapter folder
  holds that file but the model it loads into is not patched (it would train with the standard
  gradient), or is patched with other settings (the model's win); a model set to span_attention without
  settings (`from_pretrained(..., attn_implementation="span_attention")`) is patched with the adapter's.

`load_adapter` loads base + adapter and patches the model with the saved settings.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedModel,
)
from transformers.models.auto import modeling_auto as auto_names

from hf_spanattn.config import CONFIG_NAME, SpanAttentionConfig, _looks_local
from hf_spanattn.integration.registry import ATTN_IMPLEMENTATION
from hf_spanattn.integration.stored import config_of
from hf_spanattn.ops.inputs import shown, user_stacklevel

ADAPTER_CONFIG = "adapter_config.json"
SAVE_UNFINISHED = ".span_attention_save_unfinished"
_WRAPPED = "_hf_spanattn_wrapped"


def is_adapter_folder(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def holds_settings_alone(path: Any) -> bool:
    """Whether the folder `path` holds span_attention_config.json but no model and no adapter: an adapter save
    stopped after the settings, which it writes first."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, CONFIG_NAME)) and not any(
        os.path.lexists(os.path.join(path, name)) for name in (ADAPTER_CONFIG, "config.json"))


def install() -> None:
    """Wrap PEFT's save and load once (nothing without PEFT)."""
    try:
        from peft import PeftModel
    except Exception:  # PEFT missing or not importable with these versions: nothing to wrap
        return
    if getattr(PeftModel.save_pretrained, _WRAPPED, False):
        return
    save = PeftModel.save_pretrained
    add = PeftModel.load_adapter
    save_signature = inspect.signature(save)

    @functools.wraps(save)
    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        settings = config_of(self.get_base_model().config)
        arguments = save_signature.bind(self, *args, **kwargs).arguments
        directory = arguments["save_directory"]
        selected = arguments.get("selected_adapters")
        names = list(self.peft_config) if selected is None else selected  # as PEFT: [] saves none
        try:
            ours = all(isinstance(name, str) and name in self.peft_config for name in names)  # else PEFT refuses it
        except TypeError:
            ours = False
        ours = ours and arguments.get("is_main_process", True) and not os.path.isfile(directory)
        folders = [directory if name == "default" else os.path.join(directory, name) for name in names] if ours else []
        if ours and settings is not None:
            # before PEFT's files: a save stopped between the two leaves settings without an adapter (no adapter
            # folder, refused as one), never an adapter that load_pretrained would patch with other settings; over an
            # earlier adapter, the mark says the new settings may sit beside its weights until PEFT's save is done
            for folder in folders:
                if is_adapter_folder(folder):
                    try:
                        open(os.path.join(folder, SAVE_UNFINISHED), "w").close()
                    except OSError as err:  # a folder that takes no files: named, not the mark
                        raise type(err)(err.errno, f"{folder}: the adapter cannot be saved there ({err.strerror})") \
                            from None
                settings.save_pretrained(folder)
        try:
            result = save(self, *args, **kwargs)
        except OSError as err:
            if err.filename is not None or not folders:
                raise
            # PEFT's error names no file (a full disk, the file-size limit); the mark stays, so that load_pretrained
            # refuses settings that may be this save's beside weights that may be an earlier one's
            raise type(err)(err.errno, f"{directory}: the adapter's save did not finish ({err.strerror}); save it "
                                       "again once there is room") from err
        for folder in folders:
            if os.path.isfile(os.path.join(folder, SAVE_UNFINISHED)):
                os.remove(os.path.join(folder, SAVE_UNFINISHED))
        if ours and settings is None:
            for folder in folders:
                if os.path.lexists(os.path.join(folder, CONFIG_NAME)):  # the user's to remove: it may be by hand
                    warnings.warn(f"{os.path.join(folder, CONFIG_NAME)} is left from before: the model saved now is "
                                  "not patched, but hf_spanattn.load_pretrained of the adapter would patch it with "
                                  "those settings; remove the file if the adapter should load without span gradients",
                                  stacklevel=user_stacklevel())
        return result

    @functools.wraps(add)
    def load_adapter(self, model_id: Any, *args: Any, **kwargs: Any) -> Any:
        result = add(self, model_id, *args, **kwargs)
        folder = os.path.join(model_id, kwargs["subfolder"]) if kwargs.get("subfolder") else model_id
        base = self.get_base_model()
        patched_with = config_of(base.config) if is_patched(base) else None
        if not (is_adapter_folder(folder) and os.path.lexists(os.path.join(folder, CONFIG_NAME))):
            return result
        saved, described = _saved_settings(folder)
        if patched_with is None and is_patched(base):
            # set to span_attention by from_pretrained (AutoPeftModel...) without settings: the adapter's, not the
            # default's
            if saved is not None:
                from hf_spanattn.integration.patch import patch_model

                try:
                    patch_model(base, saved)
                except ValueError as err:  # the settings do not fit the model (layers it lacks)
                    raise ValueError(f"{os.path.join(folder, CONFIG_NAME)}: {err}") from None
        elif patched_with is None:
            warnings.warn(f"{folder} holds {described} but the model it was loaded into is not patched, so it trains "
                          f"with the standard gradient. Load it with hf_spanattn.load_pretrained("
                          f"{os.fspath(folder)!r}), or call hf_spanattn.patch_model(model, "
                          f"hf_spanattn.SpanAttentionConfig.from_pretrained({os.fspath(folder)!r})).",
                          stacklevel=user_stacklevel())
        elif saved is not None and saved != patched_with:
            warnings.warn(f"{folder} holds {described}, other than those the model it was loaded into is patched "
                          f"with ({_described(patched_with)}): the model's settings win, it trains with "
                          f"{_described(patched_with)}. To train with the adapter's, call hf_spanattn.patch_model("
                          f"model, hf_spanattn.SpanAttentionConfig.from_pretrained({os.fspath(folder)!r})) after "
                          "loading it.", stacklevel=user_stacklevel())
        return result

    setattr(save_pretrained, _WRAPPED, True)
    PeftModel.save_pretrained = save_pretrained
    PeftModel.load_adapter = load_adapter


def _described(config: SpanAttentionConfig) -> str:
    return config.label + (f" on layers {shown(list(config.layers))}" if config.layers is not None else "")


def _saved_settings(folder: str | os.PathLike) -> tuple[SpanAttentionConfig | None, str]:
    """The settings saved beside an adapter and their description for a warning (why, where they cannot be read):
    only to name them, PEFT's load itself needs nothing of them."""
    try:
        saved = SpanAttentionConfig.from_pretrained(folder)
    except (ValueError, TypeError, OSError) as err:
        return None, f"span attention settings that cannot be read ({err})"
    return saved, f"span attention settings ({_described(saved)})"


def train_adapters(model: torch.nn.Module) -> None:
    """Makes the active adapters that Transformers' from_pretrained added to `model` (frozen) trainable."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.set_adapter(module.active_adapters)


def settings_beside_model(folder: str | os.PathLike, model_config: Any) -> SpanAttentionConfig | None:
    """The settings for a model saved in `folder` beside an adapter: those of its config.json, else those saved with
    the adapter; where both are there and differ, a warning names both files and says the model's win."""
    ours = config_of(model_config)
    if not os.path.lexists(os.path.join(folder, CONFIG_NAME)):
        return ours
    if ours is None:  # a bad file fails here, named, as beside an adapter alone
        return SpanAttentionConfig.from_pretrained(folder)
    saved, described = _saved_settings(folder)
    if saved != ours:
        warnings.warn(f"{os.path.join(folder, CONFIG_NAME)} holds {described}, other than those of the model saved "
                      f"beside it ({os.path.join(folder, 'config.json')}: {_described(ours)}), whose weights load with "
                      f"the adapter on top: the model's settings win, it trains with {_described(ours)}. Remove the "
                      "file if it is left from an earlier save.", stacklevel=user_stacklevel())
    return ours


def is_patched(base: torch.nn.Module) -> bool:
    """Whether span_attention is in force: the registry's implementation, or GPT-Neo's adapter."""
    return base.config._attn_implementation == ATTN_IMPLEMENTATION or any(
        "_attn" in module.__dict__ for module in base.modules())  # GPT-Neo's adapter


def _base_model_of(folder: str | os.PathLike, peft_config: Any) -> str:
    """The adapter's base model (`base_model_name_or_path`): a folder that exists here, or a Hub id."""
    name = peft_config.base_model_name_or_path
    source = f"{os.path.join(folder, ADAPTER_CONFIG)}, field 'base_model_name_or_path' = {shown(name)}"
    by_hand = ("; or load the base model yourself, patch it and add the adapter: patch_model(base, SpanAttentionConfig"
               ".from_pretrained(folder)); PeftModel.from_pretrained(base, folder, is_trainable=True)")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{source}: expected the base model's folder or Hub repository id{by_hand}")
    if _looks_local(name) and not os.path.exists(name):
        raise FileNotFoundError(f"{source}: no such folder (was the base model moved? edit the field{by_hand})")
    if not os.path.exists(name):  # a Hub id, checked here: the Hub client's error repeats the name whole
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
        except HFValidationError as err:
            raise ValueError(f"{source}: no such folder, and not a Hub repository id ({shown(str(err), 300)})"
                             f"{by_hand}") from None
    return name


def load_adapter(folder: str | os.PathLike, config: SpanAttentionConfig | str | None, model_class: Any,
                 is_trainable: bool, layers: list[int] | None = None, **kwargs: Any) -> torch.nn.Module:
    """Base model (from the adapter's `base_model_name_or_path`) + adapter, patched with `config`, else
    the settings saved with the adapter, else those on the base model's config."""
    from peft import PeftConfig, PeftModel

    from hf_spanattn.integration.patch import patch_model

    refuse_unfinished(folder)
    try:
        peft_config = PeftConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # PEFT names neither the file nor the cause
        raise ValueError(f"{os.path.join(folder, ADAPTER_CONFIG)}: PEFT cannot read it as an adapter config "
                         f"({type(err).__name__}: {err})") from None
    if is_trainable and peft_config.is_prompt_learning:  # PEFT refuses it, naming neither the argument nor the way out
        kind = getattr(peft_config.peft_type, "value", peft_config.peft_type)
        raise ValueError(f"load_pretrained: {folder} holds a {kind} adapter (prompt learning), which PEFT loads for "
                         "inference only: pass is_trainable=False")
    adapter_name = kwargs.pop("adapter_name", "default")  # PEFT's (Transformers takes it too, loading no adapter)
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:  # torch names only the module
        raise ValueError(f"load_pretrained: adapter_name={shown(adapter_name)}: expected the name to give the adapter, "
                         "a non-empty string without '.' (by default 'default')")
    base_name = _base_model_of(folder, peft_config)
    if model_class is None:  # as PEFT's AutoPeftModel picks it: a classifier's adapter (and its head) on a classifier
        task = getattr(peft_config.task_type, "value", peft_config.task_type)
        model_class = TASK_CLASSES.get(task) or saved_class(base_name, kwargs)
    base, info = loaded(model_class, base_name, kwargs)
    saved = os.path.join(folder, CONFIG_NAME)
    from_file = config is None and os.path.lexists(saved)  # a settings "file" that is not one is refused
    if from_file:
        config = SpanAttentionConfig.from_pretrained(folder)
    try:
        patch_model(base, config, layers)
    except ValueError as err:  # the settings saved beside the adapter do not fit its base model
        if not from_file or layers is not None:
            raise
        raise ValueError(f"{saved}: {err}") from None
    with warnings.catch_warnings():  # settings given here over those saved beside the adapter: the caller's choice
        warnings.filterwarnings("ignore", message=".* other than those the model it was loaded into is patched with")
        model = PeftModel.from_pretrained(base, folder, adapter_name=adapter_name, is_trainable=is_trainable)
    return model if info is None else (model, info)


def refuse_adapters_below(folder: str | os.PathLike) -> None:
    """Refuses a local folder that holds neither a model nor an adapter but adapters in subfolders: PEFT saves each
    adapter not named "default" into a subfolder of its name (Transformers' error names only a missing model_type)."""
    if not os.path.isdir(folder) or any(os.path.lexists(os.path.join(folder, name)) for name in (
            "config.json", ADAPTER_CONFIG)):
        return
    below = sorted(name for name in os.listdir(folder) if is_adapter_folder(os.path.join(folder, name)))
    if below:
        raise FileNotFoundError(f"load_pretrained: {folder} holds no model and no adapter, but the adapter folders "
                                f"{shown(below)} (PEFT saves an adapter not named 'default' into a subfolder of its "
                                f"name): load one of them, e.g. load_pretrained({os.path.join(folder, below[0])!r}, "
                                f"adapter_name={below[0]!r})")


def refuse_unfinished(folder: str | os.PathLike) -> None:
    """Refuses an adapter folder whose last save did not finish (its mark file is there)."""
    if os.path.isfile(os.path.join(folder, SAVE_UNFINISHED)):
        raise OSError(f"load_pretrained: the last save into {folder} did not finish ({SAVE_UNFINISHED} is there): "
                      f"its {CONFIG_NAME} may be that save's and the adapter's weights an earlier one's. Save the "
                      "adapter again, or delete that file if they are known to belong together")


# the auto class a PEFT task type's base model is loaded with (as PEFT's AutoPeftModelFor... classes do)
TASK_CLASSES = {"CAUSAL_LM": AutoModelForCausalLM, "SEQ_CLS": AutoModelForSequenceClassification,
                "TOKEN_CLS": AutoModelForTokenClassification, "QUESTION_ANS": AutoModelForQuestionAnswering,
                "FEATURE_EXTRACTION": AutoModel, "SEQ_2_SEQ_LM": AutoModelForSeq2SeqLM}


def saved_class(name_or_path: str, kwargs: dict[str, Any]) -> Any:
    """The class to load a saved model with where `load_pretrained` is not told: the Transformers class it was saved as
    (its config's `architectures`) where AutoModelForCausalLM would load it as another class, dropping its head (a
    classifier's, a question-answering or multiple-choice head) or adding one (a base model); else
    AutoModelForCausalLM."""
    try:  # the call from_pretrained starts with: a folder or repository it cannot read fails here as there, once
        config = AutoConfig.from_pretrained(name_or_path, **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
    except (ValueError, KeyError):  # a model type Transformers does not know: from_pretrained says what to pass
        return AutoModelForCausalLM
    causal = auto_names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    name = next(iter(getattr(config, "architectures", None) or []), None)
    saved = getattr(transformers, name, None) if isinstance(name, str) else None
    if causal is not None and name != causal and isinstance(saved, type) and issubclass(saved, PreTrainedModel):
        return saved
    return AutoModelForCausalLM


_CONFIG_KWARGS = ("subfolder", "revision", "token", "cache_dir", "local_files_only", "trust_remote_code", "proxies",
                  "force_download", "gguf_file")


def loaded(model_class: Any, name_or_path: str, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """`model_class.from_pretrained(name_or_path, **kwargs)`: the model, and its loading info where
    `output_loading_info` asked for it (else None). A model that an auto class does not load (a vision-language or
    encoder-decoder model through the default AutoModelForCausalLM) names `model_class` and the saved class."""
    try:
        result = model_class.from_pretrained(name_or_path, **kwargs)
    except ValueError as err:
        if not str(err).startswith("Unrecognized configuration class"):
            raise
        config = AutoConfig.from_pretrained(name_or_path, **{k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs})
        saved = ", ".join(getattr(config, "architectures", None) or []) or type(config).__name__
        autos = [name for name in getattr(config, "auto_map", None) or {} if name.startswith("AutoModel")]
        hint = (f"an auto class that its config.json's auto_map names for its own code (model_class={autos[0]}, from "
                "transformers, with trust_remote_code=True)" if autos else
                f"the class it was saved as (model_class={saved.split(', ')[0]}, from transformers)")
        raise ValueError(f"load_pretrained: {name_or_path} holds a saved {saved}, which model_class="
                         f"{model_class.__name__} does not load; pass {hint}") from err
    if kwargs.get("output_loading_info") and isinstance(result, tuple):
        return result
    return result, None
