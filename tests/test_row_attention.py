"""The row attention's three forms agree: the XLA path unrolled (blocks to the diagonal) and scanned (long rows),
and JAX's splash kernel (in Pallas's interpreter here) alone and per shard of a mesh; on a TPU topology, `auto`
compiles the trainer's long rows to the splash kernel, with a program that does not grow with the row."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.activation_sharding import activations_on
from areal_jax.compile import hlo
from areal_jax.compile.topology import slice_devices
from areal_jax.compile.trainer_programs import trainer_programs
from areal_jax.config import load_experiment
from areal_jax.models.attention import auto_attention, xla_attention
from areal_jax.models.splash import splash_attention
from areal_jax.sharding import MeshConfig, make_mesh

ROOT = Path(__file__).resolve().parents[1]
B, T, N, K, H = 4, 256, 4, 2, 64


def _packed_rows() -> tuple[jax.Array, ...]:
    """Rows of several segments each (restarting positions), and right padding (segment 0)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, heads, H)), jnp.float32) for heads in (N, K, K))
    segments, positions = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for row, lengths in enumerate([(100, 120), (256,), (17, 33, 150), (5,)]):
        start = 0
        for segment, length in enumerate(lengths, 1):
            segments[row, start : start + length] = segment
            positions[row, start : start + length] = np.arange(length)
            start += length
    return q, k, v, jnp.asarray(segments), jnp.asarray(positions)


def _reference(q, k, v, segments, positions) -> np.ndarray:
    """Attention in float64 NumPy, one query at a time."""
    q, k, v, segments, positions = (np.asarray(x, np.float64) for x in (q, k, v, segments, positions))
    out = np.zeros_like(q)
    for b in range(B):
        for t in range(T):
            if segments[b, t] == 0:
                continue
            keys = (segments[b] == segments[b, t]) & (positions[b] <= positions[b, t])
            for n in range(N):
                scores = k[b, keys, n // (N // K)] @ q[b, t, n] / np.sqrt(H)
                weights = np.exp(scores - scores.max())
                out[b, t, n] = weights @ v[b, keys, n // (N // K)] / weights.sum()
    return out


def _valid(segments: jax.Array) -> jax.Array:
    return (segments != 0)[..., None, None]


def _loss(attend, q, k, v, segments, positions) -> jax.Array:
    out = attend(q, k, v, segment_ids=segments, positions=positions)
    return jnp.sum(jnp.where(_valid(segments), out * jnp.cos(out), 0.0))


def test_the_unrolled_scanned_and_splash_forms_agree_with_a_float64_reference():
    q, k, v, segments, positions = _packed_rows()
    expected = _reference(q, k, v, segments, positions)
    forms = {
        "unrolled": xla_attention,
        "scanned": lambda *a, **kw: xla_attention(*a, **kw, block=16),  # 16 blocks: past UNROLLED_BLOCKS
        "splash": splash_attention,
    }
    grads = {}
    for name, attend in forms.items():
        out = jax.jit(lambda *a, f=attend: f(*a[:3], segment_ids=a[3], positions=a[4]))(q, k, v, segments, positions)
        got = np.where(np.asarray(_valid(segments)), np.asarray(out), 0.0)
        np.testing.assert_allclose(got, expected, atol=2e-5, err_msg=name)
        grads[name] = jax.jit(jax.grad(lambda *a, f=attend: _loss(f, *a), argnums=(0, 1, 2)))(
            q, k, v, segments, positions
        )
    for name in ("scanned", "splash"):
        for got, want in zip(grads[name], grads["unrolled"], strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, err_msg=name)
    assert float(jnp.abs(grads["unrolled"][0]).max()) > 1e-2  # gradients that say something


def test_splash_per_shard_of_a_mesh_equals_one_device():
    """Rows over fsdp x data, heads over tensor: each chip runs the kernel on its rows and its KV heads' queries."""
    q, k, v, segments, positions = _packed_rows()
    alone = jax.jit(lambda *a: splash_attention(*a[:3], segment_ids=a[3], positions=a[4]))(q, k, v, segments, positions)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8])

    def sharded(*a: jax.Array) -> jax.Array:
        with activations_on(mesh):
            return splash_attention(*a[:3], segment_ids=a[3], positions=a[4])

    lowered = jax.jit(sharded).lower(q, k, v, segments, positions)
    assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
    np.testing.assert_allclose(
        np.asarray(lowered.compile()(q, k, v, segments, positions)), np.asarray(alone), atol=1e-6
    )


def test_auto_is_the_xla_path_off_tpu():
    q, k, v, segments, positions = _packed_rows()
    text = jax.jit(lambda *a: auto_attention(*a[:3], segment_ids=a[3], positions=a[4])).lower(
        q, k, v, segments, positions
    )
    assert "pallas" not in text.as_text().lower()


def _tpu_gradient_program_text(length: int) -> str:
    """The compiled gradient program for 4 v5p chips (FSDP) of a 2-layer model, rows of `length` tokens."""
    tiny = [
        "model.hidden_size=256",
        "model.intermediate_size=320",
        "model.num_layers=2",
        "model.num_heads=2",  # head dim 128
        "model.num_kv_heads=1",
        "model.vocab_size=512",
        f"model.max_position_embeddings={length}",
        "model.remat=full",
        "trainer.packing.rows=4",
        f"trainer.packing.token_budget={4 * length}",
        "rollout.staleness.batch_prompts=1",
        f"rollout.engine.max_length={length}",
    ]
    cfg = load_experiment(str(ROOT / "configs/train_cpu.yaml"), tiny)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), list(slice_devices("v5p-8")))
    gradient = next(spec for spec in trainer_programs(cfg, cfg.model, mesh) if spec.name.startswith("gradient"))
    assert f"x {length})" in gradient.name, gradient.name
    return gradient.jitted.lower(*gradient.args).compile().as_text()


def test_a_tpu_gradient_program_of_long_rows_calls_splash_and_does_not_grow_with_them():
    """`auto` compiles the attention of rows of 512 and 2,048 tokens to the splash kernels (forward, dq, dkv), and
    the program's text is about the same size at 4x the row."""
    sizes = {}
    for length in (512, 2048):
        text = _tpu_gradient_program_text(length)
        found = hlo.kernels(text)
        assert any("splash" in name for name in found), (length, found)
        assert any("dq" in name for name in found) and any("dkv" in name for name in found), (length, found)
        sizes[length] = len(text)
    assert sizes[2048] < 1.5 * sizes[512], sizes


def test_the_memory_plan_counts_no_scores_where_the_kernel_runs():
    """A prefill of 2 x 1,024 tokens: on TPU (splash) the plan's temporaries drop exactly the XLA path's fp32
    scores and probabilities of a query block (half of them: a prefill keeps no cotangents); on CPU they stay."""
    from areal_jax.planning.memory_terms import engine_transients

    cfg = load_experiment(
        str(ROOT / "configs/train_cpu.yaml"),
        ["rollout.engine.max_length=1024", "model.max_position_embeddings=1024", "rollout.engine.max_prefill_batch=2"],
    )
    engine, model = cfg.rollout.engine, cfg.model
    scores = 2 * model.num_heads * 256 * 1024 * 4 * 2 // 2
    _, on_tpu, _ = engine_transients(engine, model, 2, "tpu")
    _, on_cpu, _ = engine_transients(engine, model, 2, "cpu")
    _, xla_on_tpu, _ = engine_transients(engine, model.replace(attention_impl="xla"), 2, "tpu")
    assert on_cpu - on_tpu == scores and xla_on_tpu == on_cpu
