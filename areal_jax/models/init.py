"""Fresh decoder parameters created directly in their shardings (no full copy on one device first)."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.lora import adapter_state
from areal_jax.sharding import state_shardings


def create_decoder(cfg: ModelConfig, seed: int, mesh: Mesh | None = None) -> Decoder:
    """A randomly initialised decoder; under `mesh`, each parameter is born sharded by the logical rules."""
    if mesh is None:
        return new_decoder(cfg, nnx.Rngs(seed))
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: new_decoder(cfg, nnx.Rngs(seed))))
    shardings = state_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.state(new_decoder(cfg, nnx.Rngs(seed))), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def abstract_like(model: Decoder) -> Decoder:
    """`model` with each array replaced by its shape, dtype and sharding: what an engine or a restore target
    needs, holding no memory (the arrays are freed once nothing else refers to them)."""
    graphdef, state = nnx.split(model)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return nnx.merge(graphdef, abstract)


def fresh_adapters(cfg: ModelConfig, shardings: nnx.State) -> nnx.State:
    """The freshly initialised LoRA adapters of `cfg`'s decoder (seed `lora.seed`), placed as the adapter part of
    `shardings` says; the base is never materialised (compiled away)."""
    return jax.jit(
        lambda: adapter_state(nnx.state(Decoder(cfg, nnx.Rngs(0)))), out_shardings=adapter_state(shardings)
    )()
