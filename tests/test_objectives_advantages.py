"""Advantage estimators and KL reward shaping against NumPy re-statements of their formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.packing import PackingConfig, pack_sequences
from areal_jax.objectives import AdvantageConfig, kl_shaped_advantages, sequence_advantages, token_advantages

NUM_GROUPS = 7
advantages_jit = jax.jit(sequence_advantages, static_argnames=("config", "num_groups"))


def make_rewards(seed: int, binary: bool, dtype=np.float32):
    """Shuffled groups of sizes 4, 1, 6, 3, 4 (ids 0, 1, 2, 3, 5; group 4 and 6 empty), two padding entries."""
    rng = np.random.default_rng(seed)
    group = np.repeat([0, 1, 2, 3, 5], [4, 1, 6, 3, 4])
    group = np.concatenate([group, [2, 6]])
    valid = np.ones(len(group), bool)
    valid[-2:] = False
    reward = rng.integers(0, 2, len(group)).astype(float) if binary else rng.normal(0.5, 2.0, len(group))
    if binary:
        reward[group == 3] = 1.0  # a constant group
    perm = rng.permutation(len(group))
    return reward[perm].astype(dtype), group[perm].astype(np.int32), valid[perm]


def np_advantages(reward, group, valid, cfg: AdvantageConfig) -> np.ndarray:
    """Independent per-sequence loop over the definitions."""
    r = (reward.astype(np.float64) + cfg.reward_bias) * cfg.reward_scale
    if cfg.reward_clip is not None:
        r = np.clip(r, -cfg.reward_clip, cfg.reward_clip)
    adv = np.zeros(len(r))

    def members(i, level):
        same = group == group[i] if level == "group" else np.ones(len(r), bool)
        return np.flatnonzero(same & valid)

    for i in np.flatnonzero(valid):
        if cfg.mean_level == "none":
            base = 0.0
        elif cfg.leave_one_out:
            others = [j for j in members(i, cfg.mean_level) if j != i]
            base = np.mean(r[others]) if others else r[i]
        else:
            base = np.mean(r[members(i, cfg.mean_level)])
        adv[i] = r[i] - base
        if cfg.std_level != "none":
            adv[i] /= np.std(r[members(i, cfg.std_level)]) + cfg.std_eps
    return adv


VARIANTS = {
    "grpo": AdvantageConfig.grpo(),
    "dr_grpo": AdvantageConfig.dr_grpo(),
    "rloo": AdvantageConfig.rloo(),
    "batch_mean_std": AdvantageConfig(mean_level="batch", std_level="batch"),
    "group_mean_batch_std": AdvantageConfig(mean_level="group", std_level="batch"),
    "rloo_batch_group_std": AdvantageConfig(mean_level="batch", std_level="group", leave_one_out=True),
    "shaped_no_norm": AdvantageConfig(
        mean_level="none", std_level="none", reward_bias=-0.5, reward_scale=3.0, reward_clip=2.0
    ),
    "shaped_grpo": AdvantageConfig(reward_bias=1.0, reward_scale=-2.0, reward_clip=1.5, std_eps=1e-3),
}


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("name", VARIANTS)
def test_advantages_match_numpy(name, binary):
    cfg = VARIANTS[name]
    reward, group, valid = make_rewards(0, binary)
    adv, stats = advantages_jit(jnp.asarray(reward), jnp.asarray(group), cfg, NUM_GROUPS, jnp.asarray(valid))
    np.testing.assert_allclose(adv, np_advantages(reward, group, valid, cfg), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[~valid] == 0)
    assert all(np.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", ["grpo", "rloo", "rloo_batch_group_std", "shaped_grpo"])
def test_gradient_matches_finite_differences(name):
    cfg = VARIANTS[name]
    reward, group, valid = make_rewards(1, binary=False, dtype=np.float64)
    weights = np.random.default_rng(2).normal(size=len(reward))
    with jax.enable_x64(True):
        grad = jax.jit(
            jax.grad(lambda r: jnp.sum(sequence_advantages(r, jnp.asarray(group), cfg, NUM_GROUPS, valid)[0] * weights))
        )(jnp.asarray(reward))
        grad = np.asarray(grad)
    h = 1e-6
    fd = np.zeros(len(reward))
    for i in range(len(reward)):
        step = np.zeros(len(reward))
        step[i] = h
        plus = np.sum(np_advantages(reward + step, group, valid, cfg) * weights)
        minus = np.sum(np_advantages(reward - step, group, valid, cfg) * weights)
        fd[i] = (plus - minus) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)


def test_constant_groups_give_zero_advantage_without_nan():
    reward, group, valid = make_rewards(3, binary=True)
    adv, stats = advantages_jit(jnp.asarray(reward), jnp.asarray(group), AdvantageConfig.grpo(), NUM_GROUPS, valid)
    assert np.all(np.asarray(adv)[group == 3] == 0)
    assert np.all(np.asarray(adv)[group == 1] == 0)  # a group of one
    nonempty = [g for g in range(NUM_GROUPS) if valid[group == g].any()]
    constant = [g for g in nonempty if np.ptp(reward[(group == g) & valid]) == 0]
    np.testing.assert_allclose(stats["adv/constant_group_frac"], len(constant) / len(nonempty), rtol=1e-6)
    np.testing.assert_allclose(stats["adv/reward_mean"], reward[valid].mean(), rtol=1e-6)
    np.testing.assert_allclose(stats["adv/reward_std"], reward[valid].std(), rtol=1e-5)
    assert stats["adv/n_seqs"] == valid.sum()
    with jax.enable_x64(True):
        grad = jax.jit(jax.grad(lambda r: jnp.sum(advantages_jit(r, jnp.asarray(group), AdvantageConfig(), 7)[0])))(
            jnp.asarray(reward, jnp.float64)
        )
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("name", VARIANTS)
def test_an_episode_split_into_sequences_counts_once_and_each_sequence_gets_its_advantage(name):
    """`weight_N` (agent episodes trained as several sequences): copies of an episode with shares 1/k give the
    advantages of the unsplit episodes, whatever k."""
    cfg = VARIANTS[name]
    reward, group, valid = make_rewards(3, binary=False)
    adv, _ = advantages_jit(jnp.asarray(reward), jnp.asarray(group), cfg, NUM_GROUPS, jnp.asarray(valid))
    copies = np.random.default_rng(0).integers(1, 4, len(reward))  # each episode recorded as 1-3 sequences
    episode = np.repeat(np.arange(len(reward)), copies)
    split, _ = advantages_jit(
        jnp.asarray(reward[episode]),
        jnp.asarray(group[episode]),
        cfg,
        NUM_GROUPS,
        jnp.asarray(valid[episode]),
        jnp.asarray(1.0 / copies[episode]),
    )
    np.testing.assert_allclose(split, np.asarray(adv)[episode], rtol=1e-5, atol=1e-5)
    unweighted, _ = advantages_jit(
        jnp.asarray(reward[episode]), jnp.asarray(group[episode]), cfg, NUM_GROUPS, jnp.asarray(valid[episode])
    )
    if cfg.mean_level != "none":  # counting each sequence as an episode would weigh the split ones more
        assert not np.allclose(unweighted, np.asarray(adv)[episode], atol=1e-4)


def test_rloo_baseline_is_mean_of_the_others():
    reward = jnp.asarray([1.0, 0.0, 0.0, 1.0, 5.0])
    group = jnp.asarray([0, 0, 0, 0, 1])
    adv, _ = advantages_jit(reward, group, AdvantageConfig.rloo(), 2)
    np.testing.assert_allclose(adv, [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0.0], rtol=1e-6)


def test_token_advantages_broadcast_through_the_packer():
    lengths = np.array([5, 3, 8, 2, 7])
    plan = pack_sequences(lengths, PackingConfig(token_budget=16, rows=2))
    adv_N = np.linspace(-1.0, 1.0, len(lengths)).astype(np.float32)
    for seq_index, expected in zip(plan.seq_index(), plan.broadcast(adv_N), strict=True):
        np.testing.assert_array_equal(token_advantages(jnp.asarray(adv_N), jnp.asarray(seq_index)), expected)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_reward_shaping_is_return_to_go_within_each_sequence(estimator):
    rng = np.random.default_rng(4)
    lengths = rng.integers(2, 12, size=9)
    plan = pack_sequences(lengths, PackingConfig(token_budget=48, rows=3))
    logp = [-rng.uniform(0.1, 2.0, n) for n in lengths]
    logp_ref = [lp + rng.normal(0, 0.3, len(lp)) for lp in logp]
    loss_mask = [rng.uniform(size=n) < 0.8 for n in lengths]
    adv_N = rng.normal(size=len(lengths))
    coef = 0.3

    expected = []
    for lp, ref, m, a in zip(logp, logp_ref, loss_mask, adv_N, strict=True):
        log_r = ref - lp
        kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}[estimator]
        kl = np.where(m, kl, 0.0)
        to_go = np.array([kl[t:].sum() for t in range(len(kl))])
        expected.append(np.where(m, a - coef * to_go, 0.0))

    shaped = []
    for micro in zip(
        plan.broadcast(adv_N.astype(np.float32)),
        plan.pack([x.astype(np.float32) for x in logp]),
        plan.pack([x.astype(np.float32) for x in logp_ref]),
        plan.segment_ids(),
        plan.pack(loss_mask, pad_value=False),
        strict=True,
    ):
        out, stats = jax.jit(kl_shaped_advantages, static_argnames="estimator")(
            *map(jnp.asarray, micro), coef=coef, estimator=estimator
        )
        assert np.isfinite(stats["kl_reward/kl_mean"])
        shaped.append(np.asarray(out))
    for got, want in zip(plan.unpack(shaped), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="leave_one_out: is true but mean_level is 'none'"):
        AdvantageConfig(mean_level="none", leave_one_out=True)
    with pytest.raises(ConfigError, match=r"std_eps: value 0\.0 is out of range"):
        AdvantageConfig(std_eps=0.0)
    with pytest.raises(ValueError, match=r"valid_N has shape \(2,\)"):
        sequence_advantages(jnp.zeros(3), jnp.zeros(3, jnp.int32), AdvantageConfig(), 1, jnp.ones(2, bool))
