"""`ServingEngine`: what the generator and the rollout side ask of an engine, the one protocol both engines
keep: `Engine` (this process's devices) and the multi-process rollout server's `MirroredEngine` (process
0's calls carried out by every process of the server, `system/mirrored_engine.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
from flax import nnx

from areal_jax.inference.sampling import SamplingParams

if TYPE_CHECKING:
    from areal_jax.inference.engine import DecodeState, EngineConfig, PrefixBatch, ResultTokens, VersionedParams


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

    def load_params(self, state: nnx.State, version: int) -> VersionedParams: ...

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
