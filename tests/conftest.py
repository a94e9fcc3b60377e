"""Test-wide JAX settings: 8 virtual CPU devices, XLA:CPU kernels at LLVM level 0 (tests/xla_flags.py),
strict rank promotion, and a compilation cache for this session (many tests build the same small programs
on fresh engines; a cache hit still counts as a backend compilation event, so the compile-count tests see
every program)."""

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.gcs_emulator import GcsEmulator
from tests.xla_flags import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(8))  # subprocesses inherit it unless a test sets its own
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_numpy_rank_promotion", "raise")

from areal_jax.compilation_cache import enable_compilation_cache  # noqa: E402 (after the XLA flags)

# One cache for the whole session: pytest-xdist's workers inherit the environment of the process that
# loaded this file first, so both workers (and every subprocess) read and write the same directory; the
# process that created it removes it at exit.
_SESSION_CACHE = os.environ.get("AREAL_JAX_TEST_XLA_CACHE", "")
if not _SESSION_CACHE:
    _SESSION_CACHE = os.environ["AREAL_JAX_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="areal-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _SESSION_CACHE, True)
enable_compilation_cache(_SESSION_CACHE)
# The subprocesses the tests start (trainer workers, killed and resumed runs, role processes) share it through
# JAX's environment flags, unless their config names a cache of its own: a program compiled by one of them is
# loaded by the next (the exact-resume test runs the same trainer three times).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _SESSION_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations while active (`with CompileCounter() as compiles: ...; compiles.count`)."""

    def __init__(self) -> None:
        self.count = 0

    def _listener(self, event: str, seconds: float, **_: object) -> None:
        if event == COMPILE_EVENT:
            self.count += 1

    def __enter__(self) -> "CompileCounter":
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)


# The files that run the system in subprocesses for a minute or more, heaviest first. They are collected
# first, so the two xdist workers (`--dist loadfile --no-loadscope-reorder` hands out files in collection
# order; without the flag xdist reorders files by their number of tests) start on them and finish on short
# files instead of one worker running a long file alone at the end.
_LONG_FIRST = (  # by each file's total time in a full run (2026-12-04, --junitxml): 113 s ... ~25 s
    "test_memory_plan.py",
    "test_gcs_run.py",
    "test_readme_commands.py",
    "test_moe.py",
    "test_moe_replay.py",
    "test_recipes.py",
    "test_distributed_trainer.py",
    "test_resume_prompts.py",
    "test_paged_kv.py",
    "test_engine.py",
    "test_mirrored_engine.py",
    "test_hybrid_run.py",
    "test_outside_agent.py",
    "test_async_rl.py",
    "test_exact_resume.py",
    "test_failures.py",
)


# The files whose tests run the whole system (engine, generator, log, pipeline, trainer together, mostly as
# real processes) or take tens of seconds each: marked `system`, which `scripts/run_tests.sh --fast` leaves out.
_SYSTEM = frozenset(
    {
        "test_async_rl.py",
        "test_recipes.py",
        "test_readme_commands.py",
        "test_memory_plan.py",
        "test_distributed_trainer.py",
        "test_gcs_run.py",
        "test_resume_prompts.py",
        "test_exact_resume.py",
        "test_failures.py",
        "test_engine.py",
        "test_mirrored_engine.py",
        "test_lora_eval.py",
        "test_evaluation.py",
        "test_tiny_hf_run.py",
        "test_agent_workflow.py",
        "test_outside_agent.py",
        "test_run_dir.py",
        "test_direct_weights.py",
        "test_weights.py",
        "test_train_checkpoint.py",
        "test_rollout_log.py",
        "test_checkpoint_dtypes.py",
        "test_profiling.py",
        "test_lora_run.py",
        "test_moe_replay.py",
        "test_hybrid_run.py",
    }
)
# Unit files whose compiles take tens of seconds (a full run's --durations): marked `slow`, also left out of
# `--fast`, which keeps one quick check of each piece (the golden step, the engine, the objectives, packing).
_SLOW = frozenset(
    {
        "test_paged_kv.py",
        "test_lora_resume.py",
        "test_lora_dropout.py",
        "test_reference_kl.py",
        "test_prox_logp.py",
        "test_model_paths.py",
        "test_serving_weights.py",
        "test_tpu_compile.py",
        "test_moe.py",
        "test_moe_shared.py",
        "test_hybrid_train.py",
        "test_hybrid_layers.py",
        "test_gated_delta.py",
        "test_hybrid_engine.py",
        "test_hybrid_paged.py",
        "test_hybrid_moe.py",
        "test_row_attention.py",
        "test_moe_options.py",
    }
)


def pytest_collection_modifyitems(items: list) -> None:
    def rank(item) -> int:
        name = item.path.name
        return _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
    for item in items:
        if item.path.name in _SYSTEM:
            item.add_marker(pytest.mark.system)
        if item.path.name in _SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def gcs() -> Iterator[GcsEmulator]:
    """A local GCS server (one per test worker) that gcsfs and TensorStore in this process and its children
    talk to: gs://{BUCKET}/... works as on GCS."""
    emulator = GcsEmulator()
    saved = {key: os.environ.get(key) for key in emulator.env}
    emulator.apply()
    try:
        yield emulator
    finally:
        emulator.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
