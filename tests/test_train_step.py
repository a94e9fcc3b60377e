"""The sharded train step: equal to one device, invariant to micro-batching and packing, and the proximal pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from areal_jax.data.packing import PackingConfig, fixed_count_plan
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer import train_step
from areal_jax.trainer.batching import PackedBatch, build_batch
from areal_jax.trainer.config import OptimizerConfig, TrainerConfig
from areal_jax.trainer.train_step import TrainStep

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
# Adam's first update is g / (|g| + eps): for entries with |g| near eps it magnifies the ~1e-9 gradient differences
# of another reduction order; eps = 1e-6 and lr = 1e-3 bound that below 1e-5 in the parameters.
TEMPERATURE = 1.0  # the sampler's, which the trainer scores at
CONFIG = TrainerConfig(
    optimizer=OptimizerConfig(lr=1e-3, eps=1e-6, weight_decay=0.01, grad_clip=1.0),
    packing=PackingConfig(token_budget=256, rows=4, microbatch_rounding="pow2"),
)


def make_trajectories(
    rng: np.random.Generator, n: int, lengths: tuple[int, int] = (4, 40), version: int = 0, group_size: int = 4
) -> list[Trajectory]:
    """Random trajectories: a prompt, then loss tokens with behaviour log-probs sampled up to 2 versions back."""
    out = []
    for i in range(n):
        length = int(rng.integers(lengths[0], lengths[1] + 1))
        prompt = int(rng.integers(1, length))
        loss_mask = np.arange(length) >= prompt
        out.append(
            Trajectory(
                token_ids=rng.integers(0, TINY.vocab_size, length).astype(np.int32),
                behav_logprobs=np.where(loss_mask, -rng.uniform(2.0, 6.0, length), 0.0).astype(np.float32),
                versions=np.where(loss_mask, version - rng.integers(0, 3, length), -1).astype(np.int32),
                loss_mask=loss_mask,
                prompt_length=prompt,
                reward=float(rng.integers(0, 2)),
                prompt_id=f"p{i // group_size}",
                group_id=i // group_size,
                sample_index=i % group_size,
            )
        )
    return out


def single_device_mesh():
    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


@functools.cache
def tiny_model_state() -> tuple[nnx.GraphDef, nnx.State]:
    """The tiny decoder's graphdef and initial params, built once per process (train steps copy them)."""
    return nnx.split(Decoder(TINY, nnx.Rngs(0)))


@pytest.fixture(scope="module")
def model_state():
    return tiny_model_state()


@pytest.fixture(scope="module")
def single_step(model_state):
    graphdef, state = model_state
    return TrainStep(graphdef, state, CONFIG, single_device_mesh(), temperature=TEMPERATURE)


_accumulate = jax.jit(train_step._gradients_fn, static_argnums=0)


def loss_and_gradient(step: TrainStep, params, batch: PackedBatch, logp_prox, version: int = 0, logp_ref=None):
    """(loss, gradient, statistics) of a mini-batch on the mesh as `step.update` accumulates them before it
    clips the gradient and applies AdamW: the function its first program runs."""
    prox = logp_prox if step.needs_prox_pass else None
    ref = logp_ref if step.uses_reference else None
    return _accumulate(step.program, params, step.frozen, batch, prox, ref, jnp.int32(version))


def _run_update(step: TrainStep, state, batch: PackedBatch, version: int = 0):
    params, opt_state = step.init(state)
    device_batch = step.put_batch(batch)
    prox = step.logprobs(params, device_batch)
    return step.update(params, opt_state, device_batch, prox, version)


def test_sharded_step_equals_single_device_and_opt_state_is_sharded_like_params(model_state, single_step):
    graphdef, state = model_state
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded_step = TrainStep(graphdef, state, CONFIG, mesh, temperature=TEMPERATURE)
    (batch,) = build_batch(make_trajectories(np.random.default_rng(0), 8, lengths=(4, 24)), CONFIG).minibatches
    assert batch.shape == (1, 4, 30)  # the least-padding bucket

    params_1, _, stats_1 = _run_update(single_step, state, batch)
    params_8, opt_8, stats_8 = _run_update(sharded_step, state, batch)

    assert params_8["layers"]["mlp"]["gate_up"][...].sharding.spec == P(None, "fsdp", None, "tensor")
    assert params_8["layers"]["qkv"]["kernel"][...].sharding.spec == P(None, "fsdp", "tensor", None, None)
    for leaf_1, leaf_8 in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_8), strict=True):
        np.testing.assert_allclose(np.asarray(leaf_8), np.asarray(leaf_1), atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(stats_8["train/loss"]), float(stats_1["train/loss"]), atol=1e-6)
    assert float(stats_8["train/skipped_updates"]) == 0.0
    for name in ("mu", "nu"):
        moments = optax.tree_utils.tree_get(opt_8, name)
        for moment, param in zip(jax.tree.leaves(moments), jax.tree.leaves(params_8), strict=True):
            assert moment.sharding == param.sharding, name
    assert jax.tree.leaves(opt_8)[0].sharding.is_fully_replicated  # a step count


def test_loss_and_gradient_do_not_depend_on_microbatching_or_packing(model_state, single_step):
    _, state = model_state
    trajectories = make_trajectories(np.random.default_rng(1), 8, lengths=(4, 17))
    trajectories[0] = make_trajectories(np.random.default_rng(1), 1, lengths=(17, 17))[0]
    several = CONFIG.replace(packing=PackingConfig(token_budget=64, rows=4))
    (batch_one,) = build_batch(trajectories, CONFIG).minibatches
    (batch_several,) = build_batch(trajectories, several).minibatches
    (batch_fixed,) = build_batch(trajectories, CONFIG, lambda n: fixed_count_plan(n, 4)).minibatches
    assert batch_one.shape == (1, 4, 24) and batch_several.shape == batch_fixed.shape == (2, 4, 16)
    assert not np.array_equal(batch_several.segment_ids, batch_fixed.segment_ids)

    def loss_and_grad(batch: PackedBatch):
        params, _ = single_step.init(state)
        device_batch = single_step.put_batch(batch)
        prox = single_step.logprobs(params, device_batch)
        return loss_and_gradient(single_step, params, device_batch, prox)

    loss_ref, grads_ref, stats_ref = loss_and_grad(batch_one)
    assert float(stats_ref["ppo/n_tokens"]) == sum(t.num_loss_tokens for t in trajectories)
    for batch in (batch_several, batch_fixed):
        loss, grads, stats = loss_and_grad(batch)
        assert abs(float(loss) - float(loss_ref)) <= 1e-6
        assert float(stats["ppo/n_tokens"]) == float(stats_ref["ppo/n_tokens"])
        for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=1e-6, rtol=0)

    # the update applies exactly this loss and gradient
    _, _, stats = _run_update(single_step, state, batch_one)
    assert abs(float(stats["train/loss"]) - float(loss_ref)) <= 1e-7
    grad_norm = np.sqrt(sum(float(jnp.sum(g * g)) for g in jax.tree.leaves(grads_ref)))
    np.testing.assert_allclose(float(stats["train/grad_norm"]), grad_norm, rtol=1e-6)


def test_proximal_pass_is_token_logprobs_and_first_ratio_is_one(model_state, single_step):
    graphdef, state = model_state
    (batch,) = build_batch(make_trajectories(np.random.default_rng(2), 8, lengths=(4, 24)), CONFIG).minibatches
    assert batch.shape == (1, 4, 32)
    params, opt_state = single_step.init(state)
    device_batch = single_step.put_batch(batch)
    logp_prox = single_step.logprobs(params, device_batch)
    prox = np.asarray(logp_prox)

    @jax.jit
    def token_logprobs(state, tokens, targets, segment_ids, positions):
        return nnx.merge(graphdef, state).token_logprobs(tokens, targets, segment_ids, positions, TEMPERATURE)

    for m in range(batch.shape[0]):
        expected, _ = token_logprobs(state, batch.tokens[m], batch.targets[m], batch.segment_ids[m], batch.positions[m])
        real = batch.segment_ids[m] > 0
        np.testing.assert_allclose(prox[m][real], np.asarray(expected)[real], atol=1e-6, rtol=0)

    on_policy = batch._replace(logp_behav=np.where(batch.loss_mask, prox, 0.0).astype(np.float32))
    device_batch = single_step.put_batch(on_policy)
    _, _, stats = single_step.update(params, opt_state, device_batch, logp_prox, 0)
    assert abs(float(stats["ppo/ratio_mean"]) - 1.0) < 1e-5
    assert abs(float(stats["ppo/iw_mean"]) - 1.0) < 1e-5
    assert float(stats["ppo/clip_frac"]) == 0.0
    assert float(stats["ppo/approx_kl"]) < 1e-6


def test_plain_ppo_update_takes_no_proximal_logprobs(model_state):
    graphdef, state = model_state
    config = CONFIG.replace(ppo=CONFIG.ppo.replace(decoupled=False))
    step = TrainStep(graphdef, state, config, single_device_mesh(), temperature=TEMPERATURE)
    (batch,) = build_batch(make_trajectories(np.random.default_rng(3), 8, lengths=(4, 24)), config).minibatches
    params, _ = step.init(state)
    # lowered, not compiled (a compile costs seconds here): the program and its statistics
    lowered = step._update_gradients.lower(
        step.program, params, step.frozen, step.put_batch(batch), None, None, jnp.int32(0), None
    )
    stats = lowered.out_info[2]
    assert "ppo/pg_loss" in stats and "train/grad_norm" in stats and "ppo/iw_mean" not in stats


def test_bf16_params_are_updated_in_bf16_when_the_user_chooses_them(caplog):
    graphdef, state = nnx.split(Decoder(TINY.replace(param_dtype="bfloat16"), nnx.Rngs(0)))
    config = CONFIG.replace(ppo=CONFIG.ppo.replace(decoupled=False))
    with caplog.at_level("WARNING"):
        step = TrainStep(graphdef, state, config, single_device_mesh(), temperature=TEMPERATURE)
    assert "no float32 master copy" in caplog.text
    (batch,) = build_batch(make_trajectories(np.random.default_rng(3), 8, lengths=(4, 24)), config).minibatches
    params, opt_state = step.init(state)
    # lowered, not compiled: the update keeps bf16 params and Adam moments shaped like them
    gradients = step._update_gradients.lower(
        step.program, params, step.frozen, step.put_batch(batch), None, None, jnp.int32(0), None
    )
    grads = gradients.out_info[0]
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
    new_params, new_opt_state, _ = step._apply.lower(step.program, params, opt_state, grads).out_info
    assert {leaf.dtype for leaf in jax.tree.leaves(new_params)} == {jnp.dtype(jnp.bfloat16)}
    assert jnp.dtype(jnp.bfloat16) in {leaf.dtype for leaf in jax.tree.leaves(new_opt_state)}


def test_train_step_refuses_rows_that_do_not_split():
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(TINY, nnx.Rngs(0))))
    step = TrainStep(graphdef, state, CONFIG, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), temperature=TEMPERATURE)
    rows_6 = PackedBatch(*(np.zeros((1, 6, 8), np.int32) for _ in PackedBatch._fields))
    with pytest.raises(ValueError, match="6 rows, not divisible by the data\\*fsdp shards \\(4\\)"):
        step.put_batch(rows_6)


def test_bf16_compute_keeps_fp32_params_and_adam_state(model_state, single_step):
    graphdef, state = model_state
    step = TrainStep(
        graphdef, state, CONFIG.replace(compute_dtype="bfloat16"), single_device_mesh(), temperature=TEMPERATURE
    )
    assert step.model_config.compute_dtype == "bfloat16"
    params, opt_state = step.init(state)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    moments = optax.tree_utils.tree_get(opt_state, "mu")
    assert {leaf.dtype for leaf in jax.tree.leaves(moments)} == {jnp.dtype(jnp.float32)}
    (batch,) = build_batch(make_trajectories(np.random.default_rng(4), 8, lengths=(4, 24)), CONFIG).minibatches
    logp_bf16 = np.asarray(step.logprobs(params, step.put_batch(batch)))
    params_32, _ = single_step.init(state)
    logp_32 = np.asarray(single_step.logprobs(params_32, single_step.put_batch(batch)))
    real = batch.segment_ids > 0
    assert 0 < np.max(np.abs(logp_bf16 - logp_32)[real]) < 0.05


@pytest.mark.parametrize("finite", [True, False])
def test_two_program_update_equals_apply_if_finite(model_state, finite):
    """The update's AdamW program (or its skip) leaves params and optimizer state exactly where
    `optax.apply_if_finite(chain(clip, adamw))`, the optimizer the state is made by, leaves them."""
    graphdef, state = model_state
    step = TrainStep(graphdef, state, CONFIG, single_device_mesh(), temperature=TEMPERATURE)
    params, opt_state = step.init(state)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 3.0, p.dtype), params)
    if not finite:
        first = jax.tree.leaves(grads)[0]
        grads = jax.tree.unflatten(jax.tree.structure(grads), [first.at[0].set(jnp.nan), *jax.tree.leaves(grads)[1:]])
    updates, want_state = step.program.optimizer().update(grads, opt_state, params)
    want_params = optax.apply_updates(params, updates)
    clip, _ = step.program.optimizer_parts()
    clipped, _ = clip.update(grads, clip.init(grads))
    copy = functools.partial(jax.tree.map, jnp.copy)
    if finite:
        got_params, got_state, stats = step._apply(step.program, copy(params), copy(opt_state), clipped)
    else:
        (got_state, stats), got_params = step._skip(copy(opt_state)), params
    for got, want in ((got_params, want_params), (got_state, want_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert float(stats["train/skipped_updates"]) == (0.0 if finite else 1.0)


def test_adamw_program_updates_params_and_moments_in_place(model_state):
    """The AdamW program needs no buffer beside its donated arguments (the reason the update is two programs)."""
    graphdef, state = model_state
    step = TrainStep(graphdef, state, CONFIG, single_device_mesh(), temperature=TEMPERATURE)
    params, opt_state = step.init(state)
    compiled = step._apply.lower(step.program, params, opt_state, params).compile()
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert compiled.memory_analysis().temp_size_in_bytes < 0.05 * param_bytes
