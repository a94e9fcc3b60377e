"""Verified training checkpoints: a corrupted newest checkpoint is rejected for the previous one, a NaN is
never saved, and a checkpoint without a manifest restores with a warning."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from areal_jax.sharding import MeshConfig, make_mesh
from areal_jax.trainer import checkpoint
from areal_jax.trainer.checkpoint import MANIFEST, CheckpointConfig, CheckpointError, TrainCheckpointer
from areal_jax.weights import abstract_target
from tests.test_train_checkpoint import assert_trees_equal, decoder_params

LOGGER = "areal_jax.trainer.checkpoint"


def states() -> tuple[dict, dict]:
    """Steps 1 and 2 of a small sharded state (the tiny decoder's params on a 2x2x2 mesh)."""
    params = decoder_params(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    return {"params": params}, {"params": jax.tree.map(lambda p: 2.0 * p + 1.0, params)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """A directory with checkpoints 1 and 2 (async saves), and their states."""
    directory = tmp_path_factory.mktemp("saved")
    state1, state2 = states()
    checkpointer = TrainCheckpointer(directory)
    checkpointer.save(1, state1, {"policy_version": 1})
    checkpointer.save(2, state2, {"policy_version": 2})
    checkpointer.close()
    return directory, state1, state2


def largest_data_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def overwrite_4kb(step_dir: Path) -> None:
    path = largest_data_file(step_dir)
    size = path.stat().st_size
    assert size > 8192
    with path.open("r+b") as f:
        f.seek(size // 2 - 2048)
        f.write(os.urandom(4096))


def truncate(step_dir: Path) -> None:
    path = largest_data_file(step_dir)
    os.truncate(path, path.stat().st_size // 2)


def delete_metadata(step_dir: Path) -> None:
    shutil.rmtree(step_dir / TrainCheckpointer.METADATA)


def delete_manifest_and_metadata(step_dir: Path) -> None:
    (step_dir / MANIFEST).unlink()
    delete_metadata(step_dir)


def test_manifests_are_written_after_async_saves(saved: tuple[Path, dict, dict]) -> None:
    directory, _, _ = saved
    for step in (1, 2):
        files = json.loads((directory / str(step) / MANIFEST).read_text())["files"]
        on_disk = {
            os.fspath(p.relative_to(directory / str(step)))
            for p in (directory / str(step)).rglob("*")
            if p.is_file() and p.name != MANIFEST
        }
        assert set(files) == on_disk
        assert "metadata/metadata" in files
    assert not list(directory.rglob(f".{MANIFEST}.tmp"))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (overwrite_4kb, "does not match its checksum"),
        (truncate, "bytes, its manifest says"),
        (delete_metadata, "is missing"),
        (delete_manifest_and_metadata, "Orbax could not read it"),
    ],
)
def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one(
    saved: tuple[Path, dict, dict],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    corrupt: Callable[[Path], None],
    reason: str,
) -> None:
    source, state1, _ = saved
    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    corrupt(directory / "2")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    checkpointer = TrainCheckpointer(directory)
    restored = checkpointer.restore_verified(abstract_target(state1))
    assert restored.step == 1 and restored.verified
    assert restored.metadata == {"policy_version": 1, "step": 1}
    assert [step for step, _ in restored.rejected] == [2] and reason in restored.rejected[0][1]
    assert any("checkpoint 2" in r.message and reason in r.message for r in caplog.records)
    assert_trees_equal(restored.state, state1)
    with pytest.raises(CheckpointError, match=f"checkpoint 2 .* is unusable: .*{reason}"):
        checkpointer.restore(abstract_target(state1), step=2)
    checkpointer.close()


def test_a_checkpoint_without_manifest_restores_with_a_warning(
    saved: tuple[Path, dict, dict], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source, state1, state2 = saved
    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    (directory / "2" / MANIFEST).unlink()  # as after a crash between Orbax's commit and the manifest
    caplog.set_level(logging.WARNING, logger=LOGGER)
    restored = TrainCheckpointer(directory).restore_verified(abstract_target(state1))
    assert restored.step == 2 and not restored.verified and restored.rejected == ()
    assert any("checkpoint 2" in r.message and "no manifest" in r.message for r in caplog.records)
    assert_trees_equal(restored.state, state2)


def test_a_nan_state_is_not_saved(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state1, state2 = states()
    poisoned = {"params": jax.tree.map(lambda p: p.at[0].set(jnp.nan), state2["params"])}
    checkpointer = TrainCheckpointer(tmp_path, CheckpointConfig(every_steps=2))
    checkpointer.save(1, state1, {})
    with pytest.raises(CheckpointError, match=r"refusing to save checkpoint 2 .*: non-finite values in .*params"):
        checkpointer.maybe_save(2, poisoned, {})
    with pytest.raises(CheckpointError, match=r"checkpoint 2 .*: non-finite values in \['inf'\]; .* stays 1$"):
        checkpointer.save(2, {"params": state2["params"], "inf": jnp.array([1.0, jnp.inf])}, {})
    checkpointer.close()
    assert TrainCheckpointer.latest_in(tmp_path) == 1
    caplog.set_level(logging.WARNING, logger=LOGGER)
    restored = TrainCheckpointer(tmp_path).restore_verified(abstract_target(state1))
    assert restored.step == 1 and restored.rejected == ()
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert_trees_equal(restored.state, state1)


def test_nan_on_disk_is_rejected_and_all_bad_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state1, state2 = states()
    poisoned = {"params": jax.tree.map(lambda p: p.at[0].set(jnp.nan), state2["params"])}
    checkpointer = TrainCheckpointer(tmp_path)
    checkpointer.save(1, state1, {})
    with monkeypatch.context() as patch:  # a NaN written before the save guard existed
        patch.setattr(checkpoint, "nonfinite_leaves", lambda tree: [])
        checkpointer.save(2, poisoned, {})
    checkpointer.close()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    restored = TrainCheckpointer(tmp_path).restore_verified(abstract_target(state1))
    assert restored.step == 1
    assert restored.rejected[0][0] == 2 and "non-finite values in" in restored.rejected[0][1]
    assert any("checkpoint 2" in r.message and "non-finite" in r.message for r in caplog.records)
    assert_trees_equal(restored.state, state1)

    overwrite_4kb(tmp_path / "1")
    with pytest.raises(CheckpointError, match=r"step 2: non-finite values in .*; step 1: .*checksum") as err:
        TrainCheckpointer(tmp_path).restore_verified(abstract_target(state1))
    assert [step for step, _ in err.value.rejected] == [2, 1]
    with pytest.raises(FileNotFoundError, match="of step 3 or later"):
        TrainCheckpointer(tmp_path).restore_verified(abstract_target(state1), min_step=3)
