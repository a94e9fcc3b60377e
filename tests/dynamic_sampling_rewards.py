"""A user reward function for the dynamic-sampling tests (`reward.kind=tests.dynamic_sampling_rewards:
half_uniform`): half the prompts can never earn a reward, so their groups are uniform and dropped."""

from __future__ import annotations

import collections
import threading
import zlib
from typing import Any

_calls: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()  # reward functions run on several reward threads


def half_uniform(completion: str, task: Any) -> tuple[float, dict[str, float]]:
    """Prompts whose id ends in an even number ("arith-<n>"; other ids: an even hash): always 0; the others:
    0, 1, 0, 1, ... over the calls for the prompt, so each group of two samples earns different rewards (a
    tiny random policy often samples the same completion twice, so the reward cannot depend on the text)."""
    if never_rewarded(task.id):
        return 0.0, {}
    with _lock:
        _calls[task.id] += 1
        return float(_calls[task.id] % 2), {}


def never_rewarded(prompt_id: str) -> bool:
    suffix = prompt_id.rsplit("-", 1)[-1]
    return (int(suffix) if suffix.isdigit() else zlib.crc32(prompt_id.encode())) % 2 == 0
