"""The memory plan's lines on TPU: what XLA:TPU holds per chip, from the model's shapes and the mesh.

Held against `areal-jax compile` (the compiler's `memory_analysis` per program; `compile/agreement.py`), the
plan differs from its CPU lines (`memory.py`, calibrated on measured RSS) in four ways:

- **Tiles.** Every array is counted in TPU's tiled layout (`layouts.py`): a shard's two minor dims padded to
  8 x 128. Params, Adam moments, gradients, engine weights and the KV cache are summed leaf by leaf from the
  model's abstract state and the mesh's shardings, not from parameter counts.
- **Gradient buffers.** The gradient program of one micro-batch clips its gradient in place: one gradient-sized
  buffer (its output). Of several, a `lax.scan` carries the accumulated gradient, the body makes the
  micro-batch's beside it, and the clipped output is a third: three.
- **The gradient program's other inputs and copies** (read from XLA:TPU's buffer assignment at Qwen3-30B-A3B and
  R1-Distill-Qwen-1.5B, `docs/tpu.md`): the weights cast to the compute dtype, once a program for every layer
  (a `convert` hoisted out of the micro-batch loop); the mini-batch, every micro-batch of it, as its argument;
  with experts, every sparse layer's router logits, their cotangents and the expert ids (the ids' K in the lanes).
- **One program at a time.** An engine chip runs its prefill, insert and decode step one after another: the
  plan counts the larger of the prefill's and the decode step's needs, not their sum.
- **Compiled code, no flat overhead.** The CPU plan's 15% for XLA's unnamed temporaries is left out; each
  program's compiled code is a line of its own. Code is not a function of array shapes: the figures below are
  XLA:TPU's (libtpu 0.0.42.1) generated code as `areal-jax compile` reports it, rounded up. The gradient
  program (its layers one scanned body): 6.7 MiB at 2 layers of width 128, 31.6 MiB at Qwen2.5-0.5B's 24 of
  896, so 6 MiB, under 1% of any real shape's needs. The decode step unrolls its layers and each layer its
  cache segments (`KVCache`): 0.8 MiB per layer and segment at width 128 (2 x 1), 1.1 MiB at 0.5B (24 x 5),
  so 1.5 MiB each with the decode step's small buffers (XLA:TPU places each at a 16 KiB-aligned offset).

Activations (under the remat policy), log-prob chunk logits and the prefill's keys, values and activations
are the CPU plan's terms: at Qwen2.5-0.5B on v5p they are within 10% of XLA:TPU's temporaries
(`docs/tpu.md`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from areal_jax.config import ExperimentConfig
from areal_jax.inference.engine import EngineConfig
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import KEY_CACHE_AXES, VALUE_CACHE_AXES, segment_ends
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.lora import split_trainable
from areal_jax.models.moe import routing_dtype, sparse_layer_ids
from areal_jax.models.page_pool import pool_shard_shape, uses_combined_pages
from areal_jax.models.paged_attention import kv_head_shards
from areal_jax.planning import memory_terms as memory
from areal_jax.planning.layouts import shard_shape, state_bytes, tiled_elements
from areal_jax.planning.memory_terms import (
    MemoryItem,
    _bytes,
    _trainer_transients,
    engine_transients,
    largest_bucket,
    one_microbatch_per_update,
    trainer_compute_bytes,
)
from areal_jax.trainer.batching import PACKED_FIELDS

MIB = 2**20
GRADIENT_CODE_BYTES = 6 * MIB
DECODE_CODE_BYTES_PER_LAYER_SEGMENT = int(1.5 * MIB)
PLATFORM = "tpu"


def abstract_state(model: ModelConfig) -> Any:
    """The model's parameters as abstract arrays with their logical axis names (nothing allocated)."""
    return nnx.split(nnx.eval_shape(lambda: new_decoder(model, nnx.Rngs(0))))[1]


def trainer_items(
    cfg: ExperimentConfig, model: ModelConfig, state: Any, mesh_shape: dict[str, int]
) -> list[MemoryItem]:
    """Per trainer chip: params, Adam moments and gradients in tiles, the largest micro-batch's activations and
    log-prob logits, the compute-dtype weights, the mini-batch inputs, router outputs, the gradient program's
    code."""
    trainable, frozen = split_trainable(model, state)
    trained = state_bytes(trainable, mesh_shape, PLATFORM)
    params = trained + state_bytes(frozen, mesh_shape, PLATFORM)
    tokens, activations, chunk, logits = _trainer_transients(cfg, model, mesh_shape, PLATFORM)
    state_keys, trained_keys = memory.TRAINER_STATE_KEYS, memory.TRAINED_KEYS
    of = " of the adapters" if model.lora is not None else ""
    one = one_microbatch_per_update(cfg, PLATFORM)
    gradients = (
        MemoryItem(f"gradients{of} (clipped in place)", trained, trained_keys)
        if one
        else MemoryItem(f"gradients{of} (accumulated, micro-batch, clipped)", 3 * trained, trained_keys)
    )
    items = [
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
    c = trainer_compute_bytes(cfg, model, PLATFORM)
    if c < _bytes(model.param_dtype):
        compute = "bfloat16" if c == 2 else f"{c}-byte"
        items.append(
            MemoryItem(
                f"weights in {compute} (cast once a program)",
                state_bytes(state, mesh_shape, PLATFORM, c),
                ("model.compute_dtype", *state_keys),
            )
        )
    items.append(_minibatch_inputs(cfg, model, mesh_shape))
    if model.moe is not None and any(model.sparse_layers):
        items.append(_router_outputs(model, tokens))
    items.append(MemoryItem("compiled code (XLA:TPU, gradient program)", GRADIENT_CODE_BYTES, ("model.scan_layers",)))
    return items


def _minibatch_inputs(cfg: ExperimentConfig, model: ModelConfig, mesh_shape: dict[str, int]) -> MemoryItem:
    """A chip's rows of the largest mini-batch, every micro-batch of it (the gradient program's batch argument):
    PackedBatch's fields, the proximal and reference log-probs where the step takes them, the recorded routing."""
    batch_shards = memory._shards(mesh_shape, "data", "fsdp")
    micro, rows, length = largest_bucket(cfg, PLATFORM, batch_shards)
    shard = (micro, rows // batch_shards, length)
    itemsizes = [np.dtype(dtype).itemsize for dtype, _ in PACKED_FIELDS]
    itemsizes += [4] * (int(cfg.trainer.ppo.needs_prox_pass) + int(cfg.trainer.uses_reference))
    total = tiled_elements(shard, PLATFORM) * sum(itemsizes)
    if model.moe is not None:
        routed = (*shard, len(sparse_layer_ids(model)), model.moe.experts_per_token)
        total += tiled_elements(routed, PLATFORM) * routing_dtype(model).itemsize
    return MemoryItem(
        f"mini-batch inputs ({micro} x {rows} x {length})",
        total,
        ("trainer.packing.token_budget", "trainer.ppo_minibatches", "trainer.packing.rows"),
    )


def _router_outputs(model: ModelConfig, tokens: int) -> MemoryItem:
    """Every sparse layer's router logits kept for the load-balancing loss and statistics, their cotangents, and
    the expert ids in `moe.expert_ids_dtype`, for a chip's `tokens` (`trainer/moe_terms.py`). The ids are not
    padded to the lanes: cast from int32 to uint8, Qwen3-30B-A3B's gradient program at 8 layers shrank by 25 MB,
    about 3 bytes for each of K = 8 ids of a token and layer in 4 arrays, not by the 96 MiB 128-lane padding implies."""
    assert model.moe is not None
    layers, experts = len(sparse_layer_ids(model)), model.moe.num_experts
    ids = model.moe.experts_per_token * routing_dtype(model).itemsize
    return MemoryItem(
        f"router logits and ids ({layers} sparse layers)",
        layers * tokens * (2 * experts * 4 + ids),
        ("trainer.packing.token_budget", "trainer.packing.rows"),
    )


def dense_cache_bytes(model: ModelConfig, engine: EngineConfig, mesh_shape: dict[str, int], c: int) -> int:
    """A chip's dense KV cache in tiles: per layer and segment, keys [S, K, H, n] and values [S, K, n, H]
    (`KVCache.zeros`), each shard as `cache_shardings` splits it (slots over data x fsdp, KV heads over
    tensor, each only where it divides: 256 slots over 6 chips are whole on every chip)."""
    ends = segment_ends(engine.max_length, engine.prefill_buckets()[0])
    slots, heads, h = engine.max_slots, model.num_kv_heads, model.resolved_head_dim
    per_layer = 0
    for start, end in zip((0, *ends[:-1]), ends, strict=True):
        key = shard_shape((slots, heads, h, end - start), KEY_CACHE_AXES, mesh_shape)
        value = shard_shape((slots, heads, end - start, h), VALUE_CACHE_AXES, mesh_shape)
        per_layer += tiled_elements(key, PLATFORM) + tiled_elements(value, PLATFORM)
    return model.num_layers * per_layer * c


def inference_items(
    engine: EngineConfig, model: ModelConfig, state: Any, mesh_shape: dict[str, int]
) -> list[MemoryItem]:
    """Per engine chip: weights (serving dtype), per-layer copies and the KV cache in tiles; then the larger of
    the prefill's and the decode step's needs (one program runs at a time), the decode step with its code."""
    if model.hybrid is not None:  # recurrent states beside a cache of its full-attention layers: the generic lines
        return memory.inference_items(engine, model, mesh_shape, PLATFORM)
    compute = model.compute_dtype_on(PLATFORM)
    c = _bytes(compute)
    served = min(_bytes(model.param_dtype), c)
    items = [
        MemoryItem(
            f"engine weights ({compute if served == c else model.param_dtype})",
            state_bytes(state, mesh_shape, PLATFORM, served),
            ("model.compute_dtype",),
        )
    ]
    if engine.keeps_layer_copies(PLATFORM):
        copies = state_bytes(state["layers"], mesh_shape, PLATFORM, served)
        items.append(MemoryItem("per-layer weight copies", copies, ("rollout.engine.decode_layer_copies",)))
    y = model.num_layers
    if engine.paged:
        mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
        combined = uses_combined_pages(engine.page_layout, model, PLATFORM, kv_head_shards(model.num_kv_heads, mesh))
        pool = pool_shard_shape(model, engine.pool_pages, engine.page_size, combined, mesh)
        kv = y * (1 if combined else 2) * tiled_elements(pool, PLATFORM) * c
        kv_name = f"KV cache (paged: {engine.pool_pages} pages of {engine.page_size})"
        kv_keys = ("rollout.engine.num_pages", "rollout.engine.page_size", "rollout.engine.max_length")
        segments = 1
    else:
        kv = dense_cache_bytes(model, engine, mesh_shape, c)
        kv_name = f"KV cache (dense: {engine.max_slots} slots x {engine.max_length})"
        kv_keys = ("rollout.engine.max_slots", "rollout.engine.max_length", "rollout.engine.kv_cache")
        segments = len(segment_ends(engine.max_length, engine.prefill_buckets()[0]))
    items.append(MemoryItem(kv_name, kv, kv_keys))
    rows, prefill, decode = engine_transients(engine, model, c, "tpu")
    code = DECODE_CODE_BYTES_PER_LAYER_SEGMENT * y * segments
    if prefill >= decode + code:
        items.append(
            MemoryItem(
                f"prefill temporaries ({rows} x {engine.max_length}; above the decode step's)",
                prefill,
                ("rollout.engine.max_prefill_batch", "rollout.engine.max_length"),
            )
        )
    else:
        items += [
            MemoryItem("decode logits and sampling (above the prefill's needs)", decode, ("rollout.engine.max_slots",)),
            MemoryItem(
                f"compiled code (XLA:TPU, decode step: {y} layers x {segments} cache segments)",
                code,
                ("rollout.engine.min_prefill_bucket", "rollout.engine.max_length"),
            ),
        ]
    return items
