"""A run's paths come from one place: shared entries on the run location (gs:// kept), records in this process's
run directory, and every entry a run may create listed for `--overwrite` and the mirror."""

from __future__ import annotations

from pathlib import Path

from areal_jax.config import load_experiment
from areal_jax.run_layout import ENTRIES, SHARED_ENTRIES, RunLayout


def test_shared_entries_stay_on_the_run_location_and_records_in_the_local_copy(tmp_path):
    cfg = load_experiment("configs/train_cpu.yaml", ["output_dir=gs://bucket/runs", f"local_copy_dir={tmp_path}"])
    layout = cfg.layout
    assert layout.checkpoints == "gs://bucket/runs/" + cfg.name + "/checkpoints"
    assert layout.rollout_log.startswith("gs://") and layout.warm_start.startswith("gs://")
    assert layout.metrics == cfg.run_dir / "metrics.jsonl" and str(layout.metrics).startswith(str(tmp_path))
    local = RunLayout("/runs/a", Path("/runs/a"))
    assert local.hf_final == Path("/runs/a/hf_final") and local.weights == "/runs/a/weights"
    assert set(ENTRIES) > SHARED_ENTRIES and len(set(ENTRIES)) == len(ENTRIES)
