"""Code reward: correct solutions pass, hostile ones are contained with the right verdict and leave nothing behind.

Every test runs under `leaves_nothing_behind`: afterwards no run directory, no process of a sandbox uid,
no file of a sandbox uid in the shared temp directories, and no new child of this process may remain.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from areal_jax.configuration import ConfigError
from areal_jax.data.datasets import DatasetConfig, load_prompts
from areal_jax.rewards.code import (
    CodeRewardConfig,
    CodeVerifier,
    TestCase,
    extract_code,
    outputs_match,
    parse_tests,
    values_match,
)

pytestmark = pytest.mark.multiprocess

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="per-run uid containment needs root")
TIMEOUT_S = 1.5
UID_BASE, UID_SPAN = 210_000_000, 16
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
DATA = Path(__file__).parent / "data"


def _config(work_root: Path, **changes) -> CodeRewardConfig:
    settings = {
        "timeout_s": TIMEOUT_S,
        "memory_mb": 256,
        "max_parallel": 2,
        "uid_base": UID_BASE,
        "uid_span": UID_SPAN,
        "work_root": str(work_root),
    }
    return CodeRewardConfig(**(settings | changes))


@pytest.fixture(scope="module")
def work_root(tmp_path_factory):
    return tmp_path_factory.mktemp("sandbox-runs")


@pytest.fixture(scope="module")
def verifier(work_root):
    with CodeVerifier(_config(work_root)) as v:
        yield v


@pytest.fixture(scope="module")
def fallback_verifier(work_root):
    """No namespaces: containment rests on the uid, rlimits, the process-group kill and the sweeps."""
    with CodeVerifier(_config(work_root, namespaces=False)) as v:
        yield v


def _sandbox_pids() -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if UID_BASE <= os.stat(f"/proc/{name}").st_uid < UID_BASE + UID_SPAN:
                    pids.append(int(name))
            except FileNotFoundError:
                continue
    return pids


def _sandbox_files() -> list[str]:
    found = []
    for top in SHARED_TMP:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                try:
                    if UID_BASE <= os.lstat(path).st_uid < UID_BASE + UID_SPAN:
                        found.append(path)
                except FileNotFoundError:
                    continue
            dirnames[:] = [d for d in dirnames if os.stat(os.path.join(dirpath, d)).st_mode & stat.S_IWOTH]
    return found


@pytest.fixture(autouse=True)
def leaves_nothing_behind(work_root):
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    assert list(work_root.iterdir()) == [], "a run directory was left behind"
    assert _sandbox_pids() == [], "a sandboxed process outlived its run"
    assert _sandbox_files() == [], "a sandboxed run left files in a shared temp directory"
    assert {p.pid for p in me.children(recursive=True)} - before == set(), "a launcher was not reaped"


def _stdin_case(expected: str, stdin: str = "") -> list[TestCase]:
    return [TestCase("stdin", stdin, expected)]


# ---------------------------------------------------------------------------------------------- correct code


def test_stdin_solution_passes(verifier):
    tests = {"inputs": ["1 2\n", "-5 10\n", "0 0"], "outputs": ["3\n", "5", "0\n\n"]}
    result = verifier.score("a, b = map(int, input().split())\nprint(a + b)\n", tests)
    assert result.verdict == "passed" and result.reward == 1.0 and result.pass_rate == 1.0
    assert all(c.containment.get("uid") is not None for c in result.cases) == ROOT


def test_call_based_solutions_pass(verifier):
    taco = {"fn_name": "area", "inputs": [[2, 3], [5, 5]], "outputs": [[6], [25]]}
    assert verifier.score("def area(w, h):\n    return w * h\n", taco).verdict == "passed"
    lcb = [{"input": "[1, 2, 3]\n2", "output": "[3, 4, 5]", "testtype": "functional"}]
    solution = "class Solution:\n    def addAll(self, nums, k):\n        return tuple(x + k for x in nums)\n"
    assert verifier.score(solution, lcb, fn_name="addAll").verdict == "passed"


def test_deepcoder_sample_rows_pass_with_reference_solutions(verifier):
    rows = load_prompts(DatasetConfig(path=str(DATA / "deepcoder_sample.jsonl"), mapping="deepcoder"))
    solutions = {
        "dc-stdin-1": "print(sum(map(int, input().split())))",
        "dc-func-1": "class Solution:\n    def addAll(self, nums, k):\n        return [x + k for x in nums]",
        "dc-taco-1": "def area(w, h):\n    return w * h",
    }
    items = [(solutions[r.id], r.tests, r.metadata.get("fn_name")) for r in rows]
    assert [res.verdict for res in verifier.score_batch(items)] == ["passed"] * 3


def test_wrong_answer_and_runtime_error(verifier):
    tests = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    assert verifier.score("print(4)", tests).verdict == "wrong_answer"
    assert verifier.score("print(3.0000001)", tests).verdict == "passed"  # within float tolerance
    assert verifier.score("def broken(:\n", tests).verdict == "runtime_error"
    assert verifier.score("raise SystemExit(3)", tests).verdict == "runtime_error"
    assert verifier.score("import sys\nprint(3)\nsys.exit(0)", tests).verdict == "passed"
    missing = verifier.score("def other(): pass", {"fn_name": "f", "inputs": [[1]], "outputs": [1]})
    assert missing.verdict == "runtime_error" and "no function" in missing.cases[0].detail


def test_score_response_needs_a_code_block(verifier):
    tests = {"inputs": [""], "outputs": ["hi"]}
    assert verifier.score_response("```python\nprint('hi')\n```", tests).components()["correct"] == 1.0
    none = verifier.score_response("I would print hi.", tests)
    assert none.components() == {"correct": 0.0, "pass_rate": 0.0, "format": 0.0} and none.verdict is None


# ---------------------------------------------------------------------------------------------- hostile code


def test_infinite_loop_times_out(verifier):
    start = time.monotonic()
    result = verifier.score("while True:\n    pass\n", _stdin_case("1"))
    assert result.verdict == "timeout"
    assert time.monotonic() - start < TIMEOUT_S + 2.0


@needs_root
def test_fork_bomb_is_contained(verifier):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = verifier.score(bomb, _stdin_case("1"))
    assert result.verdict == "timeout"
    assert time.monotonic() - start < TIMEOUT_S + 3.0


def test_memory_bomb_hits_memory_limit(work_root):
    # A generous clock: on a loaded 2-core machine the interpreter's start alone can pass 1.5 s, and this test is
    # about which limit a memory bomb meets, not how fast it meets it.
    with CodeVerifier(_config(work_root, timeout_s=20.0)) as v:
        bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
        result = v.score(bomb, _stdin_case("1"))
        assert result.verdict == "memory_limit", result.cases[0].detail
        assert v.score("x = [0] * (10 ** 10)", _stdin_case("1")).verdict == "memory_limit"


def test_stdout_flood_hits_output_limit(verifier):
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    result = verifier.score(flood, _stdin_case("1"))
    assert result.verdict == "output_limit"
    assert result.cases[0].wall_s < TIMEOUT_S


@needs_root
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])
def test_writes_outside_the_run_directory_do_not_land(request, namespaces, tmp_path, work_root):
    v = request.getfixturevalue("verifier" if namespaces else "fallback_verifier")
    host_tmp = Path("/tmp") / f"areal-escape-{uuid.uuid4().hex}"
    outside = tmp_path / "escape.txt"
    code = (
        f"for path in [{str(host_tmp)!r}, '../escape-rel.txt', {str(outside)!r}]:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('x')\n"
        "    except OSError as e:\n"
        "        print('blocked', type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')\n"
        f"open({str(outside)!r}, 'w').write('x')\n"
    )
    result = v.score(code, _stdin_case(""))
    assert result.verdict == "runtime_error"
    assert not host_tmp.exists()
    assert not outside.exists()
    assert not (work_root / "escape-rel.txt").exists()


def test_environment_secrets_are_not_inherited(verifier, monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("AREAL_TEST_SECRET", secret)
    code = (
        "import os\n"
        "print(os.environ.get('AREAL_TEST_SECRET'))\n"
        "try:\n"
        f"    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        "except OSError:\n"
        "    print('denied')\n"
    )
    raw = verifier.sandbox.run(code + "print(sorted(os.environ))\n")
    if not ROOT and not raw.containment.get("pid"):
        pytest.skip("neither a separate uid nor a PID namespace: /proc/<trainer>/environ is readable")
    assert secret.encode() not in raw.stdout + raw.stderr
    assert b"AREAL_TEST_SECRET" not in raw.stdout
    assert verifier.score(code, _stdin_case("None\ndenied")).verdict == "passed"


def test_network_connection_does_not_arrive(verifier):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    arrived = threading.Event()

    def accept_loop(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            arrived.set()
            conn.close()

    stop = threading.Event()
    thread = threading.Thread(target=accept_loop, args=(stop,), daemon=True)
    thread.start()
    code = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'leak')\n"
        "print('connected')\n"
    )
    try:
        result = verifier.score(code, _stdin_case("connected"))
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        listener.close()
    if not result.cases[0].containment.get("net"):
        pytest.skip("the kernel refused a network namespace; see docs/rewards.md for this fallback")
    assert result.verdict == "runtime_error"
    assert "Network is unreachable" in result.cases[0].detail
    assert not arrived.is_set()


@needs_root
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])
def test_process_that_outlives_the_run_is_killed(request, namespaces):
    v = request.getfixturevalue("verifier" if namespaces else "fallback_verifier")
    code = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        sys.stdout.close()\n"
        "        time.sleep(0.5)\n"
        "        open('/dev/shm/areal-late', 'w').write('still alive')\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(3)\n"
    )
    result = v.score(code, _stdin_case("3"))
    assert result.verdict == "passed"
    assert result.cases[0].containment["leftover_pids"] == []
    assert _sandbox_pids() == []
    time.sleep(0.8)  # the daemon would have written by now
    assert not os.path.exists("/dev/shm/areal-late")


@needs_root
def test_killing_the_parent_is_refused(verifier):
    code = (
        "import os, signal\n"
        f"for target in (os.getppid(), {os.getpid()}, 1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "        print('killed', target)\n"
        "    except OSError:\n"
        "        print('blocked')\n"
    )
    assert verifier.score(code, _stdin_case("blocked\nblocked\nblocked")).verdict == "passed"
    everyone = (
        "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    os.kill(0, signal.SIGKILL)\n"
    )
    suicide = verifier.score(everyone + "print(1)", _stdin_case("1"))
    assert suicide.verdict == "runtime_error" and "signal 9" in suicide.cases[0].detail
    assert psutil.pid_exists(os.getpid())


def test_unstartable_interpreter_is_a_sandbox_error(work_root):
    with CodeVerifier(_config(work_root, python="/nonexistent/python3")) as v:
        result = v.score("print(1)", _stdin_case("1"))
    assert result.verdict == "sandbox_error" and "could not start" in result.cases[0].detail


# ---------------------------------------------------------------------------------------------- formats


def test_parse_tests_shapes():
    stdin = parse_tests('{"inputs": [["1", "2"], "3\\n"], "outputs": [["a", "b"], "c"]}')
    assert stdin == [TestCase("stdin", "1\n2", "a\nb"), TestCase("stdin", "3\n", "c")]
    call = parse_tests({"inputs": [[1, 2], 5], "outputs": [[3], 5]}, fn_name="f")
    assert call == [TestCase("call", [1, 2], [3], "f"), TestCase("call", [5], 5, "f")]
    lcb = parse_tests(
        [{"input": "x\n", "output": "y\n"}, {"input": '"s"\n2', "output": "true", "testtype": "functional"}], "g"
    )
    assert lcb == [TestCase("stdin", "x\n", "y\n"), TestCase("call", ["s", 2], True, "g")]
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_tests("{nope")
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": ["a", "b"], "outputs": ["c"]})
    with pytest.raises(ValueError, match="input/output is not JSON"):
        parse_tests([{"input": "[1,", "output": "1", "testtype": "functional"}], "f")
    with pytest.raises(ValueError, match="functional but no fn_name"):
        parse_tests([{"input": "1", "output": "1", "testtype": "functional"}])


def test_output_comparison():
    assert outputs_match("1 2  \n3\n\n", "1 2\n3")
    assert not outputs_match("1 2\n3", "1 2 3")
    assert outputs_match("0.3333333", "0.33333333")
    assert not outputs_match("0.3333333", "0.33333333", rel_tol=0, abs_tol=0)
    assert not outputs_match("0.33", "0.34")
    assert values_match([1, [2.0000000001, {"a": 3}]], [1, [2, {"a": 3}]])
    assert not values_match(True, 1) and not values_match([1, 2], [1, 2, 3])


def test_extract_code_takes_the_last_block():
    response = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```"
    assert extract_code(response) == "print(2)\n"
    assert extract_code("no code") is None


def test_config_refusals():
    with pytest.raises(ConfigError, match="uid_span"):
        CodeRewardConfig(max_parallel=8, uid_span=4)
    with pytest.raises(ConfigError, match="timeout_s"):
        CodeRewardConfig(timeout_s=0)
