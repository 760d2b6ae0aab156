"""The process around the package: interpreter flags, warnings filters, logging, threads, re-imports and the
environment variables of hf_spanattn. Each case gets stock Transformers' result or a clear message."""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
import threading

import pytest
import torch
from models import VOCAB, tiny
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_spanattn
from hf_spanattn import SpanAttentionConfig, patch_model
from hf_spanattn.integration import registry


def another_import(name: str):
    """The module `name` imported afresh beside the one in sys.modules, as `importlib.reload` or a notebook's
    autoreload leaves objects made by the earlier import."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grads(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    return torch.autograd.grad(loss, list(model.parameters()))


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_a_config_made_before_a_reload_of_the_config_module_is_taken():
    """A SpanAttentionConfig made by an earlier import of hf_spanattn.config (a notebook that reloaded it): refused
    as "expected a SpanAttentionConfig, got SpanAttentionConfig"; it gives the gradients of the same label."""
    old = another_import("hf_spanattn.config").SpanAttentionConfig.from_label("score:1100")
    assert not isinstance(old, SpanAttentionConfig)
    model = tiny("llama").double().train()
    want = grads(patch_model(copy.deepcopy(model), "score:1100"), batch())
    got = grads(patch_model(model, old), batch())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(torch.autograd.grad(hf_spanattn.span_attention(q, q, q, config=old).sum(), q),
                               torch.autograd.grad(hf_spanattn.span_attention(q, q, q, config="score:1100").sum(), q))


def test_register_after_a_reload_runs_the_attention_imported_now():
    """After a reload of the registry, the attention function of the earlier import stayed registered, so models ran
    the code of before the reload (and met the reloaded config class in it); register() now puts in the current one.
    A function the user registered under span_attention is kept, also one that wraps ours."""
    earlier = another_import("hf_spanattn.integration.registry").span_attention_forward
    try:
        AttentionInterface.register("span_attention", earlier)
        registry.register()
        assert ALL_ATTENTION_FUNCTIONS["span_attention"] is registry.span_attention_forward

        def own(*args, **kwargs):
            return registry.span_attention_forward(*args, **kwargs)

        wrapper = functools.wraps(earlier)(lambda *args, **kwargs: earlier(*args, **kwargs))
        for kept in (own, wrapper):
            AttentionInterface.register("span_attention", kept)
            registry.register()
            assert ALL_ATTENTION_FUNCTIONS["span_attention"] is kept
    finally:
        AttentionInterface.register("span_attention", registry.span_attention_forward)


def race(work, n_threads: int) -> list[str]:
    """Run work(i) in `n_threads` threads at once, switching between them as often as Python can; the errors they
    raised (the first three)."""
    errors, interval = [], sys.getswitchinterval()

    def run(i: int) -> None:
        try:
            work(i)
        except Exception as err:  # any error of a thread is the failure
            errors.append(repr(err))

    sys.setswitchinterval(1e-7)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return errors[:3]


def test_threads_building_causal_masks_of_several_lengths():
    """Threads training on sequences of several lengths (no padding mask: causal) shared the tiles' cache of causal
    masks; one evicted what another was returning (KeyError) or iterated it while it changed (RuntimeError)."""
    from hf_spanattn.ops import tile_engine

    def work(i: int) -> None:
        for n in range(1500):
            t = 2 + (i * 5 + n) % 9
            assert tile_engine._causal_mask(t, t, torch.float32, torch.device("cpu"), None, 0).tiles

    assert not race(work, 12)
    q = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)  # the cached masks still give the gradients
    want = torch.autograd.grad(hf_spanattn.span_attention(q, q, q, attn_mask=torch.ones(6, 6, dtype=torch.bool).tril(),
                                                          config="score:1100").sum(), q)
    torch.testing.assert_close(torch.autograd.grad(hf_spanattn.span_attention(q, q, q, is_causal=True,
                                                                              config="score:1100").sum(), q), want)


def test_threads_patching_and_unpatching_models_of_their_own():
    """Threads each patching, training and unpatching a model of its own (a server building a model per request):
    unpatch_model listed the patched models while patch_model in another thread added to them, and raised
    "Set changed size during iteration". Each thread now gets the gradients of its label, as one after the other."""
    base = tiny("gpt2", layers=1).double().train()
    labels = ["score:1000", "score:1100", "standard:QKV101", "simple:1,0"]
    want = {label: grads(patch_model(copy.deepcopy(base), label), batch()) for label in labels}
    kept = []

    def work(i: int) -> None:
        for n in range(12):
            label = labels[(i + n) % len(labels)]
            model = patch_model(copy.deepcopy(base), label)
            for a, b in zip(grads(model, batch()), want[label]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            hf_spanattn.unpatch_model(model)
            kept.append(patch_model(model, label))  # more patched models: longer lists to read

    assert not race(work, 6)


@pytest.mark.parametrize("change", ["patch", "layers", "unpatch", "schedule"])
def test_settings_changed_in_another_thread_between_forward_and_backward(change):
    """patch_model, unpatch_model or a schedule's step in another thread while a step is between its forward and
    backward passes: that backward pass applies the settings its forward pass read; the next step the new ones."""
    from hf_spanattn.integration.model_layers import attention_modules
    from hf_spanattn.integration.registry import OVERRIDE_ATTR

    def schedule_step(model: torch.nn.Module) -> None:
        for modules in attention_modules(model).values():
            for module in modules:
                setattr(module, OVERRIDE_ATTR, SpanAttentionConfig.from_label("standard:QKV111"))

    changes = {"patch": lambda m: patch_model(m, "score:1100"), "layers": lambda m: patch_model(m, layers=[1]),
               "unpatch": hf_spanattn.unpatch_model, "schedule": schedule_step}
    base = tiny("llama").double().train()
    alone = patch_model(copy.deepcopy(base), "score:1000")
    want = torch.autograd.grad(alone(input_ids=batch(), labels=batch()).loss, list(alone.parameters()))
    model = patch_model(copy.deepcopy(base), "score:1000")
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    thread = threading.Thread(target=changes[change], args=(model,))
    thread.start()
    thread.join()
    for a, b in zip(torch.autograd.grad(loss, list(model.parameters())), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    changed = copy.deepcopy(base)
    changes[change](patch_model(changed, "score:1000"))
    for a, b in zip(grads(model, batch()), grads(changed, batch())):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
