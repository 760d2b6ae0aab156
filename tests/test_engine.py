"""span_attention against SDPA and against the float64 reference of tests/reference.py."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from reference import projector, reference

from hf_spanattn import SpanAttentionConfig, span_attention
from hf_spanattn.ops import span_of, tile_engine, tiles

LABELS = [
    "standard:QKV111", "standard:QKV101", "standard:QKV001",
    "simple:10", "simple:11", "simple:0.3,1.7",
    "reductionistic:1000", "reductionistic:1100", "reductionistic:1111", "reductionistic:0.5,2,0,1.5",
    "score:1000", "score:1100", "score:1111", "score:0000", "score:0.5,2,0,1.5", "score:0111", "score:0001",
    "score:1000@per_block", "score:1100@per_block", "score:1111@per_block", "score:0.5,2,0,1.5@per_block",
    "score:0001@per_block", "reductionistic:0001", "simple:01",
    "score:1100+QKV011",
]
UNIFORM = ["score:1111", "reductionistic:1111", "simple:11", "standard:QKV111"]


def rel(a: torch.Tensor, b: torch.Tensor, floor: torch.Tensor | None = None) -> float:
    """‖a − b‖ / ‖b‖; `floor` (the standard gradient) sets the scale where b's parts cancel to ~0."""
    scale = b.double().norm() if floor is None else torch.maximum(b.double().norm(), floor.double().norm())
    return ((a.double() - b.double()).norm() / scale.clamp_min(1e-300)).item()


def make(b=2, h_q=4, h_kv=4, t=12, d=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_q, t, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, h_kv, t, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, t, d, generator=gen, dtype=torch.float64)
    d_out = torch.randn(b, h_q, t, d, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v)], d_out.to(dtype)


def run(inputs, d_out, config, **kwargs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = span_attention(*leaves, config=config, **kwargs)
    grads = torch.autograd.grad(out, leaves, d_out)
    return out, grads


def padding_mask(lengths, t):
    """Left padding and causal, as a (B, 1, T, T) bool mask."""
    pos = torch.arange(t)
    valid = pos[None, :] >= (t - torch.tensor(lengths))[:, None]
    return (torch.ones(t, t, dtype=torch.bool).tril() & valid[:, None, :])[:, None]


def random_float_mask(b, t, seed=3):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(b, 1, t, t, generator=gen, dtype=torch.float64)
    m[torch.rand(b, 1, t, t, generator=gen) < 0.3] = float("-inf")
    m[..., 0] = 0.0  # every row attends somewhere
    return m


CASES = {
    "causal": dict(shape={}, kwargs=dict(is_causal=True)),
    "full": dict(shape={}, kwargs={}),
    "padded": dict(shape={}, kwargs=dict(attn_mask=padding_mask([12, 8], 12))),
    "float_mask": dict(shape={}, kwargs=dict(attn_mask=random_float_mask(2, 12))),
    "gqa": dict(shape=dict(h_q=4, h_kv=2), kwargs=dict(is_causal=True)),
    "t_lt_d": dict(shape=dict(t=6, d=8), kwargs=dict(is_causal=True)),
    "t_gg_d": dict(shape=dict(t=40, d=4), kwargs=dict(is_causal=True)),
    "gqa_padded_scale": dict(shape=dict(h_q=6, h_kv=2, t=10), kwargs=dict(attn_mask=padding_mask([10, 4], 10),
                                                                          scale=0.7)),
    "first_rows_dead": dict(shape=dict(b=3), kwargs=dict(attn_mask=padding_mask([8, 7, 8], 12))),
    # K and V (nearly) square: their Gram matrices square a condition number that is already large
    "t_eq_d": dict(shape=dict(t=16, d=16), kwargs=dict(is_causal=True)),
    "t_near_d": dict(shape=dict(t=18, d=16), kwargs=dict(is_causal=True)),
    "padded_to_d": dict(shape=dict(t=14, d=8), kwargs=dict(attn_mask=padding_mask([14, 8], 14))),
    "padded_t_eq_d": dict(shape=dict(t=8, d=8), kwargs=dict(attn_mask=padding_mask([8, 5], 8))),
    "padded_few_rows": dict(shape=dict(t=14, d=8), kwargs=dict(attn_mask=padding_mask([14, 6], 14))),
}


def rank_deficient(kind):
    (q, k, v), d_out = make(t=6, d=8) if kind == "short" else make(t=12, d=5)
    if kind == "short":  # T < d with a repeated row: the non-zero rows are not independent
        k[:, :, 4] = k[:, :, 1]
        v[:, :, 5] = v[:, :, 0]
    elif kind == "repeated":
        k[:, :, 7] = k[:, :, 2]
        v[:, :, 7] = v[:, :, 2]
        k[:, :, :, 4] = k[:, :, :, 0] - k[:, :, :, 1]  # rank 4 < d
    else:
        k[:, :, 3] = 0.0
        v[:, :, 5] = 0.0
        v[:, :, :, 2] = 0.0
    return (q, k, v), d_out


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("case", list(CASES) + ["repeated_rows", "zero_rows", "short_rows"])
def test_matches_float64_reference(label, case):
    check_against_reference(label, case)


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("case", list(CASES) + ["repeated_rows", "zero_rows", "short_rows"])
def test_small_tiles_match_float64_reference(label, case, small_tiles):
    check_against_reference(label, case)


def _span_inputs(t: int, d: int) -> torch.Tensor:
    """(5, t, d) float64: plain, a zero row, a repeated row, few non-zero rows, all zero."""
    x = torch.randn(5, t, d, generator=torch.Generator().manual_seed(t * 100 + d), dtype=torch.float64)
    x[1, t // 2] = 0
    x[2, -1] = x[2, 0]
    x[3, min(t, d) // 2:] = 0
    x[4] = 0
    return x


@pytest.mark.parametrize("t,d", [(6, 8), (8, 8), (12, 8), (40, 8)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-9)])
def test_spans_match_explicit_projectors(t, d, dtype, tol):
    x = _span_inputs(t, d)
    for pinv in (False, True):
        span = span_of(x.to(dtype), pinv=pinv)
        for i in range(len(x)):
            expected = projector(x[i])
            assert rel(span.basis[i] @ span.basis[i].mT, expected, torch.ones(1)) < tol, (i, pinv)
            if pinv:
                assert rel(span.pinv_t()[i], torch.linalg.pinv(x[i]).mT, torch.ones(1)) < tol, (i, pinv)
    with pytest.raises(ValueError, match="pinv=True"):
        span_of(x).pinv_t()


def test_row_tiles():
    causal = torch.ones(256, 256, dtype=torch.bool).tril()
    assert tiles.row_tiles(causal, 256, 256) == [(start, start + 64, start + 64) for start in range(0, 256, 64)]
    assert tiles.row_tiles(None, 256, 256) == [(0, 256, 256)]
    keys = torch.ones(2, 1, 1, 1, 256, dtype=torch.bool)
    keys[0, ..., 200:] = False  # key padding in one sequence: every row sees all keys
    assert tiles.row_tiles(keys, 256, 256) == [(0, 256, 256)]
    dead = causal.clone()
    dead[:70] = False  # rows that attend nothing are in no tile
    assert tiles.row_tiles(dead, 256, 256)[:2] == [(64, 128, 128), (128, 192, 192)]
    assert len(tiles.row_tiles(torch.ones(2048, 2048, dtype=torch.bool).tril(), 2048, 2048)) == 8


def test_tiled_products():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 10, 9, generator=gen, dtype=torch.float64)
    cuts = [(0, 3, 4), (3, 5, 2), (6, 10, 9)]  # columns not monotone, row 5 in no tile
    expected = torch.zeros_like(full)
    for start, end, cols in cuts:
        expected[:, start:end, :cols] = full[:, start:end, :cols]
    tiled = tiles.Tiled(cuts, [full[:, start:end, :cols] for start, end, cols in cuts], 10, 9)
    x, y = torch.randn(9, 2, generator=gen, dtype=torch.float64), torch.randn(10, 2, generator=gen, dtype=torch.float64)
    assert torch.allclose(tiled @ x, expected @ x) and torch.allclose(tiled.mT @ y, expected.mT @ y)


@pytest.mark.parametrize("backend", ["tiles", "fused"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("label", ["standard:QKV101", "standard:QKV000", "standard:QKV0.5,2,1"])
def test_the_standard_rule_under_any_qkv_alphas_is_sdpa_with_its_gradients_times_them(label, dropout_p, backend):
    """SDPA's own kernels, bit for bit, each gradient times its α: no work of the backend's but the products by α."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran.add(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(h_kv=2, t=16, d=8, dtype=torch.float32)
    torch.manual_seed(0)
    with Ops() as ours:
        out, grads = run((q, k, v), d_out, config, is_causal=True, dropout_p=dropout_p, backend=backend,
                         enable_gqa=True)
    torch.manual_seed(0)
    with Ops() as sdpa:
        ref_out, ref_grads = run((q, k, v), d_out, SpanAttentionConfig.from_label("standard:QKV111"),
                                 is_causal=True, dropout_p=dropout_p, enable_gqa=True)
    assert ours.ran - sdpa.ran <= {torch.ops.aten.mul, torch.ops.aten.view}
    assert torch.equal(out, ref_out)
    for g, r, alpha in zip(grads, ref_grads, config.qkv_alphas):
        assert torch.equal(g, r * alpha)


@pytest.mark.parametrize("label", ["score:1100", "score:1100@per_block", "reductionistic:1100", "standard:QKV101"])
def test_a_mask_that_hides_everything_gives_zeros(label):
    (q, k, v), d_out = make(dtype=torch.float32)
    mask = torch.zeros(2, 1, 12, 12, dtype=torch.bool)
    out, grads = run((q, k, v), d_out, SpanAttentionConfig.from_label(label), attn_mask=mask)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def check_against_reference(label, case):
    config = SpanAttentionConfig.from_label(label)
    if case in CASES:
        inputs, d_out = make(**CASES[case]["shape"])
        kwargs = CASES[case]["kwargs"]
    else:
        inputs, d_out = rank_deficient(case.split("_")[0])
        kwargs = dict(is_causal=True)
    ref_out, ref_grads = reference(*inputs, d_out, config, **kwargs)
    _, std_grads = reference(*inputs, d_out, SpanAttentionConfig(method="standard"), **kwargs)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-4)):
        cast = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()}
        out, grads = run([x.to(dtype) for x in inputs], d_out.to(dtype), config, **cast)
        assert rel(out, ref_out) < tol
        for name, g, r, std in zip("qkv", grads, ref_grads, std_grads):
            assert g.dtype == dtype
            assert rel(g, r, std) < tol, f"d{name} {dtype}: {rel(g, r, std):.2e}"


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("case", ["causal", "padded", "float_mask", "gqa"])
def test_forward_equals_sdpa(label, case):
    inputs, d_out = make(dtype=torch.float32, **CASES[case]["shape"])
    kwargs = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v)
              for k, v in CASES[case]["kwargs"].items()}
    out, _ = run(inputs, d_out, SpanAttentionConfig.from_label(label), **kwargs)
    gqa = inputs[0].shape[1] != inputs[1].shape[1]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = F.scaled_dot_product_attention(*inputs, enable_gqa=gqa, **kwargs)
    assert (out - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("label", UNIFORM)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("case", ["causal", "padded", "gqa", "t_gg_d"])
def test_uniform_alphas_give_sdpa_gradients(label, dtype, tol, case):
    inputs, d_out = make(dtype=dtype, **CASES[case]["shape"])
    kwargs = CASES[case]["kwargs"]
    _, grads = run(inputs, d_out, SpanAttentionConfig.from_label(label), **kwargs)
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    gqa = inputs[0].shape[1] != inputs[1].shape[1]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        expected = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, enable_gqa=gqa, **kwargs), leaves, d_out)
    for g, e in zip(grads, expected):
        assert rel(g, e) < tol


def test_padded_batch_matches_each_sequence_alone():
    lengths, t = [9, 5], 9
    for label in ["score:1100", "score:1100@per_block", "reductionistic:1100", "simple:10"]:
        config = SpanAttentionConfig.from_label(label)
        inputs, d_out = make(t=t, d=4, seed=5)
        mask = padding_mask(lengths, t)
        d_out = d_out * mask[:, 0].any(-1)[:, None, :, None]  # padded positions carry no loss
        _, grads = run(inputs, d_out, config, attn_mask=mask)
        for i, n in enumerate(lengths):
            alone = [x[i : i + 1, :, t - n :] for x in inputs]
            _, alone_grads = run(alone, d_out[i : i + 1, :, t - n :], config, is_causal=True)
            for g, a in zip(grads, alone_grads):
                assert rel(g[i : i + 1, :, t - n :], a) < 1e-10, label
                if n < t:
                    assert g[i, :, : t - n].abs().max() < 1e-12  # no gradient into padding


@pytest.mark.parametrize("label", ["simple:10", "reductionistic:1100", "score:1000", "score:1111",
                                   "score:0.5,2,0,1.5@per_block"])
@pytest.mark.parametrize("case", ["causal", "float_mask", "gqa_padded_scale", "first_rows_dead", "t_gg_d"])
def test_recomputed_tiles_match_float64_reference(label, case, recomputed_tiles):
    check_against_reference(label, case)


@pytest.mark.parametrize(("t", "s", "rows"), [(12, 12, None), (12, 12, 4), (40, 40, 16), (10, 14, None),
                                             (14, 10, 4), (9, 3, 2), (5, 1, None)])
def test_the_causal_mask_from_its_tiles_is_the_mask_of_tril(t, s, rows, small_tiles):
    """The causal mask is built from its tiles alone, without a T×S matrix; it is the mask that a
    boolean tril(ones(T, S)) gives, part by part."""
    tile_engine._CAUSAL_MASKS.clear()
    built = tile_engine._prepare_mask(None, True, (1, 1, 1, t, s), torch.float64, torch.device("cpu"), rows)
    tril = torch.ones(t, s, dtype=torch.bool).tril()
    expected = tile_engine._prepare_mask(tril, False, (1, 1, 1, t, s), torch.float64, torch.device("cpu"), rows)
    assert built.tiles == expected.tiles and built.first_masked == expected.first_masked
    for a, b in zip(built.additive, expected.additive, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert (built.key_valid is None and expected.key_valid is None) or torch.equal(built.key_valid, expected.key_valid)
    assert built.dead_rows is expected.dead_rows is None


@pytest.mark.parametrize("label", ["reductionistic:1100", "score:1111", "score:0.5,2,0,1.5@per_block"])
@pytest.mark.parametrize("case", ["causal", "float_mask", "gqa_padded_scale", "first_rows_dead", "t_gg_d"])
def test_partly_kept_tiles_match_float64_reference(label, case, small_tiles, partly_kept_tiles):
    check_against_reference(label, case)


def test_the_probabilities_take_the_place_of_their_scores(monkeypatch):
    """The forward pass takes each tile's softmax in place: without a mask the rows make one tile
    that holds all of P, and its scores beside it would double the peak."""
    in_place = []
    real = tile_engine.masked_softmax
    monkeypatch.setattr(tile_engine, "masked_softmax", lambda x, dead, out=None: in_place.append(out is x)
                        or real(x, dead, out))
    (q, k, v), d_out = make(b=1, h_q=2, h_kv=1, t=256, d=64)  # all of P kept: 256² ≤ 9·256·64
    config = SpanAttentionConfig.from_label("score:1111")
    out, grads = run((q, k, v), d_out, config)
    assert in_place == [True]
    ref_out, ref_grads = reference(q, k, v, d_out, config)
    for x, r in zip((out, *grads), (ref_out, *ref_grads)):
        assert rel(x, r) < 1e-9


@pytest.mark.parametrize("label", ["reductionistic:1100", "score:1111"])
def test_the_backward_pass_forms_its_gradient_tiles_a_few_head_dims_of_rows_at_a_time(label):
    """Without a mask all 80 rows make one kept tile; the one-pass backward still forms ∂L/∂S for at
    most max(16, _BACKWARD_ROWS·d) = 32 rows at d = 8 at a time, and matches the float64 reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    rows = []

    class SoftmaxGrads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._softmax_backward_data:
                rows.append(args[0].shape[-2])
            return func(*args, **(kwargs or {}))

    config = SpanAttentionConfig.from_label(label)
    q, k, v = (torch.randn(2, 2, 80, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = span_attention(q, k, v, config=config)
    d_out = torch.randn_like(out)
    with SoftmaxGrads():
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert rows and max(rows) == 32 and sum(rows) % 80 == 0
    _, ref_grads = reference(q, k, v, d_out, config)
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9


@pytest.mark.parametrize(("t", "is_causal", "kept_tiles"),
                         [(64, True, 1), (512, True, 16), (64, False, 1), (80, False, 1)])
def test_the_forward_pass_keeps_probabilities_within_its_budget(t, is_causal, kept_tiles):
    """The forward pass keeps at most as many probabilities per query head as min(_KEPT_ROWS,
    _KEPT_PER_ROW·T) rows of Q hold, tiles from the first on, and recomputes the others in the
    backward pass. At d = 8: all of them where they fit (T = 64: 4096 ≤ 9·64·8); under a causal mask at
    T = 512 the first 16 of 32 tiles of 16 rows (16² · (1 + … + 16) ≤ 9·512·8 = 36864); without a mask
    at T = 80, 4 of 5 tiles of 16 × 80 (5120 ≤ 5760 < 6400), kept as one tile of 64 rows: the tiling of
    the recomputed rows does not cut the kept ones into small products."""
    q, k, v = (torch.randn(1, 1, t, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    budget = min(tile_engine._KEPT_ROWS, tile_engine._KEPT_PER_ROW * t) * 8
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = span_attention(q, k, v, is_causal=is_causal, config=SpanAttentionConfig.from_label("score:1111"))
    causal = {id(x) for mask in tile_engine._CAUSAL_MASKS.values() for x in mask.tensors() if x is not None}
    probs = [x for x in saved if x.shape[-1] != 8 and x.dim() == 5 and id(x) not in causal]  # the kept tiles
    kept = sum(x.numel() for x in probs)
    assert 0 < kept <= budget and len(probs) == kept_tiles
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    _, ref_grads = reference(q, k, v, d_out, SpanAttentionConfig.from_label("score:1111"), is_causal=is_causal)
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9


@pytest.mark.parametrize("label", ["score:1000", "score:1100@per_block"])
def test_a_recomputed_tile_is_let_go_before_the_next_is_formed(label, recomputed_tiles, monkeypatch):
    """The backward pass recomputes P a tile at a time and holds one tile in memory, not two: for dV,
    G and the products, for the per-block rule's ∂L/∂P, and for a learnable mask's gradient."""
    import weakref
    formed, alive = [], []
    real = tile_engine.masked_softmax

    def spy(x, dead, out=None):
        alive.append(sum(r() is not None for r in formed))
        y = real(x, dead, out)
        formed.append(weakref.ref(y))
        return y

    monkeypatch.setattr(tile_engine, "masked_softmax", spy)
    (q, k, v), d_out = make(b=1, h_q=2, h_kv=2, t=64, d=8)
    bias = (0.1 * torch.randn(1, 1, 64, 64, dtype=torch.float64)).requires_grad_()
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    config = SpanAttentionConfig.from_label(label)
    out = span_attention(*leaves, attn_mask=bias, config=config)
    formed.clear(), alive.clear()
    grads = torch.autograd.grad(out, [*leaves, bias], d_out)
    assert len(alive) >= 8 and max(alive) == 0, alive  # 4 tiles of 16 rows, formed at least twice
    _, ref_grads = reference(q, k, v, d_out, config, attn_mask=bias.detach())
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9


@pytest.mark.parametrize("is_causal", [True, False])
def test_the_per_block_stacks_stay_small_beside_a_small_batch(is_causal, monkeypatch):
    """The per-block rule stacks its blocks' scores and ∂L/∂P in buffers of at most _STACK_ELEMENTS,
    and at most twice the query's elements: at batch 1 the cache-sized stacks alone would pass 4×
    SDPA's memory."""
    from hf_spanattn.ops import blocks
    sizes, real = [], blocks.Workspace.__call__
    monkeypatch.setattr(blocks.Workspace, "__call__", lambda self, name, shape, *args: sizes.append(
        (name, torch.Size(shape).numel())) or real(self, name, shape, *args))
    (q, k, v), d_out = make(b=1, h_q=2, h_kv=2, t=64, d=16)
    config = SpanAttentionConfig.from_label("score:1111@per_block")
    out, grads = run((q, k, v), d_out, config, is_causal=is_causal)
    stacked = [n for name, n in sizes if name in ("scores", "d_probs")]
    assert stacked and max(stacked) <= 2 * q.numel(), max(stacked)
    _, ref_grads = reference(q, k, v, d_out, config, is_causal=is_causal)
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9


@pytest.mark.parametrize("label", ["score:1111", "score:1100@per_block"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_backward_pass_takes_a_part_of_the_batch_at_a_time(label, recompute, monkeypatch):
    """The backward pass takes at most 1/_BACKWARD_CHUNKS of the (batch, key/value head) pairs at a
    time (here a quarter), so that the rules' O(T·d) temporaries, spans included, are that share of
    the batch's: whole batch entries where there are as many, else parts of each entry's heads."""
    monkeypatch.setattr(tile_engine, "_BACKWARD_CHUNKS", 4)
    monkeypatch.setattr(tile_engine, "_FEW_KEPT", 0)  # parts: _BACKWARD_CHUNKS (see the next test)
    if recompute:
        monkeypatch.setattr(tile_engine, "_KEPT_ROWS", 0)
    real, chunks = tile_engine._backward, []
    monkeypatch.setattr(tile_engine, "_backward",
                        lambda batch, *args: chunks.append(tuple(batch.q.shape[:3])) or real(batch, *args))
    config = SpanAttentionConfig.from_label(label)
    cases = [(2, 3, [(1, 1, 2)] * 6), (1, 3, [(1, 1, 2)] * 3), (3, 4, [(1, 3, 2), (1, 1, 2)] * 3),
             (5, 1, [(1, 1, 2)] * 5), (8, 1, [(2, 1, 2)] * 4)]  # at most a quarter each: 5 entries in 5 parts
    for b, h_kv, expected in cases:
        chunks.clear()
        (q, k, v), d_out = make(b=b, h_q=2 * h_kv, h_kv=h_kv, t=12)
        out, grads = run((q, k, v), d_out, config, is_causal=True)
        assert chunks == expected
        ref_out, ref_grads = reference(q, k, v, d_out, config, is_causal=True)
        for g, r in zip(grads, ref_grads):
            assert rel(g, r) < 1e-9


def test_the_backward_pass_takes_no_part_of_fewer_than_min_part_elements(monkeypatch):
    """A small batch is taken whole, a larger one in parts of at least _MIN_PART elements of Q: smaller parts
    cost more time (their spans, a call per product) than they save memory."""
    monkeypatch.undo()  # the package's _MIN_PART (2**16), not the tests' 1
    real, chunks = tile_engine._backward, []
    monkeypatch.setattr(tile_engine, "_backward", lambda batch, *args: chunks.append(1) or real(batch, *args))
    config = SpanAttentionConfig.from_label("score:1111")
    for b, t, parts in [(2, 64, 1), (8, 64, 1), (8, 128, 2), (8, 256, 4)]:  # Q holds b·2·t·64 elements
        chunks.clear()
        (q, k, v), d_out = make(b=b, h_q=2, h_kv=1, t=t, d=64)
        out, grads = run((q, k, v), d_out, config, is_causal=True)
        assert len(chunks) == parts, (b, t)
        ref_out, ref_grads = reference(q, k, v, d_out, config, is_causal=True)
        for g, r in zip(grads, ref_grads):
            assert rel(g, r) < 1e-9


@pytest.mark.parametrize(("label", "t", "is_causal", "kept_rows", "parts"), [
    ("score:1111", 24, True, None, 4),  # one tile of 24² = 576 probabilities per head ≤ 5·T·d = 600
    ("score:1111", 28, True, None, 8),  # 784 > 700
    ("score:1000", 24, False, None, 4),
    ("score:1000", 28, False, None, 8),
    ("score:1100@per_block", 24, True, None, 8),  # the per-block rule's stacks are larger: always eight
    ("score:1111", 24, True, 0, 8),  # the probabilities recomputed
])
def test_the_backward_pass_takes_larger_parts_where_few_probabilities_are_kept(label, t, is_causal, kept_rows,
                                                                              parts, monkeypatch):
    """Where the kept probabilities are at most _FEW_KEPT·T·d per query head (T ≤ 512 under a causal mask
    at d = 64), the backward pass takes the batch in half as many parts: the rule's temporaries, not
    P, then bound the memory, and larger parts run faster."""
    if kept_rows is not None:
        monkeypatch.setattr(tile_engine, "_KEPT_ROWS", kept_rows)
    real, chunks = tile_engine._backward, []
    monkeypatch.setattr(tile_engine, "_backward", lambda batch, *args: chunks.append(1) or real(batch, *args))
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(b=8, h_q=2, h_kv=1, t=t)
    out, grads = run((q, k, v), d_out, config, is_causal=is_causal)
    assert len(chunks) == parts
    ref_out, ref_grads = reference(q, k, v, d_out, config, is_causal=is_causal)
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9


@pytest.mark.parametrize("label", ["score:1000", "score:1111", "simple:10"])
def test_a_recomputed_backward_forms_each_probability_tile_once(label, monkeypatch, recomputed_tiles):
    """Where the probabilities are recomputed, the backward pass forms each tile of P once and takes
    dV, G and every product the rule asks for from it while it is in memory."""
    calls = []
    real = tile_engine.masked_softmax
    monkeypatch.setattr(tile_engine, "masked_softmax", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    (q, k, v), d_out = make(b=1, h_q=2, h_kv=1, t=64)  # one backward chunk
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = span_attention(*leaves, is_causal=True, config=SpanAttentionConfig.from_label(label))
    in_forward = len(calls)
    grads = torch.autograd.grad(out, leaves, d_out)
    assert in_forward == 4 and len(calls) - in_forward == 4  # 64 rows in tiles of 16
    ref_out, ref_grads = reference(q, k, v, d_out, SpanAttentionConfig.from_label(label), is_causal=True)
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9


@pytest.mark.parametrize("label", ["score:1111", "score:1000", "reductionistic:1100", "score:1100@per_block"])
@pytest.mark.parametrize("recompute", [False, True])
def test_dropout_uses_the_forward_mask(label, recompute, small_tiles, monkeypatch):
    if recompute:
        monkeypatch.setattr(tile_engine, "_KEPT_ROWS", 0)
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), d_out = make(h_q=4, h_kv=2)
    p = 0.3
    torch.manual_seed(11)
    out, grads = run((q, k, v), d_out, config, is_causal=True, dropout_p=p)
    torch.manual_seed(11)
    keep = torch.empty(2, 2, 2, 12, 12, dtype=torch.float64).bernoulli_(1 - p).bool().reshape(2, 4, 12, 12)
    ref_out, ref_grads = reference(q, k, v, d_out, config, is_causal=True, keep=keep, dropout_p=p)
    assert rel(out, ref_out) < 1e-12
    for g, r in zip(grads, ref_grads):
        assert rel(g, r) < 1e-9
    if label == "score:1111":  # and this is autograd's gradient of the same (dropped-out) forward
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        kk, vv = (x.repeat_interleave(2, dim=1) for x in leaves[1:])
        causal = torch.zeros(12, 12, dtype=torch.float64).masked_fill(~torch.ones(12, 12).bool().tril(), -torch.inf)
        scores = leaves[0] @ kk.mT / 5**0.5 + causal
        expected = torch.autograd.grad(torch.softmax(scores, -1) * keep / (1 - p) @ vv, leaves, d_out)
        for g, e in zip(grads, expected):
            assert rel(g, e) < 1e-12


@pytest.mark.parametrize("label", UNIFORM)
def test_gradcheck_where_the_rule_is_a_true_gradient(label):
    config = SpanAttentionConfig.from_label(label)
    (q, k, v), _ = make(b=1, h_q=2, h_kv=1, t=7, d=3)
    mask = padding_mask([5], 7)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: span_attention(*x, attn_mask=mask, config=config), leaves)


@pytest.mark.parametrize("label", ["score:1000", "score:1100@per_block", "reductionistic:1100", "simple:10"])
def test_bf16_inputs(label, small_tiles):
    config = SpanAttentionConfig.from_label(label)
    inputs, d_out = make(t=32, d=8)
    _, ref_grads = reference(*inputs, d_out, config, is_causal=True)
    out, grads = run([x.bfloat16() for x in inputs], d_out.bfloat16(), config, is_causal=True)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits (unit roundoff 2^-9); 2e-2 allows for sums over T.
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()
        assert rel(g, r) < 2e-2


def test_no_grad_and_eval_paths_are_sdpa():
    (q, k, v), _ = make(dtype=torch.float32)
    config = SpanAttentionConfig.from_label("score:1000")
    with torch.no_grad():
        out = span_attention(q, k, v, is_causal=True, config=config)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_bad_calls_raise_clear_errors():
    (q, k, v), _ = make()
    q.requires_grad_(True)
    config = SpanAttentionConfig.from_label("score:1000")
    with pytest.raises(ValueError, match="self-attention"):
        span_attention(q, k[:, :, :6], v[:, :, :6], config=config)
    with pytest.raises(ValueError, match="multiple"):
        span_attention(q, k[:, :3], v[:, :3], config=config)
    with pytest.raises(ValueError, match="not both"):
        span_attention(q, k, v, attn_mask=padding_mask([12, 8], 12), is_causal=True, config=config)


# ---- the paper's structural facts, on explicit T×T projectors -------------------------------

def test_score_blocks_structure():
    from reference import projector, score_blocks

    gen = torch.Generator().manual_seed(2)
    Q, K, V = (torch.randn(16, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    PK, PV, eye = projector(K), projector(V), torch.eye(16, dtype=torch.float64)
    blocks = score_blocks(Q, K, PK, PV, eye, 0.5)
    assert all(b.norm() > 1e-3 for b in blocks.values())
    assert rel(sum(blocks.values()), 0.5 * Q @ K.T) < 1e-12
    # the 8 blocks with Π_K^⊥ on the right vanish: Kᵀ Π_K^⊥ = 0
    assert (K.T @ (eye - PK)).abs().max() < 1e-12
    non_orthogonal = {frozenset(p) for p in [((0, 0, 0), (0, 1, 0)), ((0, 0, 1), (0, 1, 1)),
                                             ((1, 0, 0), (1, 1, 0)), ((1, 0, 1), (1, 1, 1))]}
    for x, y in itertools.combinations(blocks, 2):
        inner = (blocks[x] * blocks[y]).sum() / (blocks[x].norm() * blocks[y].norm())
        assert (abs(inner) > 1e-6) == (frozenset((x, y)) in non_orthogonal), (x, y)


def test_reductionistic_projectors_sum_to_identity():
    from reference import projector

    gen = torch.Generator().manual_seed(4)
    K, V = (torch.randn(10, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    PK, PV, eye = projector(K), projector(V), torch.eye(10, dtype=torch.float64)
    total = sum(a @ b @ a for a in (PK, eye - PK) for b in (PV, eye - PV))
    assert (total - eye).abs().max() < 1e-12


def test_cross_terms_are_the_derivative_of_pi_k():
    """Autograd of Σ_B ⟨G_B, S^B(K)⟩ with the G_B held fixed = the direct terms + the paper's cross terms."""
    from reference import cross_terms, projector, score_blocks

    gen = torch.Generator().manual_seed(6)
    Q, K, V = (torch.randn(9, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    grads = {key: torch.randn(9, 9, generator=gen, dtype=torch.float64) for key in itertools.product((0, 1), repeat=3)}
    eye, PV = torch.eye(9, dtype=torch.float64), projector(V)
    Kvar = K.clone().requires_grad_(True)
    blocks = score_blocks(Q, Kvar, projector(Kvar), PV, eye, 0.5)
    total = sum((grads[key] * blocks[key]).sum() for key in blocks)
    (auto,) = torch.autograd.grad(total, Kvar)
    PK = projector(K)
    pk, pv = (PK, eye - PK), (PV, eye - PV)
    direct = sum(0.5 * pv[dl] @ grads[a, b, dl].T @ pv[a] @ pk[b] @ Q for a, b, dl in grads)
    cross = cross_terms(grads, Q, K, PK, PV, eye, 0.5, (1, 1, 1, 1))
    assert rel(direct + cross, auto) < 1e-10
    assert rel(direct, auto) > 1e-2  # the cross terms matter


@pytest.mark.parametrize("mask", ["float", "bool"])
def test_the_mask_is_let_go_after_the_backward_pass(mask):
    """After the backward pass (retain_graph off) the graph still held by the output keeps none of the mask's
    tensors, as SDPA's: a loss kept past backward held every layer's B×T×S copy of the mask."""
    import gc
    import weakref

    (q, k, v), d_out = make(b=2, h_q=2, h_kv=2, t=12, d=8)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    attn_mask = torch.zeros(2, 1, 12, 12, dtype=torch.float64)
    attn_mask[0, ..., -3:] = float("-inf")
    expected = reference(q, k, v, d_out, SpanAttentionConfig.from_label("score:1000"), attn_mask=attn_mask.clone())[1]
    attn_mask = attn_mask == 0 if mask == "bool" else attn_mask
    formed = []
    real = tile_engine._attend

    def spy(*args):
        attend, additive = real(*args)
        formed.append(weakref.ref(additive))
        return attend, additive

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tile_engine, "_attend", spy)
        out = span_attention(*leaves, attn_mask=attn_mask, config=SpanAttentionConfig.from_label("score:1000"),
                             backend="tiles")
    out.backward(d_out)
    del attn_mask
    gc.collect()
    assert formed and all(ref() is None for ref in formed)
    for leaf, r in zip(leaves, expected):
        assert rel(leaf.grad, r) < 1e-9
