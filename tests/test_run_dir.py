"""The run directory is the project's, not the user's disk: a marker identifies a run's directory,
`--overwrite` deletes nothing else, `--resume` refuses a config that changes the run before writing
anything, and every user mistake of the CLI ends in one line (its traceback with --debug)."""

import json
import os
from pathlib import Path

import pytest

from areal_jax import storage
from areal_jax.cli import main
from areal_jax.config import load_experiment
from areal_jax.configuration import ConfigError, to_yaml
from areal_jax.exit_codes import EXIT_RESUMABLE, EXIT_USER_ERROR
from areal_jax.jobs import train
from areal_jax.models.hf_config import model_config_to_hf
from areal_jax.system.run_dir import (
    MARKER,
    RESUME_MAY_CHANGE,
    RunDirectoryError,
    check_run_location,
    prepare_run_dir,
    resume_conflicts,
)
from areal_jax.trainer.checkpoint import TrainCheckpointer

CONFIG = str(Path(__file__).parents[1] / "configs" / "train_cpu.yaml")
NO_CACHE = "compilation_cache_dir=null"


def _cfg(tmp_path, *overrides):
    return load_experiment(CONFIG, [f"output_dir={tmp_path}", *overrides])


def _listing(root):
    """Every path below `root` with its bytes (files) or None (directories)."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_new_run_refuses_an_earlier_run_unless_overwritten(tmp_path, capsys):
    """An old rollout log would feed a new trainer and old checkpoints would clash with new ones, so a new
    run over an earlier one stops before doing any work; --overwrite deletes it; --resume needs a checkpoint."""
    cfg = _cfg(tmp_path)
    run_dir = cfg.run_dir
    prepare_run_dir(cfg, resume=False, overwrite=False, latest_checkpoint=None)  # a fresh directory is fine
    assert json.loads((run_dir / MARKER).read_text())["areal_jax_version"]
    assert (run_dir / "config.yaml").read_text() == to_yaml(cfg)
    (run_dir / "rollout_log").mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirectoryError, match=r"earlier run \(rollout_log, metrics.jsonl\).*--resume.*--overwrite"):
        prepare_run_dir(cfg, resume=False, overwrite=False, latest_checkpoint=None)
    with pytest.raises(RunDirectoryError, match="nothing to resume"):
        prepare_run_dir(cfg, resume=True, overwrite=False, latest_checkpoint=None)
    with pytest.raises(RunDirectoryError, match="exclude each other"):
        prepare_run_dir(cfg, resume=True, overwrite=True, latest_checkpoint=3)
    before = _listing(run_dir)
    prepare_run_dir(cfg, resume=True, overwrite=False, latest_checkpoint=3)  # resumable: nothing touched
    assert _listing(run_dir) == before

    code = main(["train", CONFIG, f"output_dir={tmp_path}", NO_CACHE])
    assert code == EXIT_USER_ERROR and "holds an earlier run" in _one_line_error(capsys)
    assert _listing(run_dir) == before  # refused: nothing deleted
    prepare_run_dir(cfg, resume=False, overwrite=True, latest_checkpoint=None)
    assert sorted(os.listdir(run_dir)) == [MARKER, "config.yaml"]  # the earlier run is gone, a new one started


def test_overwrite_keeps_what_a_run_did_not_create(tmp_path):
    cfg = _cfg(tmp_path)
    run_dir = cfg.run_dir
    prepare_run_dir(cfg, resume=False, overwrite=False, latest_checkpoint=None)
    for name in ("checkpoints/3", "rollout_log", "rollout_log_unused/resume-2", "eval/step-2", "hf_final", "profile"):
        (run_dir / name).mkdir(parents=True)
    for name in ("metrics.jsonl", "trained_groups.jsonl", "checkpoints/3/state"):
        (run_dir / name).write_text("{}\n")
    (run_dir / "notes.txt").write_text("mine")
    prepare_run_dir(cfg, resume=False, overwrite=True, latest_checkpoint=None)
    assert sorted(os.listdir(run_dir)) == [MARKER, "config.yaml", "notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_directory_without_the_marker(tmp_path, capsys):
    """A user's directory that merely looks like a run (a checkpoints/ folder) is not deleted."""
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "model.pt").write_bytes(b"weights")
    (project / "train.py").write_text("print()")
    before = _listing(tmp_path)
    cfg = _cfg(tmp_path, "name=project")
    with pytest.raises(
        RunDirectoryError, match=rf"{project} has no \.areal-run marker.*train\.py.*nothing was deleted"
    ):
        prepare_run_dir(cfg, resume=False, overwrite=True, latest_checkpoint=None)
    code = main(["train", "--overwrite", CONFIG, f"output_dir={tmp_path}", "name=project", NO_CACHE])
    assert code == EXIT_USER_ERROR and "no .areal-run marker" in _one_line_error(capsys)
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("name", [".", "..", "", "  ", "/abs/run", "a/../..", "../sibling"])
def test_a_name_that_is_not_a_directory_of_its_own_is_refused(tmp_path, capsys, name):
    """Found by a user: `output_dir=D name=.` with --overwrite deleted every file in D."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)  # looks like an earlier run
    (out / MARKER).write_text("{}")  # even marked
    (out / "thesis.tex").write_text("years of work")
    before = _listing(tmp_path)
    with pytest.raises(ConfigError, match=r"^name: value .* is not a run name"):
        check_run_location(_cfg(out, f"name={name}"))
    code = main(["train", "--overwrite", CONFIG, f"output_dir={out}", f"name={name}", NO_CACHE])
    assert code == EXIT_USER_ERROR and "config error: name: " in _one_line_error(capsys)
    assert _listing(tmp_path) == before


def test_a_run_directory_that_holds_the_current_directory_is_refused(tmp_path, monkeypatch, capsys):
    work = tmp_path / "runs" / "work"
    (work / "src").mkdir(parents=True)
    (work / "rollout_log").mkdir()
    (work / MARKER).write_text("{}")
    before = _listing(tmp_path)
    monkeypatch.chdir(work / "src")
    for output_dir, name in ((tmp_path / "runs", "work"), (tmp_path / "runs" / "work", "src"), (tmp_path, "runs")):
        with pytest.raises(ConfigError, match="is or holds the current directory"):
            check_run_location(_cfg(output_dir, f"name={name}"))
        code = main(["train", "--overwrite", CONFIG, f"output_dir={output_dir}", f"name={name}", NO_CACHE])
        assert code == EXIT_USER_ERROR and "holds the current directory" in _one_line_error(capsys)
    assert _listing(tmp_path) == before


@pytest.fixture
def run_with_checkpoint(tmp_path, monkeypatch):
    """A run directory as `train` leaves it (marker, config.yaml of configs/train_cpu.yaml, a checkpoint),
    with `TrainCheckpointer.latest_in` reporting step 3 there."""
    run_dir = _cfg(tmp_path).run_dir
    (run_dir / "checkpoints" / "3").mkdir(parents=True)
    (run_dir / MARKER).write_text("{}")
    (run_dir / "config.yaml").write_text(to_yaml(load_experiment(CONFIG)))
    monkeypatch.setattr(TrainCheckpointer, "latest_in", classmethod(lambda cls, directory: 3))
    return run_dir


def test_resume_refuses_a_config_that_changes_the_run_before_writing(tmp_path, run_with_checkpoint, capsys):
    """Found by a user: `--resume model.hidden_size=32` overwrote the run's config.yaml before the restore
    failed, with the real error buried in a 314-line traceback."""
    before = _listing(tmp_path)
    code = main(["train", "--resume", CONFIG, f"output_dir={tmp_path}", "model.hidden_size=32", NO_CACHE])
    err = _one_line_error(capsys)
    assert code == EXIT_USER_ERROR
    assert "model.hidden_size: 64 -> 32" in err and "config.yaml" in err, err
    assert _listing(tmp_path) == before  # config.yaml bytes equal, nothing else written
    code = main(["train", "--resume", CONFIG, f"output_dir={tmp_path}", "seed=1", "trainer.optimizer.lr=0.1", NO_CACHE])
    assert code == EXIT_USER_ERROR and "seed: 0 -> 1; trainer.optimizer.lr: 0.001 -> 0.1" in _one_line_error(capsys)
    assert _listing(tmp_path) == before


def test_resume_accepts_settings_that_leave_the_run_the_same(tmp_path, run_with_checkpoint):
    before = _listing(tmp_path)
    overrides = ["train_steps=500", "train_checkpoint.every_steps=5", "mesh.fsdp=1", "rollout.engine.max_slots=8"]
    overrides += [
        "eval.every_steps=10",
        "reward.math.num_workers=8",
        "pipeline.poll_max_s=1.0",
        "name=async-arithmetic",
    ]
    prepare_run_dir(_cfg(tmp_path, *overrides), resume=True, overwrite=False, latest_checkpoint=3)
    assert _listing(tmp_path) == before  # config.yaml stays the run's


def test_resume_allow_list_covers_only_what_keeps_the_run():
    base = load_experiment(CONFIG)
    refused = ["model.num_layers=3", "hf_checkpoint=x", "tokenizer=y", "seed=3", "dataset.arithmetic_problems=8"]
    refused += [
        "rollout.workflow.n_samples=4",
        "rollout.staleness.max_head_offpolicyness=0",
        "trainer.ppo.eps_clip_high=0.3",
    ]
    for override in refused:
        key = override.split("=")[0]
        assert list(resume_conflicts(base, load_experiment(CONFIG, [override]))) == [key], override
    assert "mesh.*" in RESUME_MAY_CHANGE and "model.*" not in RESUME_MAY_CHANGE


def test_a_marker_is_written_on_resume_when_missing(tmp_path, run_with_checkpoint):
    (run_with_checkpoint / MARKER).unlink()
    prepare_run_dir(_cfg(tmp_path), resume=True, overwrite=False, latest_checkpoint=3)
    assert (run_with_checkpoint / MARKER).is_file()


# Each makes one mistake in `tmp_path` and returns (config file and overrides of `train`, what its line says).
def _missing_config_file(tmp_path):
    return [str(tmp_path / "missing.yaml")], "config error: cannot read config file"


def _hf_dir_without_config(tmp_path):
    (tmp_path / "hf").mkdir()
    return [CONFIG, f"hf_checkpoint={tmp_path / 'hf'}"], "config error: hf_checkpoint: "


def _hf_dir_without_weights(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(model_config_to_hf(load_experiment(CONFIG).model)))
    return [CONFIG, f"hf_checkpoint={tmp_path / 'hf'}"], "HF checkpoint: "


def _missing_dataset(tmp_path):
    files = f"dataset.files=[{{path: {tmp_path}/gsm8k.jsonl, mapping: gsm8k}}]"
    return [CONFIG, files], "gsm8k.jsonl' does not exist"


def _malformed_dataset(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "1+1?"}) + "\n")
    return [CONFIG, f"dataset.files=[{{path: {tmp_path}/gsm8k.jsonl, mapping: gsm8k}}]"], "dataset: "


def _output_dir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    return [CONFIG, f"output_dir={tmp_path}/file/runs"], "run directory: cannot write the run directory"


MISTAKES = [
    _missing_config_file,
    _hf_dir_without_config,
    _hf_dir_without_weights,
    _missing_dataset,
    _malformed_dataset,
    _output_dir_under_a_file,
]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda f: f.__name__.strip("_"))
def test_user_mistakes_end_in_one_line_and_debug_shows_the_traceback(tmp_path, capsys, mistake):
    args, expected = mistake(tmp_path)
    argv = ["train", args[0], f"output_dir={tmp_path}/runs", *args[1:], NO_CACHE]
    assert main(argv) == EXIT_USER_ERROR
    err = _one_line_error(capsys)
    assert err.startswith("areal-jax train: ") and expected in err, err
    assert main(["--debug", *argv]) == EXIT_USER_ERROR
    assert "Traceback" in capsys.readouterr().err


def test_a_read_only_output_dir_ends_in_one_line(tmp_path, capsys, monkeypatch):
    read_only = tmp_path / "ro"
    real_mkdir = Path.mkdir

    def refusing_mkdir(self, *args, **kwargs):  # root ignores mode bits, so the refusal is made here
        if read_only in (self, *self.parents):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refusing_mkdir)
    assert main(["train", CONFIG, f"output_dir={read_only}", NO_CACHE]) == EXIT_USER_ERROR
    assert "Permission denied" in _one_line_error(capsys)


def test_internal_errors_keep_their_traceback_and_a_signal_stop_is_resumable(tmp_path, monkeypatch):
    def broken(cfg, resume, overwrite):
        raise RuntimeError("a bug")

    monkeypatch.setattr(train, "run_async", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", CONFIG, f"output_dir={tmp_path}", NO_CACHE])

    def stopped(cfg, resume, overwrite):
        return train.RunSummary(0, 3, 0, 0.0, 0.0, 1.0, 0, 0, "metrics.jsonl", None, stopped_by_signal=True)

    monkeypatch.setattr(train, "run_async", stopped)
    assert main(["train", CONFIG, f"output_dir={tmp_path}", NO_CACHE]) == EXIT_RESUMABLE == 75


def test_a_run_directory_on_a_bucket_is_checked_and_overwritten_the_same_way(gcs):
    from tests.gcs_emulator import BUCKET

    output_dir = f"gs://{BUCKET}/{os.urandom(8).hex()}"
    cfg = load_experiment(CONFIG, [f"output_dir={output_dir}", "name=run"])
    run = cfg.run_location
    assert run == f"{output_dir}/run" and not str(cfg.run_dir).startswith("gs:")  # records: a local copy
    prepare_run_dir(cfg, resume=False, overwrite=False, latest_checkpoint=None)
    assert storage.names(run) == [MARKER, "config.yaml"]
    assert storage.read_text(storage.join(run, "config.yaml")) == to_yaml(cfg)
    for name in ("rollout_log/w_00000000_000000000000_1.arrayrecord", "metrics.jsonl", "checkpoints/3/x", "notes.txt"):
        storage.write_atomic(storage.join(run, name), "x")
    with pytest.raises(RunDirectoryError, match=r"earlier run \(checkpoints, rollout_log, metrics.jsonl\)"):
        prepare_run_dir(cfg, resume=False, overwrite=False, latest_checkpoint=None)
    changed = load_experiment(CONFIG, [f"output_dir={output_dir}", "name=run", "seed=7"])
    with pytest.raises(RunDirectoryError, match=r"differs from the run's gs://.*seed: 0 -> 7"):
        prepare_run_dir(changed, resume=True, overwrite=False, latest_checkpoint=3)
    prepare_run_dir(cfg, resume=False, overwrite=True, latest_checkpoint=None)
    assert storage.names(run) == [MARKER, "config.yaml", "notes.txt"]  # the user's file stays

    storage.remove(storage.join(run, MARKER))
    storage.write_atomic(storage.join(run, "metrics.jsonl"), "x")
    with pytest.raises(RunDirectoryError, match=r"has no \.areal-run marker.*notes\.txt.*nothing was deleted"):
        prepare_run_dir(cfg, resume=False, overwrite=True, latest_checkpoint=None)
    assert storage.names(run) == ["config.yaml", "metrics.jsonl", "notes.txt"]
