"""The prompts of a run: dataset files or an embedded synthetic task (`dataset.kind`: one-step arithmetic or
running sums with a worked answer), split into a training stream and a held-out set.

The training stream is a Grain `MapDataset` over the records, shuffled with the run seed (a different
order every epoch) and repeated `epochs` times. Group g always gets element g of it, so the stream's read
position is a single integer, the next group id, which the training checkpoint already holds: a resumed
run continues the exact prompt order. The held-out set is drawn from the records once, with the run seed,
before the training stream is built; no held-out prompt is ever trained on.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import grain
import numpy as np

from areal_jax.configuration import Config, ConfigError, option
from areal_jax.data.datasets import DatasetConfig, PromptRecord, load_prompts
from areal_jax.rewards.synthetic import (
    ArithmeticTaskConfig,
    ChainSumTaskConfig,
    make_chain_problems,
    make_problems,
)

logger = logging.getLogger(__name__)

_MAX_LOGGED_SKIPS = 10


@dataclasses.dataclass(frozen=True)
class TaskDataConfig(Config):
    """Where a run's prompts come from and in which order they are used."""

    files: tuple[DatasetConfig, ...] = option(
        (), doc="prompt files (jsonl/parquet, local or gs://), read in order; empty = the embedded task `kind`"
    )
    kind: Literal["arithmetic", "chain_sums"] = option(
        "arithmetic",
        doc="the embedded task when `files` is empty: 'arithmetic' (one operation, answer the result) or "
        "'chain_sums' (running sums with a worked answer; pair with reward.kind=chain_sums)",
    )
    arithmetic: ArithmeticTaskConfig = option(
        default_factory=ArithmeticTaskConfig, doc="the embedded arithmetic task (kind 'arithmetic')"
    )
    arithmetic_problems: int = option(4096, ge=1, doc="problems drawn for the embedded arithmetic task")
    chain_sums: ChainSumTaskConfig = option(
        default_factory=ChainSumTaskConfig, doc="the embedded running-sums task (kind 'chain_sums')"
    )
    shuffle: bool = option(True, doc="shuffle with the run seed (each epoch in a different order)")
    epochs: int | None = option(None, ge=1, doc="passes over the training prompts; null = repeat until the run ends")
    heldout: int = option(0, ge=0, doc="prompts set aside (drawn with the run seed) for evaluation, never trained")
    max_prompt_tokens: int = option(
        512, ge=1, doc="prompts longer than this once rendered with the chat template are skipped and reported"
    )

    def validate(self) -> None:
        seen: set[str] = set()
        for index, dataset in enumerate(self.files):
            if dataset.path in seen:
                raise ConfigError(f"files[{index}].path", f"{dataset.path!r} is listed twice")
            seen.add(dataset.path)


def arithmetic_records(config: ArithmeticTaskConfig, count: int, seed: int) -> list[PromptRecord]:
    """The embedded task's problems as `PromptRecord`s (id "arith-<n>", answer the decimal result)."""
    return [
        PromptRecord(f"arith-{p.prompt_id}", p.question, p.answer, None, "arithmetic", {})
        for p in make_problems(config, count, seed)
    ]


def chain_sum_records(config: ChainSumTaskConfig, seed: int) -> list[PromptRecord]:
    """The running-sums problems as `PromptRecord`s (id "sums-<n>", answer the worked chain, metadata the
    number of terms)."""
    problems = make_chain_problems(config, seed)
    terms = [{"terms": 1 + p.question.count("+")} for p in problems]
    return [
        PromptRecord(f"sums-{p.prompt_id}", p.question, p.answer, None, "chain_sums", t)
        for p, t in zip(problems, terms, strict=True)
    ]


def load_task_records(config: TaskDataConfig, seed: int) -> list[PromptRecord]:
    """Every record of the configured files in order (malformed rows refused or skipped per file), or the
    embedded task's problems. Raises ValueError when nothing is left."""
    if not config.files:
        if config.kind == "chain_sums":
            return chain_sum_records(config.chain_sums, seed)
        return arithmetic_records(config.arithmetic, config.arithmetic_problems, seed)
    records: list[PromptRecord] = []
    for dataset in config.files:
        loaded = load_prompts(dataset)
        logger.info("%s: %d prompts (%d malformed rows skipped)", dataset.path, len(loaded), len(loaded.skipped))
        records.extend(loaded)
    if not records:
        raise ValueError(f"no usable prompt in {', '.join(d.path for d in config.files)}")
    return records


def drop_long_prompts(
    records: Sequence[PromptRecord], prompt_length: Callable[[PromptRecord], int], max_tokens: int
) -> list[PromptRecord]:
    """The records whose rendered prompt has at most `max_tokens` tokens; the others are reported."""
    kept: list[PromptRecord] = []
    skipped: list[PromptRecord] = []
    for record in records:
        (kept if prompt_length(record) <= max_tokens else skipped).append(record)
    for record in skipped[:_MAX_LOGGED_SKIPS]:
        logger.warning("skipping prompt %s (%s): longer than %d tokens", record.id, record.source, max_tokens)
    if skipped:
        logger.warning("skipped %d of %d prompts longer than %d tokens", len(skipped), len(records), max_tokens)
    if not kept:
        raise ValueError(f"every prompt is longer than {max_tokens} tokens (dataset.max_prompt_tokens)")
    return kept


def split_heldout(
    records: Sequence[PromptRecord], count: int, seed: int
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training, held-out): `count` records drawn with `seed`, both parts in their original order."""
    if count >= len(records):
        raise ValueError(f"dataset.heldout={count} leaves no training prompt out of {len(records)}")
    chosen = set(np.random.default_rng(seed).permutation(len(records))[:count].tolist())
    train = [r for i, r in enumerate(records) if i not in chosen]
    heldout = [r for i, r in enumerate(records) if i in chosen]
    return train, heldout


class TaskStream:
    """Group id -> training prompt: a shuffled, repeated Grain `MapDataset` indexed by group id."""

    def __init__(self, records: Sequence[PromptRecord], seed: int, shuffle: bool = True, epochs: int | None = None):
        if not records:
            raise ValueError("a task stream needs at least one prompt")
        dataset = grain.MapDataset.source(list(records))
        if shuffle:
            dataset = dataset.shuffle(seed=seed)
        self.prompts_per_epoch = len(records)
        self.epochs = epochs
        self._dataset = dataset.repeat(epochs)

    def __len__(self) -> int:
        """Groups the stream can feed (a very large number when it repeats forever)."""
        return len(self._dataset)

    def task_for(self, group_id: int) -> PromptRecord:
        if not 0 <= group_id < len(self):
            raise IndexError(f"group {group_id} is past the end of the prompts ({len(self)} groups)")
        return self._dataset[group_id]

    def groups(self, first_group_id: int, reissue: Sequence[int] = ()) -> Iterator[tuple[int, PromptRecord]]:
        """(group id, prompt) pairs: first the `reissue` ids (groups a crash lost), then every id from
        `first_group_id` until the stream ends."""
        for group_id in reissue:
            yield group_id, self.task_for(group_id)
        for group_id in range(first_group_id, len(self)):
            yield group_id, self._dataset[group_id]
