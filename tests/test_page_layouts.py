"""The paged KV cache's two pool layouts (`models/page_pool.py`): split (keys and values each [K, P, page, H], JAX's
`paged_attention` kernel's) and combined ([P, page, 2K, H], `ragged_paged_attention`'s): the same writes hold the
same entries, the reference attention reads both alike, the ragged kernel's inputs give our answer by the kernel's
own reference, an engine on the combined layout generates the dense engine's tokens, and the layout rule."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.page_pool import CombinedPages, SplitPages, uses_combined_pages
from areal_jax.models.paged_attention import ragged_decode_args, xla_paged_decode_attention
from areal_jax.sharding import MeshConfig, make_mesh
from tests.engine_fixtures import TINY, tiny_model


def _as_split(pool: CombinedPages) -> SplitPages:
    """A combined pool's keys and values as a split pool's (head k's key at 2k, its value at 2k + 1)."""
    p, page, combined, h = pool.kv.shape
    pairs = np.asarray(pool.kv).reshape(p, page, combined // 2, 2, h).transpose(2, 3, 0, 1, 4)  # [K, 2, P, page, H]
    return SplitPages(k=jnp.asarray(pairs[:, 0]), v=jnp.asarray(pairs[:, 1]))


def _random_pools(rng: np.random.Generator, k_heads: int, pool: int, page: int, h: int):
    k = rng.standard_normal((k_heads, pool, page, h)).astype(np.float32)
    v = rng.standard_normal((k_heads, pool, page, h)).astype(np.float32)
    combined = np.stack([k, v], axis=1).transpose(2, 3, 0, 1, 4).reshape(pool, page, 2 * k_heads, h)
    split, joined = SplitPages(k=jnp.asarray(k), v=jnp.asarray(v)), CombinedPages(kv=jnp.asarray(combined))
    np.testing.assert_array_equal(np.asarray(_as_split(joined).k), k)
    return split, joined


def test_both_layouts_hold_the_same_entries_after_inserts_and_decode_writes():
    """Whole pages of two prefix rows (`put`), then one token per slot at given pages and offsets (`write`), into
    a split and a combined pool: the combined one read as keys and values is the split one, page id P (no page)
    dropped in both."""
    rng = np.random.default_rng(0)
    k_heads, pool, page, h, b, w = 2, 6, 4, 8, 2, 2
    split = SplitPages(k=jnp.zeros((k_heads, pool, page, h)), v=jnp.zeros((k_heads, pool, page, h)))
    combined = CombinedPages(kv=jnp.zeros((pool, page, 2 * k_heads, h)))
    pages_BxW = jnp.array([[3, 0], [5, pool]], jnp.int32)  # row 1's second page: none, dropped
    k_prefix, v_prefix = (jnp.asarray(rng.standard_normal((b, w, page, k_heads, h)), jnp.float32) for _ in range(2))
    split, combined = split.put(pages_BxW, k_prefix, v_prefix), combined.put(pages_BxW, k_prefix, v_prefix)
    page_B, offset_B = jnp.array([0, pool, 1], jnp.int32), jnp.array([2, 0, 3], jnp.int32)  # slot 1: no page
    k_new, v_new = (jnp.asarray(rng.standard_normal((3, k_heads, h)), jnp.float32) for _ in range(2))
    split, combined = split.write(page_B, offset_B, k_new, v_new), combined.write(page_B, offset_B, k_new, v_new)
    read = _as_split(combined)
    np.testing.assert_array_equal(np.asarray(read.k), np.asarray(split.k))
    np.testing.assert_array_equal(np.asarray(read.v), np.asarray(split.v))
    np.testing.assert_array_equal(np.asarray(split.k)[:, 5, :, 0], np.asarray(k_prefix)[1, 0, :, :, 0].T)
    np.testing.assert_array_equal(np.asarray(split.v)[:, 0, 2], np.asarray(v_new)[0])
    np.testing.assert_array_equal(np.asarray(split.k)[:, 1, 3], np.asarray(k_new)[2])
    assert not np.asarray(split.k)[:, [2, 4]].any()  # pages nobody wrote


def _decode_inputs(seed: int):
    """Pools of 40 pages of 8 tokens (2 KV heads of 16) in both layouts, 3 slots' page tables of 8 pages, their
    queries (3 query heads a KV head) and positions."""
    rng = np.random.default_rng(seed)
    b, k_heads, g, h, page, pool, attend = 3, 2, 3, 16, 8, 40, 8
    split, combined = _random_pools(rng, k_heads, pool, page, h)
    table = jnp.asarray(rng.permutation(pool)[: b * attend].reshape(b, attend), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, 1, k_heads * g, h)), jnp.float32)
    return split, combined, table, q, jnp.array([0, 37, 63], jnp.int32)


def test_the_reference_attention_reads_either_layout_alike():
    split, combined, table, q, positions = _decode_inputs(1)
    attend_fn = jax.jit(xla_paged_decode_attention)
    np.testing.assert_allclose(attend_fn(q, combined, table, positions), attend_fn(q, split, table, positions), 1e-6)


def test_the_ragged_kernels_inputs_give_our_answer_by_its_own_reference():
    """On TPU a combined pool's decode step calls JAX's ragged paged attention on the inputs `ragged_decode_args`
    builds (each slot a one-token sequence over its cached tokens up to its position). The kernel fails in Pallas's
    TPU interpreter in jax 0.10.2 (`'ReshapeTransform' object has no attribute 'indices'`), so its own reference,
    `ref_ragged_paged_attention`, reads the same pool and inputs here; it must answer as our XLA path does."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    _, combined, table, q, positions = _decode_inputs(2)
    h = q.shape[-1]
    want = jax.jit(xla_paged_decode_attention)(q, combined, table, positions)
    got = ref_ragged_paged_attention(*ragged_decode_args(q[:, 0], combined.kv, positions, table), sm_scale=h**-0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, 0], atol=1e-5)


def _generate(model, config, requests, mesh=None, interrupt=False):
    engine = Engine(model, config, mesh=mesh)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(prompt, sampling) for prompt, sampling in requests]
        if interrupt:
            deadline = time.monotonic() + 60
            while gen.stats.emitted_tokens < 40 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert gen.update_params(nnx.state(model), 1, interrupt=True).result(timeout=60) == 1
        return engine, [future.result(timeout=120)[0] for future in futures]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "tensor-2"])
def test_an_engine_on_the_combined_layout_generates_the_dense_engines_tokens(sharded):
    """`page_layout: combined` on CPU (the reference attention over it): the dense cache's tokens and log-probs,
    through an interruption; on a (data 2, fsdp 2, tensor 2) mesh each chip holds one KV head's key and value."""
    model = tiny_model(0)
    requests = [
        ([(3 * i + j) % 60 + 1 for j in range(i % 20 + 1)], SamplingParams(temperature=0.0, max_new_tokens=i % 17 + 4))
        for i in range(10)
    ]
    common = {"max_slots": 4, "max_length": 64, "min_prefill_bucket": 16}
    _, dense = _generate(model, EngineConfig(**common), requests)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)) if sharded else None
    config = EngineConfig(kv_cache="paged", page_size=8, page_layout="combined", **common)
    engine, paged = _generate(model, config, requests, mesh=mesh, interrupt=not sharded)
    assert engine.combined_pages
    for a, b in zip(dense, paged, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, atol=1e-5)
    pool = engine.init_decode_state().cache.pools[0]
    assert isinstance(pool, CombinedPages) and pool.kv.shape == (config.pool_pages, 8, 2 * TINY.num_kv_heads, 8)
    if sharded:
        assert pool.kv.sharding.spec[2] == "tensor" and pool.kv.addressable_shards[0].data.shape[2] == 2


def test_auto_is_combined_exactly_where_the_ragged_kernel_takes_the_pool():
    """auto: combined on TPU at head dim 128 with heads the kernel tiles (a device's share), split elsewhere; an
    explicit combined the kernel cannot take on TPU is refused naming the key, and allowed off TPU."""
    at_128 = dataclasses.replace(TINY, hidden_size=512, num_heads=4, num_kv_heads=2, compute_dtype="bfloat16")
    assert at_128.resolved_head_dim == 128
    assert uses_combined_pages("auto", at_128, "tpu")
    assert uses_combined_pages("auto", at_128, "tpu", kv_shards=2)  # one head's key and value a chip
    assert not uses_combined_pages("auto", at_128, "cpu") and not uses_combined_pages("split", at_128, "tpu")
    three_heads = dataclasses.replace(at_128, hidden_size=768, num_heads=6, num_kv_heads=3)  # 6 combined: not tiled
    assert not uses_combined_pages("auto", three_heads, "tpu")
    at_256 = dataclasses.replace(at_128, head_dim=256)  # Qwen3.5's: Mosaic refuses the page copies
    assert not uses_combined_pages("auto", at_256, "tpu")
    with pytest.raises(ConfigError, match="head dim 256") as err:
        uses_combined_pages("combined", at_256, "tpu")
    assert err.value.key == "rollout.engine.page_layout"
    assert uses_combined_pages("combined", at_256, "cpu")
    with pytest.raises(ConfigError) as err:
        EngineConfig(page_layout="ragged")
    assert err.value.key == "page_layout"
