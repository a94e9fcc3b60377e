"""Proximal log-probs without the forward pass (`ppo.prox_logp_method`): AReaL's loglinear weight on hand-worked
versions, each method against a NumPy re-statement, all methods equal on on-policy tokens, and the skipped pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.objectives.config import PPOConfig
from areal_jax.objectives.prox import APPROXIMATIONS, approximate_prox_logp, loglinear_alpha, prox_approximation_stats
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.train_step import TrainStep
from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import CONFIG, TEMPERATURE, make_trajectories, single_device_mesh, tiny_model_state

METHODS = ("recompute", "rollout", "loglinear", "metrics")


def numpy_alpha(versions: np.ndarray, trainer_version: int) -> np.ndarray:
    """AReaL: v_theta = trainer version, v_prox = v_theta - 1, alpha = (v_prox - v) / (v_theta - v) in [0, 1]."""
    out = np.zeros(versions.shape)
    for i, v in enumerate(versions):
        if v >= 0 and trainer_version > v:
            out[i] = min(max((trainer_version - 1 - v) / (trainer_version - v), 0.0), 1.0)
    return out


def test_loglinear_weight_on_hand_worked_versions():
    versions = np.array([5, 4, 3, 2, 1, -1, 6], np.int32)
    expected = [0.0, 0.0, 1 / 2, 2 / 3, 3 / 4, 0.0, 0.0]  # staleness 0, 1, 2, 3, 4; prompt token; from the future
    np.testing.assert_allclose(numpy_alpha(versions, 5), expected)
    np.testing.assert_allclose(np.asarray(loglinear_alpha(jnp.asarray(versions), 5)), expected, rtol=1e-6)


def test_approximations_match_numpy_and_carry_no_gradient():
    rng = np.random.default_rng(0)
    versions = rng.integers(-1, 8, size=(3, 10)).astype(np.int32)
    behav = -rng.uniform(0.1, 5.0, size=(3, 10)).astype(np.float32)
    logp = -rng.uniform(0.1, 5.0, size=(3, 10)).astype(np.float32)
    alpha = numpy_alpha(versions.reshape(-1), 7).reshape(3, 10)
    rollout = approximate_prox_logp("rollout", jnp.asarray(logp), jnp.asarray(behav), jnp.asarray(versions), 7)
    np.testing.assert_array_equal(np.asarray(rollout), behav)
    loglinear = approximate_prox_logp("loglinear", jnp.asarray(logp), jnp.asarray(behav), jnp.asarray(versions), 7)
    np.testing.assert_allclose(np.asarray(loglinear), behav + alpha * (logp - behav), atol=1e-6, rtol=0)
    assert 0 < alpha.mean() < 1

    def total(logp_BxL):
        return jnp.sum(approximate_prox_logp("loglinear", logp_BxL, jnp.asarray(behav), jnp.asarray(versions), 7))

    assert np.all(np.asarray(jax.grad(total)(jnp.asarray(logp))) == 0)  # the proximal policy is a constant
    with pytest.raises(ValueError, match="not an approximation"):
        approximate_prox_logp("recompute", jnp.asarray(logp), jnp.asarray(behav), jnp.asarray(versions), 7)


def test_approximation_errors_match_numpy():
    rng = np.random.default_rng(1)
    versions = rng.integers(0, 6, size=(2, 12)).astype(np.int32)
    behav, logp, prox = (-rng.uniform(0.1, 5.0, size=(2, 12)).astype(np.float32) for _ in range(3))
    mask = rng.random((2, 12)) < 0.7
    stats = prox_approximation_stats(*map(jnp.asarray, (prox, logp, behav, versions)), 5, jnp.asarray(mask))
    alpha = numpy_alpha(versions.reshape(-1), 5).reshape(2, 12)
    loglinear = behav + alpha * (logp - behav)
    np.testing.assert_allclose(float(stats["prox/rollout_abs_err"]), np.abs(behav - prox)[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(stats["prox/loglinear_abs_err"]), np.abs(loglinear - prox)[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(stats["prox/rollout_abs_err_max"]), np.abs(behav - prox)[mask].max(), rtol=1e-6)
    np.testing.assert_allclose(float(stats["prox/loglinear_alpha_mean"]), alpha[mask].mean(), rtol=1e-6)
    assert float(stats["prox/n_tokens"]) == mask.sum()


def test_config_refuses_an_approximation_without_decoupled_ppo():
    with pytest.raises(ConfigError, match="prox_logp_method: is 'loglinear' but decoupled is false"):
        PPOConfig(decoupled=False, prox_logp_method="loglinear")
    with pytest.raises(ConfigError, match="prox_logp_method"):
        PPOConfig(prox_logp_method="exact")
    assert [PPOConfig(prox_logp_method=m).needs_prox_pass for m in METHODS] == [True, False, False, True]


def _steps() -> dict[str, TrainStep]:
    graphdef, state = tiny_model_state()
    return {
        method: TrainStep(
            graphdef,
            state,
            CONFIG.replace(ppo=CONFIG.ppo.replace(prox_logp_method=method)),
            single_device_mesh(),
            temperature=TEMPERATURE,
        )
        for method in (*METHODS, "auto")
    }


@pytest.fixture(scope="module")
def steps():
    return _steps()


def test_on_policy_tokens_every_method_equals_recompute(steps):
    """Tokens sampled by the trainer's own version with its own log-probs: every method's update is recompute's,
    auto's too when the trainer skips the proximal pass (logp_prox None)."""
    _, state = tiny_model_state()
    version = 3
    (batch,) = build_batch(
        make_trajectories(np.random.default_rng(2), 8, lengths=(4, 24), version=0), CONFIG
    ).minibatches
    recompute = steps["recompute"]
    params, _ = recompute.init(state)
    prox = np.asarray(recompute.logprobs(params, recompute.put_batch(batch)))
    on_policy = batch._replace(
        logp_behav=np.where(batch.loss_mask, prox, 0.0).astype(np.float32),
        versions=np.where(batch.loss_mask, version, -1).astype(np.int32),
    )
    results = {}
    for method in ("recompute", *APPROXIMATIONS, "auto"):
        step = steps[method]
        params, opt_state = step.init(state)
        device_batch = step.put_batch(on_policy)
        logp_prox = step.logprobs(params, device_batch) if step.needs_prox_pass and method != "auto" else None
        new_params, _, stats = step.update(params, opt_state, device_batch, logp_prox, version)
        results[method] = (jax.device_get(new_params), jax.device_get(stats))
    ref_params, ref_stats = results["recompute"]
    for method in (*APPROXIMATIONS, "auto"):
        new_params, stats = results[method]
        assert float(stats["train/loss"]) == pytest.approx(float(ref_stats["train/loss"]), abs=1e-7), method
        for leaf, ref in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), strict=True):
            np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref), atol=1e-7, rtol=0, err_msg=method)


def test_metrics_reports_the_errors_of_stale_tokens(steps):
    """Stale tokens: `metrics` trains on the recomputed log-probs and reports each approximation's error, which on
    the first update (log pi_theta = log pi_prox) is |behav - prox| and (1 - alpha) |behav - prox|."""
    _, state = tiny_model_state()
    version = 4
    trajectories = make_trajectories(np.random.default_rng(3), 8, lengths=(4, 24), version=version)
    (batch,) = build_batch(trajectories, CONFIG).minibatches
    step = steps["metrics"]
    params, opt_state = step.init(state)
    device_batch = step.put_batch(batch)
    logp_prox = step.logprobs(params, device_batch)
    _, _, stats = step.update(params, opt_state, device_batch, logp_prox, version)
    prox, mask = np.asarray(logp_prox, np.float64), batch.loss_mask
    alpha = numpy_alpha(batch.versions.reshape(-1), version).reshape(batch.versions.shape)
    diff = np.abs(batch.logp_behav - prox)
    assert 0 < alpha[mask].mean() < 1
    np.testing.assert_allclose(float(stats["prox/rollout_abs_err"]), diff[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(stats["prox/loglinear_abs_err"]), ((1 - alpha) * diff)[mask].mean(), rtol=1e-5)


def _count_proximal_passes(trainer: Trainer) -> list:
    """Record every call of the jitted log-prob program (the proximal pass; no reference pass here)."""
    calls = []
    program = trainer.train_step._logprobs
    trainer.train_step._logprobs = lambda *args: calls.append(args) or program(*args)
    return calls


@pytest.mark.parametrize("method", ["rollout", "loglinear", "recompute"])
def test_approximations_skip_the_proximal_forward_pass(method):
    graphdef, state = tiny_model_state()
    config = CONFIG.replace(ppo=CONFIG.ppo.replace(prox_logp_method=method))
    trainer = Trainer(nnx.merge(graphdef, state), config, single_device_mesh(), temperature=TEMPERATURE)
    calls = _count_proximal_passes(trainer)
    stats = trainer.step(make_trajectories(np.random.default_rng(2), 8, lengths=(4, 24)))  # the shapes compiled above
    assert np.isfinite(stats["train/loss"])
    assert len(calls) == (1 if method == "recompute" else 0)  # recompute: one pass per mini-batch
