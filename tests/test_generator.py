"""Generator: continuous batching, interruptible weight updates, abort, stop conditions,
bounded compilation under many concurrent requests."""

import asyncio
import time

import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from tests.engine_fixtures import TINY, all_at_once, scoring_logprobs, tiny_model

TEMPERATURE = 0.9


def _wait_until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


@pytest.fixture(scope="module")
def models():
    return tiny_model(0), tiny_model(1)


@pytest.mark.parametrize("interrupt", [True, False])
def test_weight_update_mid_generation(models, interrupt):
    old, new = models
    engine = Engine(old, EngineConfig(max_slots=2, max_length=96))
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=40, seed=5)
    prompt = [3, 1, 4, 1, 5]
    with Generator(engine, engine.load_params(nnx.state(old), 0)) as gen:
        future = gen.submit(prompt, sampling)
        _wait_until(lambda: gen.stats.emitted_tokens >= 4)
        at_swap = []  # the tokens handled when the new weights came into use, read on the loop thread
        with all_at_once(gen):  # the update cannot land before its callback is attached
            applied = gen.update_params(nnx.state(new), 1, interrupt=interrupt)
            applied.add_done_callback(lambda _: at_swap.append(gen.stats.emitted_tokens))
        assert applied.result(timeout=60) == 1
        (result,) = future.result(timeout=60)
        later = gen.submit(prompt, sampling).result(timeout=60)[0]
    versions = np.array(result.output_versions)
    assert len(result.output_ids) == 40 and result.finish_reason == "length"
    assert (np.diff(versions) >= 0).all()
    if interrupt:
        (emitted_before,) = at_swap
        assert result.num_interruptions == 1 and gen.stats.interruptions == 1 and emitted_before >= 4
        assert (versions[:emitted_before] == 0).all()
        assert versions[-1] == 1 and (versions == 0).sum() == emitted_before
    else:
        assert result.num_interruptions == 0 and (versions == 0).all()
    assert set(later.output_versions) == {1}
    # each token's behaviour log-prob is the log-prob of its own version's params for its prefix
    prefix_and_outputs = list(result.output_ids)
    for version, model in ((0, old), (1, new)):
        chosen = versions == version
        if chosen.any():
            scored = scoring_logprobs(model, prompt, prefix_and_outputs, TEMPERATURE)
            np.testing.assert_allclose(np.array(result.output_logprobs)[chosen], scored[chosen], atol=1e-5)


def test_prefill_ahead_batches_queued_prompts_without_changing_results(models):
    """Queued prompts of one length bucket ride along in a batched prefill before their slots free up:
    fewer prefill calls, each prompt prefilled once, and the same tokens as one request at a time."""
    model = models[0]
    prompts = [[5 + i, 6, 7, 8, 9 + i] for i in range(8)]  # one length bucket
    samplings = [SamplingParams(temperature=0.0, max_new_tokens=3 + i) for i in range(8)]
    config = EngineConfig(max_slots=4, max_length=64)
    params = Engine(model, config).load_params(nnx.state(model), 0)
    with Generator(Engine(model, config), params) as gen:
        alone = [gen.submit(p, s).result(timeout=120)[0].output_ids for p, s in zip(prompts, samplings, strict=True)]
    with Generator(Engine(model, config), params) as gen:
        with all_at_once(gen):
            futures = [gen.submit(p, s) for p, s in zip(prompts, samplings, strict=True)]
        together = [f.result(timeout=120)[0].output_ids for f in futures]
        assert gen.stats.prefills == len(prompts)  # each prompt prefilled exactly once
        # the first 4 fill the slots; when the shortest finishes, the 5th is prefilled with 3 more ahead
        assert gen.stats.prefill_calls == 2
    assert together == alone


def test_requests_for_a_queued_prompt_share_its_prefill_without_changing_results(models):
    """Requests whose prompt is already queued (an agent group's episodes all open with the task's prompt) join
    that prompt's prefill: one prefill serves them all, each sample keeps its own seed and so its own tokens,
    and aborting one of them leaves the others whole."""
    model = models[0]
    shared, other = [4, 8, 15, 16, 23], [42, 7, 7, 1]
    requests = [  # (prompt, sampling, n)
        (shared, SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=1), 2),
        (other, SamplingParams(temperature=TEMPERATURE, max_new_tokens=5, seed=2), 1),
        (shared, SamplingParams(temperature=TEMPERATURE, max_new_tokens=9, seed=3), 1),
        (shared, SamplingParams(temperature=0.0, max_new_tokens=4), 1),
    ]
    config = EngineConfig(max_slots=8, max_length=64)
    params = Engine(model, config).load_params(nnx.state(model), 0)
    with Generator(Engine(model, config), params) as gen:
        alone = [gen.submit(p, s, n).result(timeout=120) for p, s, n in requests]
    with Generator(Engine(model, config), params) as gen:
        with all_at_once(gen):
            futures = [gen.submit(p, s, n) for p, s, n in requests]
        together = [f.result(timeout=120) for f in futures]
        assert gen.stats.shared_prefills == 2 and gen.stats.prefills == 2  # one per distinct prompt
    for results, reference in zip(together, alone, strict=True):
        assert [r.output_ids for r in results] == [r.output_ids for r in reference]
        for result, expected in zip(results, reference, strict=True):
            np.testing.assert_allclose(result.output_logprobs, expected.output_logprobs, atol=1e-5)
    assert together[2][0].output_ids != together[0][0].output_ids  # own seeds: not one sample copied

    # the slot is busy, so both requests for `shared` wait in one job; aborting one leaves the other whole
    engine = Engine(model, EngineConfig(max_slots=1, max_length=64))
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        with all_at_once(gen):
            busy = gen.submit(other, SamplingParams(temperature=0.0, max_new_tokens=20))
            dropped = gen.submit(shared, SamplingParams(temperature=0.0, max_new_tokens=4), request_id="dropped")
            kept = gen.submit(shared, SamplingParams(temperature=0.0, max_new_tokens=4))
        with all_at_once(gen):
            gen.abort("dropped")
        assert dropped.result(timeout=60)[0].finish_reason == "abort"
        assert kept.result(timeout=60)[0].output_ids == alone[3][0].output_ids
        assert busy.result(timeout=60)[0].finish_reason == "length"
        assert gen.stats.shared_prefills == 1 and gen.stats.prefills == 2


@pytest.mark.parametrize("interrupt", [True, False])
def test_prefixes_prefilled_ahead_are_dropped_when_weights_change(models, interrupt):
    """A prompt prefilled ahead under version 0 but admitted after version 1 arrived is prefilled again:
    every token it emits carries version 1 and the new params' log-probs."""
    old, new = models
    engine = Engine(old, EngineConfig(max_slots=2, max_length=96, max_prefill_batch=2))
    lengths = {"a": 70, "x": 2, "b": 60, "c": 8}  # b and a run long: the update comes before c is admitted
    prompts = {name: [2 + i, 7, 1, 8, 2] for i, name in enumerate(lengths)}
    with Generator(engine, engine.load_params(nnx.state(old), 0)) as gen:
        with all_at_once(gen):
            futures = {
                name: gen.submit(prompts[name], SamplingParams(temperature=TEMPERATURE, max_new_tokens=n, seed=i))
                for i, (name, n) in enumerate(lengths.items())
            }
        _wait_until(lambda: gen.stats.prefill_calls == 2)  # x finished: b admitted, c prefilled ahead (v0)
        with all_at_once(gen):
            assert gen.stats.prefills == 4 and not futures["b"].done()
            applied = gen.update_params(nnx.state(new), 1, interrupt=interrupt)
        assert applied.result(timeout=60) == 1
        results = {name: future.result(timeout=60)[0] for name, future in futures.items()}
        # interrupted: a and b re-prefilled with c; draining: c alone once a and b are done
        assert gen.stats.prefills == (7 if interrupt else 5)
    c = results["c"]
    assert set(c.output_versions) == {1}
    np.testing.assert_allclose(
        c.output_logprobs, scoring_logprobs(new, prompts["c"], list(c.output_ids), TEMPERATURE), atol=1e-5
    )
    assert set(results["a"].output_versions) == ({0, 1} if interrupt else {0})


def test_many_concurrent_requests_each_answered_once_with_bounded_compiles(models):
    model = models[0]
    engine = Engine(model, EngineConfig(max_slots=8, max_length=64))
    rng = np.random.default_rng(0)
    stop_token = 7
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = {}
        for i in range(200):
            prompt = rng.integers(8, TINY.vocab_size, rng.integers(1, 40)).tolist()
            sampling = SamplingParams(
                temperature=1.0, max_new_tokens=int(rng.integers(1, 16)), stop_token_ids=(stop_token,), seed=i
            )
            futures[f"r{i}"] = (gen.submit(prompt, sampling, request_id=f"r{i}"), sampling, prompt)
        for request_id, (future, sampling, prompt) in futures.items():
            (result,) = future.result(timeout=300)
            assert result.request_id == request_id and result.prompt_ids == tuple(prompt)
            n = len(result.output_ids)
            assert 1 <= n <= sampling.max_new_tokens
            if result.finish_reason == "stop":
                assert result.output_ids[-1] == stop_token and stop_token not in result.output_ids[:-1]
            else:
                assert n == sampling.max_new_tokens or len(prompt) + n == 64
                assert stop_token not in result.output_ids
        assert gen.num_in_flight() == 0
        assert gen.stats.prefills == 200
    programs_per_length = len(engine.prefill_rows)  # prefill and insert: one per (length, row) bucket
    assert engine._generate._cache_size() <= len(engine.buckets)
    assert engine._prefill_batch._cache_size() <= len(engine.buckets) * programs_per_length
    assert engine._insert_batch._cache_size() <= len(engine.buckets) * programs_per_length


def test_slots_refill_as_soon_as_one_finishes(models):
    model = models[0]
    engine = Engine(model, EngineConfig(max_slots=2, max_length=64))
    long = SamplingParams(temperature=1.0, max_new_tokens=30, seed=0)
    short = SamplingParams(temperature=1.0, max_new_tokens=3, seed=0)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        first_long = gen.submit([1, 2], long)
        shorts = [gen.submit([3, 4], short) for _ in range(4)]
        for f in shorts:
            f.result(timeout=60)
        steps_when_shorts_done = gen.stats.decode_steps
        first_long.result(timeout=60)
    # 4 short requests of 3 tokens through one free slot need ~12 steps, not waiting for the 30-token one
    assert steps_when_shorts_done <= 16


def test_abort_idle_time_and_stop_strings(models):
    model = models[0]
    engine = Engine(model, EngineConfig(max_slots=2, max_length=64))
    params = engine.load_params(nnx.state(model), 0)
    with Generator(engine, params, detokenize=lambda ids: "".join(chr(97 + t % 26) for t in ids)) as gen:
        time.sleep(0.2)  # no request yet: the loop waits, and waiting is not working (the planner's generation rate)
        assert gen.stats.busy_seconds == 0
        endless = gen.submit([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=60, seed=1), request_id="x")
        _wait_until(lambda: gen.stats.emitted_tokens >= 2)
        gen.abort("x")
        (aborted,) = endless.result(timeout=60)
        assert aborted.finish_reason == "abort" and 2 <= len(aborted.output_ids) < 60
        assert gen.stats.busy_seconds > 0

        greedy = gen.submit([5, 6], SamplingParams(temperature=0.0, max_new_tokens=20)).result(timeout=60)[0]
        text = "".join(chr(97 + t % 26) for t in greedy.output_ids)
        stop = text[2:4]
        cut = gen.submit([5, 6], SamplingParams(temperature=0.0, max_new_tokens=20, stop_strings=(stop,)))
        (stopped,) = cut.result(timeout=60)
    stopped_text = "".join(chr(97 + t % 26) for t in stopped.output_ids)
    assert stopped.finish_reason == "stop" and stopped_text.endswith(stop)
    assert stopped_text == text[: text.index(stop) + len(stop)]


def test_async_api_and_bad_input(models):
    model = models[0]
    engine = Engine(model, EngineConfig(max_slots=4, max_length=32))

    async def main(gen):
        return await asyncio.gather(
            *(gen.generate([i + 1, i + 2], SamplingParams(temperature=0.0, max_new_tokens=4), n=2) for i in range(5))
        )

    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        results = asyncio.run(main(gen))
        assert [len(r) for r in results] == [2] * 5
        assert all(r[0].output_ids == r[1].output_ids for r in results)  # greedy samples agree
        with pytest.raises(ValueError, match="prompt length 40"):
            gen.submit(list(range(40)), SamplingParams())
        with pytest.raises(ValueError, match="n must be >= 1"):
            gen.submit([1], SamplingParams(), n=0)
        # a request id already in flight fails the second future; the id is free again once answered
        with all_at_once(gen):
            first = gen.submit([1, 2], SamplingParams(max_new_tokens=2), request_id="dup")
            second = gen.submit([1, 2], SamplingParams(max_new_tokens=2), request_id="dup")
            assert gen.num_in_flight() == 2
        with pytest.raises(ValueError, match="'dup' is already in flight"):
            second.result(timeout=60)
        assert len(first.result(timeout=60)) == 1
        assert gen.num_in_flight() == 0  # the refused request is not counted as in flight either
        assert len(gen.submit([1, 2], SamplingParams(max_new_tokens=2), request_id="dup").result(timeout=60)) == 1
    with pytest.raises(RuntimeError, match="closed"):
        gen.submit([1], SamplingParams())


def test_cancelled_caller_aborts_its_request_and_generator_survives(models):
    model = models[0]
    engine = Engine(model, EngineConfig(max_slots=2, max_length=64))

    async def main(gen):
        task = asyncio.create_task(gen.generate([1, 2], SamplingParams(max_new_tokens=50, seed=0), request_id="c"))
        while gen.num_in_flight() == 0:  # submitted: the cancellation reaches a request, not a task not yet run
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await gen.generate([3, 4], SamplingParams(temperature=0.0, max_new_tokens=3))

    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        (result,) = asyncio.run(main(gen))
        assert len(result.output_ids) == 3
        _wait_until(lambda: gen.num_in_flight() == 0)
