"""The run directory `<output_dir>/<name>` of `areal-jax train`: where it may be, what marks it as a run's,
what `--overwrite` may delete, and which settings `--resume` may change.

A run writes the marker file `.areal-run` (JSON: when it was created, by which areal-jax version) into its
directory when it starts. `--overwrite` deletes only a marked directory, and in it only what a run creates
(`RUN_ENTRIES`); a directory without the marker is refused, naming the files it holds, and nothing is
deleted. `--resume` compares the new config with the run's `config.yaml`: only the keys matching
`RESUME_MAY_CHANGE` may differ. Every check runs before anything is written.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areal_jax import __version__, storage
from areal_jax.config import ExperimentConfig, load_experiment
from areal_jax.configuration import ConfigError, to_dict, to_yaml
from areal_jax.run_layout import CONFIG_FILE, ENTRIES, MARKER, SHARED_ENTRIES, WARM_START_DIR  # noqa: F401

logger = logging.getLogger(__name__)

RUN_ENTRIES = ENTRIES
# The entries that mean an earlier run got going (its config and marker alone are a run that never started;
# a warm start alone is what `areal-jax sft` leaves for the run to use).
_EARLIER_RUN = tuple(name for name in RUN_ENTRIES if name not in (CONFIG_FILE, MARKER, WARM_START_DIR))

# The config keys (fnmatch patterns over dotted keys) whose value may differ between a run's config.yaml
# and the config of `--resume`. Everything else fixes the model, the tokenizer, the data order or the
# algorithm (model.*, hf_checkpoint, tokenizer, seed, dataset.*, rollout.workflow.*, rollout.staleness.*,
# trainer.*, ...), and a resumed run with other values would not continue the same run.
RESUME_MAY_CHANGE = (
    # where the run lives, how long it goes on, what is recorded around it
    "name",
    "output_dir",
    "local_copy_dir",
    "local_copy_upload_s",
    "train_steps",
    "train_checkpoint.*",
    "profile.*",
    "report.*",
    "eval.*",
    "compilation_cache_dir",
    "generation.*",  # `demo` only
    # devices: a checkpoint restores onto any mesh and any inference:trainer split
    "mesh.*",
    "rollout.inference_share",
    "rollout.trainer_share",
    "distributed.*",
    "cluster.weights_keep",
    "cluster.weights_poll_s",
    "cluster.start_timeout_s",
    "cluster.restarts",
    "cluster.status_every_s",
    "cluster.floors_poll_s",
    # speed and memory only: the same values are computed
    "model.remat",
    "model.logprob_chunk",
    "rollout.engine.max_slots",
    "rollout.engine.min_prefill_bucket",
    "rollout.engine.max_prefill_batch",
    "rollout.engine.row_bucket_growth",
    "rollout.workflow.reward_workers",
    "rollout.log.fsync",
    "pipeline.poll_initial_s",
    "pipeline.poll_max_s",
    "pipeline.idle_timeout_s",
    "pipeline.gap_timeout_s",
    "reward.*.num_workers",
    "reward.*.timeout_s",
    "reward.*.startup_timeout_s",
    "reward.*.start_method",
    "reward.code.max_parallel",
    "reward.code.work_root",
)


class RunDirectoryError(Exception):
    """The run directory does not fit the request (a new run over an old one, `--overwrite` of a directory
    that is not a run's, a resume with nothing to resume or with another config, a directory that cannot
    be written); raised before any work is done."""


def check_run_location(cfg: ExperimentConfig) -> None:
    """Refuse a run directory that is not a directory of its own below `output_dir`: `name` empty, `.`,
    absolute or with `..`, or a run directory that is (or holds) the output root or the current directory."""
    name = cfg.name
    parts = Path(name).parts
    if not name.strip() or not parts or Path(name).is_absolute() or ".." in parts:
        raise ConfigError(
            "name",
            f"value {name!r} is not a run name; expected a relative path below output_dir without '..' (e.g. 'my-run')",
        )
    if storage.is_remote(cfg.run_location):
        return  # a bucket prefix holds neither output_dir's parent on this host nor the current directory
    run_dir = cfg.run_dir.resolve()
    for what, path in (("output_dir", Path(cfg.output_dir)), ("the current directory", Path.cwd())):
        place = path.resolve()
        if run_dir == place or run_dir in place.parents:
            raise ConfigError(
                "name",
                f"the run directory {cfg.run_dir} is or holds {what} {place}; --overwrite would delete it; "
                "pick another name=... / output_dir=...",
            )


def _listing(names: list[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _entries(run_location: str) -> list[str]:
    return sorted(name + ("/" if is_dir else "") for name, (is_dir, _) in storage.listing(run_location).items())


def _previous_run(run_location: str) -> str | None:
    """What an earlier run left in `run_location` (None when nothing)."""
    found = [name for name in _EARLIER_RUN if storage.exists(storage.join(run_location, name))]
    return ", ".join(found) or None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(old: ExperimentConfig, new: ExperimentConfig) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (old value, new value) for every setting that differs."""
    before, after = _flatten(to_dict(old)), _flatten(to_dict(new))
    keys = sorted(before.keys() | after.keys())
    return {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}


def resume_conflicts(old: ExperimentConfig, new: ExperimentConfig) -> dict[str, tuple[Any, Any]]:
    """The changes that `--resume` refuses: those not matching `RESUME_MAY_CHANGE`."""
    return {
        key: values
        for key, values in config_changes(old, new).items()
        if not any(fnmatch.fnmatchcase(key, pattern) for pattern in RESUME_MAY_CHANGE)
    }


def _short(value: Any, most: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def _check_resume_config(cfg: ExperimentConfig, saved: str) -> None:
    if not storage.exists(saved):
        logger.warning("%s not found: the config of the resumed run cannot be compared with its own", saved)
        return
    try:
        old = load_experiment(saved)  # local or gs://
    except ConfigError as err:
        raise RunDirectoryError(
            f"cannot read the run's config {saved} ({err}); fix it, or remove it to resume unchecked"
        ) from None
    conflicts = resume_conflicts(old, cfg)
    if conflicts:
        changed = "; ".join(f"{key}: {_short(a)} -> {_short(b)}" for key, (a, b) in conflicts.items())
        raise RunDirectoryError(
            f"--resume with a config that differs from the run's {saved} in {changed}; these settings fix the "
            "model, data order or algorithm of a run (allowed to change: areal_jax.system.run_dir.RESUME_MAY_CHANGE); "
            "start a new run with another name=... instead"
        )
    allowed = config_changes(old, cfg)
    if allowed:
        logger.info("resuming with changed settings: %s", ", ".join(allowed))


def _delete_run(run_location: str) -> None:
    """Delete what a run created in the marked `run_location` (the directory too when nothing else is in it)."""
    foreign = [name for name in _entries(run_location) if name.rstrip("/") not in RUN_ENTRIES]
    local = not storage.is_remote(run_location)
    if not foreign and local and not Path(run_location).is_symlink():
        logger.warning("--overwrite: deleting the earlier run %s", run_location)
        shutil.rmtree(run_location)
        return
    if foreign:
        logger.warning("--overwrite: deleting the earlier run in %s, keeping %s", run_location, _listing(foreign))
    else:
        logger.warning("--overwrite: deleting the earlier run %s", run_location)
    for name in RUN_ENTRIES:
        path = storage.join(run_location, name)
        if local and Path(path).is_symlink():
            Path(path).unlink()
        elif storage.is_dir(path):
            storage.remove_tree(path)
        else:
            storage.remove(path)


def _refuse_unmarked(run_dir: str, previous: str) -> RunDirectoryError:
    foreign = [name for name in _entries(run_dir) if name.rstrip("/") not in RUN_ENTRIES]
    holds = f"files that are not a run's: {_listing(foreign)}" if foreign else f"only a run's files ({previous})"
    return RunDirectoryError(
        f"--overwrite refused: {run_dir} has no {MARKER} marker, so it is not known to be a run directory; "
        f"it holds {holds}; nothing was deleted: delete it yourself, or pick another name=... / output_dir=..."
    )


def _write_marker(location: str) -> None:
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    storage.write_atomic(location, json.dumps({"created": created, "areal_jax_version": __version__}) + "\n")


def prepare_run_dir(cfg: ExperimentConfig, resume: bool, overwrite: bool, latest_checkpoint: int | None) -> None:
    """Check `cfg.run_dir` for the request, then start the run there: create it with its marker and (for a
    new run) its `config.yaml`.

    A new run needs a directory without an earlier run (an old rollout log would feed the new trainer, old
    checkpoints would clash with new ones): refuse, or with `overwrite` delete the earlier run first, if
    the directory is marked as a run's. A resume needs a checkpoint (`latest_checkpoint`) and a config
    that differs from the run's only in `RESUME_MAY_CHANGE`. Every refusal comes before anything is written.
    """
    start_run_dir(cfg, check_run_dir(cfg, resume, overwrite, latest_checkpoint))


@dataclasses.dataclass(frozen=True)
class RunDirPlan:
    """What `start_run_dir` does, decided by `check_run_dir` (which writes nothing)."""

    resume: bool
    previous: str | None  # what an earlier run left (deleted by a new run: --overwrite)


def check_run_dir(cfg: ExperimentConfig, resume: bool, overwrite: bool, latest_checkpoint: int | None) -> RunDirPlan:
    """The refusals of `prepare_run_dir`, writing nothing (every trainer process checks; process 0 starts)."""
    check_run_location(cfg)
    run_dir = cfg.run_location
    if resume and overwrite:
        raise RunDirectoryError("--resume and --overwrite exclude each other")
    previous = _previous_run(run_dir)
    if resume:
        if latest_checkpoint is None:
            raise RunDirectoryError(
                f"nothing to resume: no training checkpoint in {cfg.layout.checkpoints}"
                + (f" (found: {previous}); start over with --overwrite" if previous else "")
            )
        _check_resume_config(cfg, cfg.layout.config_file)
    elif previous is not None:
        if not overwrite:
            raise RunDirectoryError(
                f"{run_dir} holds an earlier run ({previous}); continue it with --resume, start over with "
                "--overwrite (deletes it), or pick another name=... / output_dir=..."
            )
        if not storage.exists(cfg.layout.marker):
            raise _refuse_unmarked(run_dir, previous)
    return RunDirPlan(resume, previous)


def start_run_dir(cfg: ExperimentConfig, plan: RunDirPlan) -> None:
    """Start the run in `cfg.run_dir` as `check_run_dir` planned it (delete an earlier run, the marker, the
    config)."""
    run_dir, resume, previous = cfg.run_location, plan.resume, plan.previous
    try:
        if previous is not None and not resume:
            _delete_run(run_dir)
        storage.make_dirs(run_dir)
        if not resume or not storage.exists(cfg.layout.marker):
            _write_marker(cfg.layout.marker)
        if not resume:
            storage.write_atomic(cfg.layout.config_file, to_yaml(cfg))
    except OSError as err:
        where = f" ({err.filename})" if err.filename and str(err.filename) != run_dir else ""
        raise RunDirectoryError(f"cannot write the run directory {run_dir}{where}: {err.strerror or err}") from err
