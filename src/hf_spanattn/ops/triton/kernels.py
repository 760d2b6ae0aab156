"""The Triton kernels: a FlashAttention-2 forward that saves the log-sum-exp, and a backward that
recomputes P and G = ∂L/∂S per tile and multiplies the tile by the caller's operands.

Layouts (all contiguous, last dimension the head dim): Q, O (N, B, H_q, T, ·); K (N, B, H_kv, S, ·);
V (B, H_kv, S, ·) and dO (B, H_q, T, ·) shared by the N blocks; Δ (N, B, H_q, T) float32; LSE (N, B, H_q, T, 2)
float32, the log-sum-exp in log2 units as two parts (below);
BIAS (B, S) float32, the key mask in log2 units (0 or −inf for a padding mask); X (N, B, H_kv, S, W_X)
the key-side operands of G·X, Y (N, B, H_q, T, W_Y) the query-side operands of Gᵀ·Y. N is the block
axis of the per-block reading (1 otherwise); program_id(2) walks it.

Scores run in log2 units: s = log2(e)·scale·q·k + bias, p = 2^((s − m) − r) with the row's maximum m and
r = log2 Σ 2^(s − m) kept apart under a key bias: their float32 sum loses r where |m| is large (a row whose
every key has a bias of −1e9 or the dtype's minimum), and P would no longer sum to 1 in the backward pass;
without a bias they are added once per row (p = 2^(s − (m + r)): one operation less per entry). A row that
attends nothing has m = −inf and p = 0 (output 0, as SDPA under a bool mask). Dropout keeps an entry
where a Philox draw from (seed, row·S + column, batch·H_q + head) is at least p_drop: the same
draw in the forward and in both backward kernels, for every block.
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from hf_spanattn.ops.inputs import shown, user_stacklevel
from hf_spanattn.ops.triton import interpreting

INTERPRET = interpreting()

if INTERPRET:  # the interpreter's program ids are 1-element arrays, which NumPy ≥ 2.4 no longer takes as an index
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope) -> None:
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interpreter._patch_lang_tensor = _patch_lang_tensor


_TUNE_OFF, _TUNE_ON = ("0", "off", "false", "no"), ("1", "on", "true", "yes", "")


def tuning(value: str | None) -> bool:
    """Whether the kernels autotune, given HF_SPANATTN_TRITON_TUNE (None: unset). 0/off/false/no (any case,
    spaces around) turn it off; unset, 1/on/true/yes tune. Another value tunes, with a warning: an error would
    stop the first use of the kernels over a setting that changes only how long the first calls take."""
    word = (value or "").strip().lower()
    if word not in _TUNE_OFF + _TUNE_ON:
        warnings.warn(f"HF_SPANATTN_TRITON_TUNE={shown(value)} is not one of 0, off, false, no (no autotuning) or "
                      "1, on, true, yes (autotuning, the default): the kernels autotune", stacklevel=user_stacklevel())
    return word not in _TUNE_OFF


TUNE = tuning(os.environ.get("HF_SPANATTN_TRITON_TUNE"))


def _configs(kind: str) -> list[triton.Config]:
    """Block sizes, warps and stages to autotune over (one config under the interpreter, which runs
    programs one after another and rejects several). kind: "forward", "keys" (the dK/dV side: one
    key block per program) or "queries" (the dQ side). Lists per GPU family, after the Triton
    fused-attention tutorial and FlagAttention; the autotuner picks per shape. HF_SPANATTN_TRITON_TUNE=0
    (or off, false, no) takes the first of the list without tuning (tests: many shapes, each tuned once otherwise)."""
    if INTERPRET or not torch.cuda.is_available():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    major, _ = torch.cuda.get_device_capability()
    # (BLOCK_M, BLOCK_N, warps, stages); the first of each list is the one taken without tuning, and
    # compiles without register spills for sm_90 (ptxas -v: D = 64, operands 64–128 wide, no dropout)
    if major >= 9:  # Hopper (H100, H200)
        table = {"forward": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
                 "keys": [(32, 128, 8, 3), (64, 64, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
                 "queries": [(128, 32, 8, 3), (64, 64, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3)]}
    elif major == 8:  # Ampere, Ada
        table = {"forward": [(128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4)],
                 "keys": [(32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 3)],
                 "queries": [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 3)]}
    else:
        table = {"forward": [(64, 64, 4, 2), (64, 32, 4, 2)],
                 "keys": [(32, 64, 4, 2), (64, 64, 8, 2)],
                 "queries": [(64, 32, 4, 2), (64, 64, 8, 2)]}
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in table[kind]]
    return configs if TUNE else configs[:1]


_KEY = ["T", "S", "D", "DV", "W", "CAUSAL", "HAS_BIAS", "DROPOUT"]


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with float32 accumulation; half inputs go to float32 first under the interpreter, whose
    bfloat16 dot is wrong."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _keep(seed, bh, rows, cols, S, p_drop):
    """The dropout draw for head bh at (rows, cols) (broadcasting index tensors): True where kept."""
    offsets = rows * S + cols
    r, _, _, _ = tl.philox(seed, offsets, tl.zeros_like(offsets) + bh.to(tl.int32), 0, 0)
    return tl.uint_to_uniform_float(r) >= p_drop


@triton.jit
def _scores(q, k, bias_ptr, b, rows, cols, T, S, scale_log2,
            CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The (rows, cols) tile of log2(e)·(scale·QKᵀ + mask); masked entries −inf."""
    s = _dot(q, tl.trans(k), UPCAST, PRECISION) * scale_log2
    valid = (rows[:, None] < T) & (cols[None, :] < S)
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    if HAS_BIAS:
        s = s + tl.load(bias_ptr + b * S + cols, mask=cols < S, other=0.0)[None, :]
    return tl.where(valid, s, float("-inf"))


@triton.autotune(configs=_configs("forward"), key=_KEY)
@triton.jit
def forward_kernel(Q, K, V, O, LSE, BIAS, SEED, B, H_Q, H_KV, T, S, scale_log2, p_drop,
                   D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   W: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, bh, blk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    b, h = bh // H_Q, bh % H_Q
    bkv = b * H_KV + h // (H_Q // H_KV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q_row = (blk * B * H_Q + bh) * T + rows
    q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=(rows[:, None] < T) & (d[None, :] < D), other=0.0)
    k_base = K + (blk * B * H_KV + bkv) * S * D
    v_base = V + bkv * S * DV
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = S
    if CAUSAL:
        hi = (pid_m + 1) * BLOCK_M  # the keys past S are masked
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + cols[:, None] * D + d[None, :], mask=(cols[:, None] < S) & (d[None, :] < D), other=0.0)
        s = _scores(q, k, BIAS, b, rows, cols, T, S, scale_log2, CAUSAL, HAS_BIAS, UPCAST, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(_keep(seed, bh, rows[:, None], cols[None, :], S, p_drop), p / (1.0 - p_drop), 0.0)
        v = tl.load(v_base + cols[:, None] * DV + dv[None, :], mask=(cols[:, None] < S) & (dv[None, :] < DV),
                    other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + q_row[:, None] * DV + dv[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < T) & (dv[None, :] < DV))
    tl.store(LSE + 2 * q_row, m_i, mask=rows < T)
    tl.store(LSE + 2 * q_row + 1, tl.math.log2(tl.where(empty, 1.0, l_i)), mask=rows < T)


@triton.jit
def _probabilities(q, k, bias_ptr, m, r, b, rows, cols, T, S, scale_log2,
                   CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """P's (rows, cols) tile from the saved log-sum-exp (`_row_lse`)."""
    s = _scores(q, k, bias_ptr, b, rows, cols, T, S, scale_log2, CAUSAL, HAS_BIAS, UPCAST, PRECISION)
    return _exp2_less(s, m[:, None], r[:, None], HAS_BIAS)


@triton.jit
def _exp2_less(s, m, r, HAS_BIAS: tl.constexpr):
    """2^(s − m − r): m and r apart under a key bias (its finite minimum puts m where float32 drops r)."""
    if HAS_BIAS:
        return tl.math.exp2((s - m) - r)
    return tl.math.exp2(s - (m + r))


@triton.jit
def _row_lse(LSE, q_row, rows, T):
    """The rows' m and r (log2 units); m = +inf where a row attends nothing, so that every p is 0."""
    m = tl.load(LSE + 2 * q_row, mask=rows < T, other=float("inf"))
    r = tl.load(LSE + 2 * q_row + 1, mask=rows < T, other=0.0)
    return tl.where(m == float("-inf"), float("inf"), m), r


@triton.autotune(configs=_configs("keys"), key=_KEY)
@triton.jit
def keys_kernel(Q, K, V, DO, LSE, DELTA, BIAS, SEED, Y, DV_OUT, GY, B, H_Q, H_KV, T, S, scale, scale_after, scale_log2,
                p_drop, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                W: tl.constexpr, BLOCK_W: tl.constexpr, Y_IS_Q: tl.constexpr, WANT_DV: tl.constexpr,
                WANT_GY: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key block of one key/value head: dV = Σ_h Pᵀ dO and Gᵀ·Y summed over the head's query heads h.
    Tiles are held transposed (keys × queries), as in the Triton tutorial's dK/dV loop."""
    pid_n, bkv, blk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    b, h_kv = bkv // H_KV, bkv % H_KV
    group = H_Q // H_KV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d, dv, w = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_W)
    k_row = (blk * B * H_KV + bkv) * S + cols
    c_mask = cols[:, None] < S
    k = tl.load(K + k_row[:, None] * D + d[None, :], mask=c_mask & (d[None, :] < D), other=0.0)
    v = tl.load(V + (bkv * S + cols)[:, None] * DV + dv[None, :], mask=c_mask & (dv[None, :] < DV), other=0.0)
    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + b * S + cols, mask=cols < S, other=0.0)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    acc_dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    acc_gy = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(group):
        bh = b * H_Q + h_kv * group + g
        for start in range(lo, T, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            q_row = (blk * B * H_Q + bh) * T + rows
            r_mask = rows[:, None] < T
            q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=r_mask & (d[None, :] < D), other=0.0)
            m, r = _row_lse(LSE, q_row, rows, T)
            d_out = tl.load(DO + (bh * T + rows)[:, None] * DV + dv[None, :], mask=r_mask & (dv[None, :] < DV),
                            other=0.0)
            s_t = _dot(k, tl.trans(q), UPCAST, PRECISION) * scale_log2 + bias[:, None]
            valid = c_mask & (rows[None, :] < T)
            if CAUSAL:
                valid = valid & (cols[:, None] <= rows[None, :])
            p_t = _exp2_less(tl.where(valid, s_t, float("-inf")), m[None, :], r[None, :], HAS_BIAS)
            if DROPOUT:
                keep = _keep(seed, bh, rows[None, :], cols[:, None], S, p_drop)
                p_used = tl.where(keep, p_t / (1.0 - p_drop), 0.0)
            else:
                p_used = p_t
            if WANT_DV:
                acc_dv += _dot(p_used.to(d_out.dtype), d_out, UPCAST, PRECISION)
            if WANT_GY:
                delta = tl.load(DELTA + q_row, mask=rows < T, other=0.0)
                dp_t = _dot(v, tl.trans(d_out), UPCAST, PRECISION)
                if DROPOUT:
                    dp_t = tl.where(keep, dp_t / (1.0 - p_drop), 0.0)
                ds_t = p_t * (dp_t - delta[None, :]) * scale  # Gᵀ's tile, short of the factor scale_after
                if Y_IS_Q:
                    y = q
                else:
                    y = tl.load(Y + q_row[:, None] * W + w[None, :], mask=r_mask & (w[None, :] < W), other=0.0)
                acc_gy += _dot(ds_t.to(y.dtype), y, UPCAST, PRECISION)
    if WANT_DV:
        tl.store(DV_OUT + (bkv * S + cols)[:, None] * DV + dv[None, :], acc_dv.to(DV_OUT.dtype.element_ty),
                 mask=c_mask & (dv[None, :] < DV))
    if WANT_GY:
        tl.store(GY + k_row[:, None] * W + w[None, :], acc_gy * scale_after, mask=c_mask & (w[None, :] < W))


@triton.autotune(configs=_configs("queries"), key=_KEY)
@triton.jit
def queries_kernel(Q, K, V, DO, LSE, DELTA, BIAS, SEED, X, GX, B, H_Q, H_KV, T, S, scale, scale_after, scale_log2,
                   p_drop, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   W: tl.constexpr, BLOCK_W: tl.constexpr, X_IS_K: tl.constexpr, X_PER_QUERY_HEAD: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One query block of one query head: G·X, X per key/value head (or per query head)."""
    pid_m, bh, blk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    b, h = bh // H_Q, bh % H_Q
    bkv = b * H_KV + h // (H_Q // H_KV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d, dv, w = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_W)
    q_row = (blk * B * H_Q + bh) * T + rows
    r_mask = rows[:, None] < T
    q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=r_mask & (d[None, :] < D), other=0.0)
    d_out = tl.load(DO + (bh * T + rows)[:, None] * DV + dv[None, :], mask=r_mask & (dv[None, :] < DV), other=0.0)
    m, r = _row_lse(LSE, q_row, rows, T)
    delta = tl.load(DELTA + q_row, mask=rows < T, other=0.0)
    k_base = (blk * B * H_KV + bkv) * S
    x_base = k_base
    if X_PER_QUERY_HEAD:
        x_base = (blk * B * H_Q + bh) * S
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    acc = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    hi = S
    if CAUSAL:
        hi = (pid_m + 1) * BLOCK_M  # the keys past S are masked
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        c_mask = cols[:, None] < S
        k = tl.load(K + (k_base + cols)[:, None] * D + d[None, :], mask=c_mask & (d[None, :] < D), other=0.0)
        v = tl.load(V + (bkv * S + cols)[:, None] * DV + dv[None, :], mask=c_mask & (dv[None, :] < DV), other=0.0)
        p = _probabilities(q, k, BIAS, m, r, b, rows, cols, T, S, scale_log2, CAUSAL, HAS_BIAS, UPCAST, PRECISION)
        dp = _dot(d_out, tl.trans(v), UPCAST, PRECISION)
        if DROPOUT:
            dp = tl.where(_keep(seed, bh, rows[:, None], cols[None, :], S, p_drop), dp / (1.0 - p_drop), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        if X_IS_K:
            x = k
        else:
            x = tl.load(X + (x_base + cols)[:, None] * W + w[None, :], mask=c_mask & (w[None, :] < W), other=0.0)
        acc += _dot(ds.to(x.dtype), x, UPCAST, PRECISION)
    tl.store(GX + q_row[:, None] * W + w[None, :], acc * scale_after, mask=r_mask & (w[None, :] < W))
