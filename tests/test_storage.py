"""`areal_jax.storage` on a local directory, on gs:// (a local GCS server) and on memory://, and the local copy
of a gs:// run's records (`system/run_mirror.py`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import gcsfs
import pytest
from etils import epath

from areal_jax import storage
from areal_jax.system.run_mirror import RunMirror, pull_records
from tests.gcs_emulator import BUCKET, GcsEmulator


@pytest.fixture(params=["local", "gs", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A directory that does not exist yet: on a disk, on a bucket, or in fsspec's memory filesystem (no
    branch of `storage` names it: the same fsspec calls serve every kind)."""
    if request.param == "local":
        yield str(tmp_path / "root")
    elif request.param == "gs":
        request.getfixturevalue("gcs")
        yield f"gs://{BUCKET}/{uuid.uuid4().hex}"
    else:
        location = f"memory://{uuid.uuid4().hex}"
        yield location
        storage.remove_tree(location)  # the memory filesystem is one store for the whole process


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


def test_edges_mean_the_same_everywhere(root: str, tmp_path: Path) -> None:
    """What a listing holds, what a missing or mistaken location gives, on every kind of location."""
    assert storage.names(root) == [] and not storage.is_dir(root) and storage.read_json(storage.join(root, "x")) is None
    storage.remove_tree(root)  # nothing there: nothing to do
    assert not storage.remove(storage.join(root, "x"))
    before_ns = time.time_ns()
    storage.write_json_atomic(storage.join(root, "a.json"), {"b": 1, "a": 2})
    storage.write_json_atomic(storage.join(root, "a.json"), {"b": 1, "a": 3})
    storage.make_dirs(storage.join(root, "empty", "below"))
    assert storage.read_text(storage.join(root, "a.json")) == '{"a": 3, "b": 1}'
    assert storage.read_json(storage.join(root, "a.json")) == {"a": 3, "b": 1}
    assert storage.read_bytes(storage.join(root, "a.json")) == b'{"a": 3, "b": 1}'
    entries = storage.listing(root)
    assert sorted(entries) == (["a.json"] if root.startswith("gs://") else ["a.json", "empty"])  # no empty prefix
    assert storage.names(root) == sorted(entries)  # no temporary file of the atomic writes left behind
    directory, modified_ns = entries["a.json"]
    assert not directory and abs(modified_ns - before_ns) < 60e9  # in ns, near now
    file = storage.join(root, "a.json")
    assert storage.listing(file) == {} and storage.names(file) == [] and storage.files_below(file) == []
    assert storage.name_of(file) == "a.json" and storage.parent_of(file) == root
    elsewhere = tmp_path / "elsewhere.json" if storage.is_remote(root) else "memory://elsewhere.json"
    with pytest.raises(ValueError, match="different file systems"):
        storage.move(file, elsewhere)
    storage.write_atomic(storage.join(root, "d", "e", "f.txt"), b"\xff")
    assert storage.files_below(root) == ["a.json", "d/e/f.txt"]
    storage.move(storage.join(root, "d", "e", "f.txt"), file)  # replaces the target
    assert storage.read_bytes(file) == b"\xff" and not storage.exists(storage.join(root, "d", "e", "f.txt"))
    storage.remove_tree(root)
    assert not storage.exists(root) and storage.listing(root) == {}


def test_a_local_link_to_a_directory_is_listed_as_one(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "a.txt").write_text("a")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "linked").symlink_to(tmp_path / "real")
    assert storage.listing(tmp_path / "root")["linked"][0] and storage.is_dir(tmp_path / "root" / "linked")
    assert storage.files_below(tmp_path / "root") == ["linked/a.txt"]


def test_only_a_url_is_remote_and_only_a_remote_location_takes_an_upload(tmp_path: Path) -> None:
    assert storage.is_remote("gs://b/x") and storage.is_remote("memory://x") and storage.is_remote("s3://b/x")
    assert not any(map(storage.is_remote, ["runs/x", tmp_path, "file:///tmp/x", "runs/a://b"]))
    assert storage.join("gs://b", "x", "y.json") == "gs://b/x/y.json" and storage.join(tmp_path, "y") == str(
        tmp_path / "y"
    )
    (tmp_path / "f").write_text("f")
    with pytest.raises(ValueError, match="remote location"):
        storage.upload(tmp_path / "f", tmp_path / "g")
    with pytest.raises(ValueError, match="remote location"):
        storage.download(tmp_path / "f", tmp_path / "g")


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
