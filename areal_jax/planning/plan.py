"""The plan for a config: calibrations combined into speeds and overheads, every split predicted, the table.

Several calibrations may be given. Each arrangement is predicted from the runs most like it: the split
rows from the split runs of the target's regime (eta 0, or eta >= 1: with eta >= 1 the trainer does its own
host work, publishing and reading the log, during its training; with eta 0 while it waits), else from the
other split runs, else from the colocated ones; the colocated row from the colocated runs, and only when
one was measured (every fallback is noted). Their rates become the measured points of each side's speed
(a run on another number of units replaces the linear-scaling assumption there; runs on the same number
are averaged), and their overheads are averaged. The eta-0 hand-off comes from the eta-0 runs of the
topology. The target's samples per step are its batch
(`batch_prompts` x `n_samples`); its tokens per sample are the calibrations' (mean).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from areal_jax.config import ExperimentConfig
from areal_jax.configuration import to_dict
from areal_jax.planning.calibration import Calibration, CalibrationError
from areal_jax.planning.step_model import Measured, Prediction, Workload, every_split, fastest


@dataclasses.dataclass(frozen=True)
class Plan:
    calibrations: tuple[Calibration, ...]
    devices: int
    work: Workload
    split: Measured
    colocated: Measured | None
    notes: tuple[str, ...]
    rows: tuple[Prediction, ...]

    @property
    def unit(self) -> str:
        return self.calibrations[0].unit

    @property
    def best(self) -> Prediction:
        return fastest(self.rows)

    def lines(self) -> list[str]:
        """The printed plan: calibrations, workload, assumptions, the table, and last the recommendation."""
        work, unit = self.work, self.unit
        out = [f"calibration: {c.describe()}" for c in self.calibrations]
        out.append(
            f"target: {self.devices} {unit}, eta {work.eta}, {work.samples:.0f} samples a step of "
            f"{work.gen_tokens_per_sample:.1f} generated and {work.train_tokens_per_sample:.1f} trained tokens"
        )
        out.extend(f"note: {note}" for note in self.notes)
        header = f"{'inference : training':<22}{'generation s':>14}{'training s':>12}{'step s':>10}  bottleneck"
        out.append(header)
        for row in self.rows:
            out.append(f"{row.label:<22}{row.gen_s:>14.3f}{row.train_s:>12.3f}{row.step_s:>10.3f}  {row.bottleneck}")
        best = self.best
        if best.colocated:
            choice = f"colocated on all {best.gen_units} {unit} (generation and training take turns)"
        else:
            choice = f"{best.gen_units} inference : {best.train_units} training"
        out.append(f"recommended: {choice}, predicted step {best.step_s:.2f} s")
        return out


def make_plan(
    cfg: ExperimentConfig,
    calibrations: Sequence[Calibration],
    devices: int,
    eta: int | None = None,
    batch_prompts: int | None = None,
) -> Plan:
    """Predict every split of `devices` units for `cfg` (eta and batch: the config's unless given)."""
    if not calibrations:
        raise CalibrationError("no calibration run given (--calibration RUN_DIR)")
    if devices < 2:
        raise ValueError(f"--devices {devices}: a split needs at least 2 (1 generating, 1 training)")
    eta = cfg.rollout.staleness.max_head_offpolicyness if eta is None else eta
    batch_prompts = cfg.rollout.staleness.batch_prompts if batch_prompts is None else batch_prompts
    if eta < 0:
        raise ValueError(f"--eta {eta}: the staleness bound is 0 (synchronous) or more")
    if batch_prompts < 1:
        raise ValueError(f"--batch-prompts {batch_prompts}: a batch has at least 1 prompt")
    _check_comparable(cfg, calibrations)
    notes: list[str] = []
    work = Workload(
        samples=float(batch_prompts * cfg.rollout.workflow.n_samples),
        gen_tokens_per_sample=float(np.mean([c.gen_tokens_per_sample for c in calibrations])),
        train_tokens_per_sample=float(np.mean([c.train_tokens_per_sample for c in calibrations])),
        eta=eta,
    )
    split_runs = [c for c in calibrations if not c.colocated]
    same_regime = [c for c in split_runs if (c.eta == 0) == (eta == 0)]
    if split_runs and not same_regime:
        notes.append(
            f"no split run with {'eta 0' if eta == 0 else 'eta >= 1'} measured: the split rows use the others, "
            f"whose trainer did its own host work (publishing, reading the log) "
            f"{'during its training' if eta == 0 else 'while it waited for the batch'}"
        )
    split = _measured(same_regime or split_runs, split_runs, "split", eta, notes)
    colocated_runs = [c for c in calibrations if c.colocated]
    colocated = _measured(colocated_runs, colocated_runs, "colocated", eta, notes)
    if split is None:
        assert colocated is not None
        split = colocated
        notes.append("no split run measured: the split rows use the colocated runs' speeds and overheads")
    rows = tuple(every_split(work, devices, split, colocated))
    return Plan(tuple(calibrations), devices, work, split, colocated, tuple(notes), rows)


def _check_comparable(cfg: ExperimentConfig, calibrations: Sequence[Calibration]) -> None:
    """Refuse calibrations of another model, or mixing CPU cores with accelerator devices."""
    model = to_dict(cfg.model)
    for c in calibrations:
        differ = sorted(key for key in model if model[key] != c.model.get(key))
        if differ:
            shown = ", ".join(f"model.{k} {c.model.get(k)!r} vs {model[k]!r}" for k in differ[:3])
            raise CalibrationError(f"{c.run_dir} trained another model ({shown}): its speeds do not transfer")
    units = {c.unit for c in calibrations}
    if len(units) > 1:
        raise CalibrationError(f"the calibrations mix {' and '.join(sorted(units))}: calibrate on one kind of machine")


def _by_units(points: Sequence[tuple[int, float]]) -> dict[int, float]:
    """Mean tokens/s for each measured unit count."""
    grouped: dict[int, list[float]] = {}
    for units, rate in points:
        grouped.setdefault(units, []).append(rate)
    return {units: float(np.mean(rates)) for units, rates in grouped.items()}


def _measured(
    runs: Sequence[Calibration], handoff_runs: Sequence[Calibration], topology: str, eta: int, notes: list[str]
) -> Measured | None:
    """What `runs` measured (None without any): speeds by unit count (mean) and mean overheads; the eta-0
    hand-off from the eta-0 runs among `handoff_runs` (taken as 0, and noted, when the target is
    synchronous and none was measured)."""
    if not runs:
        return None
    gen = _by_units([(c.gen_units, c.gen_tokens_per_s) for c in runs])
    train = _by_units([(c.train_units, c.train_tokens_per_s) for c in runs])
    unit = runs[0].unit if max(*gen, *train) > 1 else runs[0].unit[:-1]
    notes.append(
        f"{topology}: generation measured on {_counts(gen)} {unit}, training on {_counts(train)}; "
        "other counts scale linearly from the nearest"
    )
    handoffs = [c.handoff_s for c in handoff_runs if c.handoff_s is not None]
    if eta == 0 and not handoffs:
        notes.append(f"no {topology} run with eta 0 measured: its eta-0 hand-off is taken as 0")
    return Measured(
        gen=gen,
        train=train,
        overhead_s=float(np.mean([c.overhead_s for c in runs])),
        handoff_s=float(np.mean(handoffs)) if handoffs else 0.0,
    )


def _counts(measured: dict[int, float]) -> str:
    return ", ".join(str(n) for n in sorted(measured))
