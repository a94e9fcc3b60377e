"""The optimizer: the lr schedule against NumPy, the lr as a named value of the optimizer state that
`train/lr` reports, weight decay by parameter kind, and non-finite updates skipped, kept out of the state
and counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from areal_jax.models.decoder import Decoder
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.config import OptimizerConfig
from areal_jax.trainer.optimizer import (
    applied_updates,
    decay_mask,
    learning_rate,
    learning_rate_schedule,
    make_optimizer,
)
from areal_jax.trainer.train_step import TrainStep
from tests.test_train_step import CONFIG, TEMPERATURE, TINY, make_trajectories, single_device_mesh, tiny_model_state


def np_schedule(config: OptimizerConfig, k: np.ndarray) -> np.ndarray:
    """NumPy restatement of OptimizerConfig's documented schedule: update k < warmup_steps uses
    lr * (k + 1) / warmup_steps; then constant, or a cosine reaching min_lr_ratio * lr at total_steps."""
    k = np.asarray(k, np.float64)
    factor = np.ones_like(k)
    if config.warmup_steps:
        factor = np.where(k < config.warmup_steps, (k + 1) / config.warmup_steps, 1.0)
    if config.schedule == "cosine":
        progress = np.clip((k - config.warmup_steps) / (config.total_steps - config.warmup_steps), 0.0, 1.0)
        factor = factor * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + np.cos(np.pi * progress)))
    return config.lr * factor


SCHEDULES = {
    "constant": OptimizerConfig(lr=3e-4),
    "constant_warmup_1": OptimizerConfig(lr=3e-4, warmup_steps=1),
    "constant_warmup_7": OptimizerConfig(lr=2.0, warmup_steps=7),
    "cosine": OptimizerConfig(lr=1e-3, schedule="cosine", total_steps=50),
    "cosine_warmup_1": OptimizerConfig(lr=1e-6, warmup_steps=1, schedule="cosine", total_steps=20, min_lr_ratio=0.3),
    "cosine_warmup_10": OptimizerConfig(lr=1.0, warmup_steps=10, schedule="cosine", total_steps=110, min_lr_ratio=0.1),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_matches_numpy(name):
    config = SCHEDULES[name]
    steps = np.arange(300)
    got = np.broadcast_to(np.asarray(learning_rate_schedule(config)(jnp.asarray(steps))), steps.shape)
    np.testing.assert_allclose(got, np_schedule(config, steps), rtol=2e-6, atol=1e-6 * config.lr)
    scalar = learning_rate_schedule(config)
    for k in (0, config.warmup_steps - 1, config.warmup_steps, 299):  # one count at a time, as the optimizer calls it
        np.testing.assert_allclose(float(scalar(jnp.int32(max(k, 0)))), np_schedule(config, max(k, 0)), rtol=2e-6)


def test_warmup_and_cosine_reach_their_documented_values():
    cosine = learning_rate_schedule(
        OptimizerConfig(lr=1.0, warmup_steps=4, schedule="cosine", total_steps=14, min_lr_ratio=0.1)
    )
    np.testing.assert_allclose([float(cosine(k)) for k in range(4)], [0.25, 0.5, 0.75, 1.0], rtol=1e-7)
    np.testing.assert_allclose([float(cosine(k)) for k in (9, 14, 100)], [0.1 + 0.9 * 0.5, 0.1, 0.1], rtol=1e-6)
    constant = learning_rate_schedule(OptimizerConfig(lr=2.0, warmup_steps=2))
    np.testing.assert_allclose([float(constant(k)) for k in (0, 1, 2, 50)], [1.0, 2.0, 2.0, 2.0], rtol=1e-7)


# -- weight decay by parameter kind ---------------------------------------------------------------------


def _name(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")


def decayed_paths(state: nnx.State) -> tuple[set[str], set[str]]:
    """(decayed, not decayed) parameter paths of `state`, read from the update the optimizer makes from a zero
    gradient: AdamW then moves exactly the decayed parameters, by -lr * weight_decay * p."""
    config = OptimizerConfig(lr=0.5, weight_decay=0.1)
    optimizer = make_optimizer(config, state)
    zeros = jax.tree.map(jnp.zeros_like, state)
    updates, _ = jax.jit(optimizer.update)(zeros, optimizer.init(state), state)
    decayed, kept = set(), set()
    for (path, update), param in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(state), strict=True):
        update, param = np.asarray(update), np.asarray(param)
        if np.any(update != 0):
            np.testing.assert_allclose(update, -0.05 * param, rtol=1e-6, atol=1e-12)
            decayed.add(_name(path))
        else:
            kept.add(_name(path))
    mask = {_name(path) for path, leaf in jax.tree_util.tree_leaves_with_path(decay_mask(state)) if leaf}
    assert mask == decayed
    return decayed, kept


KERNELS = {
    "embed",
    "layers.mlp.down",
    "layers.mlp.gate_up",
    "layers.o",
    "layers.qkv.kernel",
}
NORMS = {"final_norm.weight", "layers.input_norm.weight", "layers.post_attention_norm.weight"}


def test_weight_decay_on_qwen2_decays_kernels_and_embeddings_not_qkv_biases_or_norms():
    qwen2 = TINY.replace(family="qwen2", qkv_bias=True, qk_norm=False, tie_word_embeddings=False)
    state = nnx.state(Decoder(qwen2, nnx.Rngs(1)))
    decayed, kept = decayed_paths(state)
    assert decayed == KERNELS | {"lm_head"}
    assert kept == NORMS | {"layers.qkv.bias"}


def test_weight_decay_on_qwen3_skips_the_qk_norms():
    qwen3 = TINY.replace(family="qwen3", qkv_bias=False, qk_norm=True, tie_word_embeddings=True)
    state = nnx.state(Decoder(qwen3, nnx.Rngs(1)))
    decayed, kept = decayed_paths(state)
    assert decayed == KERNELS
    assert kept == NORMS | {"layers.qkv.q_norm.weight", "layers.qkv.k_norm.weight"}


class _Misnamed(nnx.Module):
    """A kernel whose name says 'norm' and a norm scale whose name says neither 'norm' nor 'bias'."""

    def __init__(self):
        with nnx.use_eager_sharding(False):
            self.norm_proj = nnx.Param(jnp.full((4, 8), 2.0), out_sharding=("embed", "mlp"))
            self.gain = nnx.Param(jnp.full((4,), 3.0), out_sharding=("norm",))


def test_weight_decay_follows_the_parameter_kind_not_its_name():
    decayed, kept = decayed_paths(nnx.state(_Misnamed()))
    assert decayed == {"norm_proj"} and kept == {"gain"}


# -- the lr in the optimizer state, and skipped updates -----------------------------------------------------

SCHEDULED = CONFIG.replace(
    optimizer=CONFIG.optimizer.replace(warmup_steps=3, schedule="cosine", total_steps=7, min_lr_ratio=0.2)
)


@pytest.fixture(scope="module")
def scheduled_step():
    graphdef, state = tiny_model_state()
    step = TrainStep(graphdef, state, SCHEDULED, single_device_mesh(), temperature=TEMPERATURE)
    (batch,) = build_batch(make_trajectories(np.random.default_rng(20), 8, lengths=(4, 24)), SCHEDULED).minibatches
    return step, batch


def _update(step: TrainStep, params, opt_state, batch):
    device_batch = step.put_batch(batch)
    return step.update(params, opt_state, device_batch, step.logprobs(params, device_batch), 0)


def test_train_lr_is_the_lr_in_the_optimizer_state_at_the_update_count(scheduled_step):
    step, batch = scheduled_step
    params, opt_state = step.init(tiny_model_state()[1])
    assert int(applied_updates(opt_state)) == 0
    np.testing.assert_allclose(float(learning_rate(opt_state)), np_schedule(SCHEDULED.optimizer, 0), rtol=1e-6)
    for k in range(9):
        params, opt_state, stats = _update(step, params, opt_state, batch)
        assert float(stats["train/skipped_updates"]) == 0.0
        np.testing.assert_allclose(float(stats["train/lr"]), np_schedule(SCHEDULED.optimizer, k), rtol=1e-6)
        assert float(learning_rate(opt_state)) == float(stats["train/lr"])
        assert int(applied_updates(opt_state)) == k + 1


def test_non_finite_update_is_skipped_state_unchanged_and_counted(scheduled_step):
    step, batch = scheduled_step
    params, opt_state = step.init(tiny_model_state()[1])
    params, opt_state, stats_0 = _update(step, params, opt_state, batch)
    nan_batch = batch._replace(advantages=np.where(batch.loss_mask, np.nan, batch.advantages).astype(np.float32))
    params_before, opt_before = jax.device_get((params, opt_state))

    params, opt_state, stats = _update(step, params, opt_state, nan_batch)
    assert float(stats["train/skipped_updates"]) == 1.0 and not np.isfinite(float(stats["train/loss"]))
    assert float(stats["train/lr"]) == float(stats_0["train/lr"])  # the schedule did not advance
    for before, after in zip(jax.tree.leaves(params_before), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(after), before)
    # everything but apply_if_finite's own counters: Adam moments and counts, the injected lr
    for before, after in zip(
        jax.tree.leaves(opt_before.inner_state), jax.tree.leaves(opt_state.inner_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(after), before)
    assert int(optax.tree_utils.tree_get(opt_state, "total_notfinite")) == 1
    assert int(applied_updates(opt_state)) == 1

    params, opt_state, stats = _update(step, params, opt_state, batch)
    assert float(stats["train/skipped_updates"]) == 0.0
    np.testing.assert_allclose(float(stats["train/lr"]), np_schedule(SCHEDULED.optimizer, 1), rtol=1e-6)
    assert int(applied_updates(opt_state)) == 2
    assert int(optax.tree_utils.tree_get(opt_state, "total_notfinite")) == 1
