"""The decoder's three call paths agree: packed forward, chunked log-probs, prefill + decode."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.attention import xla_attention
from areal_jax.models.config import UNROLL_MAX_LAYERS_CPU, ModelConfig
from areal_jax.models.decoder import Decoder, KVCache
from areal_jax.models.layers import gated_projection
from tests.engine_fixtures import cached_keys

CFG = ModelConfig(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    initializer_range=0.2,
    logprob_chunk=7,
)


def _alone(model, seq):
    n = len(seq)
    return model.logits(jnp.asarray([seq]), jnp.ones((1, n), jnp.int32), jnp.arange(n)[None])[0]


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, nnx.Rngs(3))


def test_packed_row_equals_each_sequence_alone(model):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (6, 11, 3)]
    width = 24
    tokens = np.zeros((1, width), np.int32)
    segments = np.zeros_like(tokens)
    positions = np.zeros_like(tokens)
    offset = 0
    for i, seq in enumerate(seqs):
        tokens[0, offset : offset + len(seq)] = seq
        segments[0, offset : offset + len(seq)] = i + 1
        positions[0, offset : offset + len(seq)] = np.arange(len(seq))
        offset += len(seq)
    packed = model.logits(jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions))
    assert not np.isnan(np.asarray(packed)).any()
    offset = 0
    for seq in seqs:
        np.testing.assert_allclose(packed[0, offset : offset + len(seq)], _alone(model, seq), atol=2e-5)
        offset += len(seq)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_log_softmax(model, temperature):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 20)), jnp.int32)  # 20 is not a multiple of 7
    targets = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 20)), jnp.int32)
    segments = jnp.ones((3, 20), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(20), (3, 20))
    logp, entropy = model.token_logprobs(tokens, targets, segments, positions, temperature)
    logits = np.asarray(model.logits(tokens, segments, positions), np.float64) / temperature
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    log_probs = logits - logz[..., None]
    expected = np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, expected, atol=2e-5)
    np.testing.assert_allclose(entropy, -(np.exp(log_probs) * log_probs).sum(-1), atol=2e-5)


def test_prefill_then_decode_reproduces_full_forward(model):
    rng = np.random.default_rng(2)
    lengths = [4, 9]
    total = 14
    seqs = [rng.integers(0, CFG.vocab_size, total).tolist() for _ in lengths]
    prompt = np.zeros((2, 16), np.int32)
    for row, n in enumerate(lengths):
        prompt[row, :n] = seqs[row][:n]
    last_logits, prefix = model.prefill(jnp.asarray(prompt), jnp.asarray(lengths))
    full = [_alone(model, s) for s in seqs]
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(last_logits[row], full[row][n - 1], atol=2e-5)
    cache = KVCache.zeros(CFG, batch=2, length=32).put_rows(prefix, jnp.arange(2))
    positions = np.array(lengths)
    for _ in range(total - max(lengths)):
        tokens = jnp.asarray([seqs[row][positions[row]] for row in range(2)])
        logits, cache = model.decode_step(tokens, jnp.asarray(positions), cache)
        for row in range(2):
            np.testing.assert_allclose(logits[row], full[row][positions[row]], atol=3e-5)
        positions = positions + 1


def test_decode_step_jitted_with_donated_cache_equals_eager(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, cache):
        return nnx.merge(graphdef, state).decode_step(tokens, positions, cache)

    step_donating = jax.jit(step.__wrapped__, donate_argnums=(3,))
    cache = KVCache.zeros(CFG, batch=3, length=8)
    tokens, positions = jnp.asarray([1, 2, 3]), jnp.asarray([0, 3, 5])
    expected_logits, expected_cache = step(state, tokens, positions, cache)
    logits, new_cache = step_donating(state, tokens, positions, KVCache.zeros(CFG, batch=3, length=8))
    np.testing.assert_array_equal(logits, expected_logits)
    np.testing.assert_array_equal(cached_keys(new_cache), cached_keys(expected_cache))
    written = cached_keys(new_cache)[:, [0, 1, 2], [0, 3, 5]]
    assert np.abs(written).sum() > 0
    untouched = cached_keys(new_cache).copy()
    untouched[:, [0, 1, 2], [0, 3, 5]] = 0
    assert np.abs(untouched).sum() == 0


@pytest.mark.parametrize("attend_length", [None, 8])
def test_decode_step_neither_copies_nor_transposes_the_cache(model, attend_length):
    """Every instruction of the compiled (donated) step that yields a cache array is a parameter, the
    in-place write (a scatter, or with XLA:CPU's classic emitters, the suite's (tests/xla_flags.py), a
    dynamic-update-slice, each alone or as a fusion's root), or plumbing: no copy, transpose or slice of the
    cache, also when it attends to the segments covering a prefix only."""
    graphdef, state = nnx.split(model)

    def step(state, layers, tokens, positions, cache):
        return nnx.merge(graphdef, state).decode_step(tokens, positions, cache, attend_length, layers)

    cache = KVCache.zeros(CFG, batch=3, length=16, first_segment=4)  # segments end at 4, 8, 16
    args = (state, model.layer_states(), jnp.asarray([1, 2, 3]), jnp.asarray([0, 3, 5]), cache)
    hlo = jax.jit(step, donate_argnums=(4,)).lower(*args).compile().as_text()
    shapes = {",".join(map(str, a.shape)) for a in jax.tree.leaves(cache)}
    producers = re.findall(r"= f32\[([\d,]+)\]\{[\d,]+\} ([\w-]+)\(([^)]*)\)", hlo)
    kinds = {kind for shape, kind, _ in producers if shape in shapes}
    assert kinds <= {"parameter", "fusion", "bitcast", "get-tuple-element", "scatter", "dynamic-update-slice"}, kinds
    fusions = re.findall(r"%(\S+) = f32\[([\d,]+)\]\{[\d,]+\} fusion\(", hlo)
    writes = [name for name, shape in fusions if shape in shapes]  # fusions rooted at an in-place write
    assert writes and all("scatter" in name or "dynamic-update-slice" in name for name in writes), fusions


def test_remat_and_unrolled_layers_keep_value_and_gradient():
    def loss(cfg):
        model = Decoder(cfg, nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        tokens = jnp.arange(12, dtype=jnp.int32)[None] % cfg.vocab_size
        seg = jnp.ones((1, 12), jnp.int32)
        pos = jnp.arange(12)[None]

        def f(state):
            logp, _ = nnx.merge(graphdef, state).token_logprobs(tokens, jnp.roll(tokens, -1), seg, pos)
            return logp.sum()

        return jax.value_and_grad(f)(state)

    v0, g0 = loss(CFG)
    for variant in (CFG.replace(remat="full"), CFG.replace(remat="dots"), CFG.replace(scan_layers=True)):
        v1, g1 = loss(variant)
        np.testing.assert_allclose(v1, v0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_gated_projection_gradient_equals_autodiff_of_the_formula_also_tensor_sharded():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 6, 16)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((16, 2, 24)) * 0.3, jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((4, 6, 24)), jnp.float32)

    def formula(x, kernel):  # the plain fused form, differentiated by JAX
        gate_up = jnp.einsum("btd,dcf->btcf", x, kernel)
        return jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]

    expected_out, expected_vjp = jax.vjp(formula, x, kernel)
    expected = expected_vjp(d_out)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    split_f = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tensor"))
    for placed in (kernel, jax.device_put(kernel, split_f)):  # F split over `tensor` as the sharding rules do
        out, vjp = jax.jit(lambda x, k: jax.vjp(gated_projection, x, k))(x, placed)
        np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
        for got, want in zip(jax.jit(vjp)(d_out), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_compute_is_close_to_fp32():
    fp32 = Decoder(CFG, nnx.Rngs(5))
    bf16 = Decoder(CFG.replace(param_dtype="bfloat16", compute_dtype="bfloat16"), nnx.Rngs(5))
    assert nnx.state(bf16)["embed"][...].dtype == jnp.bfloat16
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    seg, pos = jnp.ones((1, 10), jnp.int32), jnp.arange(10)[None]
    a = fp32.logits(tokens, seg, pos)
    b = bf16.logits(tokens, seg, pos)
    assert b.dtype == jnp.float32
    np.testing.assert_allclose(b, a, atol=0.1)
    assert float(jnp.abs(b - a).max()) > 0  # bf16 really changed the numerics


@pytest.mark.parametrize("first_segment", [None, 4])  # one segment (prefix sliced); segments ending at 4, 8, 16, 32
def test_decode_reading_a_cache_prefix_equals_reading_all(model, first_segment):
    rng = np.random.default_rng(4)
    shape = (CFG.num_layers, 3, 32, CFG.num_kv_heads, CFG.resolved_head_dim)
    cache = KVCache.from_entries(
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        jnp.asarray(rng.standard_normal(shape), jnp.float32),
        first_segment,
    )
    tokens, positions = jnp.asarray([1, 2, 3]), jnp.asarray([0, 5, 7])
    full_logits, full_cache = model.decode_step(tokens, positions, cache)
    short_logits, short_cache = model.decode_step(tokens, positions, cache, attend_length=8)
    np.testing.assert_allclose(short_logits, full_logits, atol=1e-5)  # summation order differs
    np.testing.assert_allclose(cached_keys(short_cache), cached_keys(full_cache), atol=1e-5)


def _numpy_row_attention(q, k, v, segments, positions):
    """Reference: each query's softmax over the keys of its own segment at positions not after its own."""
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for row in range(b):
        for i in range(t):
            if segments[row, i] == 0:
                continue
            keys = [
                j for j in range(t) if segments[row, j] == segments[row, i] and positions[row, j] <= positions[row, i]
            ]
            for head in range(n):
                scores = np.array([q[row, i, head] @ k[row, j, head // group] for j in keys]) / np.sqrt(h)
                weights = np.exp(scores - scores.max())
                out[row, i, head] = (weights / weights.sum()) @ v[row, keys, head // group]
    return out


def test_blocked_row_attention_equals_numpy_and_unblocked_gradients():
    """Rows of packed segments crossing block boundaries (and right padding): blocks of 8 queries against
    the keys up to each block's end give the reference attention, and the gradients of one unblocked call."""
    rng = np.random.default_rng(5)
    b, t, n, k, h = 2, 29, 4, 2, 8
    segments = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    for row, lengths in enumerate([(5, 13, 9), (20, 6)]):
        offset = 0
        for segment, length in enumerate(lengths, start=1):
            segments[row, offset : offset + length] = segment
            positions[row, offset : offset + length] = np.arange(length)
            offset += length
    q, key, value = (rng.standard_normal((b, t, heads, h)).astype(np.float32) for heads in (n, k, k))
    real = segments[:, :, None, None] > 0
    attention = jax.jit(xla_attention, static_argnames="block")
    blocked = attention(q, key, value, segment_ids=segments, positions=positions, block=8)
    np.testing.assert_allclose(
        np.where(real, blocked, 0), _numpy_row_attention(q, key, value, segments, positions), atol=1e-5
    )

    def loss(block, *qkv):
        out = xla_attention(*qkv, segment_ids=segments, positions=positions, block=block)
        return jnp.sum(jnp.where(real, out, 0) * jnp.cos(jnp.arange(h))[None, None, None])

    grad = jax.jit(jax.grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    grads_blocked, grads_whole = grad(8, q, key, value), grad(t, q, key, value)
    for got, want in zip(grads_blocked, grads_whole, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_unrolled_layers_compile_without_a_loop():
    def hlo(cfg: ModelConfig) -> str:
        graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(0)))
        tokens = jnp.zeros((1, 8), jnp.int32)
        seg, pos = jnp.ones((1, 8), jnp.int32), jnp.arange(8)[None]
        forward = jax.jit(lambda s: nnx.merge(graphdef, s).hidden_states(tokens, seg, pos))
        return forward.lower(state).as_text()

    assert "stablehlo.while" in hlo(CFG.replace(scan_layers=True))
    assert "stablehlo.while" not in hlo(CFG.replace(scan_layers=False))
    assert "stablehlo.while" not in hlo(CFG)  # auto on CPU: this shallow model is unrolled


def test_scan_layers_auto_unrolls_only_shallow_models_on_cpu():
    deep = CFG.replace(num_layers=UNROLL_MAX_LAYERS_CPU + 1)
    shallow = CFG.replace(num_layers=UNROLL_MAX_LAYERS_CPU)
    assert (shallow.scans_layers("cpu"), deep.scans_layers("cpu")) == (False, True)
    assert (shallow.scans_layers("tpu"), shallow.scans_layers("gpu")) == (True, True)
    assert CFG.replace(scan_layers=True).scans_layers("cpu") and not CFG.replace(scan_layers=False).scans_layers("tpu")
