"""The `warm_start` config section (a short supervised fit before RL) and where its result lives in a run
directory. A leaf: `areal_jax.config` gathers it, `areal_jax.jobs.sft` runs it."""

from __future__ import annotations

import dataclasses

from areal_jax.configuration import Config, option
from areal_jax.run_layout import WARM_START_DIR  # noqa: F401  (its home in a run directory)

SUMMARY_FILE = "summary.json"
CHECKPOINT_DIR = "hf"


@dataclasses.dataclass(frozen=True)
class WarmStartConfig(Config):
    """A short supervised fit to the task's answers before RL (random init only); 0 steps = off."""

    steps: int = option(0, ge=0, doc="optimizer steps of the warm start; 0 = none (RL starts from the random init)")
    batch_size: int = option(64, ge=1, doc="prompt/answer pairs per step (drawn with the run seed)")
    lr: float = option(3e-3, gt=0, doc="peak learning rate (AdamW, linear warmup then cosine decay to lr / 10)")
    warmup_steps: int = option(20, ge=0, doc="linear warmup steps")
    heldout_examples: int = option(256, ge=0, doc="held-out prompts scored before and after (teacher-forced)")
    balance_answer_lengths: bool = option(
        False,
        doc="draw examples so that every answer length (in tokens) is equally likely, not every example: a task "
        "whose short answers are rare (running sums: 25 two-term problems of 3,900) otherwise teaches only long ones",
    )
