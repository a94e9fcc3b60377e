"""The memory plan of a run, from its config alone (nothing compiled): what each device of each mesh holds.

Trainer devices: params (a mixture's experts and routers included), Adam moments and gradients (sharded over
fsdp x tensor; with `model.lora` the moments and gradients of the adapters alone), the largest micro-batch's
activations under the chosen remat (a mixture's dispatch buffers included), the log-prob chunks' logits, the
update's temporaries. Inference devices: the engine's weights (in their serving dtype) and per-layer copies, the
KV cache (dense or paged), the prefill and decode temporaries. Each line names the config keys that change it;
`check` refuses a run that cannot fit, naming the keys of its largest lines. On CPU every "device" is host
memory, so the plan adds both sides and the process's own runtime and compares them with the host's RAM.

The activation and temporary terms are estimates (XLA decides the real buffers); `benchmarks/scale.py` and
`tests/test_memory_plan.py` hold the plan against measured peaks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import jax.numpy as jnp
import psutil
from jax.sharding import Mesh

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import ConfigError
from areal_jax.inference.engine import EngineConfig
from areal_jax.models.attention import ROW_BLOCK
from areal_jax.models.config import ModelConfig

logger = logging.getLogger(__name__)

GIB = 2**30
# What a process holds besides arrays on CPU: Python, JAX/XLA and their libraries, the compiled programs,
# host staging buffers (measured: ~0.8 GiB for a tiny model's run).
CPU_RUNTIME_BYTES = int(1.0 * GIB)
# XLA's temporaries beyond the counted arrays, and the transient copies of a load or a weight update, as a
# share of the counted bytes.
XLA_OVERHEAD = 0.15
# Keys that spread a side over more devices: they lower a device's share, not the host's total.
DEVICE_SPREAD_KEYS = ("mesh.fsdp", "rollout.trainer_share")
# A plan may fill this share of a device (or of host RAM) before it is refused.
USABLE_SHARE = 0.92


@dataclasses.dataclass(frozen=True)
class MemoryItem:
    """One line of the plan: bytes per device and the config keys that change it."""

    name: str
    bytes: int
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SidePlan:
    """The per-device memory of one mesh (the trainer's or the inference side's)."""

    side: str
    devices: int
    mesh_shape: dict[str, int]
    items: tuple[MemoryItem, ...]

    @property
    def per_device(self) -> int:
        return sum(item.bytes for item in self.items)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Both sides' per-device plans, and how they share memory (`host`: CPU devices are host RAM)."""

    sides: tuple[SidePlan, ...]
    host: bool
    shared_devices: bool
    runtime_bytes: int

    @property
    def host_total(self) -> int:
        """On CPU: all the process holds (both sides' devices and the runtime)."""
        return sum(side.per_device * side.devices for side in self.sides) + self.runtime_bytes

    @property
    def device_total(self) -> int:
        """The fullest device: both sides' shares when they share devices."""
        if self.shared_devices:
            return sum(side.per_device for side in self.sides)
        return max(side.per_device for side in self.sides)

    def lines(self) -> list[str]:
        out = []
        for side in self.sides:
            shape = " x ".join(f"{axis} {size}" for axis, size in side.mesh_shape.items())
            out.append(f"{side.side}: {side.devices} device(s), mesh {shape}; per device:")
            for item in side.items:
                out.append(f"  {item.name:<44} {item.bytes / GIB:8.2f} GiB")
            out.append(f"  {'total':<44} {side.per_device / GIB:8.2f} GiB")
        if self.host:
            out.append(f"process runtime (Python, JAX/XLA)             {self.runtime_bytes / GIB:8.2f} GiB")
            note = ", the two sides on the same device(s)" if self.shared_devices else ""
            out.append(f"host memory in all                            {self.host_total / GIB:8.2f} GiB{note}")
        return out

    def check(self, capacity_bytes: int) -> None:
        """Refuse a plan over `USABLE_SHARE` of `capacity_bytes` (host RAM on CPU, else one device's memory),
        naming the keys of the largest lines of the fullest side."""
        usable = int(capacity_bytes * USABLE_SHARE)
        if self.host:
            need, items, where = self.host_total, [i for s in self.sides for i in s.items], "host memory"
        elif self.shared_devices:  # both sides on the same device(s)
            need, items, where = self.device_total, [i for s in self.sides for i in s.items], "a device"
        else:
            fullest = max(self.sides, key=lambda s: s.per_device)
            need, items, where = fullest.per_device, list(fullest.items), f"a {fullest.side} device"
        if need <= usable:
            return
        largest = sorted(items, key=lambda i: -i.bytes)[:3]
        keys = list(dict.fromkeys(key for item in largest for key in item.keys))
        if self.host:  # CPU devices all draw on host RAM: spreading over more of them saves nothing
            keys = [key for key in keys if key not in DEVICE_SPREAD_KEYS] or keys
        biggest = ", ".join(f"{i.name} {i.bytes / GIB:.2f} GiB" for i in largest)
        raise ConfigError(
            keys[0],
            f"the run needs about {need / GIB:.1f} GiB of {where} but {usable / GIB:.1f} GiB are usable "
            f"({USABLE_SHARE:.0%} of {capacity_bytes / GIB:.1f} GiB); largest: {biggest}; change "
            f"{', '.join(keys)} (`areal-jax plan --memory CONFIG` shows the whole plan)",
        )


def _bytes(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


def _shards(mesh_shape: dict[str, int], *axes: str) -> int:
    return math.prod(mesh_shape.get(axis, 1) for axis in axes)


def _weight_shards(model: ModelConfig, mesh_shape: dict[str, int]) -> int:
    """Devices a weight is split over: fsdp splits the model width and tensor the MLP width, each only where it
    divides them (`sharding.logical_to_spec` replicates a weight along an axis that does not: 896 over 3)."""
    fsdp, tensor = mesh_shape.get("fsdp", 1), mesh_shape.get("tensor", 1)
    return (fsdp if model.hidden_size % fsdp == 0 else 1) * (tensor if model.intermediate_size % tensor == 0 else 1)


def _layer_params(model: ModelConfig) -> int:
    return (
        model.num_held_params() - model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    ) // max(1, model.num_layers)


def _layer_activations(model: ModelConfig, tokens: int, row_length: int, rows: int, dtype_bytes: int) -> int:
    """One layer's intermediates for `tokens` tokens in rows of `row_length` (forward values and their
    cotangents): projections, MLP hidden, and the attention scores of the query blocks."""
    d, f, h = model.hidden_size, model.intermediate_size, model.resolved_head_dim
    n, k = model.num_heads, model.num_kv_heads
    feed_forward = 3 * f
    if model.moe is not None and any(model.sparse_layers):
        moe = model.moe
        # the router's logits, then every (token, pick) row the dispatch makes: its gathered input, gate/up,
        # hidden and output (`models/moe.py`); a layer holds the larger of this and a dense MLP's
        dispatch = moe.num_experts + moe.experts_per_token * (2 * d + 3 * moe.expert_intermediate_size)
        feed_forward = dispatch if all(model.sparse_layers) else max(feed_forward, dispatch)
    per_token = (n + 2 * k) * h + n * h + 4 * d + feed_forward
    block = min(ROW_BLOCK, row_length)
    scores = rows * n * block * row_length * 4 * 2  # fp32 scores and probabilities of a query block
    return 2 * tokens * per_token * dtype_bytes + scores


def trainer_items(
    cfg: ExperimentConfig, model: ModelConfig, mesh_shape: dict[str, int], platform: str
) -> list[MemoryItem]:
    """Per trainer device: the state, the largest micro-batch's activations, logits, temporaries."""
    param_shards = _weight_shards(model, mesh_shape)
    params = (model.num_held_params() + model.num_lora_params()) * _bytes(model.param_dtype) // param_shards
    # what the optimizer updates: every parameter, or with model.lora the adapters alone (the base has no moments
    # and no gradient)
    trained = (model.num_lora_params() or model.num_held_params()) * _bytes(model.param_dtype) // param_shards
    packing = cfg.packing_on(platform)
    batch_shards = _shards(mesh_shape, "data", "fsdp")
    rows = max(1, packing.rows // batch_shards)
    tokens = rows * packing.row_length
    trainer_dtype = cfg.trainer.compute_dtype
    c = _bytes(model.compute_dtype_on(platform) if trainer_dtype == "model" else trainer_dtype)
    layer = _layer_activations(model, tokens, packing.row_length, rows, c) // _shards(mesh_shape, "tensor")
    saved = tokens * model.hidden_size * c  # a layer's input, kept for the backward pass
    if model.remat == "full":
        activations = model.num_layers * saved + layer
    elif model.remat == "dots":
        activations = model.num_layers * (saved + layer // 3) + layer
    else:
        activations = model.num_layers * layer
    # a chunk is `logprob_chunk` / packing.rows positions of every row (`chunked_logprobs`): this device's rows'
    chunk = rows * min(packing.row_length, max(1, model.resolved_logprob_chunk // packing.rows))
    logits = chunk * model.vocab_size * 4 * 4  # logits, probabilities and cotangents
    state_keys = ("model.param_dtype", "mesh.fsdp", "rollout.trainer_share")
    trained_keys = (*state_keys, "model.lora")
    of = " of the adapters" if model.lora is not None else ""
    # a mini-batch of at most `rows` sequences always packs into one micro-batch (each fits a row): its gradient
    # needs no accumulator beside it
    sequences = -(-cfg.rollout.staleness.batch_prompts * cfg.rollout.workflow.n_samples // cfg.trainer.ppo_minibatches)
    one_microbatch = sequences <= packing.rows
    gradients = (
        MemoryItem(f"gradients{of}", trained, trained_keys)
        if one_microbatch
        else (MemoryItem(f"gradients{of} (accumulated + micro-batch)", 2 * trained, trained_keys))
    )
    return [
        MemoryItem("params", params, state_keys),
        MemoryItem(f"Adam moments{of}", 2 * trained, trained_keys),
        gradients,
        MemoryItem(
            f"activations ({tokens} tokens, remat {model.remat})",
            activations,
            ("trainer.packing.token_budget", "model.remat", "trainer.packing.rows"),
        ),
        MemoryItem(f"log-prob chunk logits ({chunk} tokens)", logits, ("model.logprob_chunk",)),
    ]


def inference_items(
    engine: EngineConfig, model: ModelConfig, mesh_shape: dict[str, int], platform: str
) -> list[MemoryItem]:
    """Per inference device: weights (serving dtype), per-layer copies, KV cache, prefill/decode temporaries."""
    compute = model.compute_dtype_on(platform)
    served = min(_bytes(model.param_dtype), _bytes(compute))
    c = _bytes(compute)
    weight_shards = _weight_shards(model, mesh_shape)
    weights = model.num_held_params() * served // weight_shards
    k, h, y = model.num_kv_heads, model.resolved_head_dim, model.num_layers
    head_shards = mesh_shape.get("tensor", 1) if k % mesh_shape.get("tensor", 1) == 0 else 1
    if engine.paged:
        kv = y * engine.pool_pages * engine.page_size * k * h * 2 * c // head_shards
        kv_name = f"KV cache (paged: {engine.pool_pages} pages of {engine.page_size})"
        kv_keys = ("rollout.engine.num_pages", "rollout.engine.page_size", "rollout.engine.max_length")
    else:
        slot_shards = _shards(mesh_shape, "data", "fsdp")
        kv = y * engine.max_slots * engine.max_length * k * h * 2 * c // (head_shards * slot_shards)
        kv_name = f"KV cache (dense: {engine.max_slots} slots x {engine.max_length})"
        kv_keys = ("rollout.engine.max_slots", "rollout.engine.max_length", "rollout.engine.kv_cache")
    rows = min(engine.max_prefill_batch, engine.max_slots)
    prefill_tokens = rows * engine.max_length
    prefill = (
        y * prefill_tokens * k * h * 2 * c + _layer_activations(model, prefill_tokens, engine.max_length, rows, c) // 2
    )
    decode = engine.max_slots * model.vocab_size * 4 * 4  # logits and the sampler's sorted copies
    items = [
        MemoryItem(
            f"engine weights ({compute if served == c else model.param_dtype})",
            weights,
            ("model.compute_dtype",),
        )
    ]
    if engine.keeps_layer_copies(platform):
        copies = y * _layer_params(model) * served // weight_shards
        items.append(MemoryItem("per-layer weight copies", copies, ("rollout.engine.decode_layer_copies",)))
    items += [
        MemoryItem(kv_name, kv, kv_keys),
        MemoryItem(
            f"prefill temporaries ({rows} x {engine.max_length})",
            prefill,
            ("rollout.engine.max_prefill_batch", "rollout.engine.max_length"),
        ),
        MemoryItem("decode logits and sampling", decode, ("rollout.engine.max_slots",)),
    ]
    if platform == "cpu" and c < 4:
        # XLA:CPU converts bf16 matmul operands to f32, the scanned layers' weights once per call
        converted = model.num_held_params() * 4 // weight_shards
        items.append(MemoryItem("f32 copies of bf16 weights (XLA:CPU)", converted, ("model.compute_dtype",)))
    return items


def _with_overhead(items: list[MemoryItem]) -> tuple[MemoryItem, ...]:
    overhead = int(XLA_OVERHEAD * sum(item.bytes for item in items))
    return (*items, MemoryItem("XLA temporaries and transient copies (estimate)", overhead, items[0].keys))


def plan_memory(
    cfg: ExperimentConfig,
    model: ModelConfig,
    trainer_mesh: Mesh,
    inference_mesh: Mesh | None,
) -> MemoryPlan:
    """The plan of a run whose policy is `model` (the checkpoint's architecture with the run's choices) on
    these meshes; `inference_mesh` None: the rollout side is not in this process."""
    shared = inference_mesh is not None and set(inference_mesh.devices.flat) == set(trainer_mesh.devices.flat)
    return plan_for_shapes(
        cfg,
        model,
        trainer_mesh.devices.flat[0].platform,
        dict(trainer_mesh.shape),
        None if inference_mesh is None else dict(inference_mesh.shape),
        shared,
    )


def plan_for_shapes(
    cfg: ExperimentConfig,
    model: ModelConfig,
    platform: str,
    trainer_shape: dict[str, int],
    inference_shape: dict[str, int] | None,
    shared: bool = False,
) -> MemoryPlan:
    """`plan_memory` for meshes of these shapes on devices of `platform` (devices this machine need not have);
    `shared`: both sides on the same device(s)."""
    sides = [
        SidePlan(
            "trainer",
            math.prod(trainer_shape.values()),
            trainer_shape,
            _with_overhead(trainer_items(cfg, model, trainer_shape, platform)),
        )
    ]
    if inference_shape is not None:
        inference = inference_items(cfg.rollout.engine, model, inference_shape, platform)
        sides.append(
            SidePlan("inference", math.prod(inference_shape.values()), inference_shape, _with_overhead(inference))
        )
    host = platform == "cpu"
    return MemoryPlan(tuple(sides), host, shared, CPU_RUNTIME_BYTES if host else 0)


def device_capacity(devices: Sequence) -> int | None:
    """Bytes one device may hold: host RAM on CPU, else the device's memory limit (None: it reports none)."""
    device = devices[0]
    if device.platform == "cpu":
        return int(psutil.virtual_memory().total)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return int(limit) if limit else None


def check_memory(
    cfg: ExperimentConfig, model: ModelConfig, trainer_mesh: Mesh, inference_mesh: Mesh | None
) -> MemoryPlan:
    """Log the run's memory plan and refuse it (`ConfigError` naming keys) when it cannot fit this machine."""
    plan = plan_memory(cfg, model, trainer_mesh, inference_mesh)
    logger.info("memory plan (before anything compiles):\n%s", "\n".join(plan.lines()))
    capacity = device_capacity(list(trainer_mesh.devices.flat))
    if capacity is None:
        logger.warning("the devices report no memory limit: the memory plan is not checked")
    else:
        plan.check(capacity)
    return plan
