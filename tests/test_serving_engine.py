"""The one engine protocol (`inference/serving_engine.py`): `Engine` and the multi-process server's
`MirroredEngine` both keep it, member by member with the same parameters, so the generator and the rollout
side may be handed either."""

from __future__ import annotations

import inspect

import pytest

from areal_jax.inference.engine import Engine
from areal_jax.inference.serving_engine import ServingEngine
from areal_jax.system.mirrored_engine import MirroredEngine

MEMBERS = sorted(
    name for name in vars(ServingEngine) if not name.startswith("_") and name not in {"__protocol_attrs__"}
)


def test_the_protocol_names_what_the_generator_and_the_rollout_side_call() -> None:
    assert {"load_params", "prefill_batch", "insert_batch", "generate", "warmup", "config"} <= set(MEMBERS)


@pytest.mark.parametrize("engine", [Engine, MirroredEngine])
@pytest.mark.parametrize("member", MEMBERS)
def test_each_engine_keeps_every_member_with_its_parameters(engine: type, member: str) -> None:
    want = inspect.getattr_static(ServingEngine, member)
    have = inspect.getattr_static(engine, member, None)
    if isinstance(want, property):  # a property, or an attribute its constructor sets
        assert isinstance(have, property) or f"self.{member} = " in inspect.getsource(engine.__init__), member
        return
    assert callable(have), f"{engine.__name__} has no method {member}"
    wanted = list(inspect.signature(want).parameters)
    got = list(inspect.signature(have).parameters)
    assert got[: len(wanted)] == wanted, f"{engine.__name__}.{member}{got} does not take {wanted}"
    extra = [inspect.signature(have).parameters[name] for name in got[len(wanted) :]]
    assert all(p.default is not inspect.Parameter.empty for p in extra), "extra parameters must be optional"
