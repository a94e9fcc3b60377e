"""Sampling: reported log-probs are those of the distribution actually sampled (chi-square checks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from areal_jax.inference.sampling import sample_slots, truncate_logits

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
