"""The gated delta rule (Gated DeltaNet linear attention) and its short causal convolution, in JAX.

Per value head, a state S [K, V] is decayed, corrected toward each token's value and read by its query:
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T q_t
with q and k L2-normalised and q scaled by K^-1/2 (HF `torch_recurrent_gated_delta_rule`).

Two forms of the same function: `chunk_gated_delta_rule` (training and prefill: within a chunk every token
at once through a triangular solve, `lax.scan` over the chunks) and `gated_delta_step` (decoding: one token).
Packed rows mark where each sequence starts with `reset` (`resets_from_segments`): there the state and the
convolution window start from zero, so packed sequences never see each other.

Legend: B rows, T length, N query/key heads, H value heads (each key head serves H / N consecutive ones),
K key head dim, V value head dim, J chunks, C chunk length, W convolution width, E channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from areal_jax.activation_sharding import unsplit_axis

# HF's chunk length: the intra-chunk work is [C, C] per head and chunk, the scan J = T / C steps long.
DEFAULT_CHUNK = 64


def resets_from_segments(segment_ids_BxT: jax.Array) -> jax.Array:
    """True [B, T] where a new sequence starts: the first position and wherever the segment id changes
    (padding, segment 0, is a run of its own)."""
    first_Bx1 = jnp.ones_like(segment_ids_BxT[:, :1], dtype=bool)
    return jnp.concatenate([first_Bx1, segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], axis=1)


def _segment_ordinals(reset_BxT: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
    """Which sequence of its row each position belongs to: 0 for the one the initial state belongs to,
    one more at each reset."""
    if reset_BxT is None:
        return jnp.zeros(shape, jnp.int32)
    return jnp.cumsum(reset_BxT.astype(jnp.int32), axis=1)


def _l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _prepare(
    q_xNxK: jax.Array, k_xNxK: jax.Array, v_xHxV: jax.Array, g_xH: jax.Array, beta_xH: jax.Array, l2_normalize: bool
) -> tuple[jax.Array, ...]:
    """The inputs in fp32 (or wider: fp64 under x64 for finite differences), q/k repeated to the value heads
    and normalised, q scaled by K^-1/2."""
    dtype = jnp.promote_types(v_xHxV.dtype, jnp.float32)
    repeat = v_xHxV.shape[-2] // k_xNxK.shape[-2]
    q, k = (jnp.repeat(x.astype(dtype), repeat, axis=-2) for x in (q_xNxK, k_xNxK))
    if l2_normalize:
        q, k = _l2_normalize(q), _l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v_xHxV.astype(dtype), g_xH.astype(dtype), beta_xH.astype(dtype)


def _initial_state(state_BxHxKxV: jax.Array | None, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    return jnp.zeros(shape, dtype) if state_BxHxKxV is None else state_BxHxKxV.astype(dtype)


def chunk_gated_delta_rule(
    q_BxTxNxK: jax.Array,
    k_BxTxNxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    reset_BxT: jax.Array | None = None,
    initial_state_BxHxKxV: jax.Array | None = None,
    chunk: int = DEFAULT_CHUNK,
    l2_normalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over whole rows, `chunk` tokens at a time: outputs [B, T, H, V] in v's dtype and
    the final state [B, H, K, V] fp32 (the state of the row's last sequence). `g` is the log decay (<= 0),
    `beta` the write strength; at a `reset` the state restarts from zero, else the first sequence continues
    `initial_state` (zero when None).

    Within a chunk the delta rule's corrections are a unit lower-triangular system (the UT transform of
    DeltaNet), solved for every token at once; only the [H, K, V] state crosses chunks. Token pairs from
    different sequences are masked out of the chunk's matrices, and a token reads (or a chunk passes on)
    the carried state only if no reset lies between them."""
    b, t, _, kd = k_BxTxNxK.shape
    h, vd = v_BxTxHxV.shape[2:]
    q, k, v, g, beta = _prepare(q_BxTxNxK, k_BxTxNxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, l2_normalize)
    seg_BxT = _segment_ordinals(reset_BxT, (b, t))
    chunk = min(chunk, t)
    j = -(-t // chunk)
    pad = j * chunk - t
    if pad:  # zero keys and write strengths, no decay: the padding changes nothing
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
        seg_BxT = jnp.pad(seg_BxT, ((0, 0), (0, pad)), mode="edge")

    def chunks(x: jax.Array) -> jax.Array:  # [B, J*C, ...] -> [B, J, H, C, ...]
        return jnp.moveaxis(x.reshape(b, j, chunk, *x.shape[2:]), 3, 2) if x.ndim > 2 else x

    q_BxJxHxCxK, k_BxJxHxCxK, v_BxJxHxCxV = (chunks(x) for x in (q, k, v))
    g_BxJxHxC, beta_BxJxHxC = (x.reshape(b, j, chunk, h).swapaxes(2, 3) for x in (g, beta))
    seg_BxJxC = seg_BxT.reshape(b, j, chunk)
    # The sequence the carried state belongs to at each chunk's start: the previous token's (the initial
    # state's, 0, for the first chunk).
    carried_BxJ = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), seg_BxJxC[:, :-1, -1]], axis=1)
    reads_state_BxJx1xC = (seg_BxJxC == carried_BxJ[:, :, None])[:, :, None, :]
    same_BxJx1xCxC = (seg_BxJxC[:, :, :, None] == seg_BxJxC[:, :, None, :])[:, :, None]
    causal_CxC = jnp.tril(jnp.ones((chunk, chunk), bool))
    strictly_lower_CxC = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    pairs_BxJx1xCxC = same_BxJx1xCxC & causal_CxC[None, None, None]

    cum_BxJxHxC = jnp.cumsum(g_BxJxHxC, axis=-1)
    # The log decay from token j to token i: g summed over (j, i] from j on (Mamba-2's segment sum), not cum_i -
    # cum_j, whose rounding is ~|cum| eps however close the two tokens (strong gates take cum to -500 within a
    # chunk of 64: a decay near 1 off by ~3e-5 in fp32). -inf before exp where masked (no overflow).
    after_BxJxHxCxC = jnp.where(strictly_lower_CxC, g_BxJxHxC[..., :, None], 0.0)
    span_BxJxHxCxC = jnp.cumsum(after_BxJxHxCxC, axis=-2)
    decay_BxJxHxCxC = jnp.exp(jnp.where(pairs_BxJx1xCxC, span_BxJxHxCxC, -jnp.inf))
    k_beta_BxJxHxCxK = k_BxJxHxCxK * beta_BxJxHxC[..., None]
    v_beta_BxJxHxCxV = v_BxJxHxCxV * beta_BxJxHxC[..., None]
    system_BxJxHxCxC = jnp.einsum("bjhik,bjhsk->bjhis", k_beta_BxJxHxCxK, k_BxJxHxCxK) * decay_BxJxHxCxC
    system_BxJxHxCxC = (
        jnp.where(strictly_lower_CxC[None, None, None], system_BxJxHxCxC, 0.0)
        + jnp.eye(chunk, dtype=q.dtype)[None, None, None]
    )

    def solve(rhs_BxJxHxCxX: jax.Array) -> jax.Array:
        return jax.scipy.linalg.solve_triangular(system_BxJxHxCxC, rhs_BxJxHxCxX, lower=True, unit_diagonal=True)

    decay_in_BxJxHxC = jnp.exp(cum_BxJxHxC) * reads_state_BxJx1xC  # from the chunk's start to each token
    values_BxJxHxCxV = solve(v_beta_BxJxHxCxV)
    state_keys_BxJxHxCxK = solve(k_beta_BxJxHxCxK * decay_in_BxJxHxC[..., None])
    attn_BxJxHxCxC = jnp.einsum("bjhik,bjhsk->bjhis", q_BxJxHxCxK, k_BxJxHxCxK) * decay_BxJxHxCxC
    q_state_BxJxHxCxK = q_BxJxHxCxK * decay_in_BxJxHxC[..., None]
    # What each chunk hands on: its last sequence's keys decayed to the chunk's end, and the carried state
    # decayed through the chunk when no reset lies in it.
    last_BxJxHx1 = cum_BxJxHxC[..., -1:]
    in_last_BxJx1xC = (seg_BxJxC == seg_BxJxC[:, :, -1:])[:, :, None, :]
    k_end_BxJxHxCxK = k_BxJxHxCxK * (jnp.exp(span_BxJxHxCxC[..., -1, :]) * in_last_BxJx1xC)[..., None]
    state_decay_BxJxH = jnp.exp(last_BxJxHx1[..., 0]) * reads_state_BxJx1xC[..., -1]

    def step(state_BxHxKxV: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        values, state_keys, attn, q_state, k_end, state_decay = xs
        v_new_BxHxCxV = values - jnp.einsum("bhck,bhkv->bhcv", state_keys, state_BxHxKxV)
        out_BxHxCxV = jnp.einsum("bhck,bhkv->bhcv", q_state, state_BxHxKxV) + jnp.einsum(
            "bhcs,bhsv->bhcv", attn, v_new_BxHxCxV
        )
        state_BxHxKxV = state_BxHxKxV * state_decay[..., None, None] + jnp.einsum(
            "bhck,bhcv->bhkv", k_end, v_new_BxHxCxV
        )
        return state_BxHxKxV, out_BxHxCxV

    xs = (values_BxJxHxCxV, state_keys_BxJxHxCxK, attn_BxJxHxCxC, q_state_BxJxHxCxK, k_end_BxJxHxCxK, state_decay_BxJxH)
    initial = _initial_state(initial_state_BxHxKxV, (b, h, kd, vd), v.dtype)
    # the chunk axis whole on every device: a prefill of fewer rows than devices left it to propagation, which
    # split the sequence (and so the chunks), and each step's chunk became an all-gather of every chunk (XLA:TPU,
    # Qwen3.5-35B-A3B's prefill of 4 x 28,672 over 32 chips: 448 gathers of 235-470 MB a linear layer)
    per_chunk = tuple(unsplit_axis(jnp.moveaxis(x, 1, 0), 0) for x in xs)
    state_BxHxKxV, out_JxBxHxCxV = jax.lax.scan(step, initial, per_chunk)
    out_BxTxHxV = jnp.moveaxis(out_JxBxHxCxV, 0, 1).swapaxes(2, 3).reshape(b, j * chunk, h, vd)[:, :t]
    return out_BxTxHxV.astype(v_BxTxHxV.dtype), state_BxHxKxV


def _delta_step(
    state_BxHxKxV: jax.Array,
    q_BxHxK: jax.Array,
    k_BxHxK: jax.Array,
    v_BxHxV: jax.Array,
    g_BxH: jax.Array,
    beta_BxH: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token of the rule on prepared (fp32, repeated, normalised) inputs: (new state, output)."""
    state_BxHxKxV = state_BxHxKxV * jnp.exp(g_BxH)[..., None, None]
    predicted_BxHxV = jnp.einsum("bhk,bhkv->bhv", k_BxHxK, state_BxHxKxV)
    delta_BxHxV = (v_BxHxV - predicted_BxHxV) * beta_BxH[..., None]
    state_BxHxKxV = state_BxHxKxV + k_BxHxK[..., :, None] * delta_BxHxV[..., None, :]
    return state_BxHxKxV, jnp.einsum("bhk,bhkv->bhv", q_BxHxK, state_BxHxKxV)


def gated_delta_step(
    q_BxNxK: jax.Array,
    k_BxNxK: jax.Array,
    v_BxHxV: jax.Array,
    g_BxH: jax.Array,
    beta_BxH: jax.Array,
    state_BxHxKxV: jax.Array,
    l2_normalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """One decoding step: the output [B, H, V] in v's dtype and the updated state [B, H, K, V] fp32."""
    q, k, v, g, beta = _prepare(q_BxNxK, k_BxNxK, v_BxHxV, g_BxH, beta_BxH, l2_normalize)
    state_BxHxKxV, out_BxHxV = _delta_step(state_BxHxKxV.astype(v.dtype), q, k, v, g, beta)
    return out_BxHxV.astype(v_BxHxV.dtype), state_BxHxKxV


def recurrent_gated_delta_rule(
    q_BxTxNxK: jax.Array,
    k_BxTxNxK: jax.Array,
    v_BxTxHxV: jax.Array,
    g_BxTxH: jax.Array,
    beta_BxTxH: jax.Array,
    reset_BxT: jax.Array | None = None,
    initial_state_BxHxKxV: jax.Array | None = None,
    l2_normalize: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """`chunk_gated_delta_rule` one token at a time (`gated_delta_step` under `lax.scan`): the reference
    form, and what a decode of several tokens computes."""
    b, t, _, kd = k_BxTxNxK.shape
    h, vd = v_BxTxHxV.shape[2:]
    prepared = _prepare(q_BxTxNxK, k_BxTxNxK, v_BxTxHxV, g_BxTxH, beta_BxTxH, l2_normalize)
    reset_BxT = jnp.zeros((b, t), bool) if reset_BxT is None else reset_BxT
    initial = _initial_state(initial_state_BxHxKxV, (b, h, kd, vd), prepared[2].dtype)

    def step(state_BxHxKxV: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        reset_B, *token = xs
        state_BxHxKxV = jnp.where(reset_B[:, None, None, None], 0.0, state_BxHxKxV)
        return _delta_step(state_BxHxKxV, *token)

    xs = (reset_BxT.T, *(jnp.moveaxis(x, 1, 0) for x in prepared))
    state_BxHxKxV, out_TxBxHxV = jax.lax.scan(step, initial, xs)
    return jnp.moveaxis(out_TxBxHxV, 0, 1).astype(v_BxTxHxV.dtype), state_BxHxKxV


def causal_conv1d(
    x_BxTxE: jax.Array,
    weight_WxE: jax.Array,
    reset_BxT: jax.Array | None = None,
    window_BxWxE: jax.Array | None = None,
) -> jax.Array:
    """Depthwise causal convolution over the length: y_t = sum_w weight_w * x_{t - (W-1) + w} [B, T, E],
    inputs of other sequences (before a reset) read as zero. `window` [B, W-1, E]: the inputs before the row
    (a decode slot's `conv_step` window), continuing the first sequence; zeros when None."""
    b, t, e = x_BxTxE.shape
    w = weight_WxE.shape[0]
    if window_BxWxE is None:
        window_BxWxE = jnp.zeros((b, w - 1, e), x_BxTxE.dtype)
    ext_BxTxE = jnp.concatenate([window_BxWxE.astype(x_BxTxE.dtype), x_BxTxE], axis=1)
    seg_BxT = _segment_ordinals(reset_BxT, (b, t))
    ext_seg_BxT = jnp.concatenate([jnp.zeros((b, w - 1), jnp.int32), seg_BxT], axis=1)
    y_BxTxE = jnp.zeros_like(x_BxTxE)
    for tap in range(w):
        same_BxTx1 = (ext_seg_BxT[:, tap : tap + t] == seg_BxT)[..., None]
        y_BxTxE = y_BxTxE + jnp.where(same_BxTx1, ext_BxTxE[:, tap : tap + t], 0) * weight_WxE[tap][None, None]
    return y_BxTxE


def conv_step(x_BxE: jax.Array, weight_WxE: jax.Array, window_BxWxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d` of one token per slot: the output [B, E] and the window [B, W-1, E] moved on by it."""
    ext_BxWxE = jnp.concatenate([window_BxWxE.astype(x_BxE.dtype), x_BxE[:, None]], axis=1)
    return jnp.einsum("bwe,we->be", ext_BxWxE, weight_WxE.astype(x_BxE.dtype)), ext_BxWxE[:, 1:]


def conv_window(x_BxTxE: jax.Array, lengths_B: jax.Array, width: int) -> jax.Array:
    """The `conv_step` window [B, W-1, E] after each right-padded row's first `lengths_B` inputs: its last W-1
    real inputs, zeros before the row's start."""
    index_BxW = lengths_B[:, None] - (width - 1) + jnp.arange(width - 1)[None, :]
    window_BxWxE = jnp.take_along_axis(x_BxTxE, jnp.maximum(index_BxW, 0)[..., None], axis=1)
    return jnp.where((index_BxW >= 0)[..., None], window_BxWxE, 0)
