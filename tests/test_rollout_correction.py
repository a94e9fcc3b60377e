"""Rollout correction (`ppo.rollout_correction`): token/sequence TIS and MIS, token/sequence/geometric rejection on
hand-worked packed rows, against a NumPy re-statement; its statistics, their exact merge, the loss gradient
through the corrected (stop-gradient) weight, the behav_weight_cap alias and the config's refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.configuration import ConfigError, load
from areal_jax.objectives import PPOConfig, RolloutCorrectionConfig, correct_behav_weight, merge_stats, ppo_loss
from areal_jax.trainer.config import TrainerConfig

# Two packed rows of L = 6. Row 0: sequences 1 (w 0.5, 1, 4), 2 (w 1.5, 1.5) and 3 (no loss token).
# Row 1: sequence 1 (a prompt token, then w 0.25), sequence 2 (w 1, 1, [9 not a loss token], 1).
W = np.array([[0.5, 1.0, 4.0, 1.5, 1.5, 7.0], [2.0, 0.25, 1.0, 1.0, 9.0, 1.0]])
SEG = np.array([[1, 1, 1, 2, 2, 3], [1, 1, 2, 2, 2, 2]], np.int32)
MASK = np.array([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 1]], bool)
N_SEQS = 4  # sequences with a loss token
correct = jax.jit(correct_behav_weight, static_argnames="config")

# config, expected weight, truncated, masked (0 = padding / not a loss token)
CASES = {
    "token_plain": (
        RolloutCorrectionConfig(),
        [[0.5, 1, 4, 1.5, 1.5, 0], [0, 0.25, 1, 1, 0, 1]],
        [],
        [],
    ),
    "token_tis": (
        RolloutCorrectionConfig(is_mode="truncate", is_high=2.0),
        [[0.5, 1, 2, 1.5, 1.5, 0], [0, 0.25, 1, 1, 0, 1]],
        [(0, 2)],
        [],
    ),
    "token_mis": (  # [1/2, 2]
        RolloutCorrectionConfig(is_mode="mask", is_high=2.0),
        [[0.5, 1, 0, 1.5, 1.5, 0], [0, 0, 1, 1, 0, 1]],
        [],
        [(0, 2), (1, 1)],
    ),
    "sequence_tis": (  # W = 2, 2.25, 0.25, 1 (the non-loss 9 is not in the product)
        RolloutCorrectionConfig(is_level="sequence", is_mode="truncate", is_high=2.1),
        [[2, 2, 2, 2.1, 2.1, 0], [0, 0.25, 1, 1, 0, 1]],
        [(0, 3), (0, 4)],
        [],
    ),
    "sequence_mis": (
        RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_high=2.0),
        [[2, 2, 2, 0, 0, 0], [0, 0, 1, 1, 0, 1]],
        [],
        [(0, 3), (0, 4), (1, 1)],
    ),
    "geometric_rs": (  # geometric means 2^(1/3) = 1.26, 1.5, 0.25, 1 against [1/1.3, 1.3]
        RolloutCorrectionConfig(rs_level="geometric", rs_high=1.3),
        [[0.5, 1, 4, 0, 0, 0], [0, 0, 1, 1, 0, 1]],
        [],
        [(0, 3), (0, 4), (1, 1)],
    ),
    "token_rs_and_tis": (  # reject w outside [0.3, 3], truncate the rest at 1.2
        RolloutCorrectionConfig(is_mode="truncate", is_high=1.2, rs_level="token", rs_high=3.0, rs_low=0.3),
        [[0.5, 1, 0, 1.2, 1.2, 0], [0, 0, 1, 1, 0, 1]],
        [(0, 3), (0, 4)],
        [(0, 2), (1, 1)],
    ),
    "sequence_rs_all_rejected": (  # every sequence's product is outside [0.9, 1.1] but row 1's second
        RolloutCorrectionConfig(rs_level="sequence", rs_high=1.1, rs_low=0.9),
        [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 1]],
        [],
        [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 1)],
    ),
}


def np_correct(w, mask, seg, cfg: RolloutCorrectionConfig):
    """NumPy re-statement, one packed sequence at a time."""
    log_w = np.where(mask, np.log(w), 0.0)
    rho = np.exp(log_w)
    seq_log, geo_log = np.zeros_like(log_w), np.zeros_like(log_w)
    for b in range(w.shape[0]):
        for s in set(seg[b].tolist()) - {0}:
            at = (seg[b] == s) & mask[b]
            seq_log[b, seg[b] == s] = np.clip(log_w[b][at].sum(), -20, 20)
            geo_log[b, seg[b] == s] = log_w[b][at].mean() if at.any() else 0.0
    if cfg.is_level == "sequence":
        rho = np.exp(seq_log)
    truncated, masked = np.zeros(w.shape, bool), np.zeros(w.shape, bool)
    if cfg.is_mode == "truncate":
        truncated = rho > cfg.is_high
        rho = np.minimum(rho, cfg.is_high)
    elif cfg.is_mode == "mask":
        low = 1 / cfg.is_high if cfg.is_low is None else cfg.is_low
        masked = (rho < low) | (rho > cfg.is_high)
    if cfg.rs_level != "none":
        low = 1 / cfg.rs_high if cfg.rs_low is None else cfg.rs_low
        test = {"token": np.exp(log_w), "sequence": np.exp(seq_log), "geometric": np.exp(geo_log)}[cfg.rs_level]
        masked |= (test < low) | (test > cfg.rs_high)
    masked &= mask
    truncated &= mask & ~masked
    return np.where(mask & ~masked, rho, 0.0), truncated, masked


def cells(points):
    out = np.zeros(W.shape, bool)
    for b, t in points:
        out[b, t] = True
    return out


@pytest.mark.parametrize("name", CASES)
def test_weights_truncation_and_masks_on_hand_worked_rows(name):
    cfg, weight, truncated, masked = CASES[name]
    got = correct(jnp.log(jnp.asarray(W, jnp.float32)), jnp.asarray(MASK), cfg, jnp.asarray(SEG))
    np_weight, np_truncated, np_masked = np_correct(W, MASK, SEG, cfg)
    np.testing.assert_allclose(np.asarray(got.weight_BxL), weight, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np_weight, weight, rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(got.truncated_BxL), cells(truncated))
    np.testing.assert_array_equal(np.asarray(got.masked_BxL), cells(masked))
    np.testing.assert_array_equal(np_truncated, cells(truncated))
    np.testing.assert_array_equal(np_masked, cells(masked))


def test_sequence_weight_is_bounded_and_random_rows_match_numpy():
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 5, (3, 20)), axis=1)[:, ::-1].astype(np.int32)  # segments 4, 3, .., padding 0
    mask = (seg > 0) & (rng.random((3, 20)) < 0.8)
    w = np.exp(rng.normal(0, 0.5, (3, 20)))
    w[0, :3] = np.exp(30.0)  # a product beyond exp(20): bounded, finite
    for cfg, *_ in CASES.values():
        got = correct(jnp.log(jnp.asarray(w)), jnp.asarray(mask), cfg, jnp.asarray(seg))
        expected = np_correct(w, mask, seg, cfg)
        np.testing.assert_allclose(np.asarray(got.weight_BxL), expected[0], rtol=2e-5)
        np.testing.assert_array_equal(np.asarray(got.masked_BxL), expected[2])
    seq = RolloutCorrectionConfig(is_level="sequence")
    got = correct(jnp.log(jnp.asarray(w)), jnp.asarray(mask), seq, jnp.asarray(seg))
    assert np.all(np.isfinite(np.asarray(got.weight_BxL))) and float(got.weight_BxL.max()) <= np.exp(20) * 1.0001


def _loss_inputs(seed: int = 1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    behav = -rng.uniform(0.5, 3.0, W.shape)
    return {
        "logp": (behav + rng.normal(0, 0.3, W.shape)).astype(dtype),
        "behav": behav.astype(dtype),
        "prox": (behav + np.log(W)).astype(dtype),  # w = pi_prox / pi_behav = W
        "adv": rng.normal(0, 1, W.shape).astype(dtype),
        "version": np.array([[5, 5, 5, 4, 4, 0], [0, 3, 2, 2, 0, 2]], np.int32),
    }


def _run(x, cfg, logp=None, rows=slice(None)):
    return ppo_loss(
        jnp.asarray(x["logp"][rows] if logp is None else logp),
        jnp.asarray(x["behav"][rows]),
        jnp.asarray(x["adv"][rows]),
        jnp.asarray(MASK[rows]),
        int(MASK.sum()),
        cfg,
        logp_prox_BxL=jnp.asarray(x["prox"][rows]),
        token_version_BxL=jnp.asarray(x["version"][rows]),
        trainer_version=5,
        segment_ids_BxL=jnp.asarray(SEG[rows]),
    )


@pytest.mark.parametrize("name", ["token_tis", "sequence_mis", "geometric_rs"])
def test_loss_gradient_through_the_corrected_weight_matches_numpy(name):
    """d loss / d logp_t = weight_t * d c_t / d logp_t / N: the corrected weight is a constant factor (no gradient
    of its own); masked and rejected tokens give 0 and stay in the denominator N."""
    correction = CASES[name][0]
    cfg = PPOConfig(rollout_correction=correction)
    with jax.enable_x64(True):
        x = _loss_inputs(dtype=np.float64)
        loss, _ = jax.jit(_run, static_argnums=1)(x, cfg)
        grad = np.asarray(jax.jit(jax.grad(lambda lp: _run(x, cfg, logp=lp)[0]))(jnp.asarray(x["logp"])))
    weight = np_correct(W, MASK, SEG, correction)[0]
    u = np.exp(x["logp"] - x["prox"])
    plain, clipped = -x["adv"] * u, -x["adv"] * np.clip(u, 0.8, 1.2)
    n = MASK.sum()
    np.testing.assert_allclose(
        float(loss), np.sum(np.where(MASK, weight * np.maximum(plain, clipped), 0)) / n, rtol=1e-12
    )
    expected = np.where(MASK & (plain >= clipped), weight * -x["adv"] * u, 0.0) / n
    np.testing.assert_allclose(grad, expected, rtol=1e-10, atol=1e-14)
    assert np.all(grad[cells(CASES[name][3])] == 0)


def test_statistics_match_numpy():
    cfg = PPOConfig(rollout_correction=RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_high=2.0))
    x = _loss_inputs()
    _, stats = _run(x, cfg)
    weight, _, masked = np_correct(W, MASK, SEG, cfg.correction)
    w = weight[MASK]
    assert stats["correction/n_tokens"] == MASK.sum() and stats["correction/seq/n_seqs"] == N_SEQS
    np.testing.assert_allclose(stats["correction/ess"], w.sum() ** 2 / (len(w) * np.sum(w**2)), rtol=1e-6)
    np.testing.assert_allclose(stats["correction/masked_frac"], masked[MASK].mean(), rtol=1e-6)
    assert stats["correction/truncated_frac"] == 0
    np.testing.assert_allclose(stats["correction/seq/rejected_frac"], 2 / N_SEQS, rtol=1e-6)
    staleness = np.clip(5 - x["version"], 0, 4)
    for k, label in enumerate(["0", "1", "2", "3", ">=4"]):
        bucket = MASK & (staleness == k)
        assert stats[f"correction/staleness/{label}/n_tokens"] == bucket.sum()
        wb = weight[bucket]
        ess = wb.sum() ** 2 / (len(wb) * np.sum(wb**2)) if bucket.any() and np.any(wb) else 0.0
        np.testing.assert_allclose(stats[f"correction/staleness/{label}/ess"], ess, rtol=1e-6, err_msg=label)
        frac = masked[bucket].mean() if bucket.any() else 0.0
        np.testing.assert_allclose(stats[f"correction/staleness/{label}/masked_frac"], frac, rtol=1e-6)


@pytest.mark.parametrize("name", ["token_tis", "sequence_mis"])
def test_statistics_of_rows_merge_to_the_whole(name):
    """ESS is not a mean of the parts' ESS: merge_stats recomputes it from the merged weight moments."""
    cfg = PPOConfig(rollout_correction=CASES[name][0])
    x = _loss_inputs()
    _, whole = _run(x, cfg)
    parts = [_run(x, cfg, rows=slice(b, b + 1))[1] for b in range(2)]  # a sequence never spans rows
    merged = merge_stats(jax.tree.map(lambda *v: jnp.stack(v), *parts))
    assert merged.keys() == whole.keys()
    for key in whole:
        np.testing.assert_allclose(merged[key], whole[key], rtol=1e-5, atol=1e-7, err_msg=key)
    if name == "token_tis":  # hand-worked: parts 0.867 and 0.862, the whole 0.824
        averaged = (5 * float(parts[0]["correction/ess"]) + 4 * float(parts[1]["correction/ess"])) / 9
        assert float(whole["correction/ess"]) == pytest.approx(9.75**2 / (9 * 12.8125), rel=1e-6)
        assert averaged - float(whole["correction/ess"]) > 0.03


def test_behav_weight_cap_is_short_for_a_token_level_correction():
    x = _loss_inputs()
    for mode, correction in (
        ("mask", RolloutCorrectionConfig(is_mode="mask", is_high=2.0, is_low=0.0)),
        ("clamp", RolloutCorrectionConfig(is_mode="truncate", is_high=2.0)),
    ):
        old = PPOConfig(behav_weight_cap=2.0, behav_weight_cap_mode=mode)
        assert old.correction == correction
        (loss_old, stats_old), (loss_new, stats_new) = _run(x, old), _run(x, PPOConfig(rollout_correction=correction))
        assert float(loss_old) == float(loss_new) and stats_old.keys() == stats_new.keys()
    loaded = load(TrainerConfig, overrides=["ppo.behav_weight_cap=5.0", "ppo.behav_weight_cap_mode=clamp"])
    assert loaded.ppo.correction == RolloutCorrectionConfig(is_mode="truncate", is_high=5.0)


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["ppo.rollout_correction.is_low=0.1"], "ppo.rollout_correction.is_low", "bounds 'mask' only"),
        (["ppo.rollout_correction.rs_level=geometric"], "ppo.rollout_correction.rs_high", "is null but rs_level"),
        (
            [
                "ppo.rollout_correction.rs_level=token",
                "ppo.rollout_correction.rs_high=2",
                "ppo.rollout_correction.rs_low=3",
            ],
            "ppo.rollout_correction.rs_low",
            "must be below rs_high=2.0",
        ),
        (["ppo.rollout_correction.rs_high=2"], "ppo.rollout_correction.rs_high", "rs_level is 'none'"),
        (["ppo.rollout_correction.is_high=0"], "ppo.rollout_correction.is_high", "allowed: > 0.0"),
        (["ppo.rollout_correction.is_mode=clip"], "ppo.rollout_correction.is_mode", "allowed: 'plain', 'truncate'"),
        (
            ["ppo.decoupled=false", "ppo.rollout_correction.is_mode=mask"],
            "ppo.rollout_correction",
            "decoupled is false",
        ),
        (
            ["ppo.behav_weight_cap=5", "ppo.rollout_correction.rs_level=token", "ppo.rollout_correction.rs_high=2"],
            "ppo.behav_weight_cap",
            "set only one",
        ),
    ],
)
def test_bad_values_name_the_key_and_the_allowed_range(overrides, key, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        load(TrainerConfig, overrides=overrides)
    assert err.value.key == key
    assert hash(RolloutCorrectionConfig(rs_level="geometric", rs_high=1.001)) == hash(
        RolloutCorrectionConfig(rs_level="geometric", rs_high=1.001)
    )
