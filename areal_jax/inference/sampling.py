"""Token sampling that reports the log-prob of each drawn token under the distribution it came from.

Per row (request slot) with temperature tau, top-k k and top-p p:
  1. z = logits / tau                                   (tau = 0 means greedy: argmax of the logits)
  2. top-k keeps the k largest z (k = 0: all);
  3. top-p keeps, of those, the smallest prefix (by decreasing z) whose renormalised mass reaches p
     (p = 1: all); ties with the last kept value are kept too;
  4. the token is drawn from softmax(z) restricted to the kept set, and its reported log-prob is
     log softmax over the kept set: the *behaviour* distribution actually sampled.
The decoder already masks the logits of padded embedding rows (ids >= `ModelConfig.vocab_limit`), so
they get no mass here, and the trainer's recomputed log-probs (`Decoder.token_logprobs` at the same
tau) are over the same usable vocabulary. With plain temperature sampling behaviour and trainer
log-probs therefore agree exactly; with top-k/top-p the behaviour log-prob is larger by log(mass of
the kept set), and the decoupled objective's importance weight pi_prox / pi_behav then accounts for
the truncation (see docs/sampling.md). Greedy tokens report their log-prob under softmax(logits)
(tau = 1, no truncation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from areal_jax.configuration import Config, option

CDF_BLOCK = 256  # vocabulary ids per block of the two-level running sum (`inverse_cdf_draw`)


@dataclasses.dataclass(frozen=True)
class SamplingParams(Config):
    """How to sample one request."""

    temperature: float = option(1.0, ge=0, doc="softmax temperature; 0 = greedy")
    top_k: int = option(0, ge=0, doc="keep the k most likely tokens; 0 = off")
    top_p: float = option(1.0, gt=0, le=1, doc="nucleus mass to keep; 1 = off")
    max_new_tokens: int = option(256, ge=1, doc="generated tokens at most")
    stop_token_ids: tuple[int, ...] = option((), doc="tokens that end a sample (included in the output)")
    stop_strings: tuple[str, ...] = option((), doc="texts that end a sample once its decoded output contains one")
    seed: int | None = option(None, ge=0, doc="per-request seed; null = drawn by the generator")


def truncation_threshold(scaled_SxV: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array) -> jax.Array:
    """Per row, the smallest scaled logit inside its top-k / top-p set (see module docstring)."""
    vocab = scaled_SxV.shape[-1]
    sorted_SxV = -jnp.sort(-scaled_SxV, axis=-1)
    k_S = jnp.where(top_k_S > 0, jnp.minimum(top_k_S, vocab), vocab)
    rank_1xV = jnp.arange(vocab)[None, :]
    in_top_k_SxV = rank_1xV < k_S[:, None]
    probs_SxV = jax.nn.softmax(jnp.where(in_top_k_SxV, sorted_SxV, -jnp.inf), axis=-1)
    mass_before_SxV = jnp.cumsum(probs_SxV, axis=-1) - probs_SxV
    kept_S = jnp.sum(in_top_k_SxV & (mass_before_SxV < top_p_S[:, None]), axis=-1)
    kept_S = jnp.maximum(kept_S, 1)
    return jnp.take_along_axis(sorted_SxV, (kept_S - 1)[:, None], axis=-1)[:, 0]


def truncate_logits(scaled_SxV: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array) -> jax.Array:
    """Set to -inf every entry outside each row's top-k / top-p set (see module docstring)."""
    threshold_S = truncation_threshold(scaled_SxV, top_k_S, top_p_S)
    return jnp.where(scaled_SxV >= threshold_S[:, None], scaled_SxV, -jnp.inf)


def sample_slots(
    logits_SxV: jax.Array,
    keys_S: jax.Array,
    temperature_S: jax.Array,
    top_k_S: jax.Array,
    top_p_S: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """(tokens [S] int32, behaviour log-probs [S] fp32), one draw per row with that row's key and params.

    A row draws by inverting its cumulative distribution with one uniform number (the running sum of
    the exponentials its log-softmax needs anyway), not with one Gumbel variate per vocabulary entry:
    the random bits and logarithms per entry cost more than the whole softmax on a CPU. The running sum
    is taken in two levels (`inverse_cdf_draw`).
    """
    logits_SxV = logits_SxV.astype(jnp.float32)
    greedy_S = temperature_S <= 0
    scaled_SxV = logits_SxV / jnp.where(greedy_S, 1.0, temperature_S)[:, None]
    truncating = jnp.any((top_k_S > 0) | (top_p_S < 1.0))
    # only the per-row threshold leaves the cond: a vocabulary-wide output would be copied out of it every step
    threshold_S = jax.lax.cond(
        truncating,
        lambda z: truncation_threshold(z, top_k_S, top_p_S),
        lambda z: jnp.full(z.shape[:1], -jnp.inf, z.dtype),
        scaled_SxV,
    )
    restricted_SxV = jnp.where(scaled_SxV >= threshold_S[:, None], scaled_SxV, -jnp.inf)
    source_SxV = jnp.where(greedy_S[:, None], logits_SxV, restricted_SxV)
    top_S = jnp.max(source_SxV, axis=-1)
    weights_SxV = jnp.exp(source_SxV - top_S[:, None])
    drawn_S = inverse_cdf_draw(weights_SxV, jax.vmap(jax.random.uniform)(keys_S))
    tokens_S = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
    chosen_S = jnp.take_along_axis(source_SxV, tokens_S[:, None], axis=-1)[:, 0]
    # The normaliser is a reduction, as in log_softmax: the running sum's last entry is less accurate.
    return tokens_S, chosen_S - top_S - jnp.log(jnp.sum(weights_SxV, axis=-1))


def inverse_cdf_draw(weights_SxV: jax.Array, uniform_S: jax.Array) -> jax.Array:
    """Per row, the first id whose running sum of `weights` exceeds u * their total (never one without mass).

    In two levels: the running sum over blocks of `CDF_BLOCK` ids, then within the one block holding the
    draw. A running sum over the whole vocabulary (XLA's cumsum, a reduce-window) cost 14x its plain sum
    on CPU at 64 x 160k, and 0.34 s per decode step (benchmarks/sampling.py).
    """
    s, v = weights_SxV.shape
    block = min(CDF_BLOCK, v)
    blocks = -(-v // block)
    padded_SxNxK = jnp.pad(weights_SxV, ((0, 0), (0, blocks * block - v))).reshape(s, blocks, block)
    block_sum_SxN = jnp.sum(padded_SxNxK, axis=-1)
    block_cdf_SxN = jnp.cumsum(block_sum_SxN, axis=-1)
    threshold_S = uniform_S * block_cdf_SxN[:, -1]
    # u * total can round up to total: then the last id with any mass (the first one past the threshold has some)
    block_ids_SxN = jax.lax.broadcasted_iota(jnp.int32, block_sum_SxN.shape, 1)
    last_block_S = jnp.max(jnp.where(block_sum_SxN > 0, block_ids_SxN, 0), axis=-1)
    j_S = jnp.minimum(jnp.sum(block_cdf_SxN <= threshold_S[:, None], axis=-1, dtype=jnp.int32), last_block_S)
    before_S = jnp.take_along_axis(block_cdf_SxN - block_sum_SxN, j_S[:, None], axis=-1)[:, 0]
    in_block_SxK = jnp.take_along_axis(padded_SxNxK, j_S[:, None, None], axis=1)[:, 0]
    local_cdf_SxK = before_S[:, None] + jnp.cumsum(in_block_SxK, axis=-1)
    k_S = jnp.sum(local_cdf_SxK <= threshold_S[:, None], axis=-1, dtype=jnp.int32)
    ids_SxK = jax.lax.broadcasted_iota(jnp.int32, in_block_SxK.shape, 1)
    last_in_block_S = jnp.max(jnp.where(in_block_SxK > 0, ids_SxK, 0), axis=-1)
    return j_S * block + jnp.minimum(k_S, last_in_block_S)


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, temperature: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain temperature sampling of a batch with one key (0 = greedy): (tokens [B], log-probs [B])."""
    b = logits_BxV.shape[0]
    temperature_B = jnp.full((b,), temperature, jnp.float32)
    return sample_slots(
        logits_BxV, jax.random.split(key, b), temperature_B, jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32)
    )
