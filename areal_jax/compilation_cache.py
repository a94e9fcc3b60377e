"""The persistent XLA compilation cache: compiled programs saved on disk and reused by later runs.

A run compiles dozens of programs (every prefill/insert/decode bucket, the train step per shape); on a
TPU pod a large model's programs take minutes. With a cache directory, a rerun or a resumed run
deserialises them instead. Every program is cached, however fast it compiled: on CPU the many small
programs add up. The key covers the program, the devices and the JAX/XLA versions, so a changed model or
mesh simply misses.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from areal_jax import storage

logger = logging.getLogger(__name__)


DEFAULT_DIR = "~/.cache/areal-jax/xla_cache"


def enable_compilation_cache(directory: str | os.PathLike[str] | None) -> None:
    """Use `directory` (local path or gs://) as the persistent compilation cache; "auto": the environment's
    JAX_COMPILATION_CACHE_DIR when set (JAX reads it itself), else DEFAULT_DIR; None sets none (JAX itself
    still reads JAX_COMPILATION_CACHE_DIR when it is set)."""
    if directory is None:
        return
    if directory == "auto":
        if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
            logger.info(
                "persistent compilation cache: %s ($JAX_COMPILATION_CACHE_DIR)", os.environ["JAX_COMPILATION_CACHE_DIR"]
            )
            return
        directory = DEFAULT_DIR
    location = os.fspath(directory)
    if not storage.is_remote(location):
        location = str(Path(location).expanduser().absolute())
    jax.config.update("jax_compilation_cache_dir", location)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("persistent compilation cache: %s", location)
