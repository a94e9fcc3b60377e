"""The weights an inference engine keeps: each weight the decoder casts to `compute_dtype` where it uses it
(matmul kernels, embeddings, biases) stored in that dtype, the RMSNorm scales (used as they are) unchanged.

Storing them cast changes no result (the decoder would cast them to the same values at every use) and, for
bf16 compute over fp32 master params, halves the engine's weight memory and the bytes a decode step reads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig


def is_norm_scale(path: tuple[Any, ...]) -> bool:
    """Whether the state path (of a leaf of an `nnx.State`) names an RMSNorm scale (`..., <something>norm,
    weight`), which the decoder multiplies in fp32 without casting."""
    names = [str(part.key) for part in path if isinstance(part, jax.tree_util.DictKey)]
    return len(names) >= 2 and names[-1] == "weight" and names[-2].endswith("norm")


def serving_dtype(path: tuple[Any, ...], dtype: jnp.dtype, cfg: ModelConfig) -> jnp.dtype:
    """The dtype the engine stores the leaf at `path` (held in `dtype`) in."""
    compute = jnp.dtype(cfg.compute_jnp_dtype)
    if is_norm_scale(path) or jnp.dtype(dtype).itemsize <= compute.itemsize:
        return jnp.dtype(dtype)
    return compute


def needs_cast(state: nnx.State, cfg: ModelConfig) -> bool:
    """Whether any leaf of `state` is stored in another dtype for serving."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return any(serving_dtype(path, leaf.dtype, cfg) != jnp.dtype(leaf.dtype) for path, leaf in flat)


def cast_for_serving(state: nnx.State, cfg: ModelConfig) -> nnx.State:
    """`state` with every leaf in its serving dtype (jittable)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: x.astype(serving_dtype(path, x.dtype, cfg)), state)
