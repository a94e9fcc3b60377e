"""From trajectories to host micro-batches: the next-token shift, group advantages, PPO mini-batches, packing.

The shift. A trajectory of T tokens x_0 .. x_{T-1} (each with loss mask m_t, behaviour log-prob b_t and
version v_t, all describing the sampling of token t) is packed as T - 1 positions p = 0 .. T - 2:

    tokens[p] = x_p    targets[p] = x_{p+1}    positions[p] = p
    loss_mask[p] = m_{p+1}    logp_behav[p] = b_{p+1}    versions[p] = v_{p+1}

so the loss at position p is the log-prob of predicting token p + 1 from x_0 .. x_p. Token 0 (a prompt
token) is never a target and the last token is never an input (it predicts nothing). Every position of a
sequence gets the sequence's advantage (`sequence_advantages` on its reward within its group); only loss
positions read it. Padding has segment id 0, loss mask false and zeros elsewhere.

Legend: N sequences, P PPO mini-batches, M micro-batches per mini-batch, B rows, L row length.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from areal_jax.data.packing import PackingConfig, PackPlan, pack_sequences
from areal_jax.data.trajectory import Trajectory
from areal_jax.objectives.advantages import sequence_advantages
from areal_jax.objectives.config import AdvantageConfig
from areal_jax.objectives.stats import count_loss_tokens
from areal_jax.trainer.config import TrainerConfig

Planner = Callable[[np.ndarray], PackPlan]


class PackedBatch(NamedTuple):
    """One PPO mini-batch as stacked micro-batches; every field is [M, B, L]."""

    tokens: np.ndarray  # int32 input token x_p
    targets: np.ndarray  # int32 next token x_{p+1}
    segment_ids: np.ndarray  # int32, 0 = padding, 1.. per sequence within a row
    positions: np.ndarray  # int32, restart at 0 per sequence
    loss_mask: np.ndarray  # bool, m_{p+1}
    logp_behav: np.ndarray  # float32, b_{p+1}
    versions: np.ndarray  # int32, v_{p+1}; -1 where the token was not sampled by the policy
    advantages: np.ndarray  # float32, the sequence's advantage on each of its positions

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.tokens.shape


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """A training step's input: `ppo_minibatches` packed mini-batches of one shape, and host statistics."""

    minibatches: list[PackedBatch]
    stats: dict[str, float]


def advantages_of(
    rewards_N: np.ndarray, group_ids_N: np.ndarray, config: AdvantageConfig
) -> tuple[np.ndarray, dict[str, float]]:
    """Per-sequence advantages (`sequence_advantages`) for arbitrary integer group ids, and their statistics.

    The sequence count is padded to a power of two (padding marked invalid) so few shapes get compiled.
    """
    n = len(rewards_N)
    padded = 1 << max(n - 1, 0).bit_length()
    _, group_index_N = np.unique(np.asarray(group_ids_N), return_inverse=True)
    reward_P = np.zeros(padded, np.float32)
    reward_P[:n] = rewards_N
    group_P = np.zeros(padded, np.int32)
    group_P[:n] = group_index_N
    valid_P = np.arange(padded) < n
    adv_P, stats = _sequence_advantages(reward_P, group_P, valid_P, config, padded)
    return np.asarray(adv_P)[:n], {key: float(value) for key, value in jax.device_get(stats).items()}


@functools.partial(jax.jit, static_argnums=(3, 4))
def _sequence_advantages(
    reward_N: jax.Array, group_id_N: jax.Array, valid_N: jax.Array, config: AdvantageConfig, num_groups: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    return sequence_advantages(reward_N, group_id_N, config, num_groups, valid_N)


def split_minibatches(lengths_N: np.ndarray, count: int) -> list[np.ndarray]:
    """Sequence indices of `count` mini-batches with balanced token totals (longest first onto the lightest
    mini-batch); each list is in ascending index order."""
    if count > len(lengths_N):
        raise ValueError(f"cannot split {len(lengths_N)} sequences into {count} PPO mini-batches")
    heap = [(0, k) for k in range(count)]
    members: list[list[int]] = [[] for _ in range(count)]
    for i in np.argsort(-np.asarray(lengths_N), kind="stable"):
        total, k = heapq.heappop(heap)
        members[k].append(int(i))
        heapq.heappush(heap, (total + int(lengths_N[i]), k))
    return [np.sort(np.asarray(m, dtype=np.int64)) for m in members]


def token_budget_planner(config: PackingConfig) -> Planner:
    """The default planner: first-fit-decreasing token-budget packing (`pack_sequences`)."""
    return functools.partial(pack_sequences, config=config)


def _stack(arrays: Sequence[np.ndarray], shape: tuple[int, int, int], dtype: type, pad: object) -> np.ndarray:
    """Micro-batch arrays (possibly of different [B, L]) padded with `pad` into one [M, B, L] array."""
    out = np.full(shape, pad, dtype)
    for m, array in enumerate(arrays):
        out[m, : array.shape[0], : array.shape[1]] = array
    return out


def _pack_one(trajectories: Sequence[Trajectory], adv_N: np.ndarray, plan: PackPlan) -> list[list[np.ndarray]]:
    """Per field of `PackedBatch`, the plan's micro-batch arrays (shifted as in the module docstring)."""
    return [
        plan.pack([t.token_ids[:-1] for t in trajectories]),
        plan.pack([t.token_ids[1:] for t in trajectories]),
        plan.segment_ids(),
        plan.positions(),
        plan.pack([np.asarray(t.loss_mask[1:], bool) for t in trajectories], pad_value=False),
        plan.pack([t.behav_logprobs[1:] for t in trajectories]),
        plan.pack([t.versions[1:] for t in trajectories], pad_value=-1),
        plan.broadcast(adv_N),
    ]


_DTYPES = (np.int32, np.int32, np.int32, np.int32, np.bool_, np.float32, np.int32, np.float32)
_PADS = (0, 0, 0, 0, False, 0.0, -1, 0.0)


def build_batch(
    trajectories: Sequence[Trajectory], config: TrainerConfig, planner: Planner | None = None
) -> TrainBatch:
    """Shift, score and pack `trajectories` into `config.ppo_minibatches` mini-batches of one [M, B, L] shape.

    `planner` maps the packed lengths (T - 1 per trajectory) of one mini-batch to a `PackPlan`; the default
    is token-budget packing with `config.packing`. Mini-batches with fewer micro-batches, and micro-batches
    smaller than the largest, are padded (empty micro-batches / rows / columns) to the common shape.
    """
    if not trajectories:
        raise ValueError("got an empty list of trajectories; a training step needs at least one")
    short = [t for t in trajectories if t.length < 2]
    if short:
        t = short[0]
        raise ValueError(
            f"trajectory {t.prompt_id}/{t.sample_index} has {t.length} token(s); training needs at least 2 "
            "(a prompt token and a predicted token)"
        )
    planner = planner or token_budget_planner(config.packing)
    rewards_N = np.asarray([t.reward for t in trajectories], np.float32)
    group_ids_N = np.asarray([t.group_id for t in trajectories], np.int64)
    adv_N, adv_stats = advantages_of(rewards_N, group_ids_N, config.advantage)
    lengths_N = np.asarray([t.length - 1 for t in trajectories], np.int64)

    fields_P = []  # per mini-batch, per field, the micro-batch arrays
    for members in split_minibatches(lengths_N, config.ppo_minibatches):
        plan = planner(lengths_N[members])
        fields_P.append(_pack_one([trajectories[i] for i in members], adv_N[members], plan))
    m = max(len(fields[0]) for fields in fields_P)
    b = max(array.shape[0] for fields in fields_P for array in fields[0])
    length = max(array.shape[1] for fields in fields_P for array in fields[0])
    minibatches = []
    for fields in fields_P:
        columns = zip(fields, _DTYPES, _PADS, strict=True)
        minibatches.append(PackedBatch(*(_stack(arrays, (m, b, length), dtype, pad) for arrays, dtype, pad in columns)))

    num_tokens = int(lengths_N.sum())
    capacity = len(minibatches) * m * b * length
    stats = {
        **adv_stats,
        "batch/sequences": float(len(trajectories)),
        "batch/tokens": float(num_tokens),
        "batch/loss_tokens": float(sum(count_loss_tokens(mb.loss_mask) for mb in minibatches)),
        "batch/capacity": float(capacity),
        "batch/pack_efficiency": num_tokens / capacity,
        "batch/microbatches": float(len(minibatches) * m),
    }
    return TrainBatch(minibatches=minibatches, stats=stats)
