"""Sampling: reported log-probs are those of the distribution actually sampled (chi-square checks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from areal_jax.inference.sampling import CDF_BLOCK, inverse_cdf_draw, sample_slots, truncate_logits

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
DRAWS = 20_000


def _reference_distribution(temperature, top_k, top_p):
    z = LOGITS.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    k = top_k if top_k > 0 else len(z)
    top = order[:k]
    p = np.exp(z[top] - z[top].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    kept = top[before < top_p]
    keep[kept] = True
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.8)]
)
def test_empirical_frequencies_match_reported_logprobs(temperature, top_k, top_p):
    expected = _reference_distribution(temperature, top_k, top_p)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    keys = jax.random.split(jax.random.key(7), DRAWS)
    tokens, logp = jax.jit(sample_slots)(
        logits,
        keys,
        jnp.full((DRAWS,), temperature),
        jnp.full((DRAWS,), top_k, jnp.int32),
        jnp.full((DRAWS,), top_p),
    )
    tokens, logp = np.asarray(tokens), np.asarray(logp)
    # every reported log-prob is the reference log-prob of that token
    np.testing.assert_allclose(np.exp(logp), expected[tokens], rtol=1e-5)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    assert counts[expected == 0].sum() == 0, "sampled a token outside the top-k/top-p set"
    support = expected > 0
    result = stats.chisquare(counts[support], DRAWS * expected[support])
    assert result.pvalue > 1e-3, (counts, DRAWS * expected)


def test_greedy_rows_take_argmax_and_report_untempered_logprob():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]))
    tokens, logp = sample_slots(
        logits, jax.random.split(jax.random.key(0), 2), jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2)
    )
    assert tokens.tolist() == [0, 7]
    np.testing.assert_allclose(logp, jax.nn.log_softmax(logits)[jnp.arange(2), tokens], rtol=1e-6)


def test_truncation_keeps_at_least_one_token_and_ties():
    z = jnp.asarray([[1.0, 1.0, 0.0, -1.0]])
    out = truncate_logits(z, jnp.asarray([1]), jnp.asarray([1.0]))
    assert np.isfinite(np.asarray(out)).tolist() == [[True, True, False, False]]
    out = truncate_logits(z, jnp.asarray([0]), jnp.asarray([1e-6]))
    assert np.isfinite(np.asarray(out)).sum() >= 1


def test_the_two_level_draw_is_the_first_id_past_u_times_the_total():
    """`inverse_cdf_draw` (block sums, then one block) against a float64 running sum over the whole row: a
    vocabulary that is not a multiple of the block, rows with mass in few blocks, and u at 0 and 1."""
    rng = np.random.default_rng(3)
    rows, vocab = 512, 1000  # 3 full blocks of CDF_BLOCK and a partial one
    assert vocab % CDF_BLOCK and vocab > 3 * CDF_BLOCK
    weights = rng.exponential(size=(rows, vocab)).astype(np.float32)
    weights[rows // 2 :, rng.random(vocab) < 0.9] = 0.0  # mass in scattered ids only
    weights[-1, :] = 0.0
    weights[-1, [5, 700]] = 1.0  # two ids, blocks apart
    uniform = rng.random(rows).astype(np.float32)
    uniform[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 1.0]
    drawn = np.asarray(jax.jit(inverse_cdf_draw)(jnp.asarray(weights), jnp.asarray(uniform)))

    cdf = np.cumsum(weights.astype(np.float64), axis=-1)
    threshold = uniform.astype(np.float64) * cdf[:, -1]
    expected = np.minimum((cdf <= threshold[:, None]).sum(-1), [np.flatnonzero(w).max() for w in weights])
    near_a_boundary = np.abs(cdf[np.arange(rows), expected] - threshold) < 1e-5 * cdf[:, -1]
    assert np.all(weights[np.arange(rows), drawn] > 0), "drew an id without mass"
    moved = drawn != expected
    assert not np.any(moved & ~near_a_boundary), np.flatnonzero(moved)  # fp32 rounding moves only those
    assert moved.sum() <= 2, np.flatnonzero(moved)
    assert drawn[2] == np.flatnonzero(weights[2]).max()  # u = 1: the last id with mass
