"""A LoRA weight version: only adapter bytes through the Orbax store and the direct path, the engine serving them
over the base it keeps once (same programs, no recompile), and interruption as with full versions."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from areal_jax.inference.engine import Engine
from areal_jax.inference.engine_config import EngineConfig
from areal_jax.inference.generator import Generator
from areal_jax.inference.sampling import SamplingParams
from areal_jax.models.decoder import Decoder
from areal_jax.models.lora import adapter_state, split_trainable
from areal_jax.models.lora_config import LoRAConfig
from areal_jax.weights import OrbaxWeightPublisher, OrbaxWeightSubscriber, abstract_target
from areal_jax.weights.base import tree_nbytes
from areal_jax.weights.direct import DirectWeightPublisher, DirectWeightSubscriber
from tests.engine_fixtures import TINY, all_at_once, scoring_logprobs
from tests.test_lora_model import with_random_adapters

CFG = TINY.replace(lora=LoRAConfig(rank=4, targets=("q", "v", "o", "down")))
TEMPERATURE = 0.9


def _disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_a_lora_version_moves_only_adapter_bytes_through_both_weight_paths(tmp_path: Path) -> None:
    policy = Decoder(CFG, nnx.Rngs(0))
    engine = Engine(policy, EngineConfig(max_slots=2, max_length=64))
    trainable, frozen = split_trainable(CFG, with_random_adapters(policy, seed=3))
    adapter_bytes, base_bytes = tree_nbytes(trainable), tree_nbytes(frozen)
    assert adapter_bytes == CFG.num_lora_params() * 4 and base_bytes > 8 * adapter_bytes
    target = abstract_target(trainable, adapter_state(engine.param_shardings))
    assert jax.tree.structure(target) == jax.tree.structure(adapter_state(nnx.state(policy)))

    store = OrbaxWeightPublisher(tmp_path / "weights", async_save=False)
    try:
        store.publish(trainable, 1)
    finally:
        store.close()
    written = _disk_bytes(tmp_path / "weights" / "1")
    # the version directory: the adapter arrays plus Orbax's metadata, nothing near the base's size
    assert adapter_bytes <= written < adapter_bytes + 64 * 1024 < base_bytes
    subscriber = OrbaxWeightSubscriber(tmp_path / "weights")
    try:
        loaded = subscriber.load(1, target)
    finally:
        subscriber.close()
    assert (loaded.version, loaded.nbytes, loaded.source) == (1, adapter_bytes, "orbax")

    announcement = tmp_path / "announcement.json"
    direct = DirectWeightPublisher(announcement, OrbaxWeightPublisher(tmp_path / "direct"), pullers=1, timeout_s=30)
    puller = DirectWeightSubscriber(announcement, OrbaxWeightSubscriber(tmp_path / "direct"), puller=0, timeout_s=30)
    try:
        direct.publish(trainable, 2)
        pulled = puller.load(2, target)
        direct.wait()
    finally:
        direct.close()
        puller.close()
    assert (pulled.version, pulled.nbytes, pulled.source, pulled.fell_back) == (2, adapter_bytes, "direct", False)
    for path in (loaded.params, pulled.params):
        for got, want in zip(jax.tree.leaves(path), jax.tree.leaves(trainable), strict=True):
            np.testing.assert_array_equal(got, want)


def _wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_the_engine_serves_adapter_versions_over_its_one_base_with_interruption_unchanged() -> None:
    policy = Decoder(CFG, nnx.Rngs(0))
    engine = Engine(policy, EngineConfig(max_slots=2, max_length=32))
    new_state = with_random_adapters(policy, seed=7, std=0.5)
    adapters = split_trainable(CFG, new_state)[0]
    new_policy = nnx.merge(nnx.graphdef(policy), new_state)
    first = engine.load_params(nnx.state(policy), 0)
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=24, seed=5)
    prompt = [3, 1, 4, 1, 5]
    with Generator(engine, first) as gen:
        future = gen.submit(prompt, sampling)
        _wait_until(lambda: gen.stats.emitted_tokens >= 4)
        with all_at_once(gen):
            applied = gen.update_params(adapters, 1, interrupt=True)
        assert applied.result(timeout=60) == 1
        (result,) = future.result(timeout=60)
        later = gen.submit(prompt, sampling).result(timeout=60)[0]
        # one decode program per attend-length bucket (16, 32) whatever the version: no recompile for adapters
        assert engine._generate._cache_size() == len(engine.buckets) == 2
    versions = np.array(result.output_versions)
    assert result.num_interruptions == 1 and versions[0] == 0 and versions[-1] == 1
    assert set(later.output_versions) == {1}
    outputs = list(result.output_ids)
    for version, model in ((0, policy), (1, new_policy)):
        chosen = versions == version
        scored = scoring_logprobs(model, prompt, outputs, TEMPERATURE)
        np.testing.assert_allclose(np.array(result.output_logprobs)[chosen], scored[chosen], atol=1e-5)
    # the base is held once: the adapter version's base arrays are the first version's own
    second = engine.load_params(adapters, 2)
    base_first = jax.tree.leaves(split_trainable(CFG, first.state)[1])
    base_second = jax.tree.leaves(split_trainable(CFG, second.state)[1])
    assert all(a is b for a, b in zip(base_first, base_second, strict=True))
    if second.layers is not None:
        assert jax.tree.structure(second.layers) == jax.tree.structure(first.layers)
