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
from typing import Generic, NamedTuple, TypeVar

import jax
import numpy as np

from areal_jax.data.packing import PackPlan, plan_minibatches
from areal_jax.data.trajectory import Trajectory
from areal_jax.objectives.advantages import overlong_penalty, sequence_advantages
from areal_jax.objectives.config import AdvantageConfig
from areal_jax.objectives.stats import count_loss_tokens
from areal_jax.trainer.config import TrainerConfig

Planner = Callable[[np.ndarray], PackPlan]


# NumPy arrays on the host, JAX arrays once on the mesh (`TrainStep.put_batch`) and inside the jitted step
ArrayT = TypeVar("ArrayT", np.ndarray, jax.Array)


class PackedBatch(NamedTuple, Generic[ArrayT]):
    """One PPO mini-batch as stacked micro-batches; every field is [M, B, L]."""

    tokens: ArrayT  # int32 input token x_p
    targets: ArrayT  # int32 next token x_{p+1}
    segment_ids: ArrayT  # int32, 0 = padding, 1.. per sequence within a row
    positions: ArrayT  # int32, restart at 0 per sequence
    loss_mask: ArrayT  # bool, m_{p+1}
    logp_behav: ArrayT  # float32, b_{p+1}
    versions: ArrayT  # int32, v_{p+1}; -1 where the token was not sampled by the policy
    advantages: ArrayT  # float32, the sequence's advantage on each of its positions
    # [M, B, L, Ym, K] uint8/uint16: the rollout's experts for input x_p (`Trajectory.routing`), when every
    # trajectory carries them (a mixture of experts); None otherwise
    routing: ArrayT | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        m, b, length = self.tokens.shape
        return m, b, length


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """A training step's input: `ppo_minibatches` packed mini-batches of one shape, and host statistics."""

    minibatches: list[PackedBatch[np.ndarray]]
    stats: dict[str, float]


def _host_device() -> jax.Device:
    """The host CPU device when the CPU backend is up (it is unless JAX_PLATFORMS leaves it out), else the default."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def advantages_of(
    rewards_N: np.ndarray, group_ids_N: np.ndarray, config: AdvantageConfig, shares_N: np.ndarray | None = None
) -> tuple[np.ndarray, dict[str, float]]:
    """Per-sequence advantages (`sequence_advantages`) for arbitrary integer group ids, and their statistics;
    `shares_N`: each sequence's share of its episode (1 / `Trajectory.num_sequences`), default 1.

    Computed on the host CPU device (no accelerator round trip for a few hundred floats). The sequence count
    is padded to a power of two (padding marked invalid) so few shapes get compiled.
    """
    n = len(rewards_N)
    padded = 1 << max(n - 1, 0).bit_length()
    _, group_index_N = np.unique(np.asarray(group_ids_N), return_inverse=True)
    reward_P = np.zeros(padded, np.float32)
    reward_P[:n] = rewards_N
    group_P = np.zeros(padded, np.int32)
    group_P[:n] = group_index_N
    valid_P = np.arange(padded) < n
    share_P = np.ones(padded, np.float32)
    if shares_N is not None:
        share_P[:n] = shares_N
    with jax.default_device(_host_device()):
        adv_P, stats = jax.device_get(_sequence_advantages(reward_P, group_P, valid_P, share_P, config, padded))
    return np.asarray(adv_P)[:n], {key: float(value) for key, value in stats.items()}


@functools.partial(jax.jit, static_argnums=(4, 5))
def _sequence_advantages(
    reward_N: jax.Array,
    group_id_N: jax.Array,
    valid_N: jax.Array,
    share_N: jax.Array,
    config: AdvantageConfig,
    num_groups: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    return sequence_advantages(reward_N, group_id_N, config, num_groups, valid_N, share_N)


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


PACKED_FIELDS = (  # PackedBatch field: dtype, padding value (the host packer's and the compiled programs' rule)
    (np.int32, 0),  # tokens
    (np.int32, 0),  # targets
    (np.int32, 0),  # segment_ids
    (np.int32, 0),  # positions
    (np.bool_, False),  # loss_mask
    (np.float32, 0.0),  # logp_behav
    (np.int32, -1),  # versions
    (np.float32, 0.0),  # advantages
)


def _write_minibatch(
    trajectories: Sequence[Trajectory], adv_N: np.ndarray, plan: PackPlan, shape: tuple[int, int, int]
) -> PackedBatch[np.ndarray]:
    """The plan's placement of `trajectories` written straight into `[M, B, L]` arrays of `shape` (one copy of
    each token's data, shifted as in the module docstring); the rest is padding."""
    out = [np.full(shape, pad, dtype) for dtype, pad in PACKED_FIELDS]
    tokens, targets, segment_ids, positions, loss_mask, logp_behav, versions, advantages = out
    ranks = np.arange(int(plan.lengths_N.max()), dtype=np.int32)
    for k, t in enumerate(trajectories):
        n, start = int(plan.lengths_N[k]), int(plan.offset_N[k])
        at = (int(plan.microbatch_N[k]), int(plan.row_N[k]), slice(start, start + n))
        tokens[at] = t.token_ids[:-1]
        targets[at] = t.token_ids[1:]
        segment_ids[at] = plan.segment_N[k]
        positions[at] = ranks[:n]
        loss_mask[at] = t.loss_mask[1:]
        logp_behav[at] = t.behav_logprobs[1:]
        versions[at] = t.versions[1:]
        advantages[at] = adv_N[k]
    return PackedBatch(
        tokens,
        targets,
        segment_ids,
        positions,
        loss_mask,
        logp_behav,
        versions,
        advantages,
        _write_routing(trajectories, plan, shape),
    )


def _write_routing(
    trajectories: Sequence[Trajectory], plan: PackPlan, shape: tuple[int, int, int]
) -> np.ndarray | None:
    """The routing of the inputs x_0 .. x_{T-2} placed like the tokens, [M, B, L, Ym, K] (expert 0 on padding, and
    on a sequence without routing or loss tokens: an aborted sample never prefilled); None unless every trajectory
    with loss tokens has routing."""
    routed = [t.routing for t in trajectories if t.routing is not None]
    if not routed or any(t.routing is None and t.num_loss_tokens for t in trajectories):
        return None
    out = np.zeros((*shape, *routed[0].shape[1:]), routed[0].dtype)
    for k, t in enumerate(trajectories):
        if t.routing is not None:
            n, start = int(plan.lengths_N[k]), int(plan.offset_N[k])
            out[int(plan.microbatch_N[k]), int(plan.row_N[k]), start : start + n] = t.routing[:-1]
    return out


def build_batch(
    trajectories: Sequence[Trajectory],
    config: TrainerConfig,
    planner: Planner | None = None,
    max_new_tokens: int | None = None,
    routing_replay: bool = False,
) -> TrainBatch:
    """Shift, score and pack `trajectories` into `config.ppo_minibatches` mini-batches of one [M, B, L] shape.

    With `advantage.overlong_buffer` > 0 each reward first gets DAPO's overlong penalty (`overlong_penalty`) of
    its response length (tokens after the prompt) against `max_new_tokens`, the sampler's cap (then required).

    By default all mini-batches are packed into the one bucket of `config.packing` with the least padding
    (`plan_minibatches`). A `planner` instead maps the packed lengths (T - 1 per trajectory) of one mini-batch
    to a `PackPlan` (e.g. the fixed-count baseline); mini-batches with fewer micro-batches, and micro-batches
    smaller than the largest, are then padded (empty micro-batches / rows / columns) to the common shape.

    `routing_replay` (the trainer replays a mixture's routing: `TrainStep`'s scorer) refuses a trajectory with
    loss tokens but no recorded routing.
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
    if routing_replay:
        unrouted = [t for t in trajectories if t.routing is None and t.num_loss_tokens]
        if unrouted:
            t = unrouted[0]
            raise ValueError(
                f"trainer.moe.routing_replay is 'rollout' but trajectory {t.prompt_id}/{t.sample_index} (and "
                f"{len(unrouted) - 1} more) has no routing; the sampler records it for a mixture of experts only"
            )
    rewards_N = np.asarray([t.reward for t in trajectories], np.float32)
    overlong_stats = {}
    if config.advantage.overlong_buffer > 0:
        if max_new_tokens is None:
            raise ValueError("advantage.overlong_buffer is > 0 but max_new_tokens is None; pass the sampler's cap")
        response_N = np.asarray([t.length - t.prompt_length for t in trajectories])
        penalty_N = overlong_penalty(
            response_N, max_new_tokens, config.advantage.overlong_buffer, config.advantage.overlong_penalty
        )
        rewards_N = (rewards_N + penalty_N).astype(np.float32)
        overlong_N = response_N > max_new_tokens - config.advantage.overlong_buffer
        overlong_stats = {
            "adv/overlong_frac": float(overlong_N.mean()),
            "adv/overlong_penalty_mean": float(penalty_N.mean()),
        }
    group_ids_N = np.asarray([t.group_id for t in trajectories], np.int64)
    shares_N = np.asarray([1.0 / t.num_sequences for t in trajectories], np.float32)
    adv_N, adv_stats = advantages_of(rewards_N, group_ids_N, config.advantage, shares_N)
    lengths_N = np.asarray([t.length - 1 for t in trajectories], np.int64)

    members_P = split_minibatches(lengths_N, config.ppo_minibatches)
    if planner is None:
        plans = plan_minibatches([lengths_N[members] for members in members_P], config.packing)
    else:
        plans = [planner(lengths_N[members]) for members in members_P]
    m = max(plan.num_microbatches for plan in plans)
    b = max(rows for plan in plans for rows, _ in plan.shapes)
    length = max(row_length for plan in plans for _, row_length in plan.shapes)
    minibatches = [
        _write_minibatch([trajectories[i] for i in members], adv_N[members], plan, (m, b, length))
        for members, plan in zip(members_P, plans, strict=True)
    ]

    num_tokens = int(lengths_N.sum())
    capacity = len(minibatches) * m * b * length
    stats = {
        **adv_stats,
        **overlong_stats,
        "batch/sequences": float(len(trajectories)),
        "batch/tokens": float(num_tokens),
        "batch/loss_tokens": float(sum(count_loss_tokens(mb.loss_mask) for mb in minibatches)),
        "batch/capacity": float(capacity),
        "batch/pack_efficiency": num_tokens / capacity,
        "batch/microbatches": float(len(minibatches) * m),
    }
    return TrainBatch(minibatches=minibatches, stats=stats)
