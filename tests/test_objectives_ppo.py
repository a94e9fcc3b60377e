"""The PPO loss against a NumPy re-statement, its gradients, its statistics, and micro-batch invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.packing import PackingConfig, fixed_count_plan, pack_sequences
from areal_jax.objectives import PPOConfig, kl_estimate, merge_stats, ppo_loss

B, L = 4, 16
ppo_loss_jit = jax.jit(ppo_loss, static_argnames="config")


def make_batch(seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random packed tokens with masked tokens, an all-masked row, A = 0 tokens and huge and tiny w."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 3.0, (B, L))
    logp_behav = logp + rng.normal(0.0, 0.3, (B, L))
    logp_prox = logp + rng.normal(0.0, 0.3, (B, L))
    logp_prox[0, :3] = logp_behav[0, :3] + np.array([9.0, -9.0, 4.0])  # w ~ 8e3, 1e-4, 55
    adv = rng.normal(0.0, 1.0, (B, L))
    adv[1, ::4] = 0.0
    mask = rng.uniform(size=(B, L)) < 0.8
    mask[0, :3] = True
    mask[2] = False
    return {
        "logp": logp.astype(dtype),
        "logp_behav": logp_behav.astype(dtype),
        "logp_prox": logp_prox.astype(dtype),
        "logp_ref": (logp + rng.normal(0.0, 0.2, (B, L))).astype(dtype),
        "adv": adv.astype(dtype),
        "mask": mask,
        "entropy": rng.uniform(0.0, 2.0, (B, L)).astype(dtype),
        "version": rng.integers(0, 8, (B, L)).astype(np.int32),
    }


def np_token_loss(batch: dict[str, np.ndarray], logp: np.ndarray, cfg: PPOConfig) -> np.ndarray:
    """NumPy re-statement of the per-token loss L_t (AReaL Eq. 5), without masking."""
    logp = logp.astype(np.float64)
    behav, prox, adv = (batch[k].astype(np.float64) for k in ("logp_behav", "logp_prox", "adv"))
    u = np.exp(logp - (prox if cfg.decoupled else behav))
    term = np.maximum(-adv * u, -adv * np.clip(u, 1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high))
    if cfg.dual_clip is not None:
        term = np.where(adv < 0, np.minimum(term, cfg.dual_clip * np.abs(adv)), term)
    if not cfg.decoupled:
        return term
    w = np.exp(prox - behav)
    if cfg.behav_weight_cap is not None:
        if cfg.behav_weight_cap_mode == "mask":
            w = np.where(w > cfg.behav_weight_cap, 0.0, w)
        else:
            w = np.minimum(w, cfg.behav_weight_cap)
    return w * term


def np_loss(batch: dict[str, np.ndarray], logp: np.ndarray, cfg: PPOConfig, n_global: int) -> float:
    loss = np.sum(np.where(batch["mask"], np_token_loss(batch, logp, cfg), 0.0)) / max(n_global, 1)
    if cfg.kl_coef > 0:
        log_r = batch["logp_ref"].astype(np.float64) - logp
        kl = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}[cfg.kl_estimator]
        loss += cfg.kl_coef * np.sum(np.where(batch["mask"], kl, 0.0)) / max(n_global, 1)
    return float(loss)


def run_loss(batch, cfg, n_global, logp=None, **extra):
    return ppo_loss_jit(
        jnp.asarray(batch["logp"] if logp is None else logp),
        jnp.asarray(batch["logp_behav"]),
        jnp.asarray(batch["adv"]),
        jnp.asarray(batch["mask"]),
        n_global,
        cfg,
        logp_prox_BxL=jnp.asarray(batch["logp_prox"]),
        logp_ref_BxL=jnp.asarray(batch["logp_ref"]) if cfg.kl_coef > 0 else None,
        **extra,
    )


VARIANTS = {
    "plain": PPOConfig(decoupled=False),
    "plain_dual": PPOConfig(decoupled=False, dual_clip=3.0),
    "decoupled": PPOConfig(),
    "decoupled_asym_dual": PPOConfig(eps_clip_low=0.2, eps_clip_high=0.28, dual_clip=2.0),
    "decoupled_cap_mask": PPOConfig(behav_weight_cap=5.0, behav_weight_cap_mode="mask"),
    "decoupled_cap_clamp": PPOConfig(behav_weight_cap=5.0, behav_weight_cap_mode="clamp", dual_clip=3.0),
    "decoupled_kl_k3": PPOConfig(kl_coef=0.1, kl_estimator="k3"),
    "plain_kl_k1": PPOConfig(decoupled=False, kl_coef=0.05, kl_estimator="k1"),
    "decoupled_kl_k2": PPOConfig(kl_coef=0.2, kl_estimator="k2", behav_weight_cap=3.0),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_loss_matches_numpy(name):
    cfg = VARIANTS[name]
    for seed in range(3):
        batch = make_batch(seed)
        n_global = int(batch["mask"].sum()) + 7  # other shards hold more loss tokens
        loss, stats = run_loss(batch, cfg, n_global)
        np.testing.assert_allclose(loss, np_loss(batch, batch["logp"], cfg, n_global), rtol=2e-5, atol=1e-6)
        assert all(np.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", VARIANTS)
def test_gradient_matches_finite_differences(name):
    cfg = VARIANTS[name]
    with jax.enable_x64(True):
        batch = make_batch(3, dtype=np.float64)
        n_global = int(batch["mask"].sum())
        grad = jax.jit(jax.grad(lambda lp: run_loss(batch, cfg, n_global, logp=lp)[0]))(jnp.asarray(batch["logp"]))
        grad = np.asarray(grad)
    assert grad.dtype == np.float64
    h = 1e-6
    fd = np.zeros((B, L))
    for idx in np.ndindex(B, L):
        step = np.zeros((B, L))
        step[idx] = h
        plus = np_loss(batch, batch["logp"] + step, cfg, n_global)
        minus = np_loss(batch, batch["logp"] - step, cfg, n_global)
        fd[idx] = (plus - minus) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)
    assert np.all(grad[~batch["mask"]] == 0)


def test_behaviour_weight_carries_no_gradient():
    batch = make_batch(4)
    n = int(batch["mask"].sum())

    def loss_of_behav(logp_behav):
        return ppo_loss(
            jnp.asarray(batch["logp"]),
            logp_behav,
            jnp.asarray(batch["adv"]),
            jnp.asarray(batch["mask"]),
            n,
            PPOConfig(),
            logp_prox_BxL=jnp.asarray(batch["logp_prox"]),
        )[0]

    assert np.all(np.asarray(jax.jit(jax.grad(loss_of_behav))(jnp.asarray(batch["logp_behav"]))) == 0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_decoupled_with_prox_equal_behav_is_plain_ppo(dual_clip):
    batch = make_batch(5)
    batch["logp_prox"] = batch["logp_behav"].copy()
    n = int(batch["mask"].sum())
    decoupled = PPOConfig(eps_clip_high=0.3, dual_clip=dual_clip)
    plain = PPOConfig(decoupled=False, eps_clip_high=0.3, dual_clip=dual_clip)

    def grad_and_loss(cfg):
        return jax.jit(jax.value_and_grad(lambda lp: run_loss(batch, cfg, n, logp=lp)[0]))(jnp.asarray(batch["logp"]))

    (loss_d, grad_d), (loss_p, grad_p) = grad_and_loss(decoupled), grad_and_loss(plain)
    np.testing.assert_allclose(loss_d, loss_p, rtol=1e-6)
    np.testing.assert_allclose(grad_d, grad_p, rtol=1e-6, atol=1e-9)


def test_unbounded_clip_is_importance_weighted_policy_gradient():
    batch = make_batch(6)
    n = int(batch["mask"].sum())
    cfg = PPOConfig(eps_clip_low=float("inf"), eps_clip_high=float("inf"))
    loss, stats = run_loss(batch, cfg, n)
    logp, behav, prox, adv = (batch[k].astype(np.float64) for k in ("logp", "logp_behav", "logp_prox", "adv"))
    expected = np.sum(np.where(batch["mask"], -np.exp(prox - behav) * adv * np.exp(logp - prox), 0.0)) / n
    np.testing.assert_allclose(loss, expected, rtol=2e-5)
    assert stats["ppo/clip_frac"] == 0


def test_all_masked_batch_gives_zero_and_no_nan():
    batch = make_batch(7)
    batch["mask"][:] = False
    batch["logp"][:] = np.nan  # never read
    cfg = PPOConfig(dual_clip=3.0, behav_weight_cap=2.0, kl_coef=0.1)
    loss, stats = run_loss(batch, cfg, 0, token_version_BxL=jnp.asarray(batch["version"]), trainer_version=5)
    assert loss == 0
    assert all(np.isfinite(v) for v in stats.values())
    grad = jax.jit(jax.grad(lambda lp: run_loss(batch, cfg, 0, logp=lp)[0]))(jnp.zeros((B, L)))
    assert np.all(np.asarray(grad) == 0)


def test_statistics_match_numpy():
    batch = make_batch(8)
    cfg = PPOConfig(dual_clip=2.0, behav_weight_cap=5.0, eps_clip_high=0.28, num_staleness_buckets=3)
    trainer_version = 6
    _, stats = run_loss(
        batch,
        cfg,
        int(batch["mask"].sum()),
        entropy_BxL=jnp.asarray(batch["entropy"]),
        token_version_BxL=jnp.asarray(batch["version"]),
        trainer_version=trainer_version,
    )
    logp, behav, prox, adv = (batch[k].astype(np.float64) for k in ("logp", "logp_behav", "logp_prox", "adv"))
    u = np.exp(logp - prox)
    w = np.exp(prox - behav)
    plain_term, clip_term = -adv * u, -adv * np.clip(u, 0.8, 1.28)
    per_token = {
        "clip_frac": (clip_term > plain_term).astype(float),
        "dual_clip_frac": ((adv < 0) & (np.maximum(plain_term, clip_term) > 2.0 * np.abs(adv))).astype(float),
        "iw_mean": w,
        "approx_kl": w * np.log(w) - w + 1,
        "ratio_mean": u,
    }
    masked = (w > 5.0).astype(float)  # behav_weight_cap 5 (mask) is short for a token-level MIS on [0, 5]
    mask = batch["mask"]
    staleness = np.clip(trainer_version - batch["version"], 0, 3)
    buckets = [(lab, mask & (staleness == k)) for k, lab in enumerate(["0", "1", "2", ">=3"])]
    for label, bucket in [(None, mask), *buckets]:
        prefix = "ppo" if label is None else f"staleness/{label}"
        correction = "correction" if label is None else f"correction/staleness/{label}"
        assert stats[f"{prefix}/n_tokens"] == bucket.sum() == stats[f"{correction}/n_tokens"]
        expected_means = {f"{prefix}/{name}": values for name, values in per_token.items()}
        expected_means[f"{correction}/masked_frac"] = masked
        for key, values in expected_means.items():
            expected = values[bucket].mean() if bucket.any() else 0.0
            np.testing.assert_allclose(stats[key], expected, rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(stats[f"{prefix}/iw_max"], w[bucket].max() if bucket.any() else 0.0, rtol=1e-5)
    np.testing.assert_allclose(stats["ppo/entropy"], batch["entropy"][mask].mean(), rtol=1e-5)


def test_kl_estimators_match_schulman():
    rng = np.random.default_rng(9)
    logp, logp_ref = -rng.uniform(0, 3, (B, L)), -rng.uniform(0, 3, (B, L))
    log_r = logp_ref - logp
    expected = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}
    for name, value in expected.items():
        got = kl_estimate(jnp.asarray(logp, jnp.float32), jnp.asarray(logp_ref, jnp.float32), name)
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(kl_estimate(jnp.asarray(logp), jnp.asarray(logp_ref), "k3")) >= 0)
    with pytest.raises(ValueError, match="'k4'"):
        kl_estimate(jnp.asarray(logp), jnp.asarray(logp_ref), "k4")


def test_stats_of_row_splits_merge_to_whole_batch_stats():
    batch = make_batch(10)
    cfg = PPOConfig(dual_clip=2.0, behav_weight_cap=5.0, kl_coef=0.1)
    n = int(batch["mask"].sum())
    extra = {"token_version_BxL": jnp.asarray(batch["version"]), "trainer_version": 4}
    whole_loss, whole = run_loss(batch, cfg, n, **extra)
    parts = []
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        part = {k: v[rows] for k, v in batch.items()}
        parts.append(run_loss(part, cfg, n, token_version_BxL=jnp.asarray(part["version"]), trainer_version=4))
    np.testing.assert_allclose(sum(loss for loss, _ in parts), whole_loss, rtol=1e-6)
    merged = merge_stats(jax.tree.map(lambda *x: jnp.stack(x), *[s for _, s in parts]))
    assert merged.keys() == whole.keys()
    for key in whole:
        np.testing.assert_allclose(merged[key], whole[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_merge_rule_over_microbatches_and_over_updates():
    stats = {
        "ppo/n_tokens": np.array([3.0, 1.0]),
        "ppo/clip_frac": np.array([0.2, 0.6]),
        "ppo/iw_max": np.array([1.5, 2.5]),
        "ppo/pg_loss": np.array([0.4, 0.2]),
        "train/loss": np.array([0.5, 0.3]),
        "train/grad_norm": np.array([1.0, 2.0]),
        "train/lr": np.array([1e-3, 2e-3]),
        "train/skipped_updates": np.array([1.0, 0.0]),
        "train/loss_tokens": np.array([3.0, 1.0]),
    }
    stats = {key: value.astype(np.float32) for key, value in stats.items()}
    common = {
        "ppo/n_tokens": 4.0,
        "ppo/clip_frac": (3 * 0.2 + 0.6) / 4,
        "ppo/iw_max": 2.5,
        "train/grad_norm": 1.5,
        "train/lr": 2e-3,
        "train/skipped_updates": 1.0,
        "train/loss_tokens": 4.0,
    }
    for over, loss_parts in (
        ("microbatches", {"ppo/pg_loss": 0.6, "train/loss": 0.8}),
        ("updates", {"ppo/pg_loss": 0.3, "train/loss": 0.4}),
    ):
        merged = merge_stats(stats, over=over)
        assert merged.keys() == stats.keys()
        for key, expected in (common | loss_parts).items():
            np.testing.assert_allclose(merged[key], expected, rtol=1e-6, err_msg=f"{over} {key}")
    single = merge_stats({key: value[:1] for key, value in stats.items()}, over="updates")
    assert {key: float(value) for key, value in single.items()} == {
        key: float(value[0]) for key, value in stats.items()
    }


def test_missing_inputs_and_bad_shapes_are_refused():
    batch = make_batch(11)
    args = [jnp.asarray(batch[k]) for k in ("logp", "logp_behav", "adv", "mask")]
    with pytest.raises(ValueError, match="logp_prox_BxL is None"):
        ppo_loss(*args, 10, PPOConfig())
    with pytest.raises(ValueError, match=r"kl_coef is 0\.1"):
        ppo_loss(*args, 10, PPOConfig(decoupled=False, kl_coef=0.1))
    with pytest.raises(ValueError, match=r"adv_BxL has shape \(4, 15\)"):
        ppo_loss(args[0], args[1], args[2][:, 1:], args[3], 10, PPOConfig(decoupled=False))


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match=r"dual_clip: value 1\.0 is out of range"):
        PPOConfig(dual_clip=1.0)
    with pytest.raises(ConfigError, match=r"behav_weight_cap: got 2\.0 but decoupled is false"):
        PPOConfig(decoupled=False, behav_weight_cap=2.0)
    assert hash(PPOConfig()) == hash(PPOConfig())


# Micro-batch invariance: a toy policy whose token log-prob is linear in the parameters.

VOCAB = 23


def toy_sequences(seed: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 31, size=14)
    tokens = [rng.integers(0, VOCAB, n) for n in lengths]
    behav = [-rng.uniform(0.5, 2.5, n) for n in lengths]
    prox = [b + rng.normal(0, 0.3, len(b)) for b in behav]
    adv = rng.normal(size=len(lengths))
    loss_mask = [np.arange(n) >= 2 for n in lengths]  # two prompt tokens per sequence
    return lengths, tokens, behav, prox, adv, loss_mask


def packed_loss_and_grad(plan, sequences, params, cfg):
    """Sum over the plan's micro-batches of the loss with the global token count, and its gradient."""
    _, tokens, behav, prox, adv, loss_mask = sequences
    n_global = int(sum(m.sum() for m in loss_mask))
    micro = list(
        zip(
            plan.pack(tokens),
            plan.pack([b.astype(np.float32) for b in behav]),
            plan.pack([p.astype(np.float32) for p in prox]),
            plan.broadcast(adv.astype(np.float32)),
            plan.pack(loss_mask, pad_value=False),
            strict=True,
        )
    )

    def total(params):
        out = 0.0
        for tok, beh, prx, a, m in micro:
            logp = 0.1 * params[tok] - 1.0
            out = out + ppo_loss(logp, beh, a, m, n_global, cfg, logp_prox_BxL=prx)[0]
        return out

    return jax.jit(jax.value_and_grad(total))(params)


@pytest.mark.parametrize("cfg", [PPOConfig(dual_clip=3.0, behav_weight_cap=2.0), PPOConfig(decoupled=False)])
def test_loss_and_grad_invariant_to_micro_batching_and_packing(cfg):
    sequences = toy_sequences(12)
    lengths = sequences[0]
    params = jnp.asarray(np.random.default_rng(13).normal(size=VOCAB), jnp.float32)
    plans = [
        fixed_count_plan(lengths, len(lengths)),  # one micro-batch, one sequence per row
        fixed_count_plan(lengths, 3),
        pack_sequences(lengths, PackingConfig(token_budget=512, rows=16)),  # one micro-batch
        pack_sequences(lengths, PackingConfig(token_budget=64, rows=2)),
        pack_sequences(lengths, PackingConfig(token_budget=96, rows=3, microbatch_rounding="pow2")),
    ]
    assert [p.num_microbatches for p in plans][:3] == [1, 5, 1]
    results = [packed_loss_and_grad(plan, sequences, params, cfg) for plan in plans]
    loss_ref, grad_ref = results[0]
    assert np.any(np.asarray(grad_ref) != 0)
    for loss, grad in results[1:]:
        np.testing.assert_allclose(loss, loss_ref, rtol=0, atol=1e-6)
        np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-8)
