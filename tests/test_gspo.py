"""GSPO (`ppo.ratio_level: sequence`) and sequence-mean aggregation (`ppo.loss_agg: seq_mean_token_mean`): loss and
gradient against NumPy and against GSPO's sequence objective, the global sequence count, micro-batch invariance."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.packing import PackingConfig, fixed_count_plan, pack_sequences
from areal_jax.objectives import PPOConfig, RolloutCorrectionConfig, count_loss_sequences, ppo_loss
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.train_step import TrainStep
from tests.test_train_step import (
    CONFIG,
    TEMPERATURE,
    loss_and_gradient,
    make_trajectories,
    single_device_mesh,
    tiny_model_state,
)

# Row 0: sequences 1 (3 loss tokens) and 2 (2); row 1: sequence 1 (prompt + 1 loss token), sequence 2 (3 of 4).
SEG = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]], np.int32)
MASK = np.array([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 1]], bool)
SEQS = [(0, 1), (0, 2), (1, 1), (1, 2)]
GSPO = PPOConfig(ratio_level="sequence", eps_clip_low=3e-4, eps_clip_high=4e-4, loss_agg="seq_mean_token_mean")


def _inputs(seed: int, same_prox_and_behav: bool = False):
    """Log-probs whose sequence log-ratios are about +1e-3 (A > 0: clipped), 1e-4 (inside the clip range),
    -1e-3 (A < 0: clipped) and +1e-3 (A < 0: not clipped), with one advantage per sequence."""
    rng = np.random.default_rng(seed)
    behav = -rng.uniform(0.5, 3.0, SEG.shape)
    prox = behav + (0.0 if same_prox_and_behav else rng.normal(0, 1e-3, SEG.shape))
    logp, adv = prox + rng.normal(0, 1e-5, SEG.shape), np.zeros(SEG.shape)
    for (b, s), delta, a in zip(SEQS, (1e-3, 1e-4, -1e-3, 1e-3), (1.0, 0.5, -0.7, -1.2), strict=True):
        logp[b, SEG[b] == s] += delta
        adv[b, SEG[b] == s] = a
    return {"logp": logp, "behav": behav, "prox": prox, "adv": adv}


def _run(x, cfg, logp=None, n_seqs=4):
    return ppo_loss(
        jnp.asarray(x["logp"] if logp is None else logp),
        jnp.asarray(x["behav"]),
        jnp.asarray(x["adv"]),
        jnp.asarray(MASK),
        int(MASK.sum()),
        cfg,
        logp_prox_BxL=jnp.asarray(x["prox"]),
        segment_ids_BxL=jnp.asarray(SEG),
        num_loss_sequences_global=n_seqs,
    )


def np_gspo_objective(x, logp, cfg: PPOConfig) -> float:
    """GSPO's sequence objective (Zheng et al. Eq. 5, negated): the mean over sequences of the clipped term."""
    total = 0.0
    for b, s in SEQS:
        at = (SEG[b] == s) & MASK[b]
        ratio = np.exp(np.mean(logp[b][at] - x["prox"][b][at]))
        adv = x["adv"][b][at][0]
        term = max(-adv * ratio, -adv * np.clip(ratio, 1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high))
        total += term
    return total / len(SEQS)


def test_gspo_loss_and_gradient_match_numpy_and_the_sequence_objective():
    """The token form sg(s_i) * pi / sg(pi) has the value of s_i on every token and GSPO's gradient: with one
    advantage per sequence its seq-mean token-mean loss is the sequence objective, and so is its gradient
    (here against central finite differences of the NumPy sequence objective). The proximal policy is the
    behaviour one (w = 1, as in GSPO); otherwise each token's gradient carries its own w."""
    with jax.enable_x64(True):
        x = _inputs(0, same_prox_and_behav=True)
        loss, stats = jax.jit(_run, static_argnums=1)(x, GSPO)
        grad = np.asarray(jax.jit(jax.grad(lambda lp: _run(x, GSPO, logp=lp)[0]))(jnp.asarray(x["logp"])))
    # clipped: the sequences of +1e-3 with A > 0 (3 loss tokens) and of -1e-3 with A < 0 (1)
    np.testing.assert_allclose(float(stats["ppo/clip_frac"]), 4 / MASK.sum())
    np.testing.assert_allclose(float(loss), np_gspo_objective(x, x["logp"], GSPO), rtol=1e-12)
    h, fd = 1e-7, np.zeros(SEG.shape)
    for idx in zip(*np.nonzero(MASK), strict=True):
        step = np.zeros(SEG.shape)
        step[idx] = h
        plus = np_gspo_objective(x, x["logp"] + step, GSPO)
        fd[idx] = (plus - np_gspo_objective(x, x["logp"] - step, GSPO)) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-9)


def test_gspo_token_form_matches_numpy():
    """Per token: u_t = s_i, c_t = max(-A u, -A clip(u)), L_t = w_t c_t; d c_t / d logp_t = -A s_i where unclipped."""
    cfg = PPOConfig(ratio_level="sequence", eps_clip_low=3e-4, eps_clip_high=4e-4)  # token-mean aggregation
    with jax.enable_x64(True):
        x = _inputs(1)
        loss, stats = jax.jit(_run, static_argnums=1)(x, cfg)
        grad = np.asarray(jax.jit(jax.grad(lambda lp: _run(x, cfg, logp=lp)[0]))(jnp.asarray(x["logp"])))
    s = np.zeros(SEG.shape)
    for b, q in SEQS:
        at = (SEG[b] == q) & MASK[b]
        s[b, SEG[b] == q] = np.exp(np.mean(x["logp"][b][at] - x["prox"][b][at]))
    w = np.exp(x["prox"] - x["behav"])
    plain, clipped = -x["adv"] * s, -x["adv"] * np.clip(s, 1 - 3e-4, 1 + 4e-4)
    n = MASK.sum()
    np.testing.assert_allclose(float(loss), np.sum(np.where(MASK, w * np.maximum(plain, clipped), 0)) / n, rtol=1e-12)
    np.testing.assert_allclose(float(stats["ppo/ratio_mean"]), s[MASK].mean(), rtol=1e-12)
    expected = np.where(MASK & (plain >= clipped), -w * x["adv"] * s, 0.0) / n
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-14)


def test_seq_mean_token_mean_of_token_ratios_matches_numpy():
    cfg = PPOConfig(loss_agg="seq_mean_token_mean")
    x = _inputs(2)
    loss, _ = _run(x, cfg, n_seqs=7)  # other micro-batches hold 3 more sequences
    u, w = np.exp(x["logp"] - x["prox"]), np.exp(x["prox"] - x["behav"])
    token = w * np.maximum(-x["adv"] * u, -x["adv"] * np.clip(u, 0.8, 1.2))
    expected = sum(token[b][(SEG[b] == s) & MASK[b]].mean() for b, s in SEQS) / 7
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_count_loss_sequences_and_missing_inputs():
    assert int(count_loss_sequences(jnp.asarray(SEG), jnp.asarray(MASK))) == 4
    no_loss = MASK.copy()
    no_loss[1, 1] = False  # row 1's first sequence has no loss token left
    assert int(count_loss_sequences(jnp.asarray(SEG)[None], jnp.asarray(no_loss)[None])) == 3
    x = _inputs(3)
    args = [jnp.asarray(v) for v in (x["logp"], x["behav"], x["adv"], MASK)]
    with pytest.raises(ValueError, match="segment_ids_BxL is None"):
        ppo_loss(*args, 10, GSPO, logp_prox_BxL=jnp.asarray(x["prox"]), num_loss_sequences_global=4)
    with pytest.raises(ValueError, match="num_loss_sequences_global is None"):
        ppo_loss(*args, 10, GSPO, logp_prox_BxL=jnp.asarray(x["prox"]), segment_ids_BxL=jnp.asarray(SEG))
    with pytest.raises(ConfigError, match="ratio_level: got 'seq'"):
        PPOConfig(ratio_level="seq")


def test_gspo_loss_and_gradient_invariant_to_micro_batching_and_packing():
    """With the global sequence count, the sum over micro-batches of loss and gradient is the same however the
    sequences are packed (toy policy: token log-prob linear in the parameters)."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(3, 20, size=10)
    tokens = [rng.integers(0, 11, n) for n in lengths]
    behav = [-rng.uniform(0.5, 2.5, n) for n in lengths]
    adv = rng.normal(size=len(lengths)).astype(np.float32)
    loss_mask = [np.arange(n) >= 2 for n in lengths]
    params = jnp.asarray(rng.normal(size=11), jnp.float32)
    cfg = PPOConfig(decoupled=False, ratio_level="sequence", loss_agg="seq_mean_token_mean", eps_clip_high=0.01)

    def loss_and_grad(plan):
        micro = list(
            zip(
                plan.pack(tokens),
                plan.pack([b.astype(np.float32) for b in behav]),
                plan.broadcast(adv),
                plan.pack(loss_mask, pad_value=False),
                plan.segment_ids(),
                strict=True,
            )
        )
        n_tokens = int(sum(m.sum() for m in loss_mask))
        n_seqs = sum(int(count_loss_sequences(jnp.asarray(m[4]), jnp.asarray(m[3]))) for m in micro)
        assert n_seqs == len(lengths)

        def total(params):
            out = 0.0
            for tok, beh, a, m, seg in micro:
                logp = 0.1 * params[tok] - 1.0
                out = (
                    out
                    + ppo_loss(logp, beh, a, m, n_tokens, cfg, segment_ids_BxL=seg, num_loss_sequences_global=n_seqs)[0]
                )
            return out

        return jax.jit(jax.value_and_grad(total))(params)

    plans = [
        fixed_count_plan(lengths, len(lengths)),
        fixed_count_plan(lengths, 3),
        pack_sequences(lengths, PackingConfig(token_budget=64, rows=2)),
    ]
    (loss, grad), *others = [loss_and_grad(plan) for plan in plans]
    assert float(jnp.abs(grad).sum()) > 0
    for other_loss, other_grad in others:
        np.testing.assert_allclose(other_loss, loss, rtol=1e-5)
        np.testing.assert_allclose(other_grad, grad, rtol=1e-4, atol=1e-7)


def test_train_step_normalises_by_the_global_sequence_count_across_microbatches():
    """The train step's scan over micro-batches: GSPO, seq-mean aggregation and a sequence-level correction give
    the same loss and gradient in one micro-batch as in two (each normalised by the mini-batch's sequences)."""
    correction = RolloutCorrectionConfig(is_level="sequence", is_mode="truncate", is_high=1.5)
    ppo = GSPO.replace(rollout_correction=correction, prox_logp_method="recompute")
    config = CONFIG.replace(ppo=ppo)
    graphdef, state = tiny_model_state()
    step = TrainStep(graphdef, state, config, single_device_mesh(), temperature=TEMPERATURE)
    trajectories = make_trajectories(np.random.default_rng(1), 8, lengths=(4, 17))
    trajectories = [dataclasses.replace(t, reward=float(i % 2)) for i, t in enumerate(trajectories)]
    (batch_one,) = build_batch(trajectories, config).minibatches
    (batch_two,) = build_batch(trajectories, config, lambda n: fixed_count_plan(n, 4)).minibatches
    assert batch_one.shape[0] == 1 and batch_two.shape[0] == 2
    params, _ = step.init(state)
    results = []
    for batch in (batch_one, batch_two):
        device_batch = step.put_batch(batch)
        prox = step.logprobs(params, device_batch)
        results.append(loss_and_gradient(step, params, device_batch, prox))
    (loss_one, grads_one, stats_one), (loss_two, grads_two, stats_two) = results
    assert float(stats_one["correction/seq/n_seqs"]) == float(stats_two["correction/seq/n_seqs"]) == 8
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(grads_one)) > 0
    np.testing.assert_allclose(float(loss_two), float(loss_one), atol=1e-6)
    np.testing.assert_allclose(float(stats_two["correction/ess"]), float(stats_one["correction/ess"]), rtol=1e-5)
    for g_two, g_one in zip(jax.tree.leaves(grads_two), jax.tree.leaves(grads_one), strict=True):
        np.testing.assert_allclose(np.asarray(g_two), np.asarray(g_one), atol=1e-6, rtol=0)
