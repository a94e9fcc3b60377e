"""What the proxy records per episode (session): token sequences, each the exact ids the model saw and
produced over one or more turns, with per-token behaviour log-probs, versions and loss mask.

A turn either continues a recorded sequence (its prompt starts with that sequence's ids, or its chat history
repeats that sequence's conversation and reply) and becomes a longer copy of it, or starts a new sequence.
A sequence that a later turn continued is superseded; the episode's trajectories are the sequences that
were not (with n > 1 samples or an agent that branches, several). Owned by the proxy's event-loop thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.requests import GenerationResult
from areal_jax.inference.sampling import SamplingParams
from areal_jax.rollout.staleness import Admission


@dataclasses.dataclass
class TokenSequence:
    """One recorded sequence. Context tokens (prompts, tool results, forced openings): log-prob 0, version -1,
    mask 0; model tokens: their behaviour log-prob and version, mask 1."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    model: list[bool] = dataclasses.field(default_factory=list)
    prompt_length: int = 0
    conversation: tuple[str, ...] = ()  # chat turns: keys of the request's messages and of the reply
    messages: tuple[dict[str, Any], ...] = ()  # the same, normalized (the reply last)
    tools_key: str = "null"
    produced: tuple[int, ...] = ()  # the model's ids of the last turn
    turns: int = 0
    interruptions: int = 0
    divergences: int = 0
    finish_reason: str = "stop"
    ended: float = 0.0
    superseded: bool = False
    # a mixture of experts' routing of `ids` in pieces ([n, Ym, K] each): each turn adds its context's (that turn's
    # prefill) and its outputs'; None once a turn came without (a dense model)
    routing: list[np.ndarray] | None = dataclasses.field(default_factory=list)

    def extended(self, context: Sequence[int], result: GenerationResult, **fields: Any) -> TokenSequence:
        """A copy with `context` and the model's `result` after it (this sequence itself is unchanged)."""
        out = dataclasses.replace(
            self,
            ids=[*self.ids, *context, *result.output_ids],
            logprobs=[*self.logprobs, *[0.0] * len(context), *result.output_logprobs],
            versions=[*self.versions, *[-1] * len(context), *result.output_versions],
            model=[*self.model, *[False] * len(context), *[True] * len(result.output_ids)],
            prompt_length=self.prompt_length or len(context),
            produced=tuple(result.output_ids),
            turns=self.turns + 1,
            interruptions=self.interruptions + result.num_interruptions,
            finish_reason=result.finish_reason,
            ended=time.perf_counter(),
            superseded=False,
            routing=self._routing_with(context, result),
        )
        return dataclasses.replace(out, **fields)

    def _routing_with(self, context: Sequence[int], result: GenerationResult) -> list[np.ndarray] | None:
        """`routing` with the turn's new tokens' (its result's routing past the tokens already recorded)."""
        end = len(self.ids) + len(context) + len(result.output_ids)
        if self.routing is None or result.routing is None or len(result.routing) != end:
            return None
        return [*self.routing, result.routing[len(self.ids) :]]

    def routing_array(self) -> np.ndarray | None:
        """`routing` as one [T, Ym, K] array (None when not recorded)."""
        return np.concatenate(self.routing) if self.routing else None

    def trajectory(self, reward: float, train: bool, **fields: Any) -> Trajectory:
        mask = np.asarray(self.model, np.bool_) if train else np.zeros(len(self.ids), np.bool_)
        return Trajectory(
            token_ids=np.asarray(self.ids, np.int32),
            behav_logprobs=np.asarray(self.logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32),
            loss_mask=mask,
            prompt_length=self.prompt_length,
            reward=reward,
            routing=self.routing_array(),
            **fields,
        )


@dataclasses.dataclass
class Session:
    """One episode's sequences and its requests still generating."""

    session_id: str
    external: bool  # started by a client's first request (admitted by the proxy), not by the agent workflow
    sampling: SamplingParams | None = None  # its turns' base sampling; None = the proxy's
    admission: Admission | None = None  # an external episode's, released when it ends
    sequences: list[TokenSequence] = dataclasses.field(default_factory=list)
    in_flight: set[str] = dataclasses.field(default_factory=set)
    closed: bool = False

    def chat_parent(self, conversation: tuple[str, ...], tools_key: str) -> TokenSequence | None:
        """The recorded chat sequence whose conversation the request's messages extend the most."""
        best = None
        for seq in self.sequences:
            n = len(seq.conversation)
            extends = n and n < len(conversation) and conversation[:n] == seq.conversation
            if extends and seq.tools_key == tools_key and (best is None or n > len(best.conversation)):
                best = seq
        return best

    def ids_parent(self, prompt_ids: Sequence[int]) -> TokenSequence | None:
        """The recorded sequence that is the longest prefix of `prompt_ids`."""
        best = None
        for seq in self.sequences:
            n = len(seq.ids)
            if n < len(prompt_ids) and tuple(prompt_ids[:n]) == tuple(seq.ids) and (best is None or n > len(best.ids)):
                best = seq
        return best

    def add(self, parent: TokenSequence | None, child: TokenSequence) -> None:
        if parent is not None:
            parent.superseded = True
        self.sequences.append(child)

    def leaves(self) -> list[TokenSequence]:
        """The sequences no later turn continued, in the order they ended."""
        return sorted((s for s in self.sequences if not s.superseded), key=lambda s: s.ended)
