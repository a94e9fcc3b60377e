"""Static-batch generation: one prefill, then decode steps until every sequence of the batch stops.

The simple reference generator (and the 'static batching' baseline): the whole batch waits for its
longest member. Prompt and cache lengths are bucketed to powers of two so new prompt lengths reuse
compiled programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.inference.sampling import sample_tokens
from areal_jax.models.decoder import Decoder, KVCache


@dataclasses.dataclass(frozen=True)
class Completion:
    """Generated tokens of one sample, with the behaviour log-prob of each and why it stopped."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop token was produced, and is included) or "length"


def bucket_length(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class StaticBatchGenerator:
    """Jitted prefill and decode over one model; the whole batch decodes until its last member stops."""

    def __init__(self, model: Decoder, stop_token_ids: Sequence[int], pad_id: int = 0):
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.stop_ids = jnp.asarray(sorted(set(stop_token_ids)), jnp.int32)
        self.pad_id = pad_id
        self._prefill = jax.jit(self._prefill_impl, static_argnums=(3,))
        self._decode = jax.jit(self._decode_impl, donate_argnums=(1,))
        self._sample = jax.jit(sample_tokens)

    def _prefill_impl(self, state: nnx.State, tokens_BxT: jax.Array, lengths_B: jax.Array, cache_length: int):
        logits_BxV, prefix = nnx.merge(self.graphdef, state).prefill(tokens_BxT, lengths_B)
        cache = KVCache.zeros(self.config, tokens_BxT.shape[0], cache_length)
        t = tokens_BxT.shape[1]
        cache = KVCache(k=cache.k.at[:, :, :t].set(prefix.k), v=cache.v.at[:, :, :t].set(prefix.v))
        return logits_BxV, cache

    def _decode_impl(self, state: nnx.State, cache: KVCache, tokens_B: jax.Array, positions_B: jax.Array):
        return nnx.merge(self.graphdef, state).decode_step(tokens_B, positions_B, cache)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, key: jax.Array
    ) -> list[Completion]:
        """Sample one completion per prompt."""
        batch = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        width = bucket_length(int(lengths.max()))
        cache_length = bucket_length(width + max_new_tokens)
        tokens = np.full((bucket_length(batch, minimum=1), width), self.pad_id, np.int32)
        padded_lengths = np.ones(tokens.shape[0], np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
            padded_lengths[row] = len(prompt)
        logits, cache = self._prefill(self.state, jnp.asarray(tokens), jnp.asarray(padded_lengths), cache_length)
        positions = jnp.asarray(padded_lengths)
        outputs = np.zeros((tokens.shape[0], max_new_tokens), np.int32)
        logprobs = np.zeros((tokens.shape[0], max_new_tokens), np.float32)
        done = np.zeros(tokens.shape[0], bool)
        done[batch:] = True
        steps = 0
        for step in range(max_new_tokens):
            key, sub = jax.random.split(key)
            next_tokens, next_logp = self._sample(logits, sub, temperature)
            outputs[:, step], logprobs[:, step] = np.asarray(next_tokens), np.asarray(next_logp)
            steps = step + 1
            done |= np.isin(outputs[:, step], np.asarray(self.stop_ids))
            if done.all() or step == max_new_tokens - 1:
                break
            logits, cache = self._decode(self.state, cache, next_tokens, positions)
            positions = positions + 1
        stop_set = set(np.asarray(self.stop_ids).tolist())
        completions = []
        for row in range(batch):
            out = outputs[row, :steps].tolist()
            stops = [i for i, tok in enumerate(out) if tok in stop_set]
            end = stops[0] + 1 if stops else steps
            completions.append(
                Completion(
                    prompt_ids=tuple(prompts[row]),
                    output_ids=tuple(out[:end]),
                    logprobs=tuple(float(x) for x in logprobs[row, :end]),
                    finish_reason="stop" if stops else "length",
                )
            )
        return completions
