"""The rollout side's part of the proxy's workflows (`agent`, `external`): the proxy served on the side's
generator, episodes that clients open themselves counted against the side's staleness bound, on port
`agent.port + server`."""

from __future__ import annotations

import contextlib
from typing import Any

from areal_jax.agents.admission import StalenessAdmission
from areal_jax.inference.generator import Generator
from areal_jax.rollout.staleness import StalenessManager
from areal_jax.rollout.workflow import RolloutWorkflow


def workflow_serving(
    workflow: RolloutWorkflow, generator: Generator, staleness: StalenessManager, server: int
) -> contextlib.AbstractContextManager[Any]:
    """What the workflow serves while the rollout side runs: the agent proxy for kinds 'agent' and 'external'
    (its task board), else nothing."""
    if workflow.config.kind not in ("agent", "external"):
        return contextlib.nullcontext()
    from areal_jax.agents.episodes import ProxyWorkflow  # only here: the proxy's imports

    assert isinstance(workflow, ProxyWorkflow)  # what kinds 'agent' and 'external' build
    agent = workflow.config.agent
    return workflow.serving(generator, StalenessAdmission(staleness), agent.port + server if agent.port else 0)
