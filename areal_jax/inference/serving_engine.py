"""`ServingEngine`: what the generator and the rollout side ask of an engine, the one protocol both engines
keep: `Engine` (this process's devices) and the multi-process rollout server's `MirroredEngine` (process
0's calls carried out by every process of the server, `system/mirrored_engine.py`); and `warm_up`, a warm-up
through the protocol's calls alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx

from areal_jax.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from areal_jax.inference.engine import DecodeState, EngineConfig, PrefixBatch, ResultTokens
    from areal_jax.inference.engine_weights import VersionedParams


@runtime_checkable
class ServingEngine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def buckets(self) -> tuple[int, ...]: ...

    @property
    def prefill_rows(self) -> tuple[int, ...]: ...

    @property
    def max_concurrent_decodes(self) -> int: ...

    def pad_tokens(self, tokens: list[int] | np.ndarray) -> tuple[np.ndarray, int]: ...

    def init_decode_state(self) -> DecodeState: ...

    def load_params(self, state: nnx.State, version: int) -> VersionedParams:
        """The engine's own copy of `state` (the caller may donate `state` once this returns)."""
        ...

    def prefill_batch(self, params: VersionedParams, prompts: Sequence[Sequence[int]]) -> PrefixBatch: ...

    def insert_batch(
        self,
        prefixes: PrefixBatch,
        decode_state: DecodeState,
        slots: Sequence[int | None],
        samplings: Sequence[SamplingParams],
        key_data: np.ndarray,
        pages: Sequence[Sequence[int]] | None = None,
    ) -> DecodeState: ...

    def generate(
        self,
        params: VersionedParams,
        decode_state: DecodeState,
        max_position: int | None = None,
        page_updates: np.ndarray | None = None,
    ) -> tuple[DecodeState, ResultTokens]: ...

    def warmup(self, params: VersionedParams) -> None: ...


def warm_up(engine: ServingEngine, params: VersionedParams) -> None:
    """Run every program the generator can need once, through `engine`'s calls (so an engine that mirrors
    them, `MirroredEngine`, warms up its mirrors; `Engine.warmup` compiles them without running them)."""
    decode_state = engine.init_decode_state()
    sampling = SamplingParams()
    paged = engine.config.paged
    for bucket in engine.buckets:
        length = bucket - 1  # the pending token then sits at position bucket - 1: attends `bucket` entries
        for rows in engine.prefill_rows:
            batch = engine.prefill_batch(params, [[1] * length] * rows)
            if paged:  # slot 0 on the first pages: what an insert of this bucket can write
                pages = [list(range(engine.config.insert_pages(bucket)))]
                decode_state = engine.insert_batch(batch, decode_state, [0], [sampling], np.zeros((1, 2)), pages)
            else:
                decode_state = engine.insert_batch(batch, decode_state, [0], [sampling], np.zeros((1, 2)))
        decode_state, result = engine.generate(params, decode_state, max_position=length)
    jax.block_until_ready(result)
