"""Generator under concurrency: submits from several threads, weight updates and aborts from others, and a
close racing the submitters. Every request is answered exactly once and every token carries a version
that was published."""

import collections
import concurrent.futures
import random
import sys
import threading

import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from tests.engine_fixtures import TINY, tiny_model

SUBMITTERS = 4
REQUESTS_PER_SUBMITTER = 250
UPDATES = 50
OUTSTANDING_PER_SUBMITTER = 16  # submits keep coming for the whole run, not in one burst at the start
TIMEOUT = 120.0


class _Completions:
    """Counts done-callbacks per request id and lets a thread wait for a total."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.per_request: collections.Counter[str] = collections.Counter()
        self.total = 0

    def callback(self, request_id: str):
        def on_done(_: concurrent.futures.Future) -> None:
            with self._cond:
                self.per_request[request_id] += 1
                self.total += 1
                self._cond.notify_all()

        return on_done

    def wait_for(self, total: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.total >= total, TIMEOUT), f"{self.total} of {total} answered"


def _random_request(rng: random.Random) -> tuple[list[int], SamplingParams, int]:
    prompt = [rng.randrange(1, TINY.vocab_size) for _ in range(rng.randint(1, 8))]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=rng.randint(1, 4), seed=rng.randrange(2**31))
    return prompt, sampling, rng.choice((1, 1, 2))


@pytest.fixture(autouse=True)
def frequent_thread_switches():
    """Switch threads far more often than the default 5 ms, so that unguarded shared state shows up."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


@pytest.fixture(scope="module")
def engine_and_states():
    old, new = tiny_model(0), tiny_model(1)
    return Engine(old, EngineConfig(max_slots=8, max_length=32)), (nnx.state(old), nnx.state(new))


def test_submits_updates_and_aborts_from_many_threads_answer_every_request_once(engine_and_states):
    engine, states = engine_and_states
    total = SUBMITTERS * REQUESTS_PER_SUBMITTER
    completions = _Completions()
    start = threading.Barrier(SUBMITTERS + 1)

    def submitter(index: int) -> dict[str, tuple[concurrent.futures.Future, int]]:
        rng = random.Random(index)
        outstanding = threading.BoundedSemaphore(OUTSTANDING_PER_SUBMITTER)
        submitted = {}
        start.wait()
        for i in range(REQUESTS_PER_SUBMITTER):
            request_id = f"t{index}-{i}"
            prompt, sampling, n = _random_request(rng)
            assert outstanding.acquire(timeout=TIMEOUT)
            future = gen.submit(prompt, sampling, n=n, request_id=request_id)
            future.add_done_callback(completions.callback(request_id))
            future.add_done_callback(lambda _: outstanding.release())
            submitted[request_id] = (future, n)
            if i % 10 == 3:  # this request or one a little older, which may be done already
                gen.abort(f"t{index}-{i - rng.randrange(3)}")
        return submitted

    def updater() -> list[int]:
        applied = []
        start.wait()
        for pair in range(UPDATES // 2):
            # two updates queued back to back, draining and interrupting in either order
            first_interrupts = pair % 2 == 0
            versions = (2 * pair + 1, 2 * pair + 2)
            dones = [
                gen.update_params(states[v % 2], v, interrupt=first_interrupts == (k == 0))
                for k, v in enumerate(versions)
            ]
            applied += [done.result(timeout=TIMEOUT) for done in dones]
            completions.wait_for(total * (pair + 1) // (UPDATES // 2 + 1))  # spread over the run
        return applied

    with Generator(engine, engine.load_params(states[0], 0)) as gen:
        with concurrent.futures.ThreadPoolExecutor(SUBMITTERS + 1) as pool:
            submitters = [pool.submit(submitter, i) for i in range(SUBMITTERS)]
            applied = pool.submit(updater).result(timeout=4 * TIMEOUT)
            requests = {rid: entry for s in submitters for rid, entry in s.result(timeout=TIMEOUT).items()}
        completions.wait_for(total)
        results = {rid: future.result(timeout=0) for rid, (future, _) in requests.items()}
        assert gen.num_in_flight() == 0
        assert applied == list(range(1, UPDATES + 1)) and gen.version == UPDATES and gen.stats.updates == UPDATES
        after = gen.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(timeout=TIMEOUT)  # loop alive
        assert set(after[0].output_versions) == {UPDATES}

    assert len(requests) == total and set(completions.per_request) == set(requests)
    assert set(completions.per_request.values()) == {1}
    published = set(range(UPDATES + 1))
    reasons = collections.Counter()
    for request_id, samples in results.items():
        assert [s.sample_index for s in samples] == list(range(requests[request_id][1]))
        for sample in samples:
            assert sample.request_id == request_id
            reasons[sample.finish_reason] += 1
            versions = np.array(sample.output_versions, dtype=np.int64)
            assert len(versions) == len(sample.output_ids) == len(sample.output_logprobs)
            assert (np.diff(versions) >= 0).all() and set(versions.tolist()) <= published
    assert reasons["abort"] > 0 and reasons["length"] > 0 and set(reasons) <= {"length", "abort"}


def test_close_racing_submitters_answers_every_accepted_request(engine_and_states):
    """Submits either raise 'closed' at once or return a future that is answered by the time close returns."""
    engine, states = engine_and_states
    enough = threading.Event()
    accepted: list[list[concurrent.futures.Future]] = [[] for _ in range(SUBMITTERS)]

    def submitter(index: int) -> None:
        rng = random.Random(100 + index)
        while True:
            prompt, sampling, n = _random_request(rng)
            try:
                accepted[index].append(gen.submit(prompt, sampling, n=n))
            except RuntimeError as err:
                assert "closed" in str(err)
                return
            if len(accepted[index]) == 20:
                enough.set()

    gen = Generator(engine, engine.load_params(states[0], 0))
    with concurrent.futures.ThreadPoolExecutor(SUBMITTERS) as pool:
        running = [pool.submit(submitter, i) for i in range(SUBMITTERS)]
        assert enough.wait(TIMEOUT)
        gen.close()
        for r in running:
            r.result(timeout=TIMEOUT)
    futures = [f for per_thread in accepted for f in per_thread]
    assert all(f.done() for f in futures)
    for f in futures:
        if f.exception() is not None:
            assert isinstance(f.exception(), RuntimeError) and "closed" in str(f.exception())
    assert gen.num_in_flight() == 0
    gen.abort("anything")  # a closed generator ignores an abort


def test_weight_updates_racing_submits_keep_the_loop_alive(engine_and_states):
    """Many updates while the queue keeps changing under submits and aborts (the old loop walked its
    job queue during an update while other threads appended to it, and died)."""
    engine, states = engine_and_states
    updates, stop = 300, threading.Event()

    def submitter(index: int) -> list[concurrent.futures.Future]:
        rng = random.Random(200 + index)
        outstanding = threading.BoundedSemaphore(2 * OUTSTANDING_PER_SUBMITTER)
        futures = []
        while not stop.is_set():
            prompt, sampling, n = _random_request(rng)
            assert outstanding.acquire(timeout=TIMEOUT)
            futures.append(gen.submit(prompt, sampling, n=n, request_id=f"t{index}-{len(futures)}"))
            futures[-1].add_done_callback(lambda _: outstanding.release())
            if len(futures) % 7 == 0:
                gen.abort(f"t{index}-{len(futures) - 2}")
        return futures

    with Generator(engine, engine.load_params(states[0], 0)) as gen:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(submitter, i) for i in range(2)]
            try:
                for version in range(1, updates + 1):
                    done = gen.update_params(states[version % 2], version, interrupt=version % 3 != 0)
                    assert done.result(timeout=TIMEOUT) == version
            finally:
                stop.set()
            futures = [f for r in running for f in r.result(timeout=TIMEOUT)]
        answered = [f.result(timeout=TIMEOUT) for f in futures]
        assert len(answered) == len(futures) and gen.stats.updates == updates
