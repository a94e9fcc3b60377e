"""Engine warm-up (`Engine.warmup`): every program the generator can need compiled before the first request.

Each program is lowered with the arguments its calls pass (abstract where they are host data or another
program's output) and compiled, several at once, running nothing; `jit`'s in-memory cache then serves the real
calls. An engine that mirrors its calls to other processes warms up by running them instead
(`serving_engine.warm_up`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.inference.engine_config import EngineConfig
from areal_jax.inference.engine_weights import VersionedParams
from areal_jax.inference.paged import pages_for
from areal_jax.progress import Progress

logger = logging.getLogger(__name__)

# Programs `Engine.warmup` compiles at once: each XLA compile holds its own memory, so not one per core on a
# big host.
WARMUP_THREADS = 4


class EnginePrograms(Protocol):
    """What warm-up reads of an `Engine` (described here because the engine imports this module): its
    capacity and buckets, a fresh decode state and its jitted programs."""

    config: EngineConfig
    buckets: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    _no_page_updates: np.ndarray | None

    # read-only, so the engine's `jax.jit` results (a subclass of `Wrapped`) fit
    @property
    def _prefill(self) -> jax.stages.Wrapped: ...

    @property
    def _prefill_batch(self) -> jax.stages.Wrapped: ...

    @property
    def _insert(self) -> jax.stages.Wrapped: ...

    @property
    def _insert_batch(self) -> jax.stages.Wrapped: ...

    @property
    def _generate(self) -> jax.stages.Wrapped: ...

    @property
    def _generate_paged(self) -> jax.stages.Wrapped: ...

    def init_decode_state(self) -> Any: ...


def _specs(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled) -> object:
    """The outputs of a compiled program as abstract arrays with their shardings: what a call receiving them
    is lowered with."""
    return jax.tree.map(
        lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
        lowered.out_info,
        compiled.output_shardings,
    )


def _host(shape: tuple[int, ...], dtype: type) -> jax.ShapeDtypeStruct:
    """A host (numpy) argument of an engine call, as its program sees it."""
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


def compile_programs(engine: EnginePrograms, params: VersionedParams, single_prompt_api: bool = False) -> None:
    """`Engine.warmup`: every program lowered with the arguments its calls pass (abstract where they are host
    data or another program's output) and compiled, in a thread pool; nothing runs."""
    decode_state = engine.init_decode_state()
    state, layers = params.state, params.layers
    i32, u32, f32 = np.int32, np.uint32, np.float32

    paged = engine.config.paged

    def batched(bucket: int, rows: int) -> None:
        lowered = engine._prefill_batch.lower(state, _host((rows, bucket), i32), _host((rows,), i32))
        compiled = lowered.compile()
        host = [
            _host((rows,), i32),
            _host((rows, 2), u32),
            _host((rows,), f32),
            _host((rows,), i32),
            _host((rows,), f32),
        ]
        if paged:
            host.append(_host((rows, engine.config.insert_pages(bucket)), i32))
        engine._insert_batch.lower(_specs(lowered, compiled), decode_state, *host).compile()

    def single(bucket: int) -> None:
        lowered = engine._prefill.lower(state, _host((bucket,), i32), _host((), i32))
        prefix = _specs(lowered, lowered.compile())
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # key_data of a device key
        args = (_host((), i32), key, _host((), f32), _host((), i32), _host((), f32))
        engine._insert.lower(prefix, decode_state, *args).compile()

    def generate(bucket: int) -> None:
        if paged:
            assert engine._no_page_updates is not None  # a paged engine's
            updates = _host(engine._no_page_updates.shape, i32)
            pages = pages_for(bucket, engine.config.page_size)
            engine._generate_paged.lower(state, layers, decode_state, updates, pages).compile()
        else:
            attend_length = None if bucket == engine.config.max_length else bucket
            engine._generate.lower(state, layers, decode_state, attend_length).compile()

    tasks: list[tuple[str, Callable[..., None], tuple[int, ...]]]
    tasks = [(f"decode step attending {b} positions", generate, (b,)) for b in engine.buckets]
    tasks += [
        (f"prefill and insert of {r} prompts, length {b}", batched, (b, r))
        for b in engine.buckets
        for r in engine.prefill_rows
    ]
    single_prompt_api = single_prompt_api and not paged  # the one-prompt insert is the dense cache's
    if single_prompt_api:
        tasks += [(f"prefill and insert of one prompt, length {b}", single, (b,)) for b in engine.buckets]
    programs = len(engine.buckets) * (1 + 2 * len(engine.prefill_rows) + (2 if single_prompt_api else 0))
    progress = Progress(f"engine warm-up: compiling {programs} programs, tasks", len(tasks), log=logger)
    threads = max(1, min(WARMUP_THREADS, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="areal-warmup") as pool:
        futures = {pool.submit(fn, *args): what for what, fn, args in tasks}
        for future in concurrent.futures.as_completed(futures):
            future.result()
            progress.advance(futures[future])
    progress.done(f"{len(engine.buckets)} length buckets x {len(engine.prefill_rows)} row buckets, {threads} at once")
