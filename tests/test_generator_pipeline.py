"""The pipelined host loop (step t's tokens copied to the host while step t+1 runs): the same tokens,
log-probs and versions as handling each step before dispatching the next, also across a weight update
and with stop tokens and stop strings found one step late; no compilation after warm-up."""

import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from tests.conftest import CompileCounter
from tests.engine_fixtures import all_at_once, scoring_logprobs, tiny_model


def _decode(ids):  # two characters per token: stop strings cross token boundaries
    return "".join(chr(97 + t % 26) + chr(65 + t % 7) for t in ids)


@pytest.fixture(scope="module")
def warm_engine():
    """One engine for every run of this module, warmed up once: runs in either order compile nothing."""
    old, new = tiny_model(0), tiny_model(1)
    engine = Engine(old, EngineConfig(max_slots=3, max_length=32, max_prefill_batch=2))
    params = engine.load_params(nnx.state(old), 0)
    engine.warmup(params)
    return engine, params, old, new


def _as_tuples(results):
    return [(r.output_ids, r.output_versions, r.finish_reason, r.num_interruptions) for r in results]


def test_pipelined_equals_unpipelined_greedy(warm_engine):
    """More requests than slots, finishing by length, stop token and stop string, so slots are refilled
    while a step is in flight; every sample's tokens, versions and log-probs equal the unpipelined loop's."""
    engine, params, _, _ = warm_engine
    prompts = [[1, 2, 3], [4, 5], list(range(6, 20)), [9, 9, 9, 9], [30, 31], [40]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = {}
    with Generator(engine, params, pipelined=False) as gen:
        plain_runs = [gen.submit(p, greedy).result(timeout=120)[0] for p in prompts[:2]]
    stop_token = plain_runs[0].output_ids[4]
    stop_string = _decode(plain_runs[1].output_ids)[5:8]  # crosses the tokens 2 | 3
    samplings = [
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_token,)),
        SamplingParams(temperature=0.0, max_new_tokens=20, stop_strings=(stop_string,)),
        SamplingParams(temperature=0.0, max_new_tokens=7),
        SamplingParams(temperature=0.8, max_new_tokens=15, seed=3),
        SamplingParams(temperature=0.0, max_new_tokens=3),
        SamplingParams(temperature=0.8, max_new_tokens=9, seed=4),
    ]
    steps = {}
    with CompileCounter() as compiles:
        for pipelined in (False, True):
            with Generator(engine, params, detokenize=_decode, pipelined=pipelined) as gen:
                with all_at_once(gen):  # everything queued before the first step, in both orders
                    futures = [
                        gen.submit(p, s, n=2 if i == 3 else 1)
                        for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
                    ]
                plain[pipelined] = [r for f in futures for r in f.result(timeout=120)]
                steps[pipelined] = gen.stats.decode_steps
    assert compiles.count == 0
    assert _as_tuples(plain[True]) == _as_tuples(plain[False])
    for a, b in zip(plain[True], plain[False], strict=True):
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
    reasons = [r.finish_reason for r in plain[True]]
    assert reasons[0] == reasons[1] == "stop" and reasons[2:] == ["length"] * 5
    assert plain[True][0].output_ids[-1] == stop_token
    assert _decode(plain[True][1].output_ids).endswith(stop_string) and len(plain[True][1].output_ids) == 4
    # a stop found on the host one step late can cost at most one extra step per such sample
    assert steps[False] <= steps[True] <= steps[False] + 2


def test_weight_update_lands_after_the_running_step_in_both_orders(warm_engine):
    """A trigger request's completion posts a weight update from the loop thread itself. Unpipelined, the
    trigger's last token is handled right after the step that made it; pipelined, one step later, while
    the next step already runs; either way the update lands after that running step. With the trigger one
    token longer unpipelined, the swap falls after the same decode step, so the other samples' tokens,
    log-probs and versions are identical; each token's log-prob is its own version's (seeded sampling)."""
    engine, params, old, new = warm_engine
    new_state = nnx.state(new)
    prompts = {"a": [3, 1, 4, 1, 5], "c": [2, 7, 1, 8]}
    sampling = SamplingParams(temperature=0.9, max_new_tokens=24, seed=7)
    outputs = {}
    with CompileCounter() as compiles:
        for pipelined in (False, True):
            with Generator(engine, params, pipelined=pipelined) as gen:
                with all_at_once(gen):
                    futures = {name: gen.submit(p, sampling) for name, p in prompts.items()}
                    trigger = gen.submit([6, 6], SamplingParams(temperature=0.0, max_new_tokens=6 if pipelined else 7))
                    updated = []
                    trigger.add_done_callback(
                        lambda _, gen=gen, out=updated: out.append(gen.update_params(new_state, 1))
                    )
                outputs[pipelined] = {name: f.result(timeout=120)[0] for name, f in futures.items()}
                assert updated[0].result(timeout=60) == 1 and gen.stats.interruptions == 2
    assert compiles.count == 0
    for name, prompt in prompts.items():
        piped, plain = outputs[True][name], outputs[False][name]
        assert (piped.output_ids, piped.output_versions) == (plain.output_ids, plain.output_versions)
        np.testing.assert_allclose(piped.output_logprobs, plain.output_logprobs, atol=1e-5)
        versions = np.array(piped.output_versions)
        # the trigger's 7th token came from the 7th step (its first token was sampled at insert), so 7
        # steps ran on v0 and the re-prefill's token is v1
        assert versions.tolist() == [0] * 7 + [1] * 17 and piped.num_interruptions == 1
        for version, model in ((0, old), (1, new)):
            chosen = versions == version
            scored = scoring_logprobs(model, prompt, list(piped.output_ids), 0.9)
            np.testing.assert_allclose(np.array(piped.output_logprobs)[chosen], scored[chosen], atol=1e-5)
