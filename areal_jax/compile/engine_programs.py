"""The engine's programs at a run's largest buckets, with abstract sharded arguments (no weights, nothing run).

Batched prefill of the most rows at the longest bucket, the insert of its prefixes into the decode state and
the decode step attending the whole cache (dense or paged, as `rollout.engine.kv_cache` says), as `Engine`
builds them for the rollout mesh (`every_bucket`: each length and row bucket, each decode bucket). Each is
lowered under `jax.set_mesh` of the mesh (the engine's own `on_mesh` wrapping), so the kernels chosen are those
of its devices' platform (a TPU topology's from a CPU host). A hybrid (Qwen3.5) policy's decode state holds,
beside its full-attention layers' KV cache (dense or paged), a recurrent state and a convolution window per slot
and linear layer (`HybridCache`, `PagedHybridCache`): a resident line of their own, read whole by every decode
step whatever positions it attends.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.compile.programs import (
    CompiledProgram,
    ProgramSpec,
    compile_program,
    compile_with_outputs,
    laid_out_bytes,
    per_chip_bytes,
)
from areal_jax.config import ExperimentConfig
from areal_jax.inference.engine import Engine
from areal_jax.inference.paged import pages_for
from areal_jax.inference.paged_hybrid import PagedHybridCache
from areal_jax.models.config import ModelConfig
from areal_jax.models.hybrid import new_decoder
from areal_jax.models.hybrid_serving import HybridCache


def _sharded(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _host(shape: tuple[int, ...], dtype: type) -> jax.ShapeDtypeStruct:
    """A host (numpy) argument of an engine call, as its program sees it."""
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


class EngineOnMesh:
    """An `Engine` of the run's policy shapes on `mesh` with abstract weights and decode state."""

    def __init__(self, cfg: ExperimentConfig, model: ModelConfig, mesh: Mesh):
        self.mesh = mesh
        abstract_model = nnx.eval_shape(lambda: new_decoder(model, nnx.Rngs(0)))
        self.engine = engine = Engine(abstract_model, cfg.rollout.engine, mesh)
        _, state = nnx.split(abstract_model)
        served = jax.eval_shape(engine._weights._serving_copy, state)
        self.params = _sharded(served, engine.param_shardings)
        self.layers = None
        with jax.set_mesh(mesh):
            if engine.layer_copies:
                self.layers = compile_with_outputs(
                    self._spec("layer copies", engine._weights._layer_states, (self.params,))
                )[1]
            self.decode_state = engine._init_decode_state.eval_shape()  # with the jit's out_shardings

    def resident_lines(self, decode: CompiledProgram | None = None) -> tuple[tuple[str, int], ...]:
        """What a chip holds between calls by the compiler's shardings: weights, layer copies, decode state.
        With `decode` (a compiled decode step, whose arguments they all are), in the layouts it chose (TPU pads
        each shard to its tiles: a cache of head dim 64 takes twice its bytes); else the arrays' own bytes."""

        def size(arg: int, tree: Any, part: Any = None) -> int:
            if decode is None:
                return per_chip_bytes(tree)
            formats = decode.formats[arg] if part is None else part(decode.formats[arg])
            return laid_out_bytes(tree, formats)

        lines = [("engine weights", size(0, self.params))]
        if self.layers is not None:
            lines.append(("per-layer weight copies", size(1, self.layers)))
        cache = size(2, self.decode_state.cache, lambda formats: formats.cache)
        hybrid = self.decode_state.cache
        if isinstance(hybrid, HybridCache | PagedHybridCache):
            states = size(2, (hybrid.state, hybrid.window), lambda formats: (formats.cache.state, formats.cache.window))
            lines += [("KV cache", cache - states), ("recurrent states", states)]
        else:
            lines.append(("KV cache", cache))
        lines.append(("decode state besides the cache", size(2, self.decode_state) - cache))
        return tuple(lines)

    def _cache_read(self, bucket: int) -> int:
        """Bytes of the decode state's cache a decode step attending `bucket` positions reads per chip: that share
        of the KV cache, and every recurrent state and convolution window whole."""
        cache = self.decode_state.cache
        length = self.engine.config.max_length
        if not isinstance(cache, HybridCache | PagedHybridCache):
            return per_chip_bytes(cache) * bucket // length
        return per_chip_bytes(cache.kv) * bucket // length + per_chip_bytes((cache.state, cache.window))

    def compile(self, every_bucket: bool = False) -> list[CompiledProgram]:
        """Prefill and insert at the most rows and the longest bucket, the decode step attending the whole cache
        (`every_bucket`: at each row and length bucket, and each decode bucket), compiled in that order."""
        engine, config = self.engine, self.engine.config
        model = engine.model_config
        buckets = engine.buckets if every_bucket else engine.buckets[-1:]
        row_buckets = engine.prefill_rows if every_bucket else engine.prefill_rows[-1:]
        # HBM traffic, a lower bound: every chip reads its weights once a call (and a decode step its cache)
        weight_bytes = per_chip_bytes(self.params)
        compiled = []
        for bucket in buckets:
            for rows in row_buckets:
                tokens = (_host((rows, bucket), np.int32), _host((rows,), np.int32))
                flops = model.matmul_flops_per_token(bucket) * rows * bucket
                prefill = self._spec(
                    f"prefill ({rows} x {bucket})",
                    engine._prefill_batch,
                    (self.params, *tokens),
                    (0,),
                    rows * bucket,
                    flops,
                    weight_bytes,
                )
                program, prefixes = compile_with_outputs(prefill)
                compiled.append(program)
                host = [
                    _host((rows,), np.int32),
                    _host((rows, 2), np.uint32),
                    _host((rows,), np.float32),
                    _host((rows,), np.int32),
                    _host((rows,), np.float32),
                ]
                if config.paged:
                    host.append(_host((rows, config.insert_pages(bucket)), np.int32))
                insert = self._spec(
                    f"insert ({rows} x {bucket})",
                    engine._insert_batch,
                    (prefixes, self.decode_state, *host),
                    (1,),
                    hbm=per_chip_bytes(prefixes),
                )
                compiled.append(compile_program(insert))
        for bucket in buckets:
            args: tuple[Any, ...]
            if config.paged:
                assert engine._no_page_updates is not None  # a paged engine's
                updates = _host(engine._no_page_updates.shape, np.int32)
                pages = pages_for(bucket, config.page_size)
                jitted, args = engine._generate_paged, (self.params, self.layers, self.decode_state, updates, pages)
                static = (4,)
            else:
                attend = None if bucket == config.max_length else bucket
                jitted, args = engine._generate, (self.params, self.layers, self.decode_state, attend)
                static = (3,)
            cache = self._cache_read(bucket)
            slots = config.max_slots
            decode = self._spec(
                f"decode ({slots} slots, {bucket} positions)",
                jitted,
                args,
                (0, 1, 2),
                slots,
                model.matmul_flops_per_token(bucket) * slots,
                weight_bytes + cache,
                static,
            )
            compiled.append(compile_program(decode))
        return compiled

    def _spec(
        self,
        name: str,
        jitted: Any,
        args: tuple[Any, ...],
        resident: tuple[int, ...] = (),
        tokens: int = 0,
        flops: float = 0.0,
        hbm: float = 0.0,
        static: tuple[int, ...] = (),
    ) -> ProgramSpec:
        # the engine's programs lower under its mesh themselves (`activation_sharding.on_mesh`)
        return ProgramSpec(name, jitted, args, resident, tokens, flops, hbm, static)
