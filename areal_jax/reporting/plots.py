"""The plots a run writes at its end (`report.plots`): the per-step series of metrics.jsonl, then reward.png,
staleness.png and throughput.png (matplotlib, Agg)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from areal_jax.reporting.metric_keys import (
    CORRECT,
    HELDOUT,
    KEPT_BY_STALENESS,
    REWARD,
    STALENESS_MEAN,
    TRAIN_TOKENS_PER_S,
    WALL,
    generation_rate,
    is_evaluation,
)

History = list[tuple[int, dict[str, float]]]  # (step, that step's stats), in step order


def run_series(history: History) -> dict[str, np.ndarray]:
    """The plotted series, one value per step (NaN where a step lacks it): `step`, `wall` (seconds, one axis
    across resumes), reward, correct rate, held-out pass@1, mean staleness, generation and training
    tokens/s; and `staleness` / `kept` (samples trained per staleness) when the pipeline counts them."""
    history = fold_evaluations(history)
    steps = np.array([s for s, _ in history], dtype=np.float64)
    walls, offset, last_wall = [], 0.0, None
    gen_rates, previous = [], None
    for _, stats in history:
        wall = stats.get(WALL, math.nan)
        if last_wall is not None and wall <= last_wall:  # a resumed process starts its clock again
            offset += last_wall
        if not math.isnan(wall):
            last_wall = wall
        walls.append(wall + offset)
        rate = generation_rate(previous, stats)
        gen_rates.append(math.nan if rate is None else rate)
        previous = stats
    series = {"step": steps, "wall": np.array(walls), "generation_tokens_per_s": np.array(gen_rates)}
    for key in (REWARD, CORRECT, HELDOUT, STALENESS_MEAN, TRAIN_TOKENS_PER_S):
        series[key] = np.array([stats.get(key, math.nan) for _, stats in history], dtype=np.float64)
    counts = next(
        (
            {int(k[len(KEPT_BY_STALENESS) :]): v for k, v in stats.items() if k.startswith(KEPT_BY_STALENESS)}
            for _, stats in reversed(history)
            if any(k.startswith(KEPT_BY_STALENESS) for k in stats)
        ),
        None,
    )
    if counts:
        staleness = sorted(counts)
        series["staleness"] = np.array(staleness, dtype=np.float64)
        series["kept"] = np.array([counts[s] for s in staleness], dtype=np.float64)
    return series


def fold_evaluations(history: History) -> History:
    """`history` with each evaluation's line (written when it finished) merged into the line of its step, or
    in step order where its step has none (the starting policy's, step 0)."""
    lines: list[tuple[int, dict[str, float]]] = []
    by_step: dict[int, dict[str, float]] = {}
    for step, stats in history:
        if is_evaluation(stats) and step in by_step:
            by_step[step].update(stats)
            continue
        line = dict(stats)
        if not is_evaluation(stats):
            by_step[step] = line
        lines.append((step, line))
    return sorted(lines, key=lambda entry: entry[0])


def write_plots(series: Mapping[str, np.ndarray], directory: Path) -> list[Path]:
    """reward.png, staleness.png and throughput.png from `run_series` (matplotlib, Agg); their paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    directory.mkdir(parents=True, exist_ok=True)
    minutes = series["wall"] / 60.0
    written = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=100)
        written.append(path)

    fig = Figure(figsize=(11, 4))
    for ax, x, xlabel in zip(fig.subplots(1, 2), (series["step"], minutes), ("step", "wall time (min)"), strict=True):
        for key, label, style in (
            (REWARD, "reward", "-"),
            (CORRECT, "correct", "-"),
            (HELDOUT, "held-out pass@1", "o-"),
        ):
            y = series[key]
            shown = ~np.isnan(y)
            if shown.any():
                ax.plot(x[shown], y[shown], style, label=label, markersize=4)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("reward and accuracy")
    save(fig, "reward.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    if "kept" in series:
        ax.bar(series["staleness"], series["kept"])
        ax.set_xticks(series["staleness"])
        ax.set_xlabel("staleness (policy versions behind)")
        ax.set_ylabel("samples trained")
    else:
        y = series[STALENESS_MEAN]
        ax.hist(y[~np.isnan(y)], bins=20)
        ax.set_xlabel("mean staleness of a step's samples")
        ax.set_ylabel("steps")
    ax.set_title("staleness")
    save(fig, "staleness.png")

    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for key, label in (("generation_tokens_per_s", "generation"), (TRAIN_TOKENS_PER_S, "training")):
        y = series[key]
        shown = ~np.isnan(y)
        if shown.any():
            ax.plot(minutes[shown], y[shown], label=label)
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("throughput")
    save(fig, "throughput.png")
    return written
