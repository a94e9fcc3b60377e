"""The persistent compilation cache: a second process loads what the first compiled."""

import json
import subprocess
import sys

CHILD = """
import collections, json, sys
import jax, jax.numpy as jnp
from areal_jax.compilation_cache import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event]))

@jax.jit
def program(x):
    return jnp.tanh(x @ x.T).sum(axis=0)

program(jnp.ones((8, 4))).block_until_ready()
print(json.dumps({k.rsplit("/", 1)[-1]: v for k, v in events.items() if "compilation_cache" in k}))
"""


def _run(cache_dir) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(cache_dir)], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_hits_the_cache(tmp_path):
    cache = tmp_path / "xla_cache"
    first = _run(cache)
    assert first.get("cache_misses", 0) >= 1 and first.get("cache_hits", 0) == 0
    assert any(cache.iterdir())
    second = _run(cache)
    assert second.get("cache_hits", 0) >= 1 and second.get("cache_misses", 0) == 0
