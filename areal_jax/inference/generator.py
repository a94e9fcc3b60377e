"""The continuous-batching driver: a request queue feeding engine slots, refilled as soon as any
sequence finishes, with interruptible weight updates.

Ownership: one background thread, the loop, owns the engine's decode state and all bookkeeping (the
prefill queue, the slots, the in-flight requests, pending updates and aborts, the stats); no other
thread reads or writes them (their records: `requests.py`). Callers on any thread (`submit`, `abort`,
`update_params`, `close`) or coroutine (`await generate(...)`) only post command objects to the loop's
inbox (`inbox.py`), the one locked object they share with it, and hear back through futures. The only
other shared value is the in-flight count behind `num_in_flight`, a counter under its own lock. `stats`,
`params` and `version` are written by the loop alone; another thread reading them sees a recent value.

The loop blocks on the inbox while it has nothing to do. Each iteration, between two decode steps, it:
  1. takes every posted command: registers submitted requests, records aborts, queues weight updates;
  2. finishes aborted requests' samples with reason 'abort';
  3. applies a pending weight update, after handling the step in flight: with `interrupt=True`, every
     in-flight sample drops its slot (its cache, keys/values or recurrent state, came from the old weights) and is
     queued first for a re-prefill of prompt + tokens generated so far; with `interrupt=False`, admission stops
     until in-flight samples finish on the old weights, then the weights are swapped;
  4. admits queued work into free slots (a new request's n samples share one prefill, and so does a request
     whose prompt is still queued for another: the episodes of an agent group, which open with the same
     prompt each on its own request, are prefilled once; a prefill call's spare rows go to prompts still
     queued in the same length bucket, so their admission is an insert);
  5. dispatches decode step t over all slots and starts the copy of its tokens to the host;
  6. handles step t-1's tokens while step t runs on the device (pipelined, as JetStream's generate and
     detokenize threads do, here within one thread): each token goes to the sample that held the slot
     when the step was dispatched, which checks its stop conditions. A sample whose last token (by
     max_new_tokens or the length cap) is in step t gives its slot up at dispatch, so the next admission
     need not wait for that token; a sample that stops on a stop token or string is known one step late,
     and the token its slot produced meanwhile is dropped. With `pipelined=False` a step's tokens are
     handled right after it is dispatched (the baseline).
Every output token keeps the behaviour log-prob and the policy version of the weights that sampled it: a
step dispatched before a weight swap is handled (and attributed to the old version) before the swap. With a
mixture of experts it also keeps its routing (the experts the step that fed it chose, under the same weights),
and the prompt's routing is that of the sample's last prefill (`GenerationResult.routing`).

With a paged KV cache (`kv_cache: paged`) the loop also owns the page allocator (`PagedSlots`): a sample
gets the pages of its prompt and first decoded position when admitted, one more page before the step that
first writes into it (all of a step's new pages and freed rows go to the device as one small update with
that step), and gives them all back when its slot is freed (at its last dispatch, on stop, abort or
interruption). The device runs every call in order on the one decode state, so a page freed while a step
that writes it is in flight is reused only by later calls. When pages run out:
  - admission waits: the queue's head is admitted only when its pages are free (later jobs wait behind
    it, so a long prompt is not starved);
  - a running sample that needs its next page first lets the step in flight finish (samples that stop
    free theirs), then the newest admitted samples are preempted, newest first, until the rest fit: a
    preempted sample keeps its tokens, log-probs and versions and is queued first for a re-prefill of
    prompt + tokens, like an interruption. The pool holds at least one max_length sequence
    (`EngineConfig.num_pages`), so the oldest sample always runs on: no deadlock.
Stop strings are matched on text decoded incrementally (`IncrementalDecoder`): each token's new text
plus the longest stop string's overlap with the text before it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from flax import nnx

from areal_jax.inference.engine import DecodeState, VersionedParams, bucket_for
from areal_jax.inference.inbox import Abort, Close, Inbox, Submit, Update, resolve
from areal_jax.inference.paged import PagedSlots
from areal_jax.inference.requests import (
    DispatchedStep,
    FinishReason,
    GenerationResult,
    GeneratorStats,
    PrefillJob,
    Request,
    Sample,
)
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.seeds import mix_seed, sample_key_words
from areal_jax.inference.serving_engine import ServingEngine
from areal_jax.inference.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)


class Generator:
    """Continuous batching over an `Engine` (or any `ServingEngine`); see the module docstring."""

    def __init__(
        self,
        engine: ServingEngine,
        params: VersionedParams,
        *,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        seed: int = 0,
        admission: Literal["continuous", "static"] = "continuous",
        pipelined: bool = True,
    ):
        self.engine = engine
        self.params = params
        self.detokenize = detokenize
        self.admission = admission
        self.pipelined = pipelined
        self.stats = GeneratorStats()
        self._seed = seed
        self._ids = itertools.count()
        self._inbox = Inbox()
        self._in_flight = 0  # submitted requests not yet answered, under its own lock
        self._in_flight_lock = threading.Lock()
        # owned by the loop thread
        self._jobs: collections.deque[PrefillJob] = collections.deque()
        # new requests' jobs by prompt, while queued: a request whose prompt is queued joins that job
        self._queued_prompts: dict[tuple[int, ...], PrefillJob] = {}
        self._updates: collections.deque[Update] = collections.deque()
        self._aborts: set[str] = set()
        self._requests: dict[str, Request] = {}
        self._slots: list[Sample | None] = [None] * engine.max_concurrent_decodes
        self._pages: PagedSlots | None = engine.config.page_slots() if engine.config.paged else None
        self._admissions = itertools.count()
        self._in_flight_step: DispatchedStep | None = None
        self._decode_state: DecodeState = engine.init_decode_state()
        self._thread = threading.Thread(target=self._run, name="areal-generator", daemon=True)
        self._thread.start()

    # -- public API: each call posts a command to the loop -----------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        n: int = 1,
        request_id: str | None = None,
    ) -> concurrent.futures.Future[list[GenerationResult]]:
        """Queue a prompt for n samples; the future resolves with the n results, in sample order (or
        fails with ValueError when `request_id` is already in flight)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        prompt = tuple(int(t) for t in prompt_ids)
        self.engine.pad_tokens(list(prompt))  # validates the length now, at the boundary
        request_id = request_id or f"req-{next(self._ids)}"
        future: concurrent.futures.Future = concurrent.futures.Future()
        request = Request(request_id, prompt, sampling, n, future, time.perf_counter())
        request_seed = sampling.seed if sampling.seed is not None else mix_seed(self._seed, next(self._ids))
        request.samples = [Sample(request, i, (request_seed, i)) for i in range(n)]
        if sampling.stop_strings and self.detokenize is not None:
            for sample in request.samples:
                sample.stop_strings = StopStringMatcher(sampling.stop_strings, self.detokenize)
        self._count_in_flight(1)
        try:
            self._inbox.post(Submit(request))
        except RuntimeError:
            self._count_in_flight(-1)
            raise
        return future

    async def generate(
        self,
        prompt_ids: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        n: int = 1,
        request_id: str | None = None,
    ) -> list[GenerationResult]:
        """`submit` awaited; a cancelled caller aborts the request (freeing its slots) and the generator goes on."""
        request_id = request_id or f"req-{next(self._ids)}"
        future = self.submit(prompt_ids, sampling, n, request_id)
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request; its samples finish with reason 'abort' and the tokens generated so far."""
        self._inbox.offer(Abort(request_id))

    def update_params(self, state: nnx.State, version: int, interrupt: bool = True) -> concurrent.futures.Future:
        """Swap in new weights between two decode steps; the future resolves once they are in use."""
        params = self.engine.load_params(state, version)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.post(Update(params, interrupt, done))
        return done

    @property
    def version(self) -> int:
        return self.params.version

    def num_in_flight(self) -> int:
        with self._in_flight_lock:
            return self._in_flight

    def close(self) -> None:
        self._inbox.close()
        self._thread.join()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count_in_flight(self, delta: int) -> None:
        with self._in_flight_lock:
            self._in_flight += delta

    # -- the loop: everything below runs on the loop thread only -------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            while self._take_commands(block=not self._has_work()):
                started = time.perf_counter()
                self._iterate()
                self.stats.busy_seconds += time.perf_counter() - started
        except BaseException as err:  # surface loop failures to every waiter
            logger.exception("generator loop failed")
            error = err
        finally:
            self._shut_down(error)

    def _take_commands(self, block: bool) -> bool:
        """Handle every posted command (waiting for one when `block`); False once the generator is closed."""
        for command in self._inbox.take(block):
            match command:
                case Submit(request):
                    self._register(request)
                case Abort(request_id):
                    self._aborts.add(request_id)
                case Update():
                    self._updates.append(command)
                case Close():
                    return False
        return True

    def _has_work(self) -> bool:
        return bool(self._jobs or self._updates or self._aborts or self._has_active() or self._in_flight_step)

    def _has_active(self) -> bool:
        return any(s is not None for s in self._slots)

    def _iterate(self) -> None:
        aborts, self._aborts = self._aborts, set()
        self._apply_aborts(aborts)
        update = self._updates[0] if self._updates else None
        if update is not None and (update.interrupt or not self._has_active()):  # else drain on the old weights
            self._drain()
            self._apply_update(self._updates.popleft())
            return
        if update is None:
            self._admit()
        step = self._dispatch() if self._has_active() else None  # None also when preemption emptied the slots
        if self.pipelined:
            step, self._in_flight_step = self._in_flight_step, step
        if step is not None:
            self._handle(step)

    def _drain(self) -> None:
        """Handle the step in flight, if any."""
        step, self._in_flight_step = self._in_flight_step, None
        if step is not None:
            self._handle(step)

    def _register(self, request: Request) -> None:
        if request.request_id in self._requests:
            self._count_in_flight(-1)
            resolve(request.future, error=ValueError(f"request id {request.request_id!r} is already in flight"))
            return
        self._requests[request.request_id] = request
        queued = self._queued_prompts.get(request.prompt_ids)
        if queued is not None and queued.samples:  # still queued: one prefill serves both requests
            queued.samples.extend(request.samples)
            self.stats.shared_prefills += 1
            return
        job = PrefillJob(request.prompt_ids, collections.deque(request.samples))
        self._queued_prompts[request.prompt_ids] = job
        self._jobs.append(job)

    def _shut_down(self, error: BaseException | None) -> None:
        """Refuse further commands and answer everyone still waiting: with `error` when the loop failed."""
        failure = error if error is not None else RuntimeError("generator closed")
        requests, updates = list(self._requests.values()), list(self._updates)
        for command in self._inbox.shut(error):
            match command:
                case Submit(request):
                    requests.append(request)
                case Update():
                    updates.append(command)
        for request in requests:
            resolve(request.future, error=failure)
        for update in updates:
            resolve(update.done, error=failure)
        self._requests.clear()
        self._count_in_flight(-len(requests))

    def _apply_update(self, update: Update) -> None:
        """Swap in `update`'s weights (every dispatched step handled): in-flight samples are re-prefilled."""
        for slot, sample in enumerate(self._slots):
            if sample is None:
                continue
            sample.interruptions += 1
            self.stats.interruptions += 1
            self._requeue(slot)
        for job in self._jobs:
            job.prefix = None  # prefixes made with the old weights
        self.params = update.params
        self.stats.updates += 1
        resolve(update.done, update.params.version)
        logger.debug("weights v%d in use (interrupt=%s)", update.params.version, update.interrupt)

    def _apply_aborts(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            request.aborted = True
            for sample in request.samples:
                if sample.result is None:
                    self._finish(sample, "abort")
            for job in self._jobs:
                job.samples = collections.deque(s for s in job.samples if s.result is None)
            self._drop_empty_jobs()

    def _free_slot(self, slot: int) -> None:
        """Take the sample out of `slot` and give its KV pages back."""
        sample = self._slots[slot]
        assert sample is not None  # a slot in use
        self._slots[slot] = None
        sample.slot = None
        if self._pages is not None:
            self._pages.release(slot)

    def _requeue(self, slot: int) -> None:
        """Free `slot` and queue its sample first for a re-prefill of prompt + tokens so far (its step in
        flight handled: every token it sampled is in `output_ids`)."""
        sample = self._slots[slot]
        assert sample is not None  # a slot in use
        self._free_slot(slot)
        self._jobs.appendleft(
            PrefillJob(sample.request.prompt_ids + tuple(sample.output_ids), collections.deque([sample]))
        )

    def _admit(self) -> None:
        """Fill free slots from the head of the queue: the jobs that need a prefix are prefilled together
        (one call per length bucket), then each prefix batch is inserted into its slots in one call. With a
        paged cache, admission stops at the first sample whose pages are not free."""
        if self.admission == "static" and self._has_active():
            return
        free = [slot for slot, s in enumerate(self._slots) if s is None]
        placed: list[tuple[PrefillJob, Sample, int]] = []
        free_pages = self._pages.allocator.num_free if self._pages is not None else 0
        out_of_pages = False
        for job in self._jobs:
            for sample in itertools.islice(job.samples, len(free) - len(placed)):
                if self._pages is not None:
                    needed = self._pages.pages_needed(len(job.tokens) + 1)
                    out_of_pages = needed > free_pages
                    if out_of_pages:
                        break
                    free_pages -= needed
                placed.append((job, sample, free[len(placed)]))
            if out_of_pages or len(placed) == len(free):
                break
        self.stats.admission_waits += out_of_pages
        if not placed:
            return
        self._prefill_jobs([job for job in dict.fromkeys(j for j, _, _ in placed) if job.prefix is None], self._jobs)
        by_prefix: dict[int, list[tuple[PrefillJob, Sample, int]]] = collections.defaultdict(list)
        for entry in placed:
            by_prefix[id(entry[0].placed_prefix()[0])].append(entry)
        for entries in by_prefix.values():
            batch = entries[0][0].placed_prefix()[0]
            # round r inserts the r-th sample of every prompt in the batch: one call per round
            per_row: dict[int, list[tuple[PrefillJob, Sample, int]]] = collections.defaultdict(list)
            for entry in entries:
                per_row[entry[0].placed_prefix()[1]].append(entry)
            for round_index in range(max(len(v) for v in per_row.values())):
                chosen = {row: items[round_index] for row, items in per_row.items() if round_index < len(items)}
                used_rows = max(chosen) + 1
                slots: list[int | None] = [None] * used_rows
                samplings = [SamplingParams()] * used_rows
                key_data = np.zeros((used_rows, 2), np.uint32)
                pages: list[list[int]] = [[] for _ in range(used_rows)]
                for row, (job, sample, slot) in chosen.items():
                    slots[row] = slot
                    samplings[row] = sample.request.sampling
                    key_data[row] = sample_key_words(*sample.seed_words, len(sample.output_ids))
                    if self._pages is not None:
                        assigned = self._pages.assign(slot, len(job.tokens) + 1)
                        assert assigned is not None  # counted free above
                        pages[row] = assigned
                if self._pages is None:
                    self._decode_state = self.engine.insert_batch(batch, self._decode_state, slots, samplings, key_data)
                else:
                    self._decode_state = self.engine.insert_batch(
                        batch, self._decode_state, slots, samplings, key_data, pages
                    )
            for job, sample, slot in entries:
                batch, row = job.placed_prefix()
                sample.prompt_routing = None if batch.routing is None else (batch.routing, row)
                job.samples.remove(sample)
                sample.slot = slot
                sample.admitted = next(self._admissions)
                sample.pending_version = job.prefix_version
                self._slots[slot] = sample
        self._drop_empty_jobs()

    def _drop_empty_jobs(self) -> None:
        self._jobs = collections.deque(job for job in self._jobs if job.samples)
        self._queued_prompts = {prompt: job for prompt, job in self._queued_prompts.items() if job.samples}

    def _prefill_jobs(self, jobs: list[PrefillJob], queue: Sequence[PrefillJob]) -> None:
        """Prefill `jobs` in batches of one length bucket; each job keeps (its batch, its row). A call's
        spare rows go to queued jobs of the same bucket that will need a prefix later (prefill-ahead): one
        batched call costs little more than a single prompt, and their admission is then an insert."""
        wanted = set(map(id, jobs))
        by_bucket: dict[int, list[PrefillJob]] = collections.defaultdict(list)
        ahead: dict[int, list[PrefillJob]] = collections.defaultdict(list)
        for job in jobs:
            by_bucket[bucket_for(len(job.tokens), self.engine.buckets)].append(job)
        rows = self.engine.prefill_rows
        for job in queue:  # at most one call's spare rows per bucket, so the scan stops early
            if all(len(ahead[bucket]) >= rows[-1] - 1 for bucket in by_bucket):
                break
            if job.prefix is None and id(job) not in wanted:
                bucket = bucket_for(len(job.tokens), self.engine.buckets)
                if bucket in by_bucket:
                    ahead[bucket].append(job)
        for bucket, group in by_bucket.items():
            last = len(group) % rows[-1] or rows[-1]  # jobs in the last call; spare rows are filled up to
            candidates = last + len(ahead[bucket])  # the largest row bucket the queue can fill
            fill_to = max(bucket_for(last, rows), max(b for b in rows if b <= candidates))
            group = group + ahead[bucket][: fill_to - last]
            for start in range(0, len(group), rows[-1]):
                chunk = group[start : start + rows[-1]]
                batch = self.engine.prefill_batch(self.params, [job.tokens for job in chunk])
                for row, job in enumerate(chunk):
                    job.prefix = (batch, row)
                    job.prefix_version = self.params.version
                self.stats.prefills += len(chunk)
                self.stats.prefill_calls += 1

    def _position(self, sample: Sample) -> int:
        """Where the sample's pending token is written by the next step dispatched."""
        return len(sample.request.prompt_ids) + len(sample.output_ids) + sample.in_flight

    def _grow_pages(self) -> bool:
        """Give every active slot the page its next write lands in; False when the pages ran out."""
        pages = self._pages
        assert pages is not None  # a paged cache only
        return all(
            pages.grow(slot, self._position(sample)) for slot, sample in enumerate(self._slots) if sample is not None
        )

    def _make_room(self) -> None:
        """Find pages for every active slot's next write: handle the step in flight (samples that stop free
        theirs), then preempt the newest admitted samples until the others fit."""
        self._drain()
        while not self._grow_pages():
            newest = max((s for s in self._slots if s is not None), key=lambda s: s.admitted)
            self.stats.preemptions += 1
            logger.debug("KV pages exhausted: %s sample %d back to the queue", newest.request.request_id, newest.index)
            assert newest.slot is not None  # an active sample
            self._requeue(newest.slot)

    def _dispatch(self) -> DispatchedStep | None:
        """Start one decode step over all slots and the copy of its tokens to the host; a sample whose
        last token is in this step gives up its slot now. None when no sample is left to decode (all
        preempted or stopped while making room for pages)."""
        page_updates = None
        if self._pages is not None:
            if not self._grow_pages():
                self._make_room()
                if not self._has_active():
                    return None
            page_updates = self._pages.take_updates()
            self.stats.pages_in_use = self._pages.allocator.num_used  # held during this step
            self.stats.peak_pages_in_use = max(self.stats.peak_pages_in_use, self.stats.pages_in_use)
        active = [(slot, sample) for slot, sample in enumerate(self._slots) if sample is not None]
        max_position = max(self._position(sample) for _, sample in active)
        if page_updates is None:
            self._decode_state, emitted = self.engine.generate(self.params, self._decode_state, max_position)
        else:
            self._decode_state, emitted = self.engine.generate(
                self.params, self._decode_state, max_position, page_updates
            )
        emitted.tokens.copy_to_host_async()
        emitted.logprobs.copy_to_host_async()
        if emitted.routing is not None:
            emitted.routing.copy_to_host_async()
        self.stats.decode_steps += 1
        for slot, sample in active:
            sample.in_flight += 1
            emitted_count = len(sample.output_ids) + sample.in_flight
            sampling = sample.request.sampling
            if emitted_count >= sampling.max_new_tokens or self._position(sample) >= self.engine.config.max_length:
                self._free_slot(slot)
        return DispatchedStep(active, self.params.version, emitted)

    def _handle(self, step: DispatchedStep) -> None:
        """Give each token of `step` to the sample that held its slot at dispatch (unless that sample has
        finished since) and check its stop conditions."""
        tokens, logprobs = np.asarray(step.emitted.tokens), np.asarray(step.emitted.logprobs)
        routing = None if step.emitted.routing is None else np.asarray(step.emitted.routing)
        now = time.perf_counter()
        for slot, sample in step.samples:
            sample.in_flight -= 1
            if sample.result is not None:
                continue  # stopped or aborted after this step was dispatched
            self.stats.busy_slot_steps += 1
            self.stats.emitted_tokens += 1
            sample.output_ids.append(int(tokens[slot]))
            sample.logprobs.append(float(logprobs[slot]))
            if routing is not None:
                sample.routing.append(routing[slot])
            sample.versions.append(sample.pending_version)
            sample.pending_version = step.version
            if sample.first_token_time is None:
                sample.first_token_time = now
            reason = sample.stop_reason(self.engine.config.max_length)
            if reason is not None:
                self._finish(sample, reason)

    def _finish(self, sample: Sample, reason: FinishReason) -> None:
        if sample.slot is not None:
            self._free_slot(sample.slot)
        request = sample.request
        now = time.perf_counter()
        sample.result = GenerationResult(
            request_id=request.request_id,
            sample_index=sample.index,
            prompt_ids=request.prompt_ids,
            output_ids=tuple(sample.output_ids),
            output_logprobs=tuple(sample.logprobs),
            output_versions=tuple(sample.versions),
            finish_reason=reason,
            num_interruptions=sample.interruptions,
            routing=sample.full_routing(),
            timings={
                "queued_to_first_token": (sample.first_token_time or now) - request.submitted,
                "total": now - request.submitted,
            },
        )
        if all(s.result is not None for s in request.samples):
            del self._requests[request.request_id]
            self._count_in_flight(-1)
            resolve(request.future, [s.result for s in request.samples])
