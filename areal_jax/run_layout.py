"""Every entry of a run directory, named once: the shared directory (`ExperimentConfig.run_location`, local or
gs://: what crosses processes and hosts) and this process's records (`ExperimentConfig.run_dir`: the shared
directory itself, or its local copy for a gs:// run, uploaded by `system.run_mirror`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from areal_jax import storage

MARKER = ".areal-run"
CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
ROLLOUT_LOG_DIR = "rollout_log"
ROLLOUT_LOG_UNUSED_DIR = "rollout_log_unused"  # a resumed run's set-aside log records
WEIGHTS_DIR = "weights"  # the trainer role's weight versions
CONTROL_DIR = "control"  # status and end markers of the roles' processes
TRAINED_GROUPS_FILE = "trained_groups.jsonl"  # which prompts each step trained on
EVAL_DIR = "eval"
HF_FINAL_DIR = "hf_final"
PROFILE_DIR = "profile"
WARM_START_DIR = "warm_start"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LOG_FILE = "train.log"
PLOTS_DIR = "plots"
WANDB_DIR = "wandb"
REPORT_OUTPUTS = (METRICS_FILE, TENSORBOARD_DIR, LOG_FILE, PLOTS_DIR, WANDB_DIR)  # everything a reporter creates
ENTRIES = (  # what a run creates in its directory
    CHECKPOINTS_DIR,
    ROLLOUT_LOG_DIR,
    ROLLOUT_LOG_UNUSED_DIR,
    WEIGHTS_DIR,
    CONTROL_DIR,
    TRAINED_GROUPS_FILE,
    EVAL_DIR,
    HF_FINAL_DIR,
    PROFILE_DIR,
    WARM_START_DIR,
    *REPORT_OUTPUTS,
    CONFIG_FILE,
    MARKER,
)  # all that `--overwrite` deletes
# The entries that cross between processes and hosts, written straight to the run directory (on gs:// too); the
# others are this process's records, which a gs:// run writes into its local copy (`system/run_mirror.py`).
SHARED_ENTRIES = frozenset(
    (
        CHECKPOINTS_DIR,
        ROLLOUT_LOG_DIR,
        ROLLOUT_LOG_UNUSED_DIR,
        WEIGHTS_DIR,
        CONTROL_DIR,
        WARM_START_DIR,
        CONFIG_FILE,
        MARKER,
    )
)


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The paths of one run: `shared` entries as `storage` locations (str), `local` records as Paths."""

    shared: storage.Location
    local: Path

    def _shared(self, name: str) -> str:
        return storage.join(self.shared, name)

    @property
    def marker(self) -> str:
        return self._shared(MARKER)

    @property
    def config_file(self) -> str:
        return self._shared(CONFIG_FILE)

    @property
    def checkpoints(self) -> str:
        return self._shared(CHECKPOINTS_DIR)

    @property
    def rollout_log(self) -> str:
        return self._shared(ROLLOUT_LOG_DIR)

    @property
    def rollout_log_unused(self) -> str:
        return self._shared(ROLLOUT_LOG_UNUSED_DIR)

    @property
    def weights(self) -> str:
        return self._shared(WEIGHTS_DIR)

    @property
    def metrics(self) -> Path:
        return self.local / METRICS_FILE

    @property
    def trained_groups(self) -> Path:
        return self.local / TRAINED_GROUPS_FILE

    @property
    def hf_final(self) -> Path:
        return self.local / HF_FINAL_DIR

    @property
    def eval_dir(self) -> Path:
        return self.local / EVAL_DIR

    @property
    def profile(self) -> Path:
        return self.local / PROFILE_DIR

    @property
    def warm_start(self) -> str:
        return self._shared(WARM_START_DIR)
