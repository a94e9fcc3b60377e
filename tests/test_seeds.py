"""The run's named seed streams (`areal_jax/seeds.py`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from areal_jax.seeds import STREAMS, stream_seed


def test_each_stream_has_its_own_seed_and_it_is_stable() -> None:
    seeds = {name: stream_seed(0, name) for name in STREAMS}
    assert len(set(seeds.values())) == len(STREAMS)  # no two uses share a seed
    assert seeds == {name: stream_seed(0, name) for name in STREAMS}  # a function of (seed, stream) only
    assert all(0 <= s < 2**31 for s in seeds.values())
    assert stream_seed(1, "shuffle") != stream_seed(0, "shuffle")
    # pinned: a run's data order is part of what --resume reproduces, so the derivation must never change
    words = np.random.SeedSequence([0, STREAMS["shuffle"]]).generate_state(1, np.uint32)
    assert seeds["shuffle"] == int(words[0]) >> 1


def test_indexed_streams_differ_per_index() -> None:
    generators = [stream_seed(7, "generator", server) for server in range(8)]
    assert len(set(generators)) == 8  # rollout servers do not share sampling keys
    assert all(a != b for a, b in itertools.combinations([*generators, stream_seed(7, "eval")], 2))
    assert generators[0] == stream_seed(7, "generator")  # index 0 is the stream itself (the one-process run)


def test_an_unknown_stream_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown seed stream 'shufle'"):
        stream_seed(0, "shufle")
