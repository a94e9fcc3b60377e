"""DAPO's overlong reward shaping (`advantage.overlong_buffer`, `overlong_penalty`): hand-worked lengths, the
rewards it hands the advantages in a packed batch, and the refusals."""

import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.data.trajectory import Trajectory
from areal_jax.objectives import AdvantageConfig, overlong_penalty
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import CONFIG, TEMPERATURE, single_device_mesh, tiny_model_state


def test_penalty_on_hand_worked_lengths():
    # max 20, buffer 5: free up to 15, then -1/5 per token, -1 at 20 and beyond (DAPO Eq. 13)
    lengths = np.array([0, 10, 15, 16, 18, 20, 25])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 5, 1.0), [0, 0, 0, -0.2, -0.6, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 5, 0.5), [0, 0, 0, -0.1, -0.3, -0.5, -0.5])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 20, 2.0), -2.0 * np.minimum(lengths, 20) / 20)
    np.testing.assert_array_equal(overlong_penalty(lengths, 20, 0, 1.0), np.zeros(7))


def _trajectory(prompt: int, response: int, reward: float, index: int) -> Trajectory:
    n = prompt + response
    loss_mask = np.arange(n) >= prompt
    return Trajectory(
        token_ids=np.arange(n, dtype=np.int32) % 60,
        behav_logprobs=np.where(loss_mask, -1.0, 0.0).astype(np.float32),
        versions=np.where(loss_mask, 0, -1).astype(np.int32),
        loss_mask=loss_mask,
        prompt_length=prompt,
        reward=reward,
        prompt_id="p0",
        group_id=0,
        sample_index=index,
    )


def test_batch_advantages_carry_the_penalty_of_the_response_length():
    """Raw advantages (no baseline, no std): each sequence's advantage is its reward plus its penalty, measured on
    the response (tokens after the prompt), not the whole trajectory."""
    advantage = AdvantageConfig(mean_level="none", std_level="none", overlong_buffer=4, overlong_penalty=0.5)
    config = CONFIG.replace(advantage=advantage)
    responses, rewards = [3, 6, 7, 8], [1.0, 1.0, 0.0, 1.0]  # max_new_tokens 8: free up to 4 tokens
    trajectories = [_trajectory(5, r, reward, i) for i, (r, reward) in enumerate(zip(responses, rewards, strict=True))]
    batch = build_batch(trajectories, config, max_new_tokens=8)
    expected = [1.0, 1.0 - 0.25, 0.0 - 0.375, 1.0 - 0.5]
    (mb,) = batch.minibatches
    got = _advantage_by_packed_length(mb)
    assert got == pytest.approx({5 + r - 1: value for r, value in zip(responses, expected, strict=True)}, abs=1e-6)
    assert batch.stats["adv/overlong_frac"] == 0.75
    assert batch.stats["adv/overlong_penalty_mean"] == pytest.approx(-(0.25 + 0.375 + 0.5) / 4)
    assert batch.stats["adv/reward_mean"] == pytest.approx(np.mean(expected), abs=1e-6)
    with pytest.raises(ValueError, match="max_new_tokens is None"):
        build_batch(trajectories, config)
    assert "adv/overlong_frac" not in build_batch(trajectories, CONFIG).stats  # off by default


def _advantage_by_packed_length(mb) -> dict[int, float]:
    """Each packed sequence's advantage (on every one of its positions), keyed by its packed length."""
    out = {}
    for at in zip(*np.nonzero((mb.positions == 0) & (mb.segment_ids > 0)), strict=True):
        m, row, _ = (int(i) for i in at)
        same = mb.segment_ids[m, row] == mb.segment_ids[at]
        assert len(set(mb.advantages[m, row][same].tolist())) == 1
        out[int(same.sum())] = float(mb.advantages[m, row][same][0])
    return out


def test_the_trainer_refuses_a_buffer_without_or_beyond_max_new_tokens():
    config = CONFIG.replace(advantage=AdvantageConfig(overlong_buffer=16))
    model = nnx.merge(*tiny_model_state())
    with pytest.raises(ConfigError, match=r"advantage\.overlong_buffer: is 16 but the Trainer was built without"):
        Trainer(model, config, single_device_mesh(), temperature=TEMPERATURE)
    with pytest.raises(ConfigError, match="value 16 exceeds max_new_tokens=8"):
        Trainer(model, config, single_device_mesh(), temperature=TEMPERATURE, max_new_tokens=8)
    with pytest.raises(ConfigError, match="overlong_buffer: value -1 is out of range"):
        AdvantageConfig(overlong_buffer=-1)
