"""How a new weight version reaches a rollout side, the one order both weight paths (in-process and the rollout
server's follower) keep: the generator takes the weights first (interrupting in-flight samples or draining them,
`Generator.update_params`), then admission follows the version (`StalenessManager.set_version`), so no sample is
admitted against a version the generator does not decode with yet."""

from __future__ import annotations

from typing import Any

from areal_jax.inference.generator import Generator
from areal_jax.rollout.staleness import StalenessManager


def apply_version(
    generator: Generator, staleness: StalenessManager, params: Any, version: int, *, interrupt: bool
) -> None:
    """Swap `params` in as `version`; returns once the generator decodes with them and admission follows."""
    generator.update_params(params, version, interrupt=interrupt).result()
    staleness.set_version(version)
