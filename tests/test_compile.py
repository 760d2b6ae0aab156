"""torch.compile on patched models: the same gradients in training, fullgraph for evaluation and generation."""

from __future__ import annotations

import pytest
import torch
import transformers
from models import VOCAB, tiny
from packaging.version import Version
from transformers import CompileConfig

import hf_spanattn
from hf_spanattn import SpanAttentionConfig

# Transformers before 5.18 gives the attention a 4-D mask under torch.compile also without padding, which
# span_attention reads on the host: a graph break that names the mask comes first there
mask_free_under_compile = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.18"),
    reason=f"Transformers {transformers.__version__} passes a 4-D mask under torch.compile")


def gradients(model, ids, forward=None) -> dict[str, torch.Tensor]:
    """The parameter gradients of `model` after a train step through `forward` (the model itself by default)."""
    model.zero_grad(set_to_none=True)
    (model if forward is None else forward)(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_compiled_training(family: str, label: str, backend: str, compiler: str, monkeypatch,
                            device: str = "cpu") -> None:
    monkeypatch.setenv("HF_SPANATTN_BACKEND", backend)
    torch._dynamo.reset()
    model = tiny(family).to(device)
    hf_spanattn.patch_model(model, label)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    eager = gradients(model, ids)
    compiled = gradients(model, ids, torch.compile(model, backend=compiler))
    assert eager.keys() == compiled.keys()
    gaps = {name: relative(compiled[name], grad) for name, grad in eager.items()}
    worst = max(gaps, key=gaps.get)
    if gaps[worst] >= 1e-5:  # how far each lies from the standard gradient tells whether the rule was left out
        standard = gradients(hf_spanattn.unpatch_model(model), ids)[worst]
        pytest.fail(f"{worst}: compiled against eager {gaps[worst]:.2e}; against the standard gradient: eager "
                    f"{relative(eager[worst], standard):.2e}, compiled {relative(compiled[worst], standard):.2e}")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("label,backend", [("score:1000", "tiles"), ("score:1000", "fused"),
                                           pytest.param("score:1100@per_block", "tiles", marks=pytest.mark.slow),
                                           ("score:1100@per_block", "fused")])
def test_compiled_training_gives_the_same_gradients(label, backend, monkeypatch):
    """Dynamo and AOTAutograd around the patched model (graph breaks allowed), without code generation."""
    check_compiled_training("gpt2", label, backend, "aot_eager", monkeypatch)


@mask_free_under_compile
def test_fullgraph_training_on_the_fused_kernels(monkeypatch):
    """Training compiles without a graph break on the fused kernels: the check for torch.func transforms saw one
    under Dynamo and broke every graph at the attention (fullgraph=True raised naming torch.func transforms)."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "fused")
    torch._dynamo.reset()
    model = hf_spanattn.patch_model(tiny("llama"), "score:1000")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = gradients(model, ids)
    compiled = gradients(model, ids, torch.compile(model, backend="aot_eager", fullgraph=True))
    for name, grad in eager.items():
        assert ((compiled[name] - grad).norm() / grad.norm()).item() < 1e-5, name



@mask_free_under_compile
def test_fullgraph_with_gradients_on_the_tiles_names_the_break(monkeypatch):
    """fullgraph=True under autograd (a model in eval mode outside torch.no_grad) on the tiles, which Dynamo cannot
    trace: the error names span_attention and what compiles without a break, not a Dynamo internal."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "tiles")
    torch._dynamo.reset()
    model = hf_spanattn.patch_model(tiny("gpt2"), "score:1000").eval()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="span_attention: the tiles backend.*torch.no_grad"):
        torch.compile(model, backend="eager", fullgraph=True)(input_ids=ids)


@mask_free_under_compile
def test_fullgraph_training_of_the_per_block_rule_on_fused_names_the_break(monkeypatch):
    """The per-block rule's backward takes SDPA's gradients with torch.autograd.grad, which Dynamo does not trace:
    fullgraph=True names span_attention and the rules that compile without a break (it raised Dynamo's words on
    torch.autograd.grad); with breaks allowed it trains as test_compiled_training_gives_the_same_gradients checks."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "fused")
    torch._dynamo.reset()
    model = hf_spanattn.patch_model(tiny("llama", layers=1), "score:1100@per_block")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="span_attention: the per-block rule.*without @per_block"):
        gradients(model, ids, torch.compile(model, backend="aot_eager", fullgraph=True))


@mask_free_under_compile
def test_fullgraph_training_with_a_dynamic_sequence_length(monkeypatch):
    """torch._dynamo.mark_dynamic on the time axis under fullgraph=True on the fused kernels: each length's gradients
    are the eager ones (the layout of the output was found by sorting its strides: Dynamo refused symbolic ones)."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "fused")
    torch._dynamo.reset()
    model = hf_spanattn.patch_model(tiny("gpt2", layers=1), "score:1100")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for t in (12, 16):
        ids = torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(t))
        eager = gradients(model, ids)
        torch._dynamo.mark_dynamic(ids, 1)
        got = gradients(model, ids, compiled)
        for name, grad in eager.items():
            assert ((got[name] - grad).norm() / grad.norm()).item() < 1e-5, name


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tiles", "fused"])
def test_inductor_training_gives_the_same_gradients(backend, monkeypatch):
    check_compiled_training("llama", "score:1100", backend, "inductor", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("label", ["score:1100", "score:1111@per_block"])
def test_cuda_inductor_training_gives_the_same_gradients(label, monkeypatch):
    check_compiled_training("llama", label, "fused", "inductor", monkeypatch, device="cuda")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fullgraph_evaluation(family):
    torch._dynamo.reset()
    model = tiny(family).eval()
    hf_spanattn.patch_model(model, "score:1000")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.allclose(compiled(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_fullgraph_generation_with_a_static_cache():
    """As Transformers' own fullgraph generation test: a static cache and a compiled forward."""
    torch._dynamo.reset()
    model = tiny("llama").eval()
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    hf_spanattn.patch_model(model, "score:1000")
    compiled = model.generate(ids, compile_config=CompileConfig(fullgraph=True, backend="aot_eager"), **kwargs)
    assert torch.equal(compiled, expected)


# the tiles' compiled gradients also in test_compiled_training_gives_the_same_gradients
@pytest.mark.parametrize("backend", [pytest.param("tiles", marks=pytest.mark.slow), "fused"])
def test_a_compiled_module_is_patched_and_trains_with_no_warning_from_the_package(monkeypatch, backend):
    """patch_model(torch.compile(model)) patches the model inside, also after the compiled module has run,
    and the compiled module then gives the gradients of the patched model, not the stock ones, also when it
    is patched again. Dynamo warns about nothing in the package on the way (the settings are
    looked up, not parsed, per attention call)."""
    import warnings
    from pathlib import Path

    monkeypatch.setenv("HF_SPANATTN_BACKEND", backend)
    torch._dynamo.reset()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    stock = tiny("gpt2", layers=1)
    expected = hf_spanattn.patch_model(tiny("gpt2", layers=1), "score:1000")
    model = tiny("gpt2", layers=1)
    compiled = torch.compile(model, backend="eager")  # Dynamo's tracing, the graphs run as traced
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(input_ids=ids)
        assert hf_spanattn.patch_model(compiled, "score:1000") is compiled
        assert model.config._attn_implementation == "span_attention"
        got = gradients(model, ids, compiled)
    files = {path.name for path in Path(hf_spanattn.__file__).parent.rglob("*.py")}
    ours = [str(w.message) for w in caught if any(f"{name}:" in str(w.message) for name in files)
            or Path(hf_spanattn.__file__).parent in Path(w.filename).parents
            or w.filename == __file__]  # the package's warnings name the user's line
    assert not ours, ours
    want, plain = gradients(expected, ids), gradients(stock, ids)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert ((got[name] - grad).norm() / grad.norm()).item() < 1e-6, name
    assert max(((got[n] - plain[n]).norm() / plain[n].norm()).item() for n in plain) > 1e-3  # not the stock ones
    hf_spanattn.patch_model(compiled, "score:1100")  # patched again: the compiled module reads the new rule
    got, want = gradients(model, ids, compiled), gradients(hf_spanattn.patch_model(expected, "score:1100"), ids)
    for name, grad in want.items():
        assert ((got[name] - grad).norm() / grad.norm()).item() < 1e-6, name
    hf_spanattn.unpatch_model(compiled)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_settings_edited_in_place_reach_a_compiled_model(monkeypatch):
    """The compiled forward looks the settings up by their content, so an edit of the stored dict in place
    (a nested list included) recompiles rather than keeping the old rule."""
    monkeypatch.setenv("HF_SPANATTN_BACKEND", "fused")
    torch._dynamo.reset()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model = hf_spanattn.patch_model(tiny("gpt2", layers=1), "score:1000")
    compiled = torch.compile(model, backend="eager")
    before = gradients(model, ids, compiled)
    model.config.span_attention["alphas"][1] = 1.0
    got, want = gradients(model, ids, compiled), gradients(model, ids)
    assert SpanAttentionConfig.from_dict(model.config.span_attention).label == "score:1100"
    for name, grad in want.items():
        assert ((got[name] - grad).norm() / grad.norm()).item() < 1e-6, name
    assert max(((got[n] - before[n]).norm() / before[n].norm()).item() for n in before) > 1e-3  # the rule changed
