"""What the generator's loop keeps per request: the request, its samples, the prefill jobs waiting for
slots, the decode step in flight, and each finished sample's `GenerationResult`; and its counters
(`GeneratorStats`). Only the loop thread touches them once a request is submitted."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Literal

import jax
import numpy as np

from areal_jax.inference.engine import PrefixBatch, ResultTokens
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.stop_strings import StopStringMatcher

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """One finished sample."""

    request_id: str
    sample_index: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_versions: tuple[int, ...]
    finish_reason: FinishReason
    num_interruptions: int
    timings: dict[str, float]
    # a mixture of experts' routing, [P + O, Ym, K] uint8/uint16: each prompt token's experts at the last prefill
    # of the sample (a re-prefill after an interruption records them anew), each output token's in the decode step
    # that fed it (the weights that sampled it); None for a dense model
    routing: np.ndarray | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """A submitted prompt and its n samples; `future` resolves with their results."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    n: int
    future: concurrent.futures.Future
    submitted: float
    samples: list[Sample] = dataclasses.field(default_factory=list)
    aborted: bool = False


@dataclasses.dataclass(eq=False)
class Sample:
    """One of a request's samples: its tokens so far and where it is (queued, in a slot, finished)."""

    request: Request
    index: int
    seed_words: tuple[int, int]  # (request seed, sample index): the sample's PRNG stream
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    pending_version: int = -1
    in_flight: int = 0  # dispatched decode steps whose token is not handled yet
    stop_strings: StopStringMatcher | None = None
    slot: int | None = None
    admitted: int = -1  # admission order (the newest running sample is preempted first)
    interruptions: int = 0
    first_token_time: float | None = None
    result: GenerationResult | None = None
    prompt_routing: tuple[jax.Array, int] | None = None  # (its last prefill's routing [B, Tb, Ym, K], its row)
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)  # [Ym, K] per output token

    def stop_reason(self, max_length: int) -> FinishReason | None:
        """Why the sample stops after its newest token (`max_length`: the engine's cap), None if it goes on; feeds
        the token to its stop-string matcher."""
        sampling = self.request.sampling
        if self.output_ids[-1] in sampling.stop_token_ids:
            return "stop"
        if self.stop_strings is not None and self.stop_strings.push(self.output_ids[-1]):
            return "stop"
        if len(self.output_ids) >= sampling.max_new_tokens:
            return "length"
        if len(self.request.prompt_ids) + len(self.output_ids) >= max_length:
            return "length"
        return None

    def full_routing(self) -> np.ndarray | None:
        """Prompt then outputs (`GenerationResult.routing`); None when dense or never prefilled."""
        if self.prompt_routing is None or len(self.routing) != len(self.output_ids):
            return None
        batch_routing, row = self.prompt_routing
        prompt_TxYmxK = np.asarray(batch_routing)[row, : len(self.request.prompt_ids)]  # host copy, cached
        return np.concatenate([prompt_TxYmxK, *(r[None] for r in self.routing)])


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """Tokens to prefill and the samples waiting for that prefix (n for a new request, 1 for a resume)."""

    tokens: tuple[int, ...]
    samples: collections.deque[Sample]
    prefix: tuple[PrefixBatch, int] | None = None  # (batched prefill result, this job's row)
    prefix_version: int = -1

    def placed_prefix(self) -> tuple[PrefixBatch, int]:
        assert self.prefix is not None  # the loop prefills every job it places before reading its prefix
        return self.prefix


@dataclasses.dataclass(eq=False)
class DispatchedStep:
    """A dispatched decode step: the sample in each slot it decodes, the version of its weights, and its
    emitted tokens (device arrays on their way to the host)."""

    samples: list[tuple[int, Sample]]
    version: int
    emitted: ResultTokens


@dataclasses.dataclass
class GeneratorStats:
    prefills: int = 0
    prefill_calls: int = 0
    decode_steps: int = 0
    emitted_tokens: int = 0
    interruptions: int = 0
    updates: int = 0
    busy_slot_steps: int = 0
    shared_prefills: int = 0  # requests that joined a queued request's prefill of the same prompt
    preemptions: int = 0  # samples sent back to the queue for want of KV pages (paged cache)
    admission_waits: int = 0  # admissions stopped at a sample whose KV pages were not free (paged cache)
    pages_in_use: int = 0  # KV pages held by samples during the last decode step (paged cache)
    peak_pages_in_use: int = 0
    busy_seconds: float = 0.0  # wall time the loop spent working (not waiting for requests): the planner's rate
