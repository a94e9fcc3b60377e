"""Rotary position embeddings (HF 'rotate half' layout) with optional Llama-3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import RopeScalingConfig


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig | None) -> np.ndarray:
    """Per-pair inverse frequencies [H/2] in float32, Llama-3 scaled if `scaling` is given."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions_BxT: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) tables [B, T, H] in float32 for the given positions."""
    freqs_BxTxF = positions_BxT.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    angles_BxTxH = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)
    return jnp.sin(angles_BxTxH), jnp.cos(angles_BxTxH)


def apply_rope(x_BxTxNxH: jax.Array, sin_BxTxH: jax.Array, cos_BxTxH: jax.Array) -> jax.Array:
    """Rotate heads by position; computed in fp32, returned in the input dtype."""
    x = x_BxTxNxH.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BxTxH[:, :, None, :] + rotated * sin_BxTxH[:, :, None, :]
    return out.astype(x_BxTxNxH.dtype)
