"""`areal-jax plan --calibrate`: the short calibration run, made on this machine with `launch local`.

One rollout server and the trainer, each on half of this machine's CPU cores (the launcher's default), with
the config's eta (a trainer does its host work during training with eta >= 1, while waiting with eta 0, so
the speeds it reaches differ), no checkpoints inside the run, no held-out evaluation, and the servers'
status written often enough for the generator's counters to follow every step. On an accelerator host both
roles would take every local device: calibrate there with the roles on their own devices instead
(`docs/distributed.md`) and pass that run's directory as `--calibration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from areal_jax.config import load_experiment
from areal_jax.planning.calibration import CalibrationError

SETTINGS = (
    "train_checkpoint.every_steps=1000000",
    "eval.every_steps=0",
    "report.plots=false",
    "cluster.status_every_s=0.25",
)


def calibrate(config_path: str | None, overrides: Sequence[str], steps: int) -> Path:
    """Run the calibration of a config (file and overrides) for `steps` steps into
    `<output_dir>/<name>-calibration` (replacing an earlier calibration there); its directory."""
    from areal_jax.jobs.launcher import launch_local

    name = f"{load_experiment(config_path, overrides).name}-calibration"
    overrides = [*overrides, f"name={name}", f"train_steps={steps}", *SETTINGS]
    cfg = load_experiment(config_path, [*overrides, "cluster.rollout_servers=1"])
    args = [*([config_path] if config_path is not None else []), *overrides]
    code = launch_local(cfg, args, rollout_servers=1, overwrite=True)
    if code != 0:
        raise CalibrationError(f"the calibration run {cfg.run_dir} exited with status {code} (its output is above)")
    return cfg.run_dir
