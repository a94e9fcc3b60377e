"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) served from the paged KV cache: the full-attention layers' keys and values in
pages, each linear layer's recurrent state and convolution window per slot. On the tiny HF checkpoints of
`test_hybrid_engine.py`: the paged engine samples the dense hybrid engine's tokens with its log-probs (mixed
prompt lengths, several samples per prompt, more requests than slots, a pool small enough to make samples wait
and be preempted), a sharded paged engine samples what one device does, nothing compiles after warm-up, a mixture
still records its routing; the memory plan counts the pool for the full layers only beside the states; a model
with nothing to page is refused. Its log-probs against the trainer's across an abort and an interruption:
`test_hybrid_engine.py` (the same flow on both caches)."""

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.paged_hybrid import PagedHybridCache
from areal_jax.inference.sampling import SamplingParams
from areal_jax.inference.slot_cache import PAGED_REFUSAL
from areal_jax.models.hybrid import HybridDecoder
from tests.conftest import CompileCounter
from tests.test_hybrid_engine import TEMPERATURE, _assert_rounding_close, _packed_logprobs, two_versions
from tests.test_hybrid_moe import TINY_MOE
from tests.test_hybrid_parity import _load, _text_model

VOCAB = 97  # test_hybrid_parity.TEXT's


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    return two_versions(tmp_path_factory.mktemp("qwen3_5_paged"))


def _configs(**common) -> tuple[EngineConfig, EngineConfig]:
    return EngineConfig(**common), EngineConfig(kv_cache="paged", **common)


def _run(model, config, jobs, mesh=None):
    """Every (prompt, sampling, n) job through a generator on `config`: (each job's samples, stats, free pages at
    the end or None for a dense engine)."""
    engine = Engine(model, config, mesh=mesh)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(prompt, sampling, n=n) for prompt, sampling, n in jobs]
        results = [future.result(timeout=180) for future in futures]
    free = None if gen._pages is None else gen._pages.allocator.num_free  # the loop has ended: no owner left
    return results, gen.stats, free


def _jobs(count: int) -> list[tuple[list[int], SamplingParams, int]]:
    """Prompts of 1..29 tokens (prefill buckets 16 and 32), 1..24 new tokens, one to three samples each; every
    third job greedy, the others sampled."""
    jobs = []
    for i in range(count):
        prompt = [(5 * i + 3 * j) % (VOCAB - 1) + 1 for j in range((11 * i) % 29 + 1)]
        temperature = 0.0 if i % 3 == 0 else TEMPERATURE
        sampling = SamplingParams(temperature=temperature, max_new_tokens=(7 * i) % 24 + 1, seed=i)
        jobs.append((prompt, sampling, i % 3 + 1))
    return jobs


def _assert_same(dense, paged, rounding: bool = False) -> None:
    """The same tokens, and log-probs within test_paged_kv.py's dense-vs-paged tolerance (`rounding`: within
    test_hybrid_engine.py's bounds on fp32 rounding, where the two computed a state in other orders, as a
    tensor-split sum or a re-prefill does, which the gated norm's read-out can scale up)."""
    for dense_samples, paged_samples in zip(dense, paged, strict=True):
        for a, b in zip(dense_samples, paged_samples, strict=True):
            assert a.output_ids == b.output_ids
            if rounding:
                _assert_rounding_close(b.output_logprobs, a.output_logprobs)
            else:
                np.testing.assert_allclose(b.output_logprobs, a.output_logprobs, atol=1e-5)


def test_paged_equals_dense_with_mixed_lengths_samples_and_preemption(versions):
    """15 prompts (30 samples) through 4 slots: the paged engine's tokens and log-probs are the dense hybrid
    engine's; every page is back at the end.

    On a pool of 8 pages of 8 (one max_length sequence) samples wait for pages and running ones are preempted: a
    preempted sample is re-prefilled and re-inserted with a key of its own (`seeds.sample_key_words`), so from
    there a sampled one draws other tokens than the dense run's: the greedy samples keep the dense tokens, and
    every sampled token's log-prob is the trainer's (to test_hybrid_engine.py's fp32 rounding bounds)."""
    model = versions[0]
    dense_config, paged_config = _configs(max_slots=4, max_length=64, min_prefill_bucket=16, page_size=8)
    jobs = _jobs(15)
    dense, _, _ = _run(model, dense_config, jobs)
    assert sum(map(len, dense)) == 30 and len({r.output_ids for s in dense for r in s if len(r.output_ids) > 3}) > 10
    paged, stats, free = _run(model, paged_config, jobs)
    _assert_same(dense, paged)
    assert free == paged_config.pool_pages and stats.preemptions == 0
    squeezed, stats, free = _run(model, paged_config.replace(num_pages=8), jobs)
    assert stats.preemptions > 0 and stats.admission_waits > 0 and free == 8
    greedy = [job[1].temperature == 0.0 for job in jobs]
    _assert_same(*([x for x, g in zip(run, greedy, strict=True) if g] for run in (dense, squeezed)), rounding=True)
    sampled = [r for samples, g in zip(squeezed, greedy, strict=True) if not g for r in samples]
    lengths = [[len(r.output_ids) for r in samples] for samples in dense]
    assert [[len(r.output_ids) for r in samples] for samples in squeezed] == lengths
    scored = _packed_logprobs(model, [list(r.prompt_ids) + list(r.output_ids) for r in sampled], width=1024)
    behaviour = np.concatenate([r.output_logprobs for r in sampled])
    trainer = np.concatenate([logp[len(r.prompt_ids) - 1 :] for r, logp in zip(sampled, scored, strict=True)])
    _assert_rounding_close(behaviour, trainer)


def test_after_warmup_a_paged_hybrid_generator_never_compiles(versions):
    config = EngineConfig(max_slots=4, max_length=64, max_prefill_batch=2, kv_cache="paged", page_size=8, num_pages=12)
    engine = Engine(versions[1], config)
    params = engine.load_params(nnx.state(versions[1]), 0)
    with CompileCounter() as warmup:
        engine.warmup(params)
    # batched prefill and insert per length and row bucket, a paged decode step per length bucket, the decode
    # state's init
    assert warmup.count == len(engine.buckets) * (2 * len(engine.prefill_rows) + 1) + 1
    with CompileCounter() as compiles, Generator(engine, params) as gen:
        futures = [
            gen.submit(list(range(1, n + 1)), SamplingParams(max_new_tokens=50, seed=n), n=2) for n in (1, 17, 40, 5, 9)
        ]
        for future in futures:
            future.result(timeout=180)
    assert compiles.count == 0 and gen.stats.preemptions > 0  # preemption and re-prefill compile nothing either


def test_sharded_paged_generation_equals_single_device_dense(versions):
    """On a (data 2, fsdp 2, tensor 2) mesh: the pools split over KV heads, the states over slots and value
    heads; the same tokens as one device's dense cache."""
    from areal_jax.sharding import MeshConfig, make_mesh

    model = versions[1]
    jobs = [(p, SamplingParams(temperature=0.0, max_new_tokens=12), 1) for p in ([1, 2, 3], list(range(5, 30)), [7, 7])]
    dense, _, _ = _run(model, EngineConfig(max_slots=4, max_length=64, min_prefill_bucket=32), jobs)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    config = EngineConfig(max_slots=4, max_length=64, min_prefill_bucket=32, kv_cache="paged", page_size=8)
    paged, _, _ = _run(model, config, jobs, mesh=mesh)
    _assert_same(dense, paged, rounding=True)
    cache = Engine(model, config, mesh=mesh).init_decode_state().cache
    assert isinstance(cache, PagedHybridCache) and len(cache.kv.pools) == 2  # the 2 full layers' pools only
    assert cache.kv.pools[0].k.sharding.spec[0] == "tensor"  # split layout off TPU
    assert cache.state[0].sharding.spec[:2] == (("data", "fsdp"), "tensor")


def test_a_paged_mixture_records_the_dense_engines_routing():
    """qwen3_5_moe on the paged cache: the dense engine's tokens, each token's experts of every layer recorded."""
    model = HybridDecoder(TINY_MOE, nnx.Rngs(0))
    jobs = [([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=1.0, max_new_tokens=10, seed=1), 2)]
    jobs.append(([2, 7, 1, 8, 2, 8], SamplingParams(temperature=1.0, max_new_tokens=12, seed=2), 1))
    dense, _, _ = _run(model, EngineConfig(max_slots=2, max_length=32), jobs)
    paged, _, _ = _run(model, EngineConfig(max_slots=2, max_length=32, kv_cache="paged", page_size=4), jobs)
    _assert_same(dense, paged)
    for dense_samples, paged_samples in zip(dense, paged, strict=True):
        for a, b in zip(dense_samples, paged_samples, strict=True):
            assert b.routing is not None and b.routing.shape == (len(b.prompt_ids) + len(b.output_ids), 3, 2)
            np.testing.assert_array_equal(b.routing, a.routing)


def test_a_model_without_full_attention_is_refused_a_paged_cache(tmp_path):
    """Nothing to page: a clear error naming the value to use, from the engine and from the run's config."""
    from areal_jax.config import load_experiment
    from areal_jax.system.assembly import build_tokenizer, policy_config

    _text_model("linear-only", tmp_path / "hf", seed=2)
    model = _load(tmp_path / "hf")[1]
    with pytest.raises(ValueError, match="without full-attention layers"):
        Engine(model, EngineConfig(max_slots=2, max_length=64, kv_cache="paged"))
    assert "kv_cache: dense" in PAGED_REFUSAL
    overrides = [*HYBRID, "rollout.engine.kv_cache=paged"]
    cfg = load_experiment("configs/train_cpu.yaml", overrides)
    assert policy_config(cfg, build_tokenizer(cfg)).hybrid is not None  # with full layers: accepted
    linear_only = [*overrides, "model.hybrid.layer_types=[linear_attention, linear_attention]", "model.num_layers=2"]
    cfg = load_experiment("configs/train_cpu.yaml", linear_only)
    with pytest.raises(ConfigError, match=r"rollout\.engine\.kv_cache"):
        policy_config(cfg, build_tokenizer(cfg))


HYBRID = [
    "model.family=qwen3_5",
    "model.qkv_bias=false",
    "model.hybrid.layer_types=[linear_attention, linear_attention, full_attention]",
    "model.num_layers=3",
]


def _plan_lines(overrides: list[str]) -> tuple[dict[str, int], object]:
    from areal_jax.config import load_experiment
    from areal_jax.planning.memory import plan_memory
    from areal_jax.sharding import MeshConfig, make_mesh

    cfg = load_experiment("configs/train_cpu.yaml", overrides)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    plan = plan_memory(cfg, cfg.model, mesh, mesh)
    return {item.name.split(" (")[0]: item.bytes for item in plan.sides[1].items}, cfg


def test_the_memory_plan_counts_the_full_layers_pool_and_each_slots_states():
    """Paged: the KV line is the page pool of the full-attention layers only (the engine's pools to the byte;
    twice the full layers, twice the pool) and the states line is the dense engine's, whatever the pool."""
    paged = [*HYBRID, "rollout.engine.kv_cache=paged", "rollout.engine.page_size=8"]
    lines, cfg = _plan_lines(paged)
    cache = jax.eval_shape(lambda: PagedHybridCache.zeros(cfg.model, cfg.rollout.engine, combined=False))

    def size(tree) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

    assert lines["KV cache"] == size(cache.kv.pools) > 0
    assert lines["recurrent states"] == size((cache.state, cache.window)) > 0
    dense_lines, _ = _plan_lines(HYBRID)
    assert lines["recurrent states"] == dense_lines["recurrent states"]
    two_full = [*paged[:2], "model.hybrid.layer_types=[linear_attention, full_attention, full_attention]"]
    doubled, _ = _plan_lines([*two_full, *paged[3:]])
    assert doubled["KV cache"] == 2 * lines["KV cache"]
    assert doubled["recurrent states"] == lines["recurrent states"] // 2  # one linear layer of two
    half_pool, _ = _plan_lines([*paged, f"rollout.engine.num_pages={cfg.rollout.engine.pool_pages // 2}"])
    assert half_pool["KV cache"] == lines["KV cache"] // 2
    assert half_pool["recurrent states"] == lines["recurrent states"]


def test_a_paged_hybrid_engine_compiles_for_a_tpu_slice():
    """`areal-jax compile`'s engine programs for 4 v5e chips at test_hybrid_compile.py's tiny shape (head dim 128),
    paged: the decode step calls JAX's Pallas ragged paged attention kernel for the full layer (head dim 128: the
    combined layout), the recurrent states are a
    resident line of their own (a quarter of the 64 slots' per chip) beside the full layer's pools (whole on every
    chip: split over KV heads only), and the step updates both in place (donated)."""
    pytest.importorskip("libtpu")
    from areal_jax.compile.engine_programs import EngineOnMesh
    from areal_jax.compile.topology import slice_devices
    from areal_jax.config import load_experiment
    from areal_jax.sharding import MeshConfig, make_mesh
    from tests.test_hybrid_compile import ROOT, TINY

    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), [*TINY, "rollout.engine.kv_cache=paged"])
    engine = EngineOnMesh(cfg, cfg.model, make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), list(slice_devices("v5e-4"))))
    programs = {p.name.split(" ")[0]: p for p in engine.compile()}
    assert set(programs) == {"prefill", "insert", "decode"}
    assert "ragged_paged_attention_kernel" in programs["decode"].kernels, programs["decode"].kernels
    cache = engine.decode_state.cache
    assert isinstance(cache, PagedHybridCache) and len(cache.kv.pools) == 1  # one full layer: one pool
    resident = dict(engine.resident_lines())
    states = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((cache.state, cache.window)))
    assert resident["recurrent states"] == states // 4 > 0
    assert resident["KV cache"] >= sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache.kv.pools))
    assert programs["decode"].aliased >= resident["KV cache"] + resident["recurrent states"]
