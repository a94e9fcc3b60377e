"""A Qwen3.5 (`qwen3_5`) policy in the trainer's step: its loss and gradient do not depend on how the sequences
are packed (packed sequences never see each other's recurrent state or convolution window), and the step
sharded over data x fsdp x tensor equals one device."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from areal_jax.data.packing import fixed_count_plan
from areal_jax.models.config import ModelConfig
from areal_jax.models.hybrid_config import HybridConfig
from areal_jax.models.init import create_decoder
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.train_step import TrainStep
from tests.test_train_step import CONFIG, TEMPERATURE, loss_and_gradient, make_trajectories, single_device_mesh

L, F = "linear_attention", "full_attention"
HYBRID = ModelConfig(
    family="qwen3_5",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=False,
    qk_norm=True,
    hybrid=HybridConfig(layer_types=(L, F), linear_key_head_dim=8, linear_value_head_dim=8, chunk=8),
)
# each test compiles the step's programs twice (two batch shapes, or two meshes): the slow tier
pytestmark = pytest.mark.slow


def test_loss_and_gradient_do_not_depend_on_packing():
    graphdef, state = nnx.split(create_decoder(HYBRID, seed=0))
    step = TrainStep(graphdef, state, CONFIG, single_device_mesh(), temperature=TEMPERATURE)
    trajectories = make_trajectories(np.random.default_rng(1), 8, lengths=(4, 17))
    (batch_one,) = build_batch(trajectories, CONFIG).minibatches  # least padding: several sequences a row
    (batch_fixed,) = build_batch(trajectories, CONFIG, lambda n: fixed_count_plan(n, 4)).minibatches
    assert batch_one.shape != batch_fixed.shape

    def loss_and_grad(batch):
        params, _ = step.init(state)
        device_batch = step.put_batch(batch)
        return loss_and_gradient(step, params, device_batch, step.logprobs(params, device_batch))

    loss_ref, grads_ref, _ = loss_and_grad(batch_one)
    loss, grads, _ = loss_and_grad(batch_fixed)
    assert abs(float(loss) - float(loss_ref)) <= 1e-6
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-6, rtol=0)


def test_sharded_step_equals_single_device():
    graphdef, state = nnx.split(create_decoder(HYBRID, seed=0))
    (batch,) = build_batch(make_trajectories(np.random.default_rng(0), 8, lengths=(4, 24)), CONFIG).minibatches
    results = []
    for mesh in (single_device_mesh(), make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))):
        step = TrainStep(graphdef, state, CONFIG, mesh, temperature=TEMPERATURE)
        params, opt_state = step.init(state)
        device_batch = step.put_batch(batch)
        results.append(step.update(params, opt_state, device_batch, step.logprobs(params, device_batch), 0))
    (params_1, _, stats_1), (params_8, _, stats_8) = results
    assert params_8["linear_layers"]["mixer"]["qkv"][...].sharding.spec == P(None, "fsdp", "tensor", None)
    for leaf_1, leaf_8 in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_8), strict=True):
        np.testing.assert_allclose(np.asarray(leaf_8), np.asarray(leaf_1), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(stats_8["train/loss"]), float(stats_1["train/loss"]), atol=1e-6)
