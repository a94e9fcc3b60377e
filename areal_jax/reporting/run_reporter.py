"""What a training run shows and writes: `RunReporter` takes each step's flat stats and the end of the run.

The trainer loop calls `reporter.log(step, stats)` once per step (`stats`: a flat `dict[str, float]` such as
`rollout/reward_mean`, `train/loss`, `generator/emitted_tokens`, `time/wall`), `reporter.log_evaluation(step,
scalars)` for each held-out evaluation of the rollout side once it finished (`eval/pass@1`, ...; the step of
the version it evaluated, 0 for the starting policy) and `reporter.close(summary_lines)` at the end. The
reporter writes, into the run directory:

    <run_dir>/
      metrics.jsonl    one JSON line per step: the step's stats as given (`train/version` is the step);
                       a held-out evaluation's own line (`log_evaluation`: its `eval/...` scalars and the
                       evaluated version's step) whenever it finished, possibly after later steps' lines;
                       a resumed run keeps the lines up to its checkpoint and appends the rest
      tensorboard/     TensorBoard event files, every scalar of a step at that step, flushed every step
                       (`tensorboard --logdir <run_dir>/tensorboard`); a tag is its key with characters that
                       TensorBoard refuses made `_` (`eval/pass@1` -> `eval/pass_1`); a resumed run writes a
                       new file that hides the steps after its checkpoint
      train.log        every log record of the run (live display or not), appended across resumes
      plots/           PNGs written at the end (`report.plots`): reward.png (reward, correct rate and
                       held-out pass@1 against step and wall time), staleness.png (samples trained per
                       staleness, from `pipeline/kept_by_staleness/<k>`, else the per-step mean staleness),
                       throughput.png (generation and training tokens/s against wall time)
      wandb/           Weights & Biases files, only with `report.wandb_project` (the run id is kept in
                       wandb/run-id so a resumed run continues the same W&B run)

While the run goes on, a live display on stderr (`report.live`; `auto`: when stderr is a terminal) shows
the step and ETA, reward, correct rate, held-out pass@1, staleness, generation and training tokens/s, the
generator queue and interruptions; log records then go to train.log only, except warnings and errors,
which are printed above the display. At the end a summary on stdout names every file the run wrote.

Wall time (`time/wall`) and the generator counters (`generator/emitted_tokens`, `generator/interruptions`)
start again from zero in a resumed process; plots join the pieces into one time axis, and rates are taken
within a piece.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.logging import RichHandler
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from areal_jax.configuration import ConfigError
from areal_jax.jsonl import keep_upto
from areal_jax.reporting.metric_keys import (
    CORRECT,
    EVAL_PREFIX,
    HELDOUT,
    INTERRUPTIONS,
    QUEUE,
    REWARD,
    STALENESS_MAX,
    STALENESS_MEAN,
    STEP_KEY,
    TRAIN_TOKENS_PER_S,
    generation_rate,
    is_evaluation,
)
from areal_jax.reporting.plots import History, run_series, write_plots
from areal_jax.run_layout import LOG_FILE, METRICS_FILE, PLOTS_DIR, REPORT_OUTPUTS, TENSORBOARD_DIR, WANDB_DIR
from areal_jax.system_config import ReportConfig

logger = logging.getLogger(__name__)

OUTPUTS = REPORT_OUTPUTS

_TAG_REFUSED = re.compile(r"[^-/\w.]")
_WANDB_EVAL_STEP = "eval/step"  # W&B's x-axis of the evaluations, which arrive after later steps
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _LatestMessage(logging.Handler):
    """Keeps the newest INFO message (one string, replaced whole: the display's thread reads it)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.latest = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.latest = record.getMessage()


class RunReporter:
    """Everything a run shows and writes (see the module docstring). `start_step` is the step a resumed run
    continues from (0: a new run); `hparams` go to W&B as the run's config. Use as a context manager or
    call `close` in a `finally`."""

    def __init__(
        self,
        config: ReportConfig,
        run_dir: str | os.PathLike[str],
        total_steps: int,
        *,
        start_step: int = 0,
        name: str | None = None,
        hparams: Mapping[str, Any] | None = None,
        console: Console | None = None,
    ):
        self.config = config
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.start_step = start_step
        self.metrics_path = self.run_dir / METRICS_FILE
        self.tensorboard_dir = self.run_dir / TENSORBOARD_DIR
        self.log_path = self.run_dir / LOG_FILE
        self.plots_dir = self.run_dir / PLOTS_DIR
        self.console = console or Console(stderr=True)
        self.plots: list[Path] = []
        self.plot_data: dict[str, np.ndarray] = {}
        self.closed = False
        wandb = _import_wandb(config.wandb_project) if config.wandb_project else None  # before writing anything

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.wandb_run = _start_wandb(wandb, config.wandb_project, self.run_dir, name, hparams) if wandb else None
        self.log_handler = logging.FileHandler(self.log_path, mode="a", encoding="utf-8")
        self.log_handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        logging.getLogger().addHandler(self.log_handler)

        self.history: History = _keep_steps_upto(self.metrics_path, start_step)
        self.metrics = self.metrics_path.open("a", encoding="utf-8")
        SummaryWriter = _tensorboardx_writer_class()
        self.tensorboard = SummaryWriter(
            str(self.tensorboard_dir),
            purge_step=start_step + 1,  # TensorBoard hides what an earlier process wrote after the checkpoint
            flush_secs=3600,
            filename_suffix=f".from-step-{start_step:09d}",  # one file per process, even within one second
        )

        self.session_started = time.monotonic()
        self.session_steps: list[tuple[int, float]] = []  # (step, monotonic time) of this process's steps
        self.heldout: float | None = _last_value(self.history, HELDOUT)
        self.last_step = start_step
        self.display_values: dict[str, str] = {}  # the display's text of the latest step, by label
        self.live: Live | None = None
        self.muted: list[logging.Handler] = []
        self.warnings_handler: logging.Handler | None = None
        self.status_handler: _LatestMessage | None = None
        if config.live == "always" or (config.live == "auto" and sys.stderr.isatty()):
            self._start_live()

    def _write_tensorboard(self, step: int, stats: Mapping[str, float]) -> None:
        """Every scalar of the step in one event, flushed: an `add_scalar` per key (~100 keys) cost ~10 ms a
        step, a twentieth of a small trainer's step."""
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.summary import scalar

        values = [scalar(tensorboard_tag(k), float(v)).value[0] for k, v in stats.items() if isinstance(v, int | float)]
        self.tensorboard._get_file_writer().add_summary(Summary(value=values), step)  # SummaryWriter's own writer
        self.tensorboard.flush()

    def __enter__(self) -> RunReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self, step: int, stats: Mapping[str, float]) -> None:
        """Record step `step` (1-based, after its update): metrics.jsonl, TensorBoard, W&B and the display."""
        stats = dict(stats)
        self.metrics.write(json.dumps(stats) + "\n")
        self.metrics.flush()
        self._write_tensorboard(step, stats)
        if self.wandb_run is not None:
            self.wandb_run.log(stats, step=step)
        previous = next((line for _, line in reversed(self.history) if not is_evaluation(line)), None)
        self.history.append((step, stats))
        self.session_steps.append((step, time.monotonic()))
        if HELDOUT in stats:
            self.heldout = stats[HELDOUT]
        self.last_step = step
        self.display_values = self._display_values(step, stats, previous)
        if self.live is not None:
            self.live.refresh()
        values = self.display_values
        logger.info(
            "step %s reward %s correct %s staleness %s loss %s, %s training tok/s, %s generation tok/s",
            values["step"],
            values["reward"],
            values["correct"],
            values["staleness mean/max"].replace(" ", ""),
            _fmt(stats.get("train/loss"), ".4f"),
            values["training tok/s"],
            values["generation tok/s"],
        )

    def log_evaluation(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record a held-out evaluation of the version of step `step` (`eval/...` scalars), finished now:
        its own metrics.jsonl line, TensorBoard at that step, W&B against `eval/step`."""
        line = {STEP_KEY: step, **{key: float(value) for key, value in scalars.items() if key.startswith(EVAL_PREFIX)}}
        self.metrics.write(json.dumps(line) + "\n")
        self.metrics.flush()
        scalars = {k: v for k, v in line.items() if k != STEP_KEY}
        self._write_tensorboard(step, scalars)
        if self.wandb_run is not None:
            self.wandb_run.log({**scalars, _WANDB_EVAL_STEP: step})
        newest = step >= max(self.evaluated_steps(), default=-1)
        self.history.append((step, line))
        if HELDOUT in line and newest:
            self.heldout = line[HELDOUT]
            if self.display_values:  # shown now: the last step's evaluation finishes after its line
                self.display_values["held-out pass@1"] = _fmt(self.heldout, ".3f")
                if self.live is not None:
                    self.live.refresh()

    def evaluated_steps(self) -> set[int]:
        """The steps whose held-out evaluation metrics.jsonl has (this run's and, resumed, the kept ones)."""
        return {step for step, stats in self.history if is_evaluation(stats)}

    def close(self, summary_lines: Sequence[str] = ()) -> None:
        """End the run's reporting: stop the display, write the plots, close every file, and print a summary
        naming each output (then `summary_lines`, e.g. the checkpoints and the exported policy)."""
        if self.closed:
            return
        self.closed = True
        self._stop_live()
        self.metrics.close()
        self.tensorboard.close()
        if self.config.plots and self.history:
            try:
                self.plot_data = run_series(self.history)
                self.plots = write_plots(self.plot_data, self.plots_dir)
            except Exception:  # a failed plot must not hide how the run ended
                logger.exception("could not write the plots into %s", self.plots_dir)
        wandb_url = None
        if self.wandb_run is not None:
            wandb_url = getattr(self.wandb_run, "url", None)
            self.wandb_run.finish()
        logging.getLogger().removeHandler(self.log_handler)
        self.log_handler.close()
        steps = sum(not is_evaluation(stats) for _, stats in self.history)
        lines = [
            f"run directory: {self.run_dir}",
            f"  metrics:     {self.metrics_path} ({steps} step{'s' * (steps != 1)})",
            f"  tensorboard: {self.tensorboard_dir} (tensorboard --logdir {self.tensorboard_dir})",
            f"  log:         {self.log_path}",
        ]
        if self.plots:
            lines.append(f"  plots:       {', '.join(str(p) for p in self.plots)}")
        if wandb_url:
            lines.append(f"  wandb:       {wandb_url}")
        lines.extend(f"  {line}" for line in summary_lines)
        print("\n".join(lines), file=sys.stdout, flush=True)

    def renderable(self) -> RenderableType:
        """The live display of the latest step: progress and ETA, then the run's vital signs."""
        values = self.display_values
        if not values:
            latest = self.status_handler.latest if self.status_handler is not None else ""
            return Text(
                f"step {self.start_step}/{self.total_steps}: waiting for the first step"
                + (f" ({latest})" if latest else "")
            )
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text(f"step {values['step']}", style="bold"),
            ProgressBar(total=max(self.total_steps, 1), completed=self.last_step, width=30),
            Text(f"elapsed {_duration(time.monotonic() - self.session_started)}  ETA {values['ETA']}"),
        )
        body = Table.grid(padding=(0, 1))
        labels = [
            ("reward", "correct", "held-out pass@1", "staleness mean/max"),
            ("generation tok/s", "training tok/s", "queue", "interruptions"),
        ]
        for row in labels:
            cells: list[RenderableType] = []
            for label in row:
                cells += [Text(label, style="dim"), Text(values[label], style="bold")]
            body.add_row(*cells)
        return Group(head, body)

    def _display_values(
        self, step: int, stats: Mapping[str, float], previous: Mapping[str, float] | None
    ) -> dict[str, str]:
        step_seconds = _mean_step_seconds(self.session_steps, stats)
        eta = step_seconds * max(self.total_steps - step, 0) if step_seconds is not None else None
        staleness = f"{_fmt(stats.get(STALENESS_MEAN), '.2f')} / {_fmt(stats.get(STALENESS_MAX), '.0f')}"
        return {
            "step": f"{step}/{self.total_steps}",
            "ETA": _duration(eta),
            "reward": _fmt(stats.get(REWARD), ".3f"),
            "correct": _fmt(stats.get(CORRECT), ".3f"),
            "held-out pass@1": _fmt(self.heldout, ".3f"),
            "staleness mean/max": staleness,
            "generation tok/s": _fmt(generation_rate(previous, stats), ",.0f"),
            "training tok/s": _fmt(stats.get(TRAIN_TOKENS_PER_S), ",.0f"),
            "queue": _fmt(stats.get(QUEUE), ".0f"),
            "interruptions": _fmt(stats.get(INTERRUPTIONS), ".0f"),
        }

    def _start_live(self) -> None:
        """Show the display; console log handlers step aside (warnings still print, above the display)."""
        root = logging.getLogger()
        streams = {sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__}
        self.muted = [
            h
            for h in root.handlers
            if type(h) is logging.StreamHandler and getattr(h, "stream", None) in streams  # not files, not captures
        ]
        for handler in self.muted:
            root.removeHandler(handler)
        self.warnings_handler = RichHandler(console=self.console, level=logging.WARNING, show_path=False)
        root.addHandler(self.warnings_handler)
        self.status_handler = _LatestMessage()  # before the first step: what the start is doing
        root.addHandler(self.status_handler)
        self.live = Live(console=self.console, get_renderable=self.renderable, refresh_per_second=1)
        self.live.start()

    def _stop_live(self) -> None:
        if self.live is None:
            return
        self.live.stop()
        self.live = None
        root = logging.getLogger()
        for added in (self.warnings_handler, self.status_handler):
            if added is not None:
                root.removeHandler(added)
        for handler in self.muted:
            root.addHandler(handler)
        self.muted = []


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a stats key: characters outside `[A-Za-z0-9_./-]` become `_`."""
    return _TAG_REFUSED.sub("_", key).lstrip("/")


def _tensorboardx_writer_class() -> Any:
    """tensorboardX's SummaryWriter, imported without torch: the package imports torch when it is installed
    (only to accept its tensors; we write floats), which cost 5-7 s of start-up and 2-3 s of interpreter exit
    per process here. A process that already has torch keeps it."""
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError, which it catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _import_wandb(project: str) -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ConfigError(
            "report.wandb_project",
            f"is {project!r} but wandb is not installed; pip install wandb, or leave report.wandb_project empty",
        ) from err
    return wandb


def _start_wandb(wandb: Any, project: str, run_dir: Path, name: str | None, hparams: Mapping[str, Any] | None) -> Any:
    """A W&B run in `<run_dir>/wandb`; a resumed run continues the W&B run whose id is kept there."""
    directory = run_dir / WANDB_DIR
    directory.mkdir(parents=True, exist_ok=True)
    id_file = directory / "run-id"
    run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=project,
        name=name or run_dir.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        config=dict(hparams or {}),
    )
    run.define_metric(_WANDB_EVAL_STEP)
    run.define_metric(f"{EVAL_PREFIX}*", step_metric=_WANDB_EVAL_STEP)
    return run


def _keep_steps_upto(path: Path, step: int) -> History:
    """The lines of metrics.jsonl up to `step`, as (step, stats); later ones are removed from the file."""
    return [(int(stats.get(STEP_KEY, line)), stats) for line, stats in enumerate(keep_upto(path, step, STEP_KEY), 1)]


def _last_value(history: History, key: str) -> float | None:
    return next((stats[key] for _, stats in reversed(history) if key in stats), None)


def _mean_step_seconds(session_steps: list[tuple[int, float]], stats: Mapping[str, float]) -> float | None:
    """Mean seconds per step of this process (between its logged steps), else the step's own step time."""
    if len(session_steps) >= 2:
        (first_step, first_t), (last_step, last_t) = session_steps[0], session_steps[-1]
        if last_step > first_step:
            return (last_t - first_t) / (last_step - first_step)
    return stats.get("train/step_time")


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    return str(datetime.timedelta(seconds=round(seconds)))
