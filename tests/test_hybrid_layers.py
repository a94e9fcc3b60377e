"""Qwen3.5's serving pieces: a right-padded prefill, then decode steps one token per slot, give the packed
forward's outputs (the Gated DeltaNet layer alone, and the whole model with its KV cache beside the recurrent
states and convolution windows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.gated_delta import conv_window
from areal_jax.models.hybrid import GatedDeltaNet, HybridDecoder
from areal_jax.models.hybrid_config import HybridConfig
from areal_jax.models.hybrid_serving import decode_step, prefill

CFG = ModelConfig(
    family="qwen3_5",
    num_layers=1,
    hidden_size=16,
    num_heads=2,
    num_kv_heads=1,
    qkv_bias=False,
    initializer_range=0.3,
    hybrid=HybridConfig(layer_types=("linear_attention",), linear_key_head_dim=4, linear_value_head_dim=3, chunk=4),
)


def test_prefill_then_decode_equals_the_packed_forward():
    with nnx.use_eager_sharding(False):
        mixer = GatedDeltaNet(CFG, nnx.Rngs(0))
    graphdef, state = nnx.split(mixer)
    x_BxTxD = jnp.asarray(np.random.default_rng(0).normal(size=(2, 14, 16)), jnp.float32)
    lengths_B = jnp.array([5, 9])
    reset_BxT = jnp.zeros((2, 14), bool).at[:, 0].set(True)

    whole = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, reset_BxT))(state, x_BxTxD)
    # the prompts right-padded with garbage past their lengths
    prompts = jnp.where(jnp.arange(11)[None, :, None] < lengths_B[:, None, None], x_BxTxD[:, :11], 7.0)
    prefilled, recurrent, window = jax.jit(lambda s, x: nnx.merge(graphdef, s).prefill(x, lengths_B))(state, prompts)
    for row, n in enumerate(lengths_B.tolist()):
        np.testing.assert_allclose(prefilled[row, :n], whole[row, :n], atol=1e-5, rtol=0)
    decode = jax.jit(lambda s, x, h, w: nnx.merge(graphdef, s).decode(x, h, w))
    rows = jnp.arange(2)
    for i in range(5):
        out, recurrent, window = decode(state, x_BxTxD[rows, lengths_B + i][:, None], recurrent, window)
        np.testing.assert_allclose(out[:, 0], whole[rows, lengths_B + i], atol=1e-5, rtol=0)


def test_conv_window_is_the_last_inputs_before_the_length():
    x_BxTxE = jnp.arange(2 * 6 * 1, dtype=jnp.float32).reshape(2, 6, 1) + 1
    window = conv_window(x_BxTxE, jnp.array([2, 6]), width=4)
    np.testing.assert_array_equal(window[..., 0], [[0, 1, 2], [10, 11, 12]])


@pytest.mark.slow  # compiles a 3-layer prefill and decode step
def test_model_prefill_then_decode_equals_the_packed_logits():
    """Right-padded prompts prefilled, then 4 tokens decoded per slot against the recurrent states, convolution
    windows and KV cache: the logits the packed forward gives at those positions."""
    cfg = CFG.replace(
        num_layers=3,
        head_dim=8,
        vocab_size=50,
        hybrid=CFG.hybrid.replace(layer_types=("linear_attention", "full_attention", "linear_attention")),
    )
    with nnx.use_eager_sharding(False):
        model = HybridDecoder(cfg, nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    tokens_BxT = jnp.asarray(np.random.default_rng(2).integers(0, 50, size=(2, 13)), jnp.int32)
    lengths_B = jnp.array([6, 9])
    positions_BxT = jnp.broadcast_to(jnp.arange(13)[None, :], (2, 13))
    whole = jax.jit(lambda s: nnx.merge(graphdef, s).logits(tokens_BxT, jnp.ones_like(tokens_BxT), positions_BxT))(
        state
    )
    # the cache is as long as prompt + decoded tokens; the prompts' padding is garbage
    prompts = jnp.where(positions_BxT < lengths_B[:, None], tokens_BxT, 3)
    logits, cache = jax.jit(lambda s: prefill(nnx.merge(graphdef, s), prompts, lengths_B, first_segment=4))(state)
    rows = jnp.arange(2)
    np.testing.assert_allclose(logits, whole[rows, lengths_B - 1], atol=1e-4, rtol=0)
    step = jax.jit(lambda s, tokens, positions, c: decode_step(nnx.merge(graphdef, s), tokens, positions, c))
    for i in range(4):
        logits, cache = step(state, tokens_BxT[rows, lengths_B + i], lengths_B + i, cache)
        np.testing.assert_allclose(logits, whole[rows, lengths_B + i], atol=1e-4, rtol=0)
