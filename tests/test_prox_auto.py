"""`ppo.prox_logp_method: auto` (the default): the trainer skips the proximal pass on a step whose every loss token
was sampled by its starting weights and runs it otherwise, with two update programs and no further compilation."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.objectives import PPOConfig, RolloutCorrectionConfig
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.train_step import TrainStep
from areal_jax.trainer.trainer import Trainer, on_policy
from tests.test_train_step import CONFIG, TEMPERATURE, make_trajectories, single_device_mesh, tiny_model_state

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _batch(version: int, on_policy_share: float = 1.0):
    """The same 8 trajectories every time (one packed shape); loss tokens of `version`, or, beyond
    `on_policy_share` of each trajectory, of `version - 1`."""
    out = []
    for t in make_trajectories(np.random.default_rng(5), 8, lengths=(4, 24)):
        stale = np.arange(t.length) >= t.prompt_length + on_policy_share * (t.length - t.prompt_length)
        versions = np.where(t.loss_mask, np.where(stale, version - 1, version), -1).astype(np.int32)
        out.append(dataclasses.replace(t, versions=versions))
    return out


def test_on_policy_is_every_loss_token_of_the_version():
    (mb,) = build_batch(_batch(3), CONFIG).minibatches
    assert on_policy(mb, 3) and not on_policy(mb, 4)
    (mixed,) = build_batch(_batch(3, on_policy_share=0.5), CONFIG).minibatches
    assert not on_policy(mixed, 3)
    assert (mixed.versions[~mixed.loss_mask] == -1).all()  # prompt and padding positions are not looked at


def _trainer(config):
    trainer = Trainer(nnx.merge(*tiny_model_state()), config, single_device_mesh(), temperature=TEMPERATURE)
    passes = []
    program = trainer.train_step._logprobs
    trainer.train_step._logprobs = lambda *args: passes.append(args) or program(*args)
    return trainer, passes


def test_auto_passes_only_after_the_first_minibatch_and_skips_on_policy_steps_but_the_monitors():
    config = CONFIG.replace(ppo_minibatches=2, logprob_monitor_every=3)  # versions 0, 3, 6, ... pass for the monitor
    trainer, passes = _trainer(config)
    assert trainer.config.ppo.prox_logp_method == "auto"
    # the jitted update's cache is per function, shared by every TrainStep of the process (other tests' programs)
    cached_before = trainer.train_step._update_gradients._cache_size()

    def step(batch) -> float:
        before = len(passes)
        stats = trainer.step(batch)
        assert np.isfinite(stats["train/loss"]) and stats["train/skipped_updates"] == 0
        # the first mini-batch's update computes log pi_prox itself: one pass (the second's) or none
        assert len(passes) - before == stats["prox/pass_minibatches"] == 1 - stats["prox/skipped"]
        return stats["prox/skipped"]

    assert step(_batch(0)) == 0  # on-policy, but a step the sampler/trainer mismatch monitor measures
    assert step(_batch(1)) == 1  # version 1 sampled every token: log pi_prox = log pi_behav
    assert step(_batch(1)) == 0  # the trainer is at version 2 now: stale, recompute
    compiles = []

    def listener(event: str, seconds: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        assert step(_batch(3)) == 0  # the monitor's step again
        assert step(_batch(4)) == 1
        assert step(_batch(5, on_policy_share=0.5)) == 0  # one stale token is enough to recompute
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    # the first update (log pi_prox its own), later ones with the pass's log-probs and with the behaviour's
    assert trainer.train_step._update_gradients._cache_size() - cached_before == 3


@pytest.mark.parametrize("minibatches", [1, 2])
def test_auto_on_stale_tokens_equals_recompute_with_fewer_passes(minibatches):
    """Stale tokens (the behaviour weight w != 1): auto's first update takes log pi_prox from its own forward at
    the starting weights, recompute from a separate pass; the same step either way, and with one mini-batch
    auto runs no pass at all."""
    results = {}
    for method in ("auto", "recompute"):
        config = CONFIG.replace(ppo_minibatches=minibatches, ppo=CONFIG.ppo.replace(prox_logp_method=method))
        trainer, passes = _trainer(config)
        trainer.version = 2
        stats = trainer.step(_batch(1, on_policy_share=0.5))  # every token one or two versions old
        results[method] = (stats, len(passes), jax.device_get(trainer.params))
    (auto, auto_passes, auto_params), (recompute, recompute_passes, recompute_params) = results.values()
    assert (auto_passes, recompute_passes) == (minibatches - 1, minibatches)
    assert auto["prox/skipped"] == 0 and auto["prox/pass_minibatches"] == minibatches - 1
    for key in ("train/loss", "ppo/iw_mean", "ppo/logp_abs_diff", "ppo/clip_frac", "train/grad_norm"):
        np.testing.assert_allclose(auto[key], recompute[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert auto["ppo/logp_abs_diff"] > 1e-3  # w != 1: the stale tokens' weights were really applied
    for a, b in zip(jax.tree.leaves(auto_params), jax.tree.leaves(recompute_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_recomputes_whenever_the_correction_is_active():
    """On-policy the behaviour weight is the sampler/trainer mismatch, which an active correction is there for."""
    assert PPOConfig().skips_prox_pass_on_policy
    correction = RolloutCorrectionConfig(is_mode="truncate", is_high=2.0)
    for cfg in (
        PPOConfig(rollout_correction=correction),
        PPOConfig(behav_weight_cap=5.0),
        PPOConfig(prox_logp_method="recompute"),
        PPOConfig(decoupled=False),
    ):
        assert not cfg.skips_prox_pass_on_policy
    assert PPOConfig(decoupled=False).needs_prox_pass is False
    config = CONFIG.replace(ppo=CONFIG.ppo.replace(rollout_correction=correction))
    step = TrainStep(*tiny_model_state(), config, single_device_mesh(), temperature=TEMPERATURE)
    with pytest.raises(ValueError, match=r"logp_prox is None but ppo\.decoupled is true with prox_logp_method .auto."):
        step.update(None, None, None, None, 0)
