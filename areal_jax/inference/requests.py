"""What the generator's loop keeps per request: the request, its samples, the prefill jobs waiting for
slots, the decode step in flight, and each finished sample's `GenerationResult`. Only the loop thread
touches them once a request is submitted."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Literal

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


@dataclasses.dataclass(eq=False)
class PrefillJob:
    """Tokens to prefill and the samples waiting for that prefix (n for a new request, 1 for a resume)."""

    tokens: tuple[int, ...]
    samples: collections.deque[Sample]
    prefix: tuple[PrefixBatch, int] | None = None  # (batched prefill result, this job's row)
    prefix_version: int = -1


@dataclasses.dataclass(eq=False)
class DispatchedStep:
    """A dispatched decode step: the sample in each slot it decodes, the version of its weights, and its
    emitted tokens (device arrays on their way to the host)."""

    samples: list[tuple[int, Sample]]
    version: int
    emitted: ResultTokens
