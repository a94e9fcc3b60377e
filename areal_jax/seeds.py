"""The run's seed streams: every use of randomness gets its own seed, derived from the one run seed
(`seed` in the config) and the use's name, so that no two uses draw the same numbers and changing one
(e.g. more held-out prompts) leaves the others as they were.

| stream | what it seeds |
|---|---|
| `init` | the random init of the policy (when no HF checkpoint is given) |
| `tasks` | the embedded tasks' generated problems (arithmetic, running sums) |
| `heldout` | which records are set aside as the held-out split |
| `shuffle` | the training prompt order (`TaskStream`: each epoch its own permutation) |
| `warm_start` | the supervised warm start's example order |
| `generator` | rollout server i's generator (index i): the sampling keys of requests without a seed |
| `eval` | the held-out evaluation's sampling (during training and `areal-jax eval`) |
| `lora_dropout` | the LoRA dropout masks of the policy update (index: the step's policy version, the mini-batch) |

`stream_seed(seed, name, *index)` is NumPy's `SeedSequence` over (seed, the stream's number, index...):
distinct streams give independent seeds. The numbers of the streams never change (a run's data order is
part of what `--resume` reproduces); a new stream takes a new number.
"""

from __future__ import annotations

import numpy as np

STREAMS = {
    "init": 1,
    "tasks": 2,
    "heldout": 3,
    "shuffle": 4,
    "warm_start": 5,
    "generator": 6,
    "eval": 7,
    "lora_dropout": 8,
}


def stream_seed(seed: int, stream: str, *index: int) -> int:
    """The seed of `stream` (a name of `STREAMS`) for run seed `seed`, in [0, 2**31)."""
    if stream not in STREAMS:
        raise ValueError(f"unknown seed stream {stream!r}; the streams are {sorted(STREAMS)}")
    words = np.random.SeedSequence([seed, STREAMS[stream], *index]).generate_state(1, np.uint32)
    return int(words[0]) >> 1
