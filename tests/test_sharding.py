"""Meshes, logical sharding rules, and the sharded model on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from areal_jax.configuration import ConfigError
from areal_jax.models.hf_io import load_hf_checkpoint
from areal_jax.sharding import MeshConfig, logical_to_spec, make_mesh, split_devices, state_shardings
from tests.hf_fixtures import make_hf_checkpoint


def test_eight_virtual_devices_are_configured():
    assert jax.device_count() == 8, "tests/conftest.py sets XLA_FLAGS for 8 virtual CPU devices"


def test_mesh_resolves_minus_one_and_refuses_bad_products():
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
    assert MeshConfig(data=-1, fsdp=1, tensor=1).resolve(8) == (8, 1, 1)
    with pytest.raises(ConfigError, match=r"mesh.*3 devices"):
        MeshConfig(data=2, fsdp=1, tensor=1).resolve(3)
    with pytest.raises(ConfigError, match="data"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ConfigError, match="tensor: value 0"):
        MeshConfig(tensor=0)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_split_devices_by_ratio():
    devices = jax.devices()
    inference, trainer = split_devices(devices, 3, 1)
    assert (len(inference), len(trainer)) == (6, 2)
    assert set(inference).isdisjoint(trainer) and set(inference) | set(trainer) == set(devices)
    assert split_devices(devices[:1], 3, 1) == (devices[:1], devices[:1])
    assert [len(x) for x in split_devices(devices[:2], 7, 1)] == [1, 1]
    sub_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2), inference)
    assert dict(sub_mesh.shape) == {"data": 1, "fsdp": 3, "tensor": 2}


def test_logical_rules_drop_axes_that_do_not_divide():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", None), (8, 3), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 1, 16), mesh) == P("fsdp", None, None)
    assert logical_to_spec(("layers", "embed"), (3, 7), mesh) == P(None, None)
    with pytest.raises(KeyError, match="'nonsense'"):
        logical_to_spec(("nonsense",))


def test_sharded_fused_model_equals_single_device_and_params_follow_rules(tmp_path):
    """The fused q/k/v and gate/up kernels on a data=2, fsdp=2, tensor=2 mesh: each tensor shard holds whole
    head groups and half the MLP width, and logits and gradients equal a single-device run."""
    make_hf_checkpoint("qwen2-untied", tmp_path)
    _, single = load_hf_checkpoint(tmp_path)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg, sharded = load_hf_checkpoint(tmp_path, mesh=mesh)

    state = nnx.state(sharded)
    expected = state_shardings(state, mesh)
    for (path, var), (_, want) in zip(nnx.to_flat_state(state), nnx.to_flat_state(expected), strict=True):
        assert var[...].sharding == want.get_value(), path
    assert state["layers"]["mlp"]["gate_up"][...].sharding.spec == P(None, "fsdp", None, "tensor")
    assert state["embed"][...].sharding.spec == P(None, "fsdp")  # vocab 97 does not split over tensor=2
    # [Y, D, K, G + 2, H]: 2 KV heads over tensor=2, each shard one group of 3 queries + key + value
    assert state["layers"]["qkv"]["kernel"][...].sharding.spec == P(None, "fsdp", "tensor", None, None)
    assert state["layers"]["qkv"]["kernel"][...].addressable_shards[0].data.shape == (2, 24, 1, 5, 8)
    assert state["layers"]["qkv"]["bias"][...].sharding.spec == P(None, "tensor", None, None)
    assert state["layers"]["mlp"]["gate_up"][...].addressable_shards[0].data.shape == (2, 24, 2, 40)

    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 16)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 9 + [2] * 7], 4, axis=0), jnp.int32)
    pos = jnp.asarray(np.repeat([list(range(9)) + list(range(7))], 4, axis=0), jnp.int32)
    batch_sharding = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None))
    graphdef, sharded_state = nnx.split(sharded)

    def loss_and_logits(state, tokens, seg, pos):
        model = nnx.merge(graphdef, state)
        logp, _ = model.token_logprobs(tokens, jnp.roll(tokens, -1, axis=1), seg, pos)
        return -jnp.mean(logp), model.logits(tokens, seg, pos)

    step = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))
    (loss_8, logits_8), grads_8 = step(sharded_state, *(jax.device_put(x, batch_sharding) for x in (tokens, seg, pos)))
    (loss_1, logits_1), grads_1 = step(nnx.state(single), tokens, seg, pos)
    assert len(logits_8.sharding.device_set) == 8
    np.testing.assert_allclose(logits_8, logits_1, atol=1e-5)
    np.testing.assert_allclose(loss_8, loss_1, atol=1e-6)
    for (path, g8), (_, g1) in zip(nnx.to_flat_state(grads_8), nnx.to_flat_state(grads_1), strict=True):
        np.testing.assert_allclose(g8[...], g1[...], atol=1e-6, err_msg=str(path))


def test_rows_written_locally_equal_a_scatter_and_move_no_array():
    """`put_rows_locally` under a mesh of 8 (rows over data 2 x fsdp 4, heads over nothing): the same array as a
    plain scatter at rows (out-of-range rows dropped, a partial write along the last axis), left on its shards,
    and nothing the size of a device's share moves (XLA:TPU's case, where a plain scatter did:
    tests/test_tpu_compile.py)."""
    from areal_jax.activation_sharding import put_rows_locally

    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    names = ("slots", "kv_heads", "length")
    target = jnp.arange(16 * 3 * 10, dtype=jnp.float32).reshape(16, 3, 10)
    values = -jnp.arange(4 * 3 * 6, dtype=jnp.float32).reshape(4, 3, 6) - 1
    rows = jnp.asarray([3, 15, 16, 8], jnp.int32)  # 16: out of range, dropped
    at = (slice(None), slice(0, 6))
    want = target.at[(rows, *at)].set(values, mode="drop")
    sharding = jax.sharding.NamedSharding(mesh, logical_to_spec(names, target.shape, mesh))
    program = jax.jit(lambda t, r, v: put_rows_locally(t, r, v, names, at), out_shardings=sharding)
    with jax.set_mesh(mesh):
        placed = jax.device_put(target, sharding)
        got = program(placed, rows, values)
        text = program.lower(placed, rows, values).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.spec == sharding.spec
    from areal_jax.compile import hlo

    moved = [c for c in hlo.collectives(text) if c.bytes >= target.size * 4 // 8]  # a device's share of it
    assert not moved, moved


def test_a_mesh_program_traces_under_its_own_mesh():
    """`on_mesh`: a jitted function traces under its own mesh, whether called bare, lowered, or called inside a
    caller's `jax.set_mesh` of another mesh (which it replaces for the call and restores)."""
    from areal_jax.activation_sharding import on_mesh, program_mesh

    mine, other = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1)), make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    seen = []

    def traced(x: jax.Array) -> jax.Array:
        mesh = program_mesh()
        seen.append(None if mesh is None else dict(mesh.shape))
        return x + 1

    program = on_mesh(jax.jit(traced), mine)
    assert on_mesh(traced, None) is traced  # one device: the function itself
    np.testing.assert_array_equal(np.asarray(program(jnp.zeros(8))), np.ones(8))
    program.lower(jnp.zeros(4)).compile()
    with jax.set_mesh(other):
        program(jnp.zeros(2))
        assert dict(jax.sharding.get_abstract_mesh().shape) == dict(other.shape)
    assert seen == [dict(mine.shape)] * 3
