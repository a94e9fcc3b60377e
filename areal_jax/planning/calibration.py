"""A calibration: what a finished run (`areal-jax train`, `areal-jax launch local`) measured about its two sides.

Everything comes from files every run writes into its directory:

- `config.yaml`: the model, eta (`rollout.staleness.max_head_offpolicyness`), the batch (`batch_prompts` x
  `n_samples`), how many rollout servers and trainer processes there were.
- `control/resources-<role>.json` (`system/resources.py`): the devices and CPU cores of each role. A side's
  unit is the CPU core on CPU (XLA's CPU devices share their process's cores) and the device elsewhere; the
  sides are colocated when they share a unit (the one-process run on one CPU device), split otherwise.
- `metrics.jsonl`, steady steps only (the first `skip` are left out: compilation and warm-up). Medians
  (or another `quantile`: lower on a machine shared with other work, whose load only slows steps), so
  that a step which compiled a new shape does not count:
  generation tokens/s = `generator/emitted_tokens` / `generator/busy_seconds` (the generator loop's
  working time; the servers' counters summed through their status files), training tokens/s =
  `batch/tokens` / `train/step_time` (prompt + generated tokens), the trainer's host overhead per step =
  the `time/wall` difference - `train/step_time` - `time/batch_wait` (publishing weights, reporting,
  statistics), and with eta = 0 the hand-off per step = `time/batch_wait` - the generation time of the
  step's tokens (weights reaching the servers, rewards, the log reaching the trainer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from areal_jax import storage
from areal_jax.config import ExperimentConfig, load_experiment
from areal_jax.configuration import to_dict
from areal_jax.jsonl import parse_jsonl
from areal_jax.reporting.metric_keys import BATCH_WAIT, EMITTED, WALL, is_evaluation
from areal_jax.run_layout import METRICS_FILE
from areal_jax.system import resources
from areal_jax.system.run_dir import CONFIG_FILE

BUSY = "generator/busy_seconds"
TRAIN_STEP = "train/step_time"
TOKENS = "batch/tokens"
SEQUENCES = "batch/sequences"
RESPONSE_LENGTH = "rollout/response_length_mean"
_NEEDED = (WALL, BATCH_WAIT, TRAIN_STEP, TOKENS, SEQUENCES, RESPONSE_LENGTH, EMITTED, BUSY)

Unit = Literal["cores", "devices"]


class CalibrationError(Exception):
    """A run directory that cannot calibrate the planner (missing files, too few steps, an older run)."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One run's measured speeds. Rates are of a whole side (all its units together)."""

    run_dir: str | Path
    unit: Unit
    gen_units: int
    train_units: int
    colocated: bool  # the two sides shared their units (they took turns: eta must be 0)
    eta: int
    batch_prompts: int
    n_samples: int
    steps: int  # steady steps measured
    samples_per_step: float
    gen_tokens_per_sample: float  # generated
    train_tokens_per_sample: float  # prompt + generated
    gen_tokens_per_s: float
    train_tokens_per_s: float
    overhead_s: float  # the trainer's host time per step besides training and waiting for the batch
    handoff_s: float | None  # eta = 0 only: the batch wait beyond generating its tokens
    step_s: float  # the measured steady step time (the quantile, by default the median)
    model: dict[str, Any]

    @property
    def topology(self) -> str:
        return "colocated" if self.colocated else "split"

    def describe(self) -> str:
        per = self.unit[:-1]
        sides = (
            f"both sides on {self.gen_units} {_plural(per, self.gen_units)}"
            if self.colocated
            else f"{self.gen_units} {_plural(per, self.gen_units)} generating, "
            f"{self.train_units} {_plural(per, self.train_units)} training"
        )
        handoff = "" if self.handoff_s is None else f", eta-0 hand-off {self.handoff_s:.3f} s"
        return (
            f"{self.run_dir} ({self.topology}: {sides}; eta {self.eta}, {self.steps} steady steps of "
            f"{self.samples_per_step:.0f} samples, measured step {self.step_s:.3f} s): generation "
            f"{self.gen_tokens_per_s / self.gen_units:,.0f} tok/s per {per}, training "
            f"{self.train_tokens_per_s / self.train_units:,.0f} tok/s per {per}, overhead "
            f"{self.overhead_s:.3f} s/step{handoff}"
        )


def _plural(word: str, count: int) -> str:
    return word if count == 1 else f"{word}s"


def read_calibration(run_dir: str | Path, skip: int | None = None, quantile: float = 0.5) -> Calibration:
    """The calibration measured by the finished run in `run_dir`, leaving out its first `skip` steps
    (default: a quarter, at least 2), each per-step time taken at `quantile` over the steady steps."""
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile {quantile} is not in (0, 1]")
    run_dir = str(run_dir) if storage.is_remote(run_dir) else Path(run_dir)
    if not storage.is_dir(run_dir):
        raise CalibrationError(f"{run_dir} is not a directory (expected the directory of a finished run)")
    config_path = storage.join(run_dir, CONFIG_FILE)
    if not storage.exists(config_path):
        raise CalibrationError(f"{run_dir} has no {CONFIG_FILE}: not the directory of an areal-jax run")
    cfg = load_experiment(config_path)  # local or gs://
    unit, gen_units, train_units, colocated = _sides(run_dir, cfg)
    eta = cfg.rollout.staleness.max_head_offpolicyness
    if colocated and eta > 0:
        raise CalibrationError(
            f"{run_dir}: its two sides shared their {unit} with eta {eta}, so their speeds mix; calibrate "
            "a colocated run with rollout.staleness.max_head_offpolicyness=0 (the sides take turns)"
        )
    lines = _steady_lines(run_dir, skip)
    measured = _measure(lines, eta, quantile)
    return Calibration(
        run_dir=run_dir,
        unit=unit,
        gen_units=gen_units,
        train_units=train_units,
        colocated=colocated,
        eta=eta,
        batch_prompts=cfg.rollout.staleness.batch_prompts,
        n_samples=cfg.rollout.workflow.n_samples,
        model=to_dict(cfg.model),
        **measured,
    )


def _sides(run_dir: str | Path, cfg: ExperimentConfig) -> tuple[Unit, int, int, bool]:
    """(unit, generation units, training units, colocated) from the roles' resource records."""
    records = resources.read_all(run_dir)
    trainers = (cfg.distributed.num_processes or 1) if cfg.distributed.enabled else 1
    roles = {
        "trainer": [f"trainer-{i}" for i in range(trainers)],
        "rollout": [
            name for i in range(cfg.cluster.rollout_servers) for name in resources.processes_of(records, f"rollout-{i}")
        ],
    }
    missing = [role for names in roles.values() for role in names if role not in records]
    if missing:
        raise CalibrationError(
            f"{run_dir} has no record of the resources of {', '.join(missing)} (control/resources-<role>.json): "
            "a run from before areal-jax recorded them, or one that ended before training; rerun it"
        )
    platforms = {records[role]["platform"] for names in roles.values() for role in names}
    unit: Unit = "cores" if platforms == {"cpu"} else "devices"
    key = "cores" if unit == "cores" else "devices"
    used = {side: {(records[r]["host"], i) for r in names for i in records[r][key]} for side, names in roles.items()}
    return unit, len(used["rollout"]), len(used["trainer"]), bool(used["rollout"] & used["trainer"])


def _steady_lines(run_dir: str | Path, skip: int | None) -> list[dict[str, float]]:
    path = storage.join(run_dir, METRICS_FILE)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        raise CalibrationError(f"{run_dir} has no {METRICS_FILE}: the run trained no step") from None
    lines = [line for line in parse_jsonl(text) if not is_evaluation(line)]
    skip = max(2, len(lines) // 4) if skip is None else skip
    if len(lines) < skip + 3:
        raise CalibrationError(
            f"{path} has {len(lines)} steps; a calibration needs at least {skip + 3} ({skip} left out as "
            "warm-up, then 3 steady ones): train the run longer"
        )
    absent = [key for key in _NEEDED if key not in lines[-1]]
    if absent:
        raise CalibrationError(f"{path} lacks {', '.join(absent)}: a run from before areal-jax measured them; rerun it")
    return lines[skip - 1 :]  # the line before the first steady step: the start of its differences


def _measure(lines: Sequence[dict[str, float]], eta: int, quantile: float) -> dict[str, Any]:
    """The calibration's measured fields from the steady lines (the first one is only a start point)."""
    steady = lines[1:]

    def typical(values: np.ndarray) -> float:
        return float(np.quantile(values, quantile))

    def column(key: str) -> np.ndarray:
        return np.array([line[key] for line in steady], dtype=np.float64)

    walls = np.array([line[WALL] for line in lines], dtype=np.float64)
    durations = np.diff(walls)
    fresh = durations > 0  # a resumed process starts its wall clock again
    train_s, wait = column(TRAIN_STEP), column(BATCH_WAIT)
    emitted = np.diff([line[EMITTED] for line in lines])
    busy = np.diff([line[BUSY] for line in lines])
    moved = (emitted >= 0) & (busy >= 0)  # counters start again in a resumed process, too
    if busy[moved].sum() <= 0:
        raise CalibrationError(
            "the generator's counters did not move over the steady steps (a rollout server's status file "
            "is written every cluster.status_every_s): train the run longer or lower cluster.status_every_s"
        )
    samples = float(np.mean(column(SEQUENCES)))
    gen_per_sample = float(np.mean(column(RESPONSE_LENGTH)))
    gen_rate = float(emitted[moved].sum() / busy[moved].sum())
    train_rate = float(np.median(column(TOKENS)) / typical(train_s))
    handoff = None
    if eta == 0:
        handoff = max(0.0, typical(wait) - samples * gen_per_sample / gen_rate)
    return {
        "steps": len(steady),
        "samples_per_step": samples,
        "gen_tokens_per_sample": gen_per_sample,
        "train_tokens_per_sample": float(column(TOKENS).sum() / column(SEQUENCES).sum()),
        "gen_tokens_per_s": gen_rate,
        "train_tokens_per_s": train_rate,
        "overhead_s": max(0.0, typical((durations - train_s - wait)[fresh])),
        "handoff_s": handoff,
        "step_s": typical(durations[fresh]),
    }
