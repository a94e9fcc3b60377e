"""LoRA adapters in the decoder: base untouched, in-matmul equals merged weights, the trainer's gradient against
finite differences, and only adapters in the optimizer state and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.configuration import ConfigError
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.lora import LoRAParam, adapter_state, merged_state, split_trainable
from areal_jax.models.lora_config import TARGETS, LoRAConfig
from areal_jax.objectives.stats import count_loss_tokens
from areal_jax.trainer import train_step
from areal_jax.trainer.batching import build_batch
from areal_jax.trainer.trainer import Trainer
from tests.test_train_step import CONFIG, TEMPERATURE, TINY, make_trajectories, single_device_mesh

ALL = LoRAConfig(rank=3, alpha=6.0, targets=TARGETS)
SMALL = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2)


def with_random_adapters(model: Decoder, seed: int = 1, std: float = 0.2) -> nnx.State:
    """The model's full state with every adapter (a and b) drawn at random, so every delta and gradient is nonzero."""
    trainable, frozen = split_trainable(model.config, nnx.state(model))
    leaves, treedef = jax.tree.flatten(trainable)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return nnx.merge_state(frozen, jax.tree.unflatten(treedef, drawn))


def packed(rows: int = 2, length: int = 12, vocab: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * (length // 2) + [2] * (length - length // 2)], rows, 0), jnp.int32)
    positions = jnp.asarray(np.repeat([list(range(length // 2)) + list(range(length - length // 2))], rows, 0))
    return tokens, segments, positions.astype(jnp.int32)


def test_adapters_leave_the_base_init_alone_and_start_as_the_identity():
    plain = Decoder(SMALL, nnx.Rngs(0))
    lora = Decoder(SMALL.replace(lora=ALL), nnx.Rngs(0))
    trainable, frozen = split_trainable(lora.config, nnx.state(lora))
    assert jax.tree.structure(frozen) == jax.tree.structure(nnx.state(plain))
    for ours, theirs in zip(jax.tree.leaves(frozen), jax.tree.leaves(nnx.state(plain)), strict=True):
        np.testing.assert_array_equal(ours, theirs)  # the adapters draw from their own stream
    leaves = jax.tree.leaves(trainable, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert len(leaves) == 2 * len(TARGETS) and all(isinstance(v, LoRAParam) for v in leaves)
    assert sum(v.get_value().size for v in leaves) == lora.config.num_lora_params()
    tokens, segments, positions = packed()
    np.testing.assert_array_equal(lora.logits(tokens, segments, positions), plain.logits(tokens, segments, positions))


@pytest.mark.parametrize("targets", [TARGETS, ("q", "v"), ("up", "down", "k")])
def test_adapters_in_the_matmul_equal_merged_weights(targets):
    cfg = SMALL.replace(lora=ALL.replace(targets=targets))
    lora = Decoder(cfg, nnx.Rngs(0))
    state = with_random_adapters(lora)
    applied = nnx.merge(nnx.graphdef(lora), state)
    merged = nnx.merge(nnx.graphdef(Decoder(SMALL, nnx.Rngs(0))), jax.jit(functools.partial(merged_state, cfg))(state))
    tokens, segments, positions = packed()
    want = merged.logits(tokens, segments, positions)
    got = applied.logits(tokens, segments, positions)
    assert float(jnp.max(jnp.abs(got - Decoder(SMALL, nnx.Rngs(0)).logits(tokens, segments, positions)))) > 1e-2
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"lora\.rank: value 17 exceeds the width of projection 'q' \(16 -> 16\)"):
        SMALL.replace(lora=LoRAConfig(rank=17))
    with pytest.raises(ConfigError, match=r"targets: unknown target 'q_proj'.*did you mean 'up'|targets: unknown"):
        LoRAConfig(targets=("q_proj",))
    with pytest.raises(ConfigError, match="names a projection twice"):
        LoRAConfig(targets=("q", "q"))
    # GQA: k and v are narrower than q
    with pytest.raises(ConfigError, match="projection 'k' \\(16 -> 8\\); allowed: 1 <= rank <= 8"):
        SMALL.replace(lora=LoRAConfig(rank=9, targets=("q", "k")))


def test_trainer_gradient_matches_finite_differences():
    """The train step's gradient (its `_gradients_fn`, with respect to the adapters alone) of the PPO loss against
    central differences along random directions, every adapter leaf on its own."""
    cfg = TINY.replace(lora=ALL)
    model = Decoder(cfg, nnx.Rngs(0))
    trainable, frozen = split_trainable(cfg, with_random_adapters(model, std=0.3))
    config = CONFIG.replace(ppo=CONFIG.ppo.replace(decoupled=False, eps_clip_low=1.0, eps_clip_high=1e6))  # smooth
    step = train_step.TrainStep(nnx.graphdef(model), trainable, config, single_device_mesh(), temperature=TEMPERATURE,
                                frozen=frozen)  # fmt: skip
    (mb,) = build_batch(make_trajectories(np.random.default_rng(5), 6, lengths=(6, 20)), config).minibatches
    batch = step.put_batch(mb)
    assert batch.tokens.shape[0] == 1  # one micro-batch: its loss is the mini-batch's
    params = step.place(trainable)
    _, grads, _ = jax.jit(train_step._gradients_fn, static_argnums=0)(
        step.program, params, step.frozen, batch, None, None, jnp.int32(0)
    )
    only = jax.tree.map(lambda x: x[0], batch)
    tokens = count_loss_tokens(batch.loss_mask)

    @jax.jit
    def loss_at(p):
        return train_step._microbatch_loss(step.program, p, step.frozen, only, None, None, tokens, None, jnp.int32(0))[
            0
        ]

    loss = loss_at(params)
    flat_params, treedef = jax.tree.flatten(params)
    flat_grads = jax.tree.leaves(grads)
    assert len(flat_grads) == len(flat_params) == 2 * len(TARGETS)  # nothing of the base
    rng = np.random.default_rng(0)
    eps = 1e-2
    checked = 0
    for i, (leaf, grad) in enumerate(zip(flat_params, flat_grads, strict=True)):
        direction = rng.standard_normal(leaf.shape).astype(np.float32)
        direction /= np.linalg.norm(direction)

        def shifted(sign, i=i, leaf=leaf, direction=direction):
            leaves = list(flat_params)
            leaves[i] = leaf + sign * eps * direction
            return float(loss_at(jax.tree.unflatten(treedef, leaves)))

        numeric = (shifted(1) - shifted(-1)) / (2 * eps)
        analytic = float(jnp.vdot(grad, direction))
        assert abs(analytic) > 1e-4  # every adapter leaf moves the loss
        np.testing.assert_allclose(analytic, numeric, rtol=2e-2, atol=2e-4)
        checked += 1
    assert checked == 2 * len(TARGETS) and np.isfinite(float(loss))


def test_trainer_updates_adapters_only_and_keeps_the_base_out_of_the_optimizer():
    cfg = TINY.replace(lora=LoRAConfig(rank=4, targets=("q", "v", "o", "gate", "down")))
    trainer = Trainer(Decoder(cfg, nnx.Rngs(0)), CONFIG, single_device_mesh(), temperature=TEMPERATURE)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    assert adapter_bytes == cfg.num_lora_params() * 4
    opt_arrays = [x for x in jax.tree.leaves(trainer.opt_state) if x.size > 1]
    assert sum(x.nbytes for x in opt_arrays) == 2 * adapter_bytes  # Adam's two moments of the adapters, no more
    base = jax.tree.map(np.asarray, trainer.frozen)
    before = jax.tree.map(np.asarray, trainer.params)
    trainer.step(make_trajectories(np.random.default_rng(0), 8))
    for was, now in zip(jax.tree.leaves(base), jax.tree.leaves(trainer.frozen), strict=True):
        np.testing.assert_array_equal(was, now)
    moved = [
        not np.array_equal(w, n) for w, n in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.params), strict=True)
    ]
    assert any(moved)
    full = trainer.policy_state()
    assert jax.tree.structure(adapter_state(full)) == jax.tree.structure(trainer.params)


def test_the_memory_plan_counts_moments_and_gradients_of_the_adapters_only():
    """At Qwen2.5-0.5B's shape (benchmarks/lora.py), the trainer's plan before any compile."""
    import jax.sharding

    from areal_jax.config import load_experiment
    from areal_jax.planning.memory import plan_memory

    qwen = [
        "model.vocab_size=151936",
        "model.hidden_size=896",
        "model.intermediate_size=4864",
        "model.num_layers=24",
        "model.num_heads=14",
        "model.num_kv_heads=2",
        "model.tie_word_embeddings=true",
    ]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))

    def trainer_items(overrides):
        cfg = load_experiment("configs/train_cpu.yaml", [*qwen, *overrides])
        (trainer, *_) = plan_memory(cfg, cfg.model, mesh, None).sides
        return cfg.model, {item.name.split(" (")[0]: item.bytes for item in trainer.items}

    full_model, full = trainer_items([])
    lora_model, lora = trainer_items(["model.lora.rank=8", "model.lora.targets=[q,k,v,o,gate,up,down]"])
    assert lora_model.num_lora_params() == 4_399_104  # 24 layers x 8 x (in + out) of the seven projections
    assert full["Adam moments"] == 2 * full_model.num_params() * 4
    assert lora["Adam moments of the adapters"] == 2 * lora_model.num_lora_params() * 4
    adapter_bytes = lora_model.num_lora_params() * 4
    assert lora["gradients of the adapters"] in (adapter_bytes, 2 * adapter_bytes)  # one or accumulated + one
    assert lora["params"] == (full_model.num_params() + lora_model.num_lora_params()) * 4
    assert full["Adam moments"] > 100 * lora["Adam moments of the adapters"]
