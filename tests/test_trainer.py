"""The trainer: the next-token shift, mini-batches, no recompilation, NaN skipping, and PPO that learns."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.sharding import MeshConfig, copy_to, make_mesh
from areal_jax.trainer.batching import build_batch, split_minibatches
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig
from areal_jax.trainer.optimizer import applied_updates
from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import CONFIG, TEMPERATURE, make_trajectories, single_device_mesh, tiny_model_state

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _trajectory(tokens, prompt_length, behav, versions, reward, group_id, sample_index=0) -> Trajectory:
    n = len(tokens)
    return Trajectory(
        token_ids=np.asarray(tokens, np.int32),
        behav_logprobs=np.asarray(behav, np.float32),
        versions=np.asarray(versions, np.int32),
        loss_mask=np.arange(n) >= prompt_length,
        prompt_length=prompt_length,
        reward=reward,
        prompt_id=f"p{group_id}",
        group_id=group_id,
        sample_index=sample_index,
    )


@pytest.fixture(scope="module")
def trainer():
    graphdef, state = tiny_model_state()
    return Trainer(nnx.merge(graphdef, state), CONFIG, single_device_mesh(), temperature=TEMPERATURE)


def test_batching_shifts_targets_and_per_token_data_by_one():
    a = _trajectory([10, 11, 12, 13, 14], 2, [0, 0, -1, -2, -3], [-1, -1, 3, 3, 4], reward=1.0, group_id=7)
    b = _trajectory([20, 21, 22], 1, [0, -5, -6], [-1, 2, 2], reward=0.0, group_id=7, sample_index=1)
    (batch,) = build_batch([a, b], CONFIG).minibatches

    def sequence_starting_with(token: int) -> tuple[int, int, np.ndarray]:
        starts = (batch.positions == 0) & (batch.segment_ids > 0) & (batch.tokens == token)
        (m,), (row,), (col,) = np.nonzero(starts)
        return m, row, batch.segment_ids[m, row] == batch.segment_ids[m, row, col]

    m, row, cols = sequence_starting_with(10)
    assert batch.tokens[m, row][cols].tolist() == [10, 11, 12, 13]
    assert batch.targets[m, row][cols].tolist() == [11, 12, 13, 14]
    assert batch.positions[m, row][cols].tolist() == [0, 1, 2, 3]
    assert batch.loss_mask[m, row][cols].tolist() == [False, True, True, True]
    assert batch.logp_behav[m, row][cols].tolist() == [0, -1, -2, -3]
    assert batch.versions[m, row][cols].tolist() == [-1, 3, 3, 4]
    np.testing.assert_allclose(batch.advantages[m, row][cols], 1.0, atol=1e-4)  # (1 - 0.5) / 0.5
    m, row, cols = sequence_starting_with(20)
    assert batch.targets[m, row][cols].tolist() == [21, 22]
    assert batch.loss_mask[m, row][cols].tolist() == [True, True]
    np.testing.assert_allclose(batch.advantages[m, row][cols], -1.0, atol=1e-4)
    padding = batch.segment_ids == 0
    assert not batch.loss_mask[padding].any() and (batch.versions[padding] == -1).all()
    assert int(batch.loss_mask.sum()) == a.num_loss_tokens + b.num_loss_tokens

    with pytest.raises(ValueError, match="p3/0 has 1 token"):
        build_batch([_trajectory([5], 1, [0], [-1], 0.0, group_id=3)], CONFIG)


def test_split_minibatches_balances_tokens_and_refuses_too_few_sequences():
    lengths = np.array([50, 10, 40, 30, 20, 30])
    parts = split_minibatches(lengths, 2)
    assert sorted(int(lengths[p].sum()) for p in parts) == [90, 90]
    assert sorted(np.concatenate(parts).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="cannot split 6 sequences into 7"):
        split_minibatches(lengths, 7)


def test_trainer_config_validation():
    with pytest.raises(ConfigError, match="total_steps: is null but schedule is 'cosine'"):
        OptimizerConfig(schedule="cosine")
    with pytest.raises(ConfigError, match="total_steps: value 10 must exceed warmup_steps=10"):
        OptimizerConfig(schedule="cosine", total_steps=10, warmup_steps=10)
    with pytest.raises(ConfigError, match="total_steps: is 5 but schedule is 'constant'"):
        OptimizerConfig(total_steps=5)
    with pytest.raises(ConfigError, match="ppo_minibatches: value 0"):
        TrainerConfig(ppo_minibatches=0)


def _workload(rng: np.random.Generator, new_tokens: tuple[int, int]) -> list[Trajectory]:
    """The issue's workload shape on the tiny model: 8 prompts x 8 samples, 6 prompt tokens, 58..64 new ones."""
    out = []
    for i in range(64):
        length = 6 + int(rng.integers(*new_tokens, endpoint=True))
        out.append(
            _trajectory(
                rng.integers(0, 64, length),
                6,
                np.where(np.arange(length) >= 6, -3.0, 0.0),
                np.where(np.arange(length) >= 6, 0, -1),
                float(rng.integers(0, 2)),
                i // 8,
                i % 8,
            )
        )
    return out


def test_no_recompilation_once_the_workload_bucket_is_warm():
    """New batches of one workload (other tokens, lengths and rewards) land in the warm bucket: no compilation,
    and the default packing config packs them at >= 0.85 (exactly 64 new tokens: >= 0.9)."""
    graphdef, state = tiny_model_state()
    config = CONFIG.replace(packing=TrainerConfig().packing)
    trainer = Trainer(nnx.merge(graphdef, state), config, single_device_mesh(), temperature=TEMPERATURE)
    rng = np.random.default_rng(10)
    stats = trainer.step(_workload(rng, (64, 64)))
    assert stats["batch/pack_efficiency"] >= 0.9
    # one mini-batch: auto's only update takes log pi_prox from its own forward, on- or off-policy alike
    assert stats["prox/pass_minibatches"] == 0 and stats["prox/skipped"] == 0
    compiles = []

    def listener(event: str, seconds: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(3):
            stats = trainer.step(_workload(rng, (58, 64)))
            assert stats["train/skipped_updates"] == 0 and np.isfinite(stats["train/loss"])
            assert stats["batch/pack_efficiency"] >= 0.85
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []


def test_nan_reward_skips_the_update_and_training_goes_on(trainer):
    rng = np.random.default_rng(11)
    bad = make_trajectories(rng, 8, lengths=(4, 24), version=trainer.version)
    bad[1] = dataclasses.replace(bad[1], reward=float("nan"))
    params_before = jax.device_get(trainer.params)
    count_before = int(applied_updates(trainer.opt_state))
    notfinite_before = int(optax.tree_utils.tree_get(trainer.opt_state, "total_notfinite"))
    skipped_before, version_before = trainer.skipped_updates, trainer.version

    stats = trainer.step(bad)
    assert stats["train/skipped_updates"] == 1 and trainer.skipped_updates == skipped_before + 1
    assert stats["train/skipped_updates_total"] == trainer.skipped_updates
    assert not np.isfinite(stats["train/loss"])
    assert int(applied_updates(trainer.opt_state)) == count_before
    assert int(optax.tree_utils.tree_get(trainer.opt_state, "total_notfinite")) == notfinite_before + 1
    for before, after in zip(jax.tree.leaves(params_before), jax.tree.leaves(trainer.params), strict=True):
        np.testing.assert_array_equal(np.asarray(after), before)
    assert trainer.version == version_before + 1  # the (unchanged) weights are still published

    stats = trainer.step(make_trajectories(rng, 8, lengths=(4, 24), version=trainer.version))
    assert stats["train/skipped_updates"] == 0 and np.isfinite(stats["train/loss"]) and stats["train/grad_norm"] > 0
    assert int(applied_updates(trainer.opt_state)) == count_before + 1
    changed = [
        not np.array_equal(np.asarray(after), before)
        for before, after in zip(jax.tree.leaves(params_before), jax.tree.leaves(trainer.params), strict=True)
    ]
    assert all(changed)


def test_ppo_minibatches_make_several_updates_and_stats_cover_the_step():
    graphdef, state = tiny_model_state()
    trainer = Trainer(
        nnx.merge(graphdef, state),
        CONFIG.replace(ppo_minibatches=2),
        single_device_mesh(),
        version=5,
        temperature=TEMPERATURE,
    )
    trajectories = make_trajectories(np.random.default_rng(12), 16, lengths=(4, 24), version=5)
    stats = trainer.step(trajectories)
    assert int(applied_updates(trainer.opt_state)) == 2 and stats["batch/microbatches"] == 2
    assert stats["train/loss_tokens"] == stats["ppo/n_tokens"] == sum(t.num_loss_tokens for t in trajectories)
    assert stats["train/throughput"] == pytest.approx(stats["train/loss_tokens"] / stats["train/step_time"])
    assert sum(stats[f"staleness/{k}/n_tokens"] for k in ("0", "1", "2")) == stats["ppo/n_tokens"]
    assert stats["staleness/0/n_tokens"] > 0 and stats["staleness/2/n_tokens"] > 0
    assert trainer.version == 6


def test_ppo_learns_a_synthetic_task():
    """Reward 1 when the sampled token is one of the 16 lowest ids (a quarter of the vocabulary). Samples
    come from the continuous-batching generator; each new version is copied into it before the next round."""
    graphdef, state = tiny_model_state()
    config = CONFIG.replace(optimizer=CONFIG.optimizer.replace(lr=1e-2))
    trainer = Trainer(nnx.merge(graphdef, state), config, single_device_mesh(), temperature=TEMPERATURE)
    engine = Engine(nnx.merge(graphdef, state), EngineConfig(max_slots=32, max_length=16))
    rng = np.random.default_rng(0)
    mean_rewards = []
    with Generator(engine, engine.load_params(copy_to(trainer.params, engine.param_shardings), 0)) as generator:

        def publish(params: nnx.State, version: int) -> None:  # a copy: the next train step donates `params`
            generator.update_params(copy_to(params, engine.param_shardings), version).result(timeout=60)

        for round_index in range(20):
            prompts = [[int(x) for x in rng.integers(1, 64, 3)] for _ in range(8)]
            sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=1)
            futures = [
                generator.submit(p, sampling.replace(seed=round_index * 8 + i), n=4) for i, p in enumerate(prompts)
            ]
            trajectories = []
            for group_id, future in enumerate(futures):
                for result in future.result(timeout=120):
                    token = result.output_ids[0]
                    trajectories.append(
                        _trajectory(
                            [*result.prompt_ids, token],
                            3,
                            [0, 0, 0, result.output_logprobs[0]],
                            [-1, -1, -1, result.output_versions[0]],
                            reward=float(token < 16),
                            group_id=group_id,
                            sample_index=result.sample_index,
                        )
                    )
            assert {t.versions[-1] for t in trajectories} == {trainer.version}
            mean_rewards.append(np.mean([t.reward for t in trajectories]))
            stats = trainer.step(trajectories)
            publish(trainer.params, trainer.version)
            assert stats["train/skipped_updates"] == 0
            assert stats["ppo/iw_max"] < 1.001  # the sampler's log-probs match the trainer's (same version)
    first, last = np.mean(mean_rewards[:5]), np.mean(mean_rewards[-5:])
    assert last > first + 0.3, (first, last, mean_rewards)


def test_min_rows_defaults_to_the_data_shards_and_must_divide_them():
    graphdef, state = tiny_model_state()
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    trainer = Trainer(nnx.merge(graphdef, state), CONFIG, mesh, temperature=TEMPERATURE)
    assert trainer.config.packing.min_rows == 4  # a small batch: one micro-batch of 4, 8, ... rows
    odd = CONFIG.replace(packing=CONFIG.packing.replace(min_rows=2))
    with pytest.raises(ValueError, match=r"packing\.min_rows is 2, not a multiple of the data\*fsdp shards \(4\)"):
        Trainer(nnx.merge(graphdef, state), odd, mesh, temperature=TEMPERATURE)
