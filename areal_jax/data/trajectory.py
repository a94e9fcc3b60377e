"""The trajectory record: what the rollout side hands the trainer for one sampled sequence.

Per-token arrays cover the whole sequence (prompt and response, and in multi-turn workflows the
environment's tokens), so the trainer never re-tokenizes. Prompt and environment tokens carry
`loss_mask` 0, behaviour log-prob 0 and version -1; each generated token carries the log-prob under
the distribution it was sampled from and the policy version that sampled it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

SCHEMA_VERSION = 2  # 2: sequence_index and num_sequences (1 reads as one sequence per sample)
# metadata key of a sample the rollout side logged but kept out of training, with the reason as its value
# (`rollout.dynamic_sampling`: its group's rewards were all equal); the pipeline skips such groups
NOT_TRAINED = "not_trained"


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One sample of one prompt: tokens, per-token behaviour data, reward, bookkeeping."""

    token_ids: np.ndarray  # [T] int32, prompt + response (+ environment turns)
    behav_logprobs: np.ndarray  # [T] float32; 0 where loss_mask is 0
    versions: np.ndarray  # [T] int32; -1 for tokens the policy did not sample
    loss_mask: np.ndarray  # [T] bool/uint8; 1 on policy-generated tokens that train
    prompt_length: int
    reward: float
    prompt_id: str
    group_id: int  # samples of the same prompt (and admission) share it
    sample_index: int  # 0..n-1 within the group
    # an agent episode recorded as several sequences, each trained (`agent.extra_sequences: all`): this one's index
    # among its sample's `num_sequences`; the group is whole once every sample's sequences are in
    sequence_index: int = 0
    num_sequences: int = 1
    reward_components: dict[str, float] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # a mixture of experts' routing, [T, Ym, K] uint8/uint16: each token's experts in each sparse layer as the
    # sampler routed it (`GenerationResult.routing`), what `trainer.moe.routing_replay: rollout` replays; None when
    # dense or not recorded (the last token's is never read: it is no input)
    routing: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("behav_logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.prompt_id}/{self.sample_index}: {name} has length "
                    f"{len(getattr(self, name))}, token_ids has {n}"
                )
        if self.routing is not None and (self.routing.ndim != 3 or len(self.routing) != n):
            raise ValueError(
                f"trajectory {self.prompt_id}/{self.sample_index}: routing has shape {self.routing.shape}, "
                f"expected [{n}, sparse layers, experts per token]"
            )
        if not 0 <= self.sequence_index < self.num_sequences:
            raise ValueError(
                f"trajectory {self.prompt_id}/{self.sample_index}: sequence_index {self.sequence_index} outside "
                f"[0, num_sequences={self.num_sequences})"
            )
        if not 0 < self.prompt_length <= n:
            raise ValueError(
                f"trajectory {self.prompt_id}/{self.sample_index}: prompt_length {self.prompt_length} outside (0, {n}]"
            )

    @property
    def trains(self) -> bool:
        """False for a sample logged but kept out of training (`NOT_TRAINED` in its metadata)."""
        return NOT_TRAINED not in self.metadata

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    def oldest_version(self) -> int:
        """Smallest policy version among generated tokens (-1 if none were generated)."""
        generated = self.versions[self.versions >= 0]
        return int(generated.min()) if generated.size else -1
