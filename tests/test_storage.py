"""`areal_jax.storage` on a local directory and on gs:// (a local GCS server), and the local copy of a gs://
run's records (`system/run_mirror.py`)."""

from __future__ import annotations

import uuid
from pathlib import Path

import gcsfs
import pytest
from etils import epath

from areal_jax import storage
from areal_jax.system.run_mirror import RunMirror, pull_records
from tests.gcs_emulator import BUCKET, GcsEmulator


@pytest.fixture(params=["local", "gs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "root")
    request.getfixturevalue("gcs")
    return f"gs://{BUCKET}/{uuid.uuid4().hex}"


def test_the_same_operations_mean_the_same_on_a_disk_and_a_bucket(root: str, tmp_path: Path) -> None:
    status = storage.join(root, "control", "rollout-0.json")
    assert not storage.exists(status) and storage.listing(root) == {}
    with pytest.raises(FileNotFoundError):
        storage.read_text(status)
    storage.write_atomic(status, '{"v": 1}')
    storage.write_atomic(status, '{"v": 2}')  # replaced whole
    assert storage.read_text(status) == '{"v": 2}'
    assert storage.is_dir(storage.join(root, "control")) and not storage.is_dir(status)
    assert storage.names(storage.join(root, "control")) == ["rollout-0.json"]
    entries = storage.listing(root)
    assert list(entries) == ["control"] and entries["control"][0]  # a directory

    storage.move(status, storage.join(root, "aside", "old.json"))
    assert not storage.exists(status) and storage.read_text(storage.join(root, "aside", "old.json")) == '{"v": 2}'
    assert storage.remove(storage.join(root, "aside", "old.json")) and not storage.remove(status)

    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.bin").write_bytes(b"\x00" * 1000)
    (tree / "sub" / "b.txt").write_text("b")
    if storage.is_remote(root):
        storage.upload_tree(tree, storage.join(root, "copy"))
        back = tmp_path / "back"
        storage.download_tree(storage.join(root, "copy"), back)
        assert (back / "a.bin").read_bytes() == b"\x00" * 1000 and (back / "sub" / "b.txt").read_text() == "b"
        with pytest.raises(FileExistsError):
            storage.upload(tree / "a.bin", storage.join(root, "copy", "a.bin"), exclusive=True)
        assert storage.files_below(storage.join(root, "copy")) == ["a.bin", "sub/b.txt"]
        storage.remove_tree(storage.join(root, "copy"))
        assert not storage.exists(storage.join(root, "copy"))


def test_a_listing_shows_what_another_process_wrote_after_it_also_through_etils(gcs: GcsEmulator) -> None:
    """Orbax lists weight versions through etils.epath, whose gs:// filesystem would cache the listing: a
    rollout server would then never see a new version. `storage` turns the cache off at import."""
    directory = f"gs://{BUCKET}/{uuid.uuid4().hex}/weights"
    storage.write_atomic(storage.join(directory, "1"), "x")
    assert [p.name for p in epath.Path(directory).iterdir()] == ["1"]
    assert storage.names(directory) == ["1"]
    another_process = gcsfs.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False)
    another_process.pipe_file(f"{directory[len('gs://') :]}/2", b"y")
    assert sorted(p.name for p in epath.Path(directory).iterdir()) == ["1", "2"]
    assert (epath.Path(directory) / "2").exists()
    assert storage.names(directory) == ["1", "2"]


def test_the_mirror_uploads_what_changed_whole_lines_only_and_a_resume_pulls_the_records(
    gcs: GcsEmulator, tmp_path: Path
) -> None:
    remote = f"gs://{BUCKET}/{uuid.uuid4().hex}/run"
    local = tmp_path / "copy"
    (local / "eval").mkdir(parents=True)
    (local / "old.txt").write_text("from an earlier run on this host")
    server_side = RunMirror(local, remote, every_s=3600, only=frozenset({"eval"}))  # a rollout server's
    (local / "eval" / "step-2.json").write_text("{}")
    (local / "metrics.jsonl").write_text('{"train/version": 1}\n')
    server_side.close()
    assert storage.files_below(remote) == ["eval/step-2.json"]  # its own entry only, nothing it found there

    trainer = RunMirror(local, remote, every_s=3600)  # what it finds counts as the bucket's already
    with (local / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"train/version": 2}\n{"train/version": 3')  # line 3 half-written
    (local / "warm_start" / "checkpoint").mkdir(parents=True)  # a shared entry's local copy: the bucket's own
    (local / "warm_start" / "checkpoint" / "model.safetensors").write_bytes(b"weights")
    trainer.sync()
    assert not storage.exists(storage.join(remote, "warm_start"))
    assert storage.read_text(storage.join(remote, "metrics.jsonl")).splitlines() == [
        '{"train/version": 1}',
        '{"train/version": 2}',
    ]
    with (local / "metrics.jsonl").open("a") as metrics:
        metrics.write("}\n")
    trainer.close()  # the last upload
    assert storage.read_text(storage.join(remote, "metrics.jsonl")).splitlines()[-1] == '{"train/version": 3}'
    assert trainer.uploads == 2 and not storage.exists(storage.join(remote, "old.txt"))

    for shared in ("checkpoints/3/x", "rollout_log/w_0.arrayrecord", "control/stop", "profile/trace.pb"):
        storage.write_atomic(storage.join(remote, shared), "not a record to pull")
    elsewhere = tmp_path / "other-host"
    (elsewhere / "stale.txt").parent.mkdir(parents=True)
    (elsewhere / "stale.txt").write_text("stale")
    assert pull_records(remote, elsewhere) == 2
    pulled = sorted(p.relative_to(elsewhere).as_posix() for p in elsewhere.rglob("*") if p.is_file())
    assert pulled == ["eval/step-2.json", "metrics.jsonl"]


def test_sync_returns_once_the_changed_files_are_on_the_bucket(gcs: GcsEmulator, tmp_path: Path) -> None:
    remote = f"gs://{BUCKET}/{uuid.uuid4().hex}/run"
    mirror = RunMirror(tmp_path, remote, every_s=3600)  # no periodic sync within the test
    try:
        for step in (1, 2):
            with (tmp_path / "metrics.jsonl").open("a") as metrics:
                metrics.write(f'{{"train/version": {step}}}\n')
            mirror.sync()  # what a checkpoint save waits for
            assert storage.read_text(storage.join(remote, "metrics.jsonl")).count("\n") == step
    finally:
        mirror.close()
