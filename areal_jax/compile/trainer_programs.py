"""The trainer's programs at a run's largest packing bucket, with abstract sharded arguments (no weights).

Proximal pass (also the reference pass's program: the same function of params of the same shapes), the
gradient program and the AdamW apply, as `TrainStep` builds them for the trainer mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.compile.programs import CompiledProgram, ProgramSpec, per_chip_bytes
from areal_jax.config import ExperimentConfig
from areal_jax.models.config import ModelConfig
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.lora import split_trainable
from areal_jax.models.moe import routing_dtype, sparse_layer_ids
from areal_jax.planning.memory_terms import largest_bucket
from areal_jax.trainer.batching import PACKED_FIELDS, PackedBatch
from areal_jax.trainer.train_step import TrainStep, _init_fn


def _sharded(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def trainer_programs(cfg: ExperimentConfig, model: ModelConfig, mesh: Mesh) -> list[ProgramSpec]:
    """The trainer's programs for `mesh` (any devices: a topology's included), nothing placed or run."""
    abstract_model = nnx.eval_shape(lambda: new_decoder(model, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract_model)
    params, frozen = split_trainable(model, state)
    temperature = cfg.rollout.workflow.sampling.temperature
    step = TrainStep(graphdef, params, cfg.trainer, mesh, temperature=temperature, frozen=frozen)
    abstract_params = _sharded(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), step.param_shardings
    )
    abstract_frozen = _sharded(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), frozen), step.frozen_shardings
    )
    opt_state = _sharded(jax.eval_shape(lambda p: _init_fn(step.program, p), abstract_params), step.opt_shardings)
    micro, rows, length = largest_bucket(cfg, mesh.devices.flat[0].platform, step.batch_shards)
    shape = (micro, rows, length)
    batch: Any = PackedBatch(
        *(jax.ShapeDtypeStruct(shape, dtype, sharding=step.batch_sharding) for dtype, _ in PACKED_FIELDS)
    )
    if model.moe is not None:  # the rollout's experts of every input token, [M, B, L, Ym, K] (`PackedBatch.routing`)
        routed = (*shape, len(sparse_layer_ids(model)), model.moe.experts_per_token)
        batch = batch._replace(routing=jax.ShapeDtypeStruct(routed, routing_dtype(model), sharding=step.batch_sharding))
    logp = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=step.batch_sharding)
    replicated = NamedSharding(mesh, PartitionSpec())
    version = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    prox = logp if step.needs_prox_pass else None
    ref = logp if step.uses_reference else None
    seed = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated) if step.uses_dropout else None
    tokens = micro * rows * length
    compute_bytes = jnp.dtype(step.model_config.compute_jnp_dtype).itemsize
    chips = mesh.devices.size
    all_params = model.num_params() + model.num_lora_params()
    trained = model.num_lora_params() or model.num_params()
    # each pass reads every weight once per micro-batch in the compute dtype (gathered: every chip reads all of
    # an FSDP-sharded weight); a lower bound that leaves out the activations' traffic
    weight_reads = micro * all_params * compute_bytes / max(1, mesh.shape.get("tensor", 1))
    forward = model.matmul_flops_per_token(length) * tokens
    backward_passes = 3 + (1 if model.remat != "none" else 0)  # forward, backward (2x), the recomputed forward
    param_bytes = jnp.dtype(model.param_dtype).itemsize
    specs = []
    if step.needs_prox_pass or step.uses_reference:
        specs.append(
            ProgramSpec(
                "proximal log-probs" + (" (and reference)" if step.uses_reference else ""),
                step._logprobs,
                (step.program.scorer, step.mesh, abstract_params, abstract_frozen, batch),
                (2, 3),
                tokens,
                forward,
                weight_reads,
                static=(0, 1),
            )
        )
    specs.append(
        ProgramSpec(
            f"gradient ({micro} x {rows} x {length})",
            step._update_gradients,
            (step.program, abstract_params, abstract_frozen, batch, prox, ref, version, seed),
            (1, 2),
            tokens,
            forward * backward_passes,
            weight_reads * (backward_passes - 1) + trained * param_bytes / chips,
            static=(0,),
        )
    )
    specs.append(
        ProgramSpec(
            "AdamW apply",
            step._apply,
            (step.program, abstract_params, opt_state, abstract_params),
            (1, 2),
            0,
            12.0 * trained,
            # read params, gradient, two moments; write params and moments
            7 * per_chip_bytes(abstract_params) / max(1, all_params / trained),
            static=(0,),
        )
    )
    return specs


def resident_lines(
    cfg: ExperimentConfig, specs: list[ProgramSpec], compiled: list[CompiledProgram] | None = None
) -> tuple[tuple[str, int], ...]:
    """Bytes per chip held between programs: params, frozen base and optimizer state (the apply program's
    resident arguments), and the reference policy's params when a KL term needs them. With `compiled` (the
    specs' programs), in the layouts the compiler chose (TPU pads each shard to its tiles); else the arrays'
    own bytes."""
    apply = next(spec for spec in specs if spec.name == "AdamW apply")
    params, opt_state = apply.args[1], apply.args[2]
    gradient = next(spec for spec in specs if spec.name.startswith("gradient"))
    frozen = gradient.args[2]
    if compiled is None:
        weights, state = per_chip_bytes(params) + per_chip_bytes(frozen), per_chip_bytes(opt_state)
    else:
        by_name = {program.name: program for program in compiled}
        applied, graded = by_name[apply.name], by_name[gradient.name]
        weights = applied.laid_out(1, params) + graded.laid_out(2, frozen)  # trained and frozen
        state = applied.laid_out(2, opt_state)
    lines = [("params", weights), ("optimizer state", state)]
    if cfg.trainer.uses_reference:
        lines.append(("reference params", weights))
    return tuple(lines)
