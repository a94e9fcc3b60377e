"""The engine's serving copy of the weights: matmul weights in the compute dtype, norm scales as they are; it
changes no result of any call path, and the engine stores it."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder, KVCache
from areal_jax.models.serving_weights import cast_for_serving, is_norm_scale, needs_cast

CFG = ModelConfig(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, qk_norm=True
)


def _bf16_compute(seed: int = 0) -> Decoder:
    model = Decoder(CFG.replace(compute_dtype="bfloat16"), nnx.Rngs(seed))
    # norm scales away from 1 and off the bf16 grid: a cast of them would show in every output
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.013 * jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) if is_norm_scale(path) else x,
        nnx.state(model),
    )
    nnx.update(model, state)
    return model


def test_matmul_weights_are_cast_and_norm_scales_kept():
    model = _bf16_compute()
    state = nnx.state(model)
    assert needs_cast(state, model.config) and not needs_cast(nnx.state(Decoder(CFG, nnx.Rngs(0))), CFG)
    served = cast_for_serving(state, model.config)
    flat = dict(jax.tree_util.tree_flatten_with_path(served)[0])
    norms = [path for path in flat if is_norm_scale(path)]
    assert len(norms) == 5  # input, post-attention, q and k norms (each stacked over layers) and the final norm
    for path, leaf in flat.items():
        assert leaf.dtype == (jnp.float32 if is_norm_scale(path) else jnp.bfloat16), jax.tree_util.keystr(path)


def test_serving_copy_changes_no_result():
    model = _bf16_compute()
    served = nnx.merge(nnx.graphdef(model), cast_for_serving(nnx.state(model), model.config))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 12)), jnp.int32)
    seg, pos = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(12), (2, 12))
    np.testing.assert_array_equal(model.logits(tokens, seg, pos), served.logits(tokens, seg, pos))
    lengths = jnp.asarray([12, 7], jnp.int32)
    (want, want_cache), (got, got_cache) = model.prefill(tokens, lengths), served.prefill(tokens, lengths)
    np.testing.assert_array_equal(want, got)
    for a, b in zip(jax.tree.leaves(want_cache), jax.tree.leaves(got_cache), strict=True):
        np.testing.assert_array_equal(a, b)
    cache = KVCache.zeros(model.config, 2, 16)
    np.testing.assert_array_equal(
        model.decode_step(tokens[:, 0], lengths - 1, cache)[0], served.decode_step(tokens[:, 0], lengths - 1, cache)[0]
    )


def test_the_engine_stores_the_serving_copy():
    model = _bf16_compute()
    engine = Engine(model, EngineConfig(max_slots=2, max_length=32, min_prefill_bucket=8))
    params = engine.load_params(nnx.state(model), 0)
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(params.state)}
    assert dtypes == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params.state))
    assert weight_bytes < 0.6 * sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))
    fp32 = Decoder(CFG, nnx.Rngs(0))  # fp32 compute: stored as given
    stored = Engine(fp32, engine.config).load_params(nnx.state(fp32), 0).state
    assert {leaf.dtype for leaf in jax.tree.leaves(stored)} == {jnp.dtype(jnp.float32)}
