"""The paged KV cache: the allocator, the reference paged attention, and the generator on a paged engine
(equal to the dense one, pages given back, waiting and preemption when pages run out, memory that follows
the pages, no compilation after warm-up)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.paged import PageAllocator, PagedSlots
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.attention import masked_attention
from areal_jax.models.page_pool import SplitPages
from areal_jax.models.paged_attention import xla_paged_decode_attention
from areal_jax.sharding import MeshConfig, make_mesh
from tests.conftest import CompileCounter
from tests.engine_fixtures import TINY, tiny_model

GREEDY = 0.0


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def _run(model, config, requests, interrupt_after=None, abort_after=None):
    """Every request through a generator on `config`: (results in request order, stats, free pages at the
    end or None for a dense engine). With `interrupt_after`, once that many tokens are out the same weights
    come back as version 1 with interrupt=True; with `abort_after`, request 0 is aborted then."""
    engine = Engine(model, config)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(prompt, sampling, request_id=f"r{i}") for i, (prompt, sampling) in enumerate(requests)]
        trigger = interrupt_after or abort_after
        if trigger is not None:
            deadline = time.monotonic() + 60
            while gen.stats.emitted_tokens < trigger and time.monotonic() < deadline:
                time.sleep(0.001)
            if interrupt_after is not None:
                assert gen.update_params(nnx.state(model), 1, interrupt=True).result(timeout=60) == 1
            else:
                gen.abort("r0")
        results = [future.result(timeout=120)[0] for future in futures]
    free = None if gen._pages is None else gen._pages.allocator.num_free  # the loop has ended: no owner left
    return results, gen.stats, free


def _requests(count, prompt_cap, new_cap, vocab=TINY.vocab_size):
    return [
        (
            [(3 * i + j) % (vocab - 1) + 1 for j in range((7 * i) % prompt_cap + 1)],
            SamplingParams(temperature=GREEDY, max_new_tokens=(13 * i) % new_cap + 1, seed=i),
        )
        for i in range(count)
    ]


def _assert_same(dense, paged):
    for a, b in zip(dense, paged, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, atol=1e-5)


# -- the allocator ---------------------------------------------------------------------------------


def test_allocator_hands_out_frees_and_refuses_when_exhausted():
    pages = PageAllocator(5)
    first = pages.allocate(3)
    assert first == [0, 1, 2] and pages.num_free == 2 and pages.num_used == 3
    assert pages.allocate(3) is None and pages.num_free == 2  # refused whole: nothing taken
    second = pages.allocate(2)
    assert sorted(first + second) == [0, 1, 2, 3, 4] and pages.allocate(1) is None
    pages.free([1])
    assert pages.allocate(1) == [1]  # a freed page is the next one out
    with pytest.raises(ValueError, match="not allocated"):
        pages.free([1, 1])
    pages.free(first + second)
    assert pages.num_free == 5 and pages.num_used == 0


def test_paged_slots_batch_the_table_changes_of_a_step():
    slots = PagedSlots(slots=3, num_pages=6, page_size=4, max_pages=4)
    assert slots.assign(0, 5) == [0, 1] and slots.take_updates() is None  # an insert writes its own row
    assert slots.grow(0, 7) and slots.take_updates() is None  # position 7 is in page 1: nothing new
    assert slots.grow(0, 8)  # position 8 starts page 2
    assert slots.assign(2, 1) == [3]
    slots.release(2)
    updates = slots.take_updates()
    np.testing.assert_array_equal(updates, [[0, 0, 1], [2, 4, 4], [2, 0, 0]])
    assert slots.take_updates() is None and slots.allocator.num_free == 3
    assert slots.assign(2, 16) is None and slots.allocator.num_free == 3  # 4 pages wanted, 3 free
    assert slots.assign(1, 12) == [3, 4, 5] and not slots.grow(0, 12)  # pool empty
    slots.release(1)
    assert slots.assign(1, 4) == [3]  # released then reassigned before a step: the clear is cancelled
    np.testing.assert_array_equal(slots.take_updates()[0], [0, 0, 0])


def test_config_names_the_key_and_the_allowed_range():
    with pytest.raises(ConfigError, match=r"num_pages.*>= 4") as err:
        EngineConfig(max_length=64, kv_cache="paged", page_size=16, num_pages=3)
    assert err.value.key == "num_pages"
    with pytest.raises(ConfigError) as err:
        EngineConfig(kv_cache="paged", page_size=0)
    assert err.value.key == "page_size"
    with pytest.raises(ConfigError) as err:
        EngineConfig(kv_cache="ragged")
    assert err.value.key == "kv_cache"
    assert EngineConfig(max_slots=3, max_length=70, page_size=16).pool_pages == 3 * 5  # the dense footprint


# -- the reference paged attention ---------------------------------------------------------------------


def test_reference_paged_attention_equals_masked_attention_over_the_gathered_pages():
    rng = np.random.default_rng(0)
    b, k_heads, g, h, page, pool, attend = 3, 2, 2, 8, 16, 40, 5
    table = rng.permutation(pool)[: b * attend].reshape(b, attend).astype(np.int32)
    k_pages = rng.standard_normal((k_heads, pool, page, h)).astype(np.float32)
    v_pages = rng.standard_normal((k_heads, pool, page, h)).astype(np.float32)
    q = rng.standard_normal((b, 1, k_heads * g, h)).astype(np.float32)
    positions = np.array([0, 37, 79], np.int32)
    padded = np.pad(table, ((0, 0), (0, 3)))  # blocks of 4 pages: padded to 8, as the decoder does
    pool = SplitPages(k=jnp.asarray(k_pages), v=jnp.asarray(v_pages))
    got = jax.jit(xla_paged_decode_attention)(q, pool, padded, positions)
    keys = k_pages[:, table[:, :attend]].reshape(k_heads, b, attend * page, h).transpose(1, 2, 0, 3)
    values = v_pages[:, table[:, :attend]].reshape(k_heads, b, attend * page, h).transpose(1, 2, 0, 3)
    mask = (np.arange(attend * page)[None, :] <= positions[:, None])[:, None, :]
    want = masked_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


# -- the generator on a paged engine -----------------------------------------------------------------


def _configs(**common):
    return EngineConfig(**common), EngineConfig(kv_cache="paged", **common)


def test_paged_equals_dense_with_64_slots_mixed_lengths_and_an_interruption(model):
    """72 greedy requests (prompts of 1..24 tokens, 1..40 new) through 64 slots: the same tokens and
    log-probs as the dense cache, with and without a weight update that interrupts every sample; every
    page is back in the free list at the end."""
    dense_config, paged_config = _configs(max_slots=64, max_length=64, max_prefill_batch=8, page_size=8)
    requests = _requests(72, prompt_cap=24, new_cap=40)
    dense, _, _ = _run(model, dense_config, requests)
    paged, stats, free = _run(model, paged_config, requests)
    _assert_same(dense, paged)
    assert free == paged_config.pool_pages and stats.peak_pages_in_use > 64
    interrupted, stats, free = _run(model, paged_config, requests, interrupt_after=300)
    assert stats.interruptions > 0 and free == paged_config.pool_pages
    assert any(1 in r.output_versions and 0 in r.output_versions for r in interrupted)
    _assert_same(dense, interrupted)


def test_aborted_samples_give_their_pages_back(model):
    config = EngineConfig(max_slots=4, max_length=64, kv_cache="paged", page_size=8)
    long = SamplingParams(temperature=GREEDY, max_new_tokens=50)
    results, _, free = _run(model, config, [([1, 2, 3], long), ([4, 5], long)], abort_after=6)
    assert results[0].finish_reason == "abort" and len(results[0].output_ids) < 50
    assert results[1].finish_reason == "length" and free == config.pool_pages


def test_a_sample_waits_at_admission_until_pages_free_up(model):
    """Prompts of 20 tokens need 3 pages of 8 each; a pool of 8 admits two at a time: the others wait
    queued, then complete with the dense cache's tokens."""
    dense_config, paged_config = _configs(max_slots=4, max_length=64, page_size=8, num_pages=8)
    requests = [
        ([(5 * i + j) % 40 + 1 for j in range(20)], SamplingParams(temperature=GREEDY, max_new_tokens=3))
        for i in range(4)
    ]
    dense, _, _ = _run(model, dense_config, requests)
    paged, stats, free = _run(model, paged_config, requests)
    _assert_same(dense, paged)
    assert stats.admission_waits > 0 and stats.preemptions == 0
    assert stats.peak_pages_in_use <= 8 and free == 8


def test_running_samples_out_of_pages_preempt_the_newest(model):
    """Four samples admitted on one page each outgrow a pool of 8 pages: the newest go back to the queue
    (keeping their tokens) and finish later, with the dense cache's tokens and log-probs."""
    dense_config, paged_config = _configs(max_slots=4, max_length=64, page_size=8, num_pages=8)
    requests = [([i + 1, i + 2, i + 3], SamplingParams(temperature=GREEDY, max_new_tokens=40)) for i in range(4)]
    dense, _, _ = _run(model, dense_config, requests)
    paged, stats, free = _run(model, paged_config, requests)
    _assert_same(dense, paged)
    assert stats.preemptions > 0 and free == 8
    assert all(len(r.output_ids) == 40 for r in paged)


def test_64_slots_at_32k_tokens_hold_only_the_pages_in_use(model):
    """max_length 32768 and 64 slots on a pool of one sequence's pages (the least allowed): 1/64 of the
    dense footprint, and the same tokens as a dense cache of 64 tokens."""
    page, pool = 16, 32768 // 16
    config = EngineConfig(max_slots=64, max_length=32768, kv_cache="paged", page_size=page, num_pages=pool)
    engine = Engine(model, config)
    cache = engine.init_decode_state().cache
    per_token = 2 * TINY.num_layers * TINY.num_kv_heads * TINY.resolved_head_dim * 4  # k and v, fp32
    assert cache.pool_bytes == sum(a.nbytes for a in jax.tree.leaves(cache.pools)) == pool * page * per_token
    assert cache.page_table.shape == (64, pool)
    dense_bytes = 64 * 32768 * per_token
    assert cache.pool_bytes * 64 == dense_bytes
    del cache
    requests = _requests(64, prompt_cap=20, new_cap=30)
    paged, stats, free = _run(model, config, requests)
    dense, _, _ = _run(model, EngineConfig(max_slots=64, max_length=64), requests)
    _assert_same(dense, paged)
    # what the 64 samples held at most: their tokens' pages, not 64 x 32768 tokens
    assert 64 <= stats.peak_pages_in_use <= sum(-(-(len(p) + s.max_new_tokens) // page) for p, s in requests)
    assert free == pool


def test_sharded_paged_generation_equals_single_device_dense(model):
    """On a (data 2, fsdp 2, tensor 2) mesh: the pools split over the 2 KV heads, the same tokens as one
    device's dense cache."""
    requests = _requests(12, prompt_cap=20, new_cap=20)
    dense, _, _ = _run(model, EngineConfig(max_slots=4, max_length=64), requests)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    engine = Engine(model, EngineConfig(max_slots=4, max_length=64, kv_cache="paged", page_size=8), mesh=mesh)
    pool = engine.init_decode_state().cache.pools[0].k  # split off TPU
    assert pool.sharding.spec[0] == "tensor" and pool.addressable_shards[0].data.shape[0] == 1
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(p, s) for p, s in requests]
        paged = [future.result(timeout=120)[0] for future in futures]
    _assert_same(dense, paged)


def test_after_warmup_a_paged_generator_never_compiles(model):
    config = EngineConfig(max_slots=4, max_length=64, max_prefill_batch=2, kv_cache="paged", page_size=8, num_pages=12)
    engine = Engine(model, config)
    params = engine.load_params(nnx.state(model), 0)
    with CompileCounter() as warmup:
        engine.warmup(params)
    # batched prefill and insert per length and row bucket, a paged decode step per length bucket, the decode
    # state's init
    assert warmup.count == len(engine.buckets) * (2 * len(engine.prefill_rows) + 1) + 1
    with CompileCounter() as compiles, Generator(engine, params) as gen:
        futures = [
            gen.submit(list(range(1, n + 1)), SamplingParams(max_new_tokens=60, seed=n), n=2) for n in (1, 17, 40, 5, 9)
        ]
        for future in futures:
            future.result(timeout=120)
    assert compiles.count == 0 and gen.stats.preemptions > 0  # preemption and re-prefill compile nothing either
