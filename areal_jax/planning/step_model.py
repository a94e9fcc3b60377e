"""The step-time model of `areal-jax plan`: pure arithmetic on measured speeds.

A step generates S samples of Lg tokens each and trains on them (Lt = prompt + generated tokens each).
On d units a side runs at T(d) tokens/s, so

    gen(d)   = S * Lg / T_gen(d)
    train(d) = S * Lt / T_train(d)

With D units split into d_gen + d_train (disjoint):

    eta >= 1: step = max(gen(d_gen), train(d_train) + overhead)   the sides overlap; the trainer's host
                                                                  work (publishing, reporting) is its own
    eta = 0:  step = gen(d_gen) + handoff + train(d_train) + overhead

Colocated (both sides on all D units, taking turns): step = gen(D) + train(D) + overhead (+ handoff when
eta = 0). Speeds, `overhead` and `handoff` come from calibrations of the same topology (`plan.py`).

T(d) interpolates linearly between the unit counts a calibration measured; beyond them it is proportional
to d from the nearest measured count (linear scaling: an assumption, shown as such by the planner).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Workload:
    """One step's work: samples, tokens generated and trained per sample, and the staleness bound."""

    samples: float
    gen_tokens_per_sample: float
    train_tokens_per_sample: float
    eta: int


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the calibrations of one topology (split or colocated) measured."""

    gen: Mapping[int, float]  # the generation side's tokens/s by the number of units it ran on
    train: Mapping[int, float]  # the training side's
    overhead_s: float  # per step: the trainer's host work (publishing, reporting)
    handoff_s: float  # per step with eta = 0: weights to the generators and the batch back to the trainer


@dataclasses.dataclass(frozen=True)
class Prediction:
    gen_units: int
    train_units: int
    colocated: bool
    gen_s: float
    train_s: float
    step_s: float
    bottleneck: str  # "generation" or "training"

    @property
    def label(self) -> str:
        return f"colocated on {self.gen_units}" if self.colocated else f"{self.gen_units} : {self.train_units}"


def side_rate(measured: Mapping[int, float], units: int) -> float:
    """Tokens/s of a side on `units` units: measured, interpolated, or scaled linearly from the nearest count."""
    if not measured:
        raise ValueError("no measured speed")
    counts = sorted(measured)
    if units <= counts[0]:
        return measured[counts[0]] * units / counts[0]
    if units >= counts[-1]:
        return measured[counts[-1]] * units / counts[-1]
    above = bisect.bisect_left(counts, units)
    low, high = counts[above - 1], counts[above]
    share = (units - low) / (high - low)
    return measured[low] + share * (measured[high] - measured[low])


def predict(
    measured: Measured, work: Workload, gen_units: int, train_units: int, colocated: bool = False
) -> Prediction:
    """The step time of one arrangement (colocated: both sides on the same `gen_units` units)."""
    gen_s = work.samples * work.gen_tokens_per_sample / side_rate(measured.gen, gen_units)
    train_s = work.samples * work.train_tokens_per_sample / side_rate(measured.train, train_units)
    handoff = measured.handoff_s if work.eta == 0 else 0.0
    if colocated or work.eta == 0:
        step_s = gen_s + train_s + measured.overhead_s + handoff
        bottleneck = "generation" if gen_s > train_s else "training"
    else:
        trainer_s = train_s + measured.overhead_s
        step_s = max(gen_s, trainer_s)
        bottleneck = "generation" if gen_s > trainer_s else "training"
    return Prediction(gen_units, train_units, colocated, gen_s, train_s, step_s, bottleneck)


def every_split(work: Workload, devices: int, split: Measured, colocated: Measured | None = None) -> list[Prediction]:
    """Every split of `devices` units (1..devices-1 generating), then colocated on all of them when a
    colocated run was measured."""
    rows = [predict(split, work, d, devices - d) for d in range(1, devices)]
    if colocated is not None:
        rows.append(predict(colocated, work, devices, devices, colocated=True))
    return rows


def fastest(predictions: Sequence[Prediction]) -> Prediction:
    """The prediction with the shortest step (the first such in order on a tie)."""
    return min(predictions, key=lambda p: p.step_s)
