"""Token sampling that reports the log-prob of each drawn token under the distribution it came from.

With temperature tau > 0 a token is drawn from softmax(logits / tau) and its log-prob is taken under
that same tempered distribution, which is what the trainer must recompute (same tau) for importance
ratios. tau = 0 means greedy (argmax); its reported log-prob is under softmax(logits), i.e. tau = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits_BxV: jax.Array, key: jax.Array, temperature: float | jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [B] int32, log-probs [B] fp32) drawn at `temperature` (0 = greedy)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy = temperature <= 0
    scaled_BxV = logits_BxV / jnp.where(greedy, 1.0, temperature)
    logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
    drawn_B = jax.random.categorical(key, scaled_BxV, axis=-1)
    tokens_B = jnp.where(greedy, jnp.argmax(logits_BxV, axis=-1), drawn_B).astype(jnp.int32)
    return tokens_B, jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
