"""LoRA dropout (`model.lora.dropout`): on the adapters' inputs in the policy update's forward alone (the log-prob
passes stay deterministic), the expectation of the dropped-out adapter equal to the adapter, a NumPy re-statement
with the same mask, a mask per micro-batch, and the config's named error."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError
from areal_jax.models.decoder import Decoder
from areal_jax.models.lora import LoRA, dropout, split_trainable
from areal_jax.models.lora_config import LoRAConfig
from areal_jax.objectives.stats import count_loss_tokens
from areal_jax.trainer import train_step
from areal_jax.trainer.batching import build_batch
from tests.test_lora_model import with_random_adapters
from tests.test_train_step import CONFIG, TEMPERATURE, TINY, make_trajectories, single_device_mesh

RATE = 0.3
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down"), dropout=RATE)
CFG = TINY.replace(num_layers=1, lora=LORA)


def _steps():
    """Train steps of the same random adapters without and with dropout, a placed copy of those adapters, and a
    mini-batch of two micro-batches on the mesh."""
    model = Decoder(CFG, nnx.Rngs(0))
    trainable, frozen = split_trainable(CFG, with_random_adapters(model, std=0.3))
    mesh = single_device_mesh()
    steps = {}
    for rate in (0.0, RATE):
        cfg = CFG.replace(lora=LORA.replace(dropout=rate))
        graphdef = nnx.graphdef(nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, nnx.Rngs(0))))
        steps[rate] = train_step.TrainStep(graphdef, trainable, CONFIG, mesh, temperature=TEMPERATURE, frozen=frozen)
    (mb, *_) = build_batch(make_trajectories(np.random.default_rng(0), 8), CONFIG).minibatches
    batch = steps[RATE].put_batch(mb)
    assert batch.tokens.shape[0] == 2
    return steps, steps[RATE].place(trainable), batch


def test_dropout_changes_the_update_alone_and_each_micro_batch_draws_its_own_mask():
    steps, params, batch = _steps()
    plain, dropped = steps[0.0], steps[RATE]
    assert dropped.uses_dropout and not plain.uses_dropout
    # the proximal / reference pass: the same program result with or without dropout configured
    prox = plain.logprobs(params, batch)
    np.testing.assert_array_equal(np.asarray(dropped.logprobs(params, batch)), np.asarray(prox))

    def gradients(step, seed):
        seed = None if seed is None else jnp.int32(seed)
        grads, _, stats = step._update_gradients(
            step.program, params, step.frozen, batch, prox, None, jnp.int32(0), seed
        )
        return np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(grads)]), float(stats["train/loss"])

    base_grads, base_loss = gradients(plain, None)
    once, loss_once = gradients(dropped, 11)
    again, _ = gradients(dropped, 11)
    other, _ = gradients(dropped, 12)
    np.testing.assert_array_equal(once, again)  # a seed's masks are a function of the seed
    assert loss_once != base_loss and not np.allclose(once, base_grads, atol=1e-6)
    assert not np.allclose(once, other, atol=1e-6)
    with pytest.raises(ValueError, match=r"dropout_seed is None but model\.lora\.dropout is > 0"):
        dropped.update(params, None, batch, prox, 0)

    # the two micro-batches' masks: micro-batch m's key is the seed's with m folded in
    program, frozen = dropped.program, dropped.frozen
    tokens = count_loss_tokens(batch.loss_mask)
    key = jax.random.key(11)

    def micro_loss(m, key_index, current=False):
        chosen = dataclasses.replace(program, prox_is_current=True) if current else program
        mb, prox_BxL = jax.tree.map(lambda x: x[m], batch), None if current else prox[m]
        mb_key = jax.random.fold_in(key, key_index)
        version = jnp.int32(0)
        return train_step._microbatch_loss(chosen, params, frozen, mb, prox_BxL, None, tokens, None, version, mb_key)[0]

    # each micro-batch under its own key; micro-batch 1's mask on micro-batch 0; a step's first update, which
    # computes log pi_prox itself (without dropout, so as the proximal pass does)
    losses = jax.jit(lambda: jnp.stack([micro_loss(0, 0), micro_loss(1, 1), micro_loss(0, 1), micro_loss(0, 0, True)]))
    by_index_0, by_index_1, swapped, current = (float(x) for x in losses())
    np.testing.assert_allclose(by_index_0 + by_index_1, loss_once, rtol=1e-6)
    assert swapped != by_index_0
    np.testing.assert_allclose(current, by_index_0, rtol=1e-6)


def test_dropped_out_adapter_matches_its_expectation_and_a_numpy_restatement():
    cfg = TINY.replace(lora=LORA.replace(targets=("q", "v")))
    with nnx.use_eager_sharding(False):  # as the decoder builds them: no mesh needed
        q, v = LoRA(cfg, "q", nnx.Rngs(lora=0)), LoRA(cfg, "v", nnx.Rngs(lora=1))
    for adapter, seed in ((q, 2), (v, 3)):  # a nonzero b, so the adapter's output is nonzero
        adapter.b[...] = 0.5 * jax.random.normal(jax.random.key(seed), adapter.b.shape)
    x = jax.random.normal(jax.random.key(4), (2, 5, cfg.hidden_size))
    exact = np.asarray(q(x), np.float64)
    assert np.abs(exact).max() > 0.1

    n = 4096
    keys = jax.random.split(jax.random.key(5), n)
    outs = np.asarray(jax.jit(jax.vmap(lambda k: q(x, k)))(keys), np.float64)
    # E[dropout(x)] = x and the adapter is linear in x: the mean over masks is the adapter without dropout
    stderr = outs.std(axis=0) / np.sqrt(n)
    assert np.all(np.abs(outs.mean(axis=0) - exact) < 5 * stderr + 1e-6)
    assert np.abs(outs - exact).max() > 0.1  # each mask alone moves it

    key = keys[0]
    kept = np.asarray(dropout(x, RATE, jax.random.fold_in(key, q.stream))) != 0
    assert abs(1 - kept.mean() - RATE) < 0.05
    a, b = np.asarray(q.a[...], np.float64), np.asarray(q.b[...], np.float64)
    x_np = np.asarray(x, np.float64) * kept / (1 - RATE)
    want = (x_np.reshape(-1, a.shape[0]) @ a @ b.reshape(a.shape[1], -1) * LORA.scale).reshape(exact.shape)
    np.testing.assert_allclose(np.asarray(q(x, key)), want, rtol=1e-5, atol=1e-5)
    # q and v of a layer see the same input with masks of their own (PEFT: a dropout module per projection)
    kept_v = np.asarray(dropout(x, RATE, jax.random.fold_in(key, v.stream))) != 0
    assert q.stream != v.stream and (kept != kept_v).any()


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_a_dropout_outside_0_1_is_refused_naming_the_key(value):
    with pytest.raises(
        ConfigError, match=rf"model\.lora\.dropout: value {value} is out of range; allowed: >= 0 and < 1"
    ):
        load_experiment(None, [f"model.lora.dropout={value}"])
