"""The memory plan's lines for CPU and GPU devices, per side, from the config and the mesh's shape: each a
`MemoryItem` (bytes per device, the keys that change it). `memory.py` puts them together into a plan;
`tpu_memory.py` counts TPU's own way and reuses the shared terms here."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from areal_jax.config import ExperimentConfig
from areal_jax.inference.engine import EngineConfig
from areal_jax.inference.slot_cache import STATE_AXES, WINDOW_AXES
from areal_jax.models.attention import ROW_BLOCK, uses_splash
from areal_jax.models.config import ModelConfig
from areal_jax.models.moe import dispatch_impl, grouped_matmul_impl
from areal_jax.planning.layouts import shard_shape

# XLA's temporaries beyond the counted arrays, and the transient copies of a load or a weight update, as a
# share of the counted bytes.
XLA_OVERHEAD = 0.15
# The keys that change a trainer device's params, and its trained state (Adam moments, gradients).
TRAINER_STATE_KEYS = ("model.param_dtype", "mesh.fsdp", "rollout.trainer_share")
TRAINED_KEYS = (*TRAINER_STATE_KEYS, "model.lora")


@dataclasses.dataclass(frozen=True)
class MemoryItem:
    """One line of the plan: bytes per device and the config keys that change it."""

    name: str
    bytes: int
    keys: tuple[str, ...]


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


def _layer_activations(
    model: ModelConfig,
    tokens: int,
    row_length: int,
    rows: int,
    dtype_bytes: int,
    platform: str,
    expert_group: int = 1,
    trained: bool = True,
) -> int:
    """One layer's intermediates for `tokens` tokens in rows of `row_length` (forward values and their
    cotangents): projections, MLP hidden, and the attention scores of a query block (none under the splash
    kernel, which keeps its tiles on chip: `attention.uses_splash` on `platform`). `expert_group`: the
    devices whose tokens a mixture's dispatch gathers on each (`models/moe.py`): the all-gather dispatch's expert
    group, whose dispatch rows are that many times the device's own tokens'; 0 for the all-to-all dispatch. A
    hybrid's layer is the larger of its two kinds when `trained`; a prefill (not `trained`) counts its full layers
    only (the line, not split over the engine's chips, is already above XLA:TPU's on Qwen3.5, docs/tpu.md)."""
    d, f, h = model.hidden_size, model.intermediate_size, model.resolved_head_dim
    n, k = model.num_heads, model.num_kv_heads
    feed_forward = 3 * f
    if model.moe is not None and any(model.sparse_layers):
        moe = model.moe
        picks, expert_f = moe.experts_per_token, moe.expert_intermediate_size
        # the router's logits, then every (token, pick) row the dispatch makes: its input, gate/up, hidden and
        # output; the all-to-all's rows are the device's own (one round's received rows at a time, at most its
        # own count) plus its sorted input and returned output. A layer holds the larger of this and a dense MLP's
        if expert_group:
            dispatch = moe.num_experts + expert_group * picks * (2 * d + 3 * expert_f)
        else:
            dispatch = moe.num_experts + picks * (4 * d + 3 * expert_f)
        feed_forward = dispatch if all(model.sparse_layers) else max(feed_forward, dispatch)
    # a hybrid's full layers also project each query head's output gate (`models/hybrid.py`)
    gates = 0 if model.hybrid is None else n * h
    per_token = (n + 2 * k) * h + gates + n * h + 4 * d + feed_forward
    block = min(ROW_BLOCK, row_length)
    scores = rows * n * block * row_length * 4 * 2  # fp32 scores and probabilities of a query block
    if uses_splash(model.attention_impl, platform, row_length):
        scores = 0
    full = 2 * tokens * per_token * dtype_bytes + scores
    if model.hybrid is None or not model.hybrid.count("linear_attention") or not trained:
        return full
    return max(full, _linear_layer_activations(model, tokens, dtype_bytes, 4 * d + feed_forward))


def _linear_layer_activations(model: ModelConfig, tokens: int, dtype_bytes: int, rest_per_token: int) -> int:
    """A Gated DeltaNet layer's intermediates (`models/gated_delta.py`) for `tokens` tokens: its projections in the
    compute dtype with their cotangents, beside the norms and the feed-forward's `rest_per_token`, and the delta
    rule's fp32 arrays. Per value head and token those are q and k repeated, normed and scaled, then the chunk's
    key products (9 K wide), v, its write-weighted, solved, corrected and output values (5 V), five [C, C] chunk
    matrices (the decay spans, the system, the attention), and each chunk's carried state [K, V] that its scan
    saves for the backward pass. Counted once, not with cotangents: XLA:TPU held 7.2 GB of them at the gradient
    program's peak for the 7.45 GB this counts (Qwen3.5-27B, 32,768 tokens, 24 value heads a chip)."""
    hy = model.hybrid
    assert hy is not None
    kh, vh = hy.linear_num_key_heads, hy.linear_num_value_heads
    kd, vd, c = hy.linear_key_head_dim, hy.linear_value_head_dim, hy.chunk
    # q/k/v before and after the convolution, the output gate z and the rule's output
    projections = 2 * (2 * kh * kd + vh * vd) + 2 * vh * vd
    rule = vh * (9 * kd + 5 * vd + 5 * c + kd * vd // c) * 4
    return tokens * (2 * (projections + rest_per_token) * dtype_bytes + rule)


def _expert_group(model: ModelConfig, mesh_shape: dict[str, int], platform: str) -> int:
    """`_layer_activations`' expert group: the fsdp devices (the expert axis maps to fsdp) under the all-gather
    dispatch, 0 under the all-to-all (`models/moe.py`: `dispatch_impl`)."""
    if model.moe is None:
        return 1
    all_to_all = dispatch_impl(model.moe, grouped_matmul_impl(model.moe, platform)) == "all_to_all"
    return 0 if all_to_all else _shards(mesh_shape, "fsdp")


def largest_bucket(cfg: ExperimentConfig, platform: str, batch_shards: int) -> tuple[int, int, int]:
    """(micro-batches, rows, row length) of the largest micro-batch the packer can make, and as many of them as
    a mini-batch of the longest samples needs."""
    packing = cfg.packing_on(platform)
    rows, length = packing.rows, packing.row_length
    longest = cfg.longest_sample()[0]
    per_row = max(1, length // max(1, longest))
    sequences = -(-cfg.rollout.staleness.batch_prompts * cfg.rollout.workflow.n_samples // cfg.trainer.ppo_minibatches)
    micro = max(1, -(-sequences // (rows * per_row)))
    if packing.microbatch_rounding == "pow2":
        micro = 1 << (micro - 1).bit_length()
    else:
        micro = -(-micro // packing.microbatch_multiple) * packing.microbatch_multiple
    rows = -(-rows // batch_shards) * batch_shards
    return micro, rows, length


def trainer_compute_bytes(cfg: ExperimentConfig, model: ModelConfig, platform: str) -> int:
    """Bytes of an element of the trainer's compute dtype (`trainer.compute_dtype`, or the model's on `platform`)."""
    trainer_dtype = cfg.trainer.compute_dtype
    return _bytes(model.compute_dtype_on(platform) if trainer_dtype == "model" else trainer_dtype)


def _trainer_transients(
    cfg: ExperimentConfig, model: ModelConfig, mesh_shape: dict[str, int], platform: str
) -> tuple[int, int, int, int]:
    """(tokens, activations, log-prob chunk tokens, their logits) of a trainer device's largest micro-batch."""
    packing = cfg.packing_on(platform)
    batch_shards = _shards(mesh_shape, "data", "fsdp")
    rows = max(1, packing.rows // batch_shards)
    tokens = rows * packing.row_length
    c = trainer_compute_bytes(cfg, model, platform)
    expert_group = _expert_group(model, mesh_shape, platform)
    layer = _layer_activations(model, tokens, packing.row_length, rows, c, platform, expert_group) // _shards(
        mesh_shape, "tensor"
    )
    # a layer's input, kept for the backward pass: each layer is its own remat unit (a hybrid's too, inside its
    # period's scan step, `models/hybrid.py`), so the backward holds one layer's intermediates at a time
    saved = tokens * model.hidden_size * c
    if model.remat == "full":
        activations = model.num_layers * saved + layer
    elif model.remat == "dots":
        activations = model.num_layers * (saved + layer // 3) + layer
    else:
        activations = model.num_layers * layer
    # a chunk is `logprob_chunk` / packing.rows positions of every row (`chunked_logprobs`): this device's rows'
    chunk = rows * min(packing.row_length, max(1, model.resolved_logprob_chunk // packing.rows))
    logits = chunk * model.vocab_size * 4 * 4  # logits, probabilities and cotangents
    return tokens, activations, chunk, logits


def one_microbatch_per_update(cfg: ExperimentConfig, platform: str) -> bool:
    """Whether a mini-batch always packs into one micro-batch (at most `rows` sequences, each fits a row)."""
    sequences = -(-cfg.rollout.staleness.batch_prompts * cfg.rollout.workflow.n_samples // cfg.trainer.ppo_minibatches)
    return sequences <= cfg.packing_on(platform).rows


def trainer_items(
    cfg: ExperimentConfig, model: ModelConfig, mesh_shape: dict[str, int], platform: str
) -> list[MemoryItem]:
    """Per trainer device: the state, the largest micro-batch's activations, logits, temporaries."""
    param_shards = _weight_shards(model, mesh_shape)
    params = (model.num_held_params() + model.num_lora_params()) * _bytes(model.param_dtype) // param_shards
    # what the optimizer updates: every parameter, or with model.lora the adapters alone (the base has no moments
    # and no gradient)
    trained = (model.num_lora_params() or model.num_held_params()) * _bytes(model.param_dtype) // param_shards
    tokens, activations, chunk, logits = _trainer_transients(cfg, model, mesh_shape, platform)
    state_keys, trained_keys = TRAINER_STATE_KEYS, TRAINED_KEYS
    of = " of the adapters" if model.lora is not None else ""
    # a mini-batch of at most `rows` sequences always packs into one micro-batch (each fits a row): its gradient
    # needs no accumulator beside it
    one_microbatch = one_microbatch_per_update(cfg, platform)
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


def engine_transients(engine: EngineConfig, model: ModelConfig, c: int, platform: str) -> tuple[int, int, int]:
    """(rows, bytes) of the largest prefill (its keys and values, half a layer's activations: no cotangents) and
    the bytes of a decode step's logits and the sampler's sorted copies, in compute dtype of `c` bytes."""
    k, h = model.num_kv_heads, model.resolved_head_dim
    kv_layers = model.num_layers if model.hybrid is None else model.hybrid.count("full_attention")
    rows = min(engine.max_prefill_batch, engine.max_slots)
    tokens = rows * engine.max_length
    activations = _layer_activations(model, tokens, engine.max_length, rows, c, platform, trained=False)
    prefill = kv_layers * tokens * k * h * 2 * c + activations // 2
    decode = engine.max_slots * model.vocab_size * 4 * 4
    return rows, prefill, decode


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
    slot_shards = _shards(mesh_shape, "data", "fsdp")
    hy = model.hybrid
    kv_layers = y if hy is None else hy.count("full_attention")  # a qwen3_5 model's linear layers keep none
    if engine.paged:
        kv = kv_layers * engine.pool_pages * engine.page_size * k * h * 2 * c // head_shards
        kv_name = f"KV cache (paged: {engine.pool_pages} pages of {engine.page_size})"
        kv_keys = ("rollout.engine.num_pages", "rollout.engine.page_size", "rollout.engine.max_length")
    else:
        kv = kv_layers * engine.max_slots * engine.max_length * k * h * 2 * c // (head_shards * slot_shards)
        kv_name = f"KV cache (dense: {engine.max_slots} slots x {engine.max_length})"
        kv_keys = ("rollout.engine.max_slots", "rollout.engine.max_length", "rollout.engine.kv_cache")
    rows, prefill, decode = engine_transients(engine, model, c, platform)
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
    items.append(MemoryItem(kv_name, kv, kv_keys))
    if hy is not None:  # per linear layer: the fp32 recurrent states and the convolution windows, split as the cache's
        slots = engine.max_slots
        state = (slots, hy.linear_num_value_heads, hy.linear_key_head_dim, hy.linear_value_head_dim)
        window = (slots, hy.conv_kernel - 1, hy.linear_num_key_heads * hy.group_width)
        per_layer = math.prod(shard_shape(state, STATE_AXES, mesh_shape)) * 4
        per_layer += math.prod(shard_shape(window, WINDOW_AXES, mesh_shape)) * c
        states = hy.count("linear_attention") * per_layer
        items.append(MemoryItem(f"recurrent states ({engine.max_slots} slots)", states, ("rollout.engine.max_slots",)))
    items += [
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
