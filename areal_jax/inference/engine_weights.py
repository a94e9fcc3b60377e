"""The engine's own copy of each weight version (`Engine.load_params`).

A version is copied once onto the engine's shardings, each weight in its serving dtype
(`models.serving_weights`), into arrays that share no buffer with the ones it was given: the trainer may
donate its params to its next step as soon as the load returns, and nothing has to ask the engine where
they go beforehand. With `model.lora`, the first full version is also kept as the base every adapter-only
version is served over.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.lora import adapter_free, adapter_state, is_adapter_only, layer_slices
from areal_jax.models.serving_weights import cast_for_serving, needs_cast


@dataclasses.dataclass(frozen=True)
class VersionedParams:
    """Model weights and the policy version that produced them. `layers` (with
    `EngineConfig.decode_layer_copies`) holds each layer's weights again as separate arrays, which the decode
    step reads in place; None: the decode step slices them out of the stacked ones."""

    state: nnx.State
    version: int
    layers: tuple[nnx.State, ...] | None = None


def _devices(tree: Any) -> set[jax.Device]:
    """The devices holding `tree`'s arrays (none for host arrays)."""
    return {d for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}


class EngineWeights:
    """Loads weight versions for one engine (see the module docstring)."""

    def __init__(
        self, graphdef: nnx.GraphDef, state: nnx.State, cfg: ModelConfig, shardings: nnx.State, layer_copies: bool
    ):
        self.cfg = cfg
        self.shardings = {False: shardings, True: adapter_state(shardings)}  # by "adapters only"
        self.layer_copies = layer_copies
        self._device_set = {d for sharding in jax.tree.leaves(shardings) for d in sharding.device_set}
        self._casts = needs_cast(state, cfg)
        self._cast = jax.jit(partial(cast_for_serving, cfg=cfg))
        self._copy_here = jax.jit(self._serving_copy)
        self._copy_onto = {only: jax.jit(self._serving_copy, out_shardings=s) for only, s in self.shardings.items()}
        self._layer_states = jax.jit(lambda state: nnx.merge(graphdef, state).layer_states())
        self._adapter_layers = jax.jit(partial(layer_slices, num_layers=cfg.num_layers))
        # LoRA: the base (and its layer copies) of the last full load; adapter-only versions are served over it
        self._base: nnx.State | None = None
        self._base_layers: tuple[nnx.State, ...] | None = None

    def load(self, state: nnx.State, version: int) -> VersionedParams:
        """`Engine.load_params`."""
        if self.cfg.lora is not None and is_adapter_only(state):
            return self._load_adapters(state, version)
        state = self._own_copy(state, adapters_only=False)
        layers = self._layer_states(state) if self.layer_copies else None
        if self.cfg.lora is not None:  # the base every adapter-only version is served over
            self._base = adapter_free(state)
            self._base_layers = None if layers is None else tuple(adapter_free(layer) for layer in layers)
        return VersionedParams(state=state, version=version, layers=layers)

    def _load_adapters(self, adapters: nnx.State, version: int) -> VersionedParams:
        if self._base is None:
            raise ValueError(
                f"version {version} carries only LoRA adapters but the engine has no base yet: load the full "
                "policy (base and adapters) once first"
            )
        adapters = self._own_copy(adapters, adapters_only=True)
        state = nnx.merge_state(self._base, adapters)
        layers = None
        if self._base_layers is not None:
            sliced = self._adapter_layers(adapters)
            layers = tuple(nnx.merge_state(b, a) for b, a in zip(self._base_layers, sliced, strict=True))
        return VersionedParams(state=state, version=version, layers=layers)

    def _serving_copy(self, state: nnx.State) -> nnx.State:
        """Every leaf in its serving dtype, in a new buffer (jitted: a cast writes one, an unchanged leaf is
        copied)."""
        if self._casts:
            state = cast_for_serving(state, self.cfg)
        return jax.tree.map(jnp.copy, state)

    def _own_copy(self, state: nnx.State, adapters_only: bool) -> nnx.State:
        """`state` on the engine's shardings in its serving dtypes, in buffers of its own, written once. On the
        engine's devices one program casts and copies straight onto the shardings; from other devices the
        transfer is the copy (cast first: it then moves the smaller arrays). Where the two device sets only
        overlap, a transfer may hand back the shared devices' buffers (`sharding.copy_to`), so the arrays are
        copied where they are first."""
        source = _devices(state)
        if source == self._device_set:
            return self._copy_onto[adapters_only](state)
        if source & self._device_set:
            return jax.device_put(self._copy_here(state), self.shardings[adapters_only])
        return jax.device_put(self._cast(state) if self._casts else state, self.shardings[adapters_only])
