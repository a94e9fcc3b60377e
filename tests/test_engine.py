"""Engine (prefill / insert / generate): exactness against the no-cache model, logprob consistency,
bucketed compilation and sharded equivalence."""

from collections.abc import Callable

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.decoder import Decoder
from areal_jax.models.lora import split_trainable
from areal_jax.models.lora_config import LoRAConfig
from areal_jax.models.serving_weights import cast_for_serving
from areal_jax.sharding import MeshConfig, make_mesh, state_shardings
from tests.conftest import CompileCounter
from tests.engine_fixtures import TINY, cached_keys, greedy_reference, scoring_logprobs, tiny_model
from tests.test_lora_model import with_random_adapters

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def test_engine_api_shape():
    engine = Engine(tiny_model(), EngineConfig(max_slots=4, max_length=64, min_prefill_bucket=8))
    assert engine.max_concurrent_decodes == 4 and engine.max_prefill_length == 64
    assert engine.buckets == (8, 16, 32, 64)
    padded, n = engine.pad_tokens([5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert n == 9 and padded.shape == (16,) and padded[9:].sum() == 0


def test_row_buckets_follow_the_growth_factor():
    assert EngineConfig(row_bucket_growth=2).row_buckets(16) == (1, 2, 4, 8, 16)
    assert EngineConfig(row_bucket_growth=4).row_buckets(16) == (1, 4, 16)
    assert EngineConfig(row_bucket_growth=4).row_buckets(8) == (1, 4, 8)
    engine = Engine(tiny_model(), EngineConfig(max_slots=4, max_length=64, max_prefill_batch=16))
    assert engine.prefill_rows == (1, 2, 4)  # a batched prefill never exceeds the slot count
    with pytest.raises(ConfigError, match="row_bucket_growth"):
        EngineConfig(row_bucket_growth=1)


def test_greedy_with_cache_equals_full_forward_argmax():
    model = tiny_model()
    engine = Engine(model, EngineConfig(max_slots=3, max_length=64))
    prompts = [[1, 2, 3], list(range(4, 21)), [22]]
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        results = [gen.submit(p, GREEDY).result(timeout=120)[0] for p in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.output_ids) == greedy_reference(model, prompt, 8)


def test_decode_reads_the_stacked_weights_without_per_layer_copies():
    model = tiny_model()  # the other tests run with the copies (the default on CPU)
    engine = Engine(model, EngineConfig(max_slots=3, max_length=64, decode_layer_copies="off"))
    params = engine.load_params(nnx.state(model), 0)
    assert params.layers is None
    prompts = [[1, 2, 3], list(range(4, 21)), [22]]
    with Generator(engine, params) as gen:
        results = [gen.submit(p, GREEDY).result(timeout=120)[0] for p in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.output_ids) == greedy_reference(model, prompt, 8)
    assert EngineConfig().keeps_layer_copies("cpu") and not EngineConfig().keeps_layer_copies("tpu")


def test_n_samples_share_one_prefill_and_differ():
    model = tiny_model()
    engine = Engine(model, EngineConfig(max_slots=4, max_length=64))
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        results = gen.submit([3, 4, 5], SamplingParams(temperature=1.0, max_new_tokens=12, seed=1), n=4).result(60)
        assert gen.stats.prefills == 1
    assert [r.sample_index for r in results] == [0, 1, 2, 3]
    assert len({r.output_ids for r in results}) > 1


def test_behaviour_logprobs_equal_trainer_logprobs():
    model = tiny_model(1)
    engine = Engine(model, EngineConfig(max_slots=4, max_length=64))
    sampling = SamplingParams(temperature=0.8, max_new_tokens=16, seed=3)
    with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
        futures = [gen.submit(list(range(1, 2 + 3 * i)), sampling, n=2) for i in range(4)]
        results = [r for f in futures for r in f.result(timeout=120)]
    gap = max(
        np.abs(scoring_logprobs(model, list(r.prompt_ids), list(r.output_ids), 0.8) - r.output_logprobs).max()
        for r in results
    )
    assert gap <= 1e-5


def _buffers(*trees: object) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(trees) for shard in leaf.addressable_shards}


def _counted(fn: Callable, name: str, calls: list[str]) -> Callable:
    def call(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return call


# What makes a loaded version's arrays, by where the given arrays are: one program on the engine's devices (its
# layout or another), the transfer from other devices (after the serving cast when there is one), a copy where
# they are and then the transfer where the two device sets only overlap.
LOAD_STEPS = {
    ("engine-devices", "float32"): ["copy onto"],
    ("engine-devices", "bfloat16"): ["copy onto"],
    ("other-devices", "float32"): ["device_put"],
    ("other-devices", "bfloat16"): ["cast", "device_put"],
    ("overlapping-devices", "float32"): ["copy here", "device_put"],
    ("overlapping-devices", "bfloat16"): ["copy here", "device_put"],
}


@pytest.mark.parametrize("placement,compute", list(LOAD_STEPS))
def test_a_loaded_version_is_the_engines_own_copy_made_once(placement, compute, monkeypatch):
    """A trainer's params (another layout, maybe other devices) become the engine's own copy, on its shardings
    in its serving dtypes, by one copy: they share no buffer with it, so the trainer may donate them at once."""
    model = Decoder(TINY.replace(compute_dtype=compute), nnx.Rngs(0))
    devices = jax.devices()
    engine = Engine(
        model, EngineConfig(max_slots=2, max_length=32), make_mesh(MeshConfig(fsdp=1, tensor=-1), devices[:4])
    )
    trainer_devices = {"engine-devices": devices[:4], "other-devices": devices[4:], "overlapping-devices": devices[2:6]}
    trainer_mesh = make_mesh(MeshConfig(fsdp=-1, tensor=1), trainer_devices[placement])
    state = nnx.state(model)
    given = jax.device_put(state, state_shardings(state, trainer_mesh), may_alias=False)
    expected = [np.asarray(x) for x in jax.tree.leaves(cast_for_serving(state, model.config))]
    calls: list[str] = []
    weights = engine._weights
    monkeypatch.setattr(weights, "_copy_here", _counted(weights._copy_here, "copy here", calls))
    monkeypatch.setattr(weights, "_cast", _counted(weights._cast, "cast", calls))
    monkeypatch.setattr(
        weights, "_copy_onto", {k: _counted(f, "copy onto", calls) for k, f in weights._copy_onto.items()}
    )
    monkeypatch.setattr(jax, "device_put", _counted(jax.device_put, "device_put", calls))

    loaded = engine.load_params(given, 1)
    assert calls == LOAD_STEPS[placement, compute]
    assert not _buffers(loaded.state, loaded.layers) & _buffers(given)
    for leaf in jax.tree.leaves(given):
        leaf.delete()  # what donation to the trainer's next step does
    got = jax.tree.leaves(loaded.state)
    for leaf, sharding in zip(got, jax.tree.leaves(engine.param_shardings), strict=True):
        assert leaf.sharding == sharding
    for leaf, want in zip(got, expected, strict=True):
        assert leaf.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(leaf), want)
    assert np.isfinite(np.asarray(engine.prefill_batch(loaded, [[1, 2, 3]]).logits)).all()


def test_an_adapter_version_is_copied_and_served_over_the_base_kept_once():
    cfg = TINY.replace(lora=LoRAConfig(rank=4, targets=("q", "v")))
    policy = Decoder(cfg, nnx.Rngs(0))
    engine = Engine(policy, EngineConfig(max_slots=2, max_length=32))
    first = engine.load_params(nnx.state(policy), 0)
    adapters = split_trainable(cfg, with_random_adapters(policy, seed=1))[0]
    expected = [np.asarray(x) for x in jax.tree.leaves(adapters)]
    second = engine.load_params(adapters, 1)
    assert not _buffers(second.state, second.layers) & _buffers(adapters)
    for leaf in jax.tree.leaves(adapters):
        leaf.delete()
    served_adapters, base = split_trainable(cfg, second.state)
    for leaf, want in zip(jax.tree.leaves(served_adapters), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), want)
    assert _buffers(base) == _buffers(split_trainable(cfg, first.state)[1])  # the base: the first version's arrays


def test_sharded_generation_equals_single_device():
    model = tiny_model(2)
    prompts = [[1, 2, 3], list(range(5, 30)), [7, 7], [9] * 12, [40, 41, 42, 43, 44]]
    outputs = {}
    for name, mesh in [("single", None), ("sharded", make_mesh(MeshConfig(data=2, fsdp=1, tensor=4)))]:
        engine = Engine(model, EngineConfig(max_slots=4, max_length=64), mesh=mesh)
        with Generator(engine, engine.load_params(nnx.state(model), 0)) as gen:
            futures = [gen.submit(p, GREEDY) for p in prompts]
            outputs[name] = [f.result(timeout=180)[0].output_ids for f in futures]
        if mesh is not None:
            assert len(engine.init_decode_state().cache.k[0][0].sharding.device_set) == 8
            q = jax.tree.leaves(engine.load_params(nnx.state(model), 0).state)[0]
            assert len(q.sharding.device_set) == 8
    assert outputs["sharded"] == outputs["single"]


@pytest.mark.parametrize("committed", [False, True], ids=["fresh-params", "committed-params"])
def test_after_warmup_a_generator_never_compiles(committed):
    """Warm-up compiles every program a request can reach; a generator run afterwards (fresh decode state,
    params either fresh or already committed to a device, as a checkpoint load leaves them) compiles none."""
    model = tiny_model()
    engine = Engine(model, EngineConfig(max_slots=4, max_length=64, max_prefill_batch=4))
    state = nnx.state(model)
    if committed:
        state = jax.device_put(state, jax.devices()[0])
    params = engine.load_params(state, 0)
    with CompileCounter() as warmup:
        engine.warmup(params, single_prompt_api=True)
    # prefill, insert and generate per length bucket; batched prefill and insert per length and row bucket; the
    # decode state's init
    assert warmup.count == len(engine.buckets) * (3 + 2 * len(engine.prefill_rows)) + 1
    with CompileCounter() as compiles:
        for _ in range(2):
            with Generator(engine, params) as gen:
                futures = [
                    gen.submit(list(range(1, n + 1)), SamplingParams(max_new_tokens=60, seed=n), n=2)
                    for n in (1, 17, 40, 5, 9)
                ]
                for future in futures:
                    future.result(timeout=120)
    assert compiles.count == 0


def test_batched_prefill_and_insert_equal_one_at_a_time():
    model = tiny_model(3)
    engine = Engine(model, EngineConfig(max_slots=6, max_length=64, max_prefill_batch=4))
    params = engine.load_params(nnx.state(model), 0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    batch = engine.prefill_batch(params, prompts)
    assert batch.logits.shape[0] == 4  # 3 prompts padded to the row bucket of 4
    for row, prompt in enumerate(prompts):
        padded, n = engine.pad_tokens(prompt)
        single = engine.prefill(params, padded, n)
        np.testing.assert_allclose(batch.logits[row], single.logits, atol=1e-5)
    sampling = SamplingParams(temperature=0.7, seed=0)
    keys = [jax.random.key(i) for i in range(4)]
    key_data = np.stack([np.asarray(jax.random.key_data(k)) for k in keys])
    # rows 0, 1, 2 -> slots 5, 0, 2 in one call; row 1's second sample -> slot 3 in a second call
    batched = engine.insert_batch(batch, engine.init_decode_state(), [5, 0, 2], [sampling] * 3, key_data[[0, 1, 3]])
    batched = engine.insert_batch(batch, batched, [None, 3], [sampling] * 2, key_data[[0, 2]])
    one_by_one = engine.init_decode_state()
    for row, slot, key in zip([0, 1, 1, 2], [5, 0, 3, 2], [keys[0], keys[1], keys[2], keys[3]], strict=True):
        padded, n = engine.pad_tokens(prompts[row])
        one_by_one = engine.insert(engine.prefill(params, padded, n), one_by_one, slot, sampling, key)
    for field in ("positions", "tokens", "keys"):
        np.testing.assert_array_equal(getattr(batched, field), getattr(one_by_one, field), err_msg=field)
    np.testing.assert_allclose(batched.logprobs, one_by_one.logprobs, atol=1e-5)
    assert np.asarray(batched.positions)[[5, 0, 3, 2]].tolist() == [3, 5, 5, 1]
    for slot, row in zip([5, 0, 3, 2], [0, 1, 1, 2], strict=True):
        n = len(prompts[row])
        np.testing.assert_allclose(
            cached_keys(batched.cache)[:, slot, :n], cached_keys(one_by_one.cache)[:, slot, :n], atol=1e-5
        )
    untouched = cached_keys(batched.cache)[:, [1, 4]]
    assert np.abs(untouched).sum() == 0
