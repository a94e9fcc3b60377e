"""KL to a frozen reference policy in the trainer: the loss term (`ppo.kl_coef`) and the reward shaping
(`advantage.kl_reward_coef`) against NumPy on a tiny model, the reference params frozen and outside the
optimizer, coefficients of 0 leaving the loss as it was, and a KL coefficient without reference params
refused."""

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.models.decoder import Decoder
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.train_step import TrainStep
from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import (
    CONFIG,
    TEMPERATURE,
    TINY,
    loss_and_gradient,
    make_trajectories,
    single_device_mesh,
    tiny_model_state,
)

KL_LOSS = CONFIG.replace(ppo=CONFIG.ppo.replace(kl_coef=0.2, kl_estimator="k2"))
KL_REWARD = CONFIG.replace(advantage=CONFIG.advantage.replace(kl_reward_coef=0.3, kl_estimator="k3"))
KL_BOTH = CONFIG.replace(ppo=CONFIG.ppo.replace(kl_coef=0.1), advantage=CONFIG.advantage.replace(kl_reward_coef=0.05))


def perturbed(state: nnx.State, scale: float = 0.02, seed: int = 0) -> nnx.State:
    """A reference policy near `state`: every parameter plus scale * N(0, 1) noise."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    )


def np_kl(logp: np.ndarray, logp_ref: np.ndarray, estimator: str) -> np.ndarray:
    log_r = logp_ref.astype(np.float64) - logp.astype(np.float64)
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}[estimator]


def np_return_to_go(x: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """out[..., t] = sum of x over t' >= t in the same segment of the same row."""
    out = np.zeros_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        row, segments = x[index], segment_ids[index]
        for segment in np.unique(segments[segments > 0]):
            (cols,) = np.nonzero(segments == segment)
            out[index][cols] = np.cumsum(row[cols][::-1])[::-1]
    return out


@pytest.fixture(scope="module")
def setup():
    """The tiny model's params on the mesh, a reference near them, one packed batch, and the KL-free step."""
    graphdef, state = tiny_model_state()
    base = TrainStep(graphdef, state, CONFIG, single_device_mesh(), temperature=TEMPERATURE)
    params, _ = base.init(state)
    reference = base.place(perturbed(state))
    (batch,) = build_batch(make_trajectories(np.random.default_rng(30), 8, lengths=(4, 24)), CONFIG).minibatches
    device_batch = base.put_batch(batch)
    logp = base.logprobs(params, device_batch)  # the proximal log-probs, and logp_theta at these params
    logp_ref = base.logprobs(reference, device_batch)
    return base, params, batch, device_batch, logp, logp_ref


def test_kl_loss_term_matches_numpy_in_value_and_gradient(setup):
    base, params, batch, device_batch, logp, logp_ref = setup
    graphdef, state = tiny_model_state()
    step = TrainStep(graphdef, state, KL_LOSS, single_device_mesh(), temperature=TEMPERATURE)
    loss, grads, stats = loss_and_gradient(step, params, device_batch, logp, 0, logp_ref)
    loss_0, grads_0, stats_0 = loss_and_gradient(base, params, device_batch, logp)

    mask = batch.loss_mask
    kl = np_kl(np.asarray(logp), np.asarray(logp_ref), "k2")
    term = KL_LOSS.ppo.kl_coef * np.sum(kl[mask]) / mask.sum()
    assert term > 1e-4
    np.testing.assert_allclose(float(stats["kl/kl_loss"]), term, rtol=1e-5)
    np.testing.assert_allclose(float(stats["kl/kl_mean"]), kl[mask].mean(), rtol=1e-5)
    assert float(stats["kl/n_tokens"]) == mask.sum()
    np.testing.assert_allclose(float(loss) - float(loss_0), term, rtol=1e-4)
    np.testing.assert_allclose(float(stats["ppo/pg_loss"]), float(stats_0["ppo/pg_loss"]), rtol=1e-6)

    # the gradient of the KL term: its directional derivative (NumPy, finite differences) along the
    # gradient is its norm, along a random direction the inner product
    g_kl = jax.tree.map(lambda a, b: a - b, grads, grads_0)
    g_norm = float(optax.tree.norm(g_kl))
    assert g_norm > 0

    def kl_term(p: nnx.State) -> float:
        logp_p = np.asarray(base.logprobs(p, device_batch))
        return KL_LOSS.ppo.kl_coef * np.sum(np_kl(logp_p, np.asarray(logp_ref), "k2")[mask]) / mask.sum()

    leaves, treedef = jax.tree.flatten(g_kl)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    random = jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)])
    random_norm = optax.tree.norm(random)
    random = jax.tree.map(lambda x: x / random_norm, random)
    h = 1e-2
    for direction in (jax.tree.map(lambda g: g / g_norm, g_kl), random):
        plus = kl_term(jax.tree.map(lambda p, d: p + h * d, params, direction))
        minus = kl_term(jax.tree.map(lambda p, d: p - h * d, params, direction))
        slope = float(optax.tree.vdot(g_kl, direction))
        np.testing.assert_allclose((plus - minus) / (2 * h), slope, rtol=1e-2, atol=1e-4 * g_norm)
    assert kl_term(jax.tree.map(lambda p, g: p - 0.1 * g / g_norm, params, g_kl)) < kl_term(params)


def test_kl_reward_shaping_matches_numpy_and_is_ppo_on_the_shaped_advantages(setup):
    base, params, batch, device_batch, logp, logp_ref = setup
    graphdef, state = tiny_model_state()
    step = TrainStep(graphdef, state, KL_REWARD, single_device_mesh(), temperature=TEMPERATURE)
    loss, grads, stats = loss_and_gradient(step, params, device_batch, logp, 0, logp_ref)

    mask, coef = batch.loss_mask, KL_REWARD.advantage.kl_reward_coef
    kl = np.where(mask, np_kl(np.asarray(logp), np.asarray(logp_ref), "k3"), 0.0)
    shaped = np.where(mask, batch.advantages - coef * np_return_to_go(kl, batch.segment_ids), 0.0)
    assert np.max(np.abs(shaped - np.where(mask, batch.advantages, 0.0))) > 1e-3
    np.testing.assert_allclose(float(stats["kl_reward/kl_mean"]), kl[mask].mean(), rtol=1e-5)
    assert float(stats["kl_reward/n_tokens"]) == mask.sum()
    # at the proximal params u = 1, so the loss is -sum(w * A') / n with w = pi_prox / pi_behav
    w = np.exp(np.asarray(logp, np.float64) - batch.logp_behav)
    np.testing.assert_allclose(float(loss), -np.sum((w * shaped)[mask]) / mask.sum(), rtol=1e-5)

    shaped_batch = base.put_batch(batch._replace(advantages=shaped.astype(np.float32)))
    loss_s, grads_s, _ = loss_and_gradient(base, params, shaped_batch, logp)
    np.testing.assert_allclose(float(loss), float(loss_s), rtol=1e-6)
    for g, g_s in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_s), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_s), atol=1e-6, rtol=0)


def test_reference_params_stay_frozen_outside_the_optimizer():
    graphdef, state = tiny_model_state()
    reference = perturbed(state, seed=2)
    reference_host = jax.device_get(reference)
    trainer = Trainer(
        nnx.merge(graphdef, state), KL_BOTH, single_device_mesh(), temperature=TEMPERATURE, reference_params=reference
    )
    rng = np.random.default_rng(31)
    for _ in range(2):
        stats = trainer.step(make_trajectories(rng, 8, lengths=(4, 24), version=trainer.version))
        assert stats["train/skipped_updates"] == 0 and np.isfinite(stats["train/loss"])
        assert stats["kl/kl_loss"] > 0 and stats["kl/n_tokens"] == stats["ppo/n_tokens"]
        assert np.isfinite(stats["kl_reward/kl_mean"]) and stats["kl_reward/n_tokens"] == stats["ppo/n_tokens"]
    leaves = zip(
        jax.tree.leaves(reference_host),
        jax.tree.leaves(trainer.reference_params),
        jax.tree.leaves(trainer.params),
        jax.tree.leaves(reference),
        jax.tree.leaves(state),
        strict=True,
    )
    for host, placed, trained, given, initial in leaves:
        np.testing.assert_array_equal(np.asarray(placed), host)
        np.testing.assert_array_equal(np.asarray(given), host)  # the caller's arrays are still valid
        assert placed.sharding == trained.sharding
        assert not np.array_equal(np.asarray(trained), np.asarray(initial))  # the policy did train
    params_def = jax.tree.structure(trainer.params)
    like_params = [
        node
        for node in jax.tree.leaves(trainer.opt_state, is_leaf=lambda x: jax.tree.structure(x) == params_def)
        if jax.tree.structure(node) == params_def
    ]
    assert len(like_params) == 2  # Adam's mu and nu, nothing of the reference


def test_zero_kl_coefficients_leave_the_step_exactly_as_without_a_reference():
    graphdef, state = tiny_model_state()
    trajectories = make_trajectories(np.random.default_rng(32), 8, lengths=(4, 24))
    plain = Trainer(nnx.merge(graphdef, state), CONFIG, single_device_mesh(), temperature=TEMPERATURE)
    given = Trainer(
        nnx.merge(graphdef, state),
        CONFIG,
        single_device_mesh(),
        temperature=TEMPERATURE,
        reference_params=perturbed(state),
    )
    assert given.reference_params is None  # not kept: nothing reads it
    stats_plain, stats_given = plain.step(trajectories), given.step(trajectories)
    timing = {"train/step_time", "train/throughput"}
    assert stats_given.keys() == stats_plain.keys() and not any(key.startswith("kl") for key in stats_plain)
    assert {k: v for k, v in stats_given.items() if k not in timing} == {
        k: v for k, v in stats_plain.items() if k not in timing
    }
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(given.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "key, config",
    [
        ("ppo.kl_coef", CONFIG.replace(ppo=CONFIG.ppo.replace(kl_coef=0.1))),
        ("advantage.kl_reward_coef", CONFIG.replace(advantage=CONFIG.advantage.replace(kl_reward_coef=0.1))),
    ],
)
def test_kl_coefficient_without_reference_params_is_refused(key, config):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(TINY, nnx.Rngs(0))))
    message = re.escape(key) + r": is 0\.1 but the Trainer was built without reference_params; the run must pass"
    with pytest.raises(ConfigError, match=message):
        Trainer(nnx.merge(graphdef, state), config, single_device_mesh(), temperature=TEMPERATURE)


def test_reference_params_of_another_model_are_refused():
    graphdef, state = tiny_model_state()
    other = nnx.state(nnx.eval_shape(lambda: Decoder(TINY.replace(qk_norm=True), nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"reference_params do not have the structure.*q_norm"):
        Trainer(
            nnx.merge(graphdef, state), KL_LOSS, single_device_mesh(), temperature=TEMPERATURE, reference_params=other
        )
    wider = nnx.state(nnx.eval_shape(lambda: Decoder(TINY.replace(vocab_size=80), nnx.Rngs(0))))
    with pytest.raises(ValueError, match=r"reference_params\['embed'\].* has shape \(80, 32\)"):
        Trainer(
            nnx.merge(graphdef, state), KL_LOSS, single_device_mesh(), temperature=TEMPERATURE, reference_params=wider
        )
