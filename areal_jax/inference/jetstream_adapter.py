"""Our `Engine` behind JetStream's `Engine` API (google-jetstream 0.2.2), so JetStream's own orchestrator
(`jetstream.core.orchestrator.Driver` with `LLMOrchestrator`) can serve or evaluate a policy.

JetStream is an optional extra (requirements-jetstream.txt, installed into .venv-jetstream by
scripts/setup_jetstream_env.sh); this is the only module that imports it.

How the two APIs meet:
- In JetStream 0.2.2 `prefill` returns the prefix only and every output token comes from `generate`. Our
  `Engine.insert` samples a slot's first token from the prefix logits and our `generate` emits, per slot, the
  token it feeds, so a slot's first `generate` emits that first token: none is lost or repeated.
- `generate` returns `ResultTokens` with `data` [S, 3] int32: per slot the token, its validity and how many
  tokens the slot has emitted since its insert, this one included. JetStream's detokenizer ends a request when
  that count exceeds the request's `max_tokens`, or at an invalid token or a stop token (neither is returned).
  A token is invalid once the slot's cache is full (prompt + output reached `max_length`), where our own
  generator stops too. Each step reads the whole cache: `Engine.generate`'s `max_position` shortcut needs the
  active slots, and JetStream's orchestrator frees slots without telling the engine.
- JetStream passes no per-request sampling: every request is sampled with the adapter's fixed `SamplingParams`
  (temperature, top-k, top-p, seed); its `stop_token_ids` join the tokenizer's stop tokens, `max_new_tokens`
  is unused (the request's `max_tokens` decides) and `stop_strings` are refused (JetStream stops on ids only).
- JetStream prepends the tokenizer's BOS to every new prompt. For a tokenizer without one (Qwen) the
  tokenizer bridge reports `NO_TOKEN` as its BOS and `prefill` drops it again.
- JetStream 0.2.2's orchestrator frees prefixes with `jax.tree_map`, which jax removed in 0.6; importing this
  module defines it as `jax.tree.map` when it is missing.
Legend: S slots, T padded prompt length.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from areal_jax.inference.engine import DecodeState, Engine, Prefix, VersionedParams
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.slot_cache import cache_shardings
from areal_jax.models.tokenizer import CHAR_SPEC, DEFAULT_ALPHABET, CharTokenizer, HFTokenizer, Tokenizer
from areal_jax.sharding import logical_to_spec

if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map  # type: ignore[attr-defined]  # called by JetStream 0.2.2's orchestrator (delete_pytree)

NO_TOKEN = -1
# The prefill buckets of JetStream's `token_utils.pad_tokens`; the engine's max_prefill_length must be one.
JETSTREAM_PREFILL_LENGTHS = tuple(16 << i for i in range(12))


@flax.struct.dataclass
class JetStreamDecodeState:
    """Our decode state and, per slot, the number of tokens emitted since the slot's insert."""

    inner: DecodeState
    emitted: jax.Array  # [S] int32


class TokenizerBridge(tokenizer_api.Tokenizer):
    """One of our tokenizers behind JetStream's `Tokenizer` API (what the orchestrator's threads call)."""

    def __init__(self, tokenizer: Tokenizer, extra_stop_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self._stop_tokens = {*tokenizer.stop_token_ids, *extra_stop_ids}

    def encode(
        self,
        s: str,
        *,
        is_bos: bool = True,
        prefill_lengths: list[int] | None = None,
        max_prefill_length: int | None = None,
        jax_padding: bool = True,
    ) -> tuple[jax.Array | np.ndarray, int]:
        """(padded ids, true length) of `s`, with the BOS first when `is_bos`, padded as JetStream pads ids."""
        return token_utils.pad_tokens(
            np.asarray(self.tokenizer.encode(s), np.int32),
            self.bos_id,
            self.pad_id,
            is_bos=is_bos,
            prefill_lengths=prefill_lengths,
            max_prefill_length=max_prefill_length,
            jax_padding=jax_padding,
        )

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str:
        """The text of `token_ids`; JetStream's streaming keyword arguments do not apply and are ignored."""
        return self.tokenizer.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        """The eos id, or `NO_TOKEN` when the tokenizer has none."""
        eos = self.tokenizer.eos_id
        return NO_TOKEN if eos is None else eos

    @property
    def bos_id(self) -> int:
        """The BOS id, or `NO_TOKEN` (dropped again by `JetStreamEngine.prefill`) when the tokenizer has none."""
        bos = getattr(self.tokenizer, "bos_id", None)
        return NO_TOKEN if bos is None else bos

    @property
    def stop_tokens(self) -> set[int]:
        """The tokenizer's stop ids and the adapter's extra ones (JetStream's default adds the pad id; not here)."""
        return set(self._stop_tokens)


def tokenizer_spec(tokenizer: Tokenizer) -> str:
    """What `load_tokenizer` would rebuild `tokenizer` from: an HF directory, "char", or "" when neither."""
    if isinstance(tokenizer, HFTokenizer):
        return str(tokenizer.path)
    if isinstance(tokenizer, CharTokenizer) and tokenizer.alphabet == DEFAULT_ALPHABET:
        return CHAR_SPEC
    return ""


def _start_slot(emitted_S: jax.Array, slot: jax.Array) -> jax.Array:
    return emitted_S.at[slot].set(0)


def _result_data(
    tokens_S: jax.Array, positions_S: jax.Array, emitted_S: jax.Array, *, max_length: int
) -> tuple[jax.Array, jax.Array]:
    """(emitted counts after this step, ResultTokens data [S, 3]: token, validity, count)."""
    emitted_S = emitted_S + 1
    # `positions_S` is after the step: the token emitted was fed (its K/V written) at positions_S - 1.
    valid_S = (positions_S <= max_length).astype(jnp.int32)
    return emitted_S, jnp.stack([tokens_S.astype(jnp.int32), valid_S, emitted_S], axis=-1)


class JetStreamEngine(engine_api.Engine):
    """`Engine` as a JetStream 0.2.2 engine; see the module docstring for how the APIs are reconciled."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, sampling: SamplingParams, seed: int = 0):
        """Serve `engine` with `tokenizer`; every request is sampled with `sampling` (its seed, else `seed`)."""
        if engine.config.paged:
            raise ValueError("rollout.engine.kv_cache='paged': JetStream's orchestrator drives the dense cache only")
        if engine.max_prefill_length not in JETSTREAM_PREFILL_LENGTHS:
            raise ValueError(
                f"engine max_length={engine.max_prefill_length} must be one of JetStream's prefill lengths "
                f"{JETSTREAM_PREFILL_LENGTHS} (its pad_tokens pads prompts to those buckets)"
            )
        if sampling.stop_strings:
            raise ValueError(
                f"sampling.stop_strings={sampling.stop_strings!r}: JetStream 0.2.2 stops on token ids only; "
                "use stop_token_ids"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling
        self._bridge = TokenizerBridge(tokenizer, sampling.stop_token_ids)
        self._key = jax.random.key(seed if sampling.seed is None else sampling.seed)
        self._inserts = itertools.count()
        self._start_slot = jax.jit(_start_slot, donate_argnums=(0,))
        self._result_data = jax.jit(
            functools.partial(_result_data, max_length=engine.config.max_length), donate_argnums=(2,)
        )

    # -- capacity and placement ------------------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return self.engine.samples_per_slot

    @property
    def max_prefill_length(self) -> int:
        return self.engine.max_prefill_length

    @property
    def mesh(self) -> Mesh | None:
        """The engine's inference mesh; None for an engine on one (the default) device."""
        return self.engine.mesh

    @property
    def colocated_cpus(self) -> None:
        """None: the engine does not designate host CPU devices (JetStream 0.2.2's orchestrator never asks)."""
        return None

    def get_prefix_destination_sharding(self) -> Any:
        """Where a `Prefix` must live for `insert`: KV heads split like the decode cache, the rest replicated."""
        mesh = self.engine.mesh
        if mesh is None:
            return SingleDeviceSharding(self.engine.device)
        model = self.engine.model_config
        # a Prefix-shaped pytree of shardings, the form JetStream's API asks for (not a Prefix of arrays)
        return Prefix(
            cache=cache_shardings(model, 1, self.engine.config.max_length, mesh),
            logits=NamedSharding(mesh, logical_to_spec(("vocab",), (model.vocab_size,), mesh)),  # type: ignore[arg-type]
            length=NamedSharding(mesh, PartitionSpec()),  # type: ignore[arg-type]
        )

    # -- tokenizer -------------------------------------------------------------------------------

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        """The tokenizer's spec (see `tokenizer_spec`) as JetStream's tokenizer description."""
        return tokenizer_pb2.TokenizerParameters(path=tokenizer_spec(self.tokenizer))

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> TokenizerBridge:
        """The engine's own tokenizer behind JetStream's API; `metadata` (from `get_tokenizer`) is not re-read."""
        return self._bridge

    # -- weights and state -----------------------------------------------------------------------

    def load_params(self, state: nnx.State, version: int = 0) -> VersionedParams:
        return self.engine.load_params(state, version)

    def init_decode_state(self) -> JetStreamDecodeState:
        inner = self.engine.init_decode_state()
        emitted = jnp.zeros(inner.positions.shape, jnp.int32, device=inner.positions.sharding)
        return JetStreamDecodeState(inner=inner, emitted=emitted)

    # -- prefill / insert / generate -------------------------------------------------------------

    def prefill(
        self,
        *,
        params: VersionedParams,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray,
        true_length: int,
    ) -> Prefix:
        """Prefill one padded prompt (`NO_TOKEN` BOS dropped).

        A prompt JetStream truncated keeps its last ids; one that fills the cache, or an empty one, ends its
        request without output (its first token is invalid).
        """
        if existing_prefix is not None:
            raise ValueError("existing_prefix: continuing from a cached prefix is not supported by this engine")
        tokens_T = np.asarray(padded_tokens).astype(np.int32)
        # JetStream truncates an over-long prompt to its last T ids but reports the untruncated length.
        length = min(int(true_length), tokens_T.shape[0])
        if length > 0 and tokens_T[0] == NO_TOKEN:
            tokens_T = np.append(tokens_T[1:], np.int32(0))  # the appended entry is padding, masked
            length -= 1
        if length < 1:
            # Nothing to condition on: a prefix that claims a full cache, so the request ends without output.
            prefix = self.engine.prefill(params, tokens_T, 1)
            return dataclasses.replace(prefix, length=jnp.asarray(self.engine.config.max_length, jnp.int32))
        return self.engine.prefill(params, tokens_T, length)

    def insert(self, prefix: Prefix, decode_state: JetStreamDecodeState, slot: int) -> JetStreamDecodeState:
        """Put `prefix` into `slot`; the slot's first token is sampled here with the adapter's sampling."""
        key = jax.random.fold_in(self._key, next(self._inserts))
        inner = self.engine.insert(prefix, decode_state.inner, slot, self.sampling, key)
        emitted = self._start_slot(decode_state.emitted, jnp.asarray(slot, jnp.int32))
        return JetStreamDecodeState(inner=inner, emitted=emitted)

    def generate(
        self, params: VersionedParams, decode_state: JetStreamDecodeState
    ) -> tuple[JetStreamDecodeState, engine_api.ResultTokens]:
        """One decode step over all slots: per slot the token fed, its validity and the slot's count so far."""
        inner, result = self.engine.generate(params, decode_state.inner)
        emitted, data_Sx3 = self._result_data(result.tokens, inner.positions, decode_state.emitted)
        tokens = engine_api.ResultTokens(
            data=data_Sx3, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
        )
        return JetStreamDecodeState(inner=inner, emitted=emitted), tokens
