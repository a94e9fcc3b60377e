"""Code reward: run a model-written Python solution against test cases in the sandbox and grade each case.

Test rows come in the TACO/APPS/DeepCoder shape (`{"inputs": [...], "outputs": [...], "fn_name": ...}`)
or the LiveCodeBench shape (a list of `{"input", "output", "testtype": "stdin" | "functional"}`); both
become `TestCase`s. Each case is one sandboxed run (see `sandbox.py`); cases run on a thread pool of
`max_parallel`. A case ends as one of the `Verdict`s; the reward is 1 when every case passed.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import re
import signal
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeGuard

from areal_jax.configuration import ConfigError, option
from areal_jax.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult
from areal_jax.rewards.sandbox_launcher import RESULT_MARK

Verdict = Literal["passed", "wrong_answer", "runtime_error", "timeout", "memory_limit", "output_limit", "sandbox_error"]

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class CodeRewardConfig(SandboxLimits):
    """Settings of the sandboxed code reward: each case's `SandboxLimits` (its fields come first), then how
    cases run and are compared."""

    max_parallel: int = option(4, ge=1, le=1024, doc="test cases run at once")
    float_rel_tol: float = option(1e-6, ge=0, doc="relative tolerance for numeric tokens; 0 with abs 0 = exact")
    float_abs_tol: float = option(1e-6, ge=0, doc="absolute tolerance for numeric tokens")
    namespaces: bool = option(True, doc="use network/mount/PID/IPC namespaces where the kernel allows")
    uid_base: int = option(200_000_000, ge=1000, doc="first unprivileged uid given to runs when root")
    uid_span: int = option(4096, ge=1, doc="number of uids runs may be given (one per concurrent run)")
    work_root: str = option("", doc="where run directories are made; empty means the system temp dir")
    python: str = option("", doc="interpreter for solutions; empty means the running one")
    site_packages: bool = option(False, doc="let solutions import site-packages (numpy...) instead of stdlib only")

    def validate(self) -> None:
        super().validate()
        if self.uid_span < self.max_parallel:
            raise ConfigError("uid_span", f"{self.uid_span} is fewer than max_parallel={self.max_parallel}")
        if self.uid_base + self.uid_span >= 2**31 - 1:
            raise ConfigError("uid_base", f"{self.uid_base} + uid_span {self.uid_span} exceeds the uid range")

    def limits(self) -> SandboxLimits:
        """The limits alone (what the sandbox hands its launcher)."""
        return SandboxLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SandboxLimits)})


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One test: stdin text and expected stdout, or call arguments and the expected return value."""

    __test__ = False  # not a pytest class

    kind: Literal["stdin", "call"]
    input: Any
    expected: Any
    fn_name: str | None = None


@dataclasses.dataclass(frozen=True)
class CaseResult:
    verdict: Verdict
    wall_s: float
    cpu_s: float
    detail: str
    containment: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """Grade of one solution: per-case results, `reward` (1 iff all passed), `format` (code was found)."""

    cases: tuple[CaseResult, ...]
    format: float

    @property
    def reward(self) -> float:
        return float(bool(self.cases) and all(c.verdict == "passed" for c in self.cases))

    @property
    def pass_rate(self) -> float:
        return sum(c.verdict == "passed" for c in self.cases) / len(self.cases) if self.cases else 0.0

    @property
    def verdict(self) -> Verdict | None:
        """The first non-passing case's verdict, "passed" if all passed, None if nothing ran."""
        for case in self.cases:
            if case.verdict != "passed":
                return case.verdict
        return "passed" if self.cases else None

    def components(self) -> dict[str, float]:
        return {"correct": self.reward, "pass_rate": self.pass_rate, "format": self.format}


# ---------------------------------------------------------------------------------------------- test rows


def _lines(value: Any) -> str:
    return "\n".join(str(v) for v in value) if isinstance(value, list) else str(value)


def parse_tests(tests: str | Mapping[str, Any] | Sequence[Any], fn_name: str | None = None) -> list[TestCase]:
    """Normalise a TACO/DeepCoder dict, a LiveCodeBench list, or their JSON text into `TestCase`s."""
    if isinstance(tests, str):
        text = tests
        try:
            tests = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"tests are not valid JSON ({err}): {text[:80]!r}") from None
    if isinstance(tests, Mapping):
        if "inputs" not in tests or "outputs" not in tests:
            raise ValueError(f"test dict needs 'inputs' and 'outputs', got keys {sorted(tests)}")
        inputs, outputs = tests["inputs"], tests["outputs"]
        if len(inputs) != len(outputs):
            raise ValueError(f"test dict has {len(inputs)} inputs but {len(outputs)} outputs")
        name = tests.get("fn_name") or fn_name
        if name:
            pairs = zip(inputs, outputs, strict=True)
            return [TestCase("call", i if isinstance(i, list) else [i], o, name) for i, o in pairs]
        return [TestCase("stdin", _lines(i), _lines(o)) for i, o in zip(inputs, outputs, strict=True)]
    if isinstance(tests, Sequence):
        cases = []
        for k, row in enumerate(tests):
            if not isinstance(row, Mapping) or "input" not in row or "output" not in row:
                raise ValueError(f"test {k} needs 'input' and 'output', got {str(row)[:80]!r}")
            if row.get("testtype", "stdin") == "functional":
                name = row.get("fn_name") or fn_name
                if not name:
                    raise ValueError(f"test {k} is functional but no fn_name was given")
                try:
                    args = [json.loads(line) for line in str(row["input"]).splitlines() if line.strip()]
                    output = json.loads(row["output"]) if isinstance(row["output"], str) else row["output"]
                except json.JSONDecodeError as err:
                    raise ValueError(f"test {k} is functional but its input/output is not JSON: {err}") from None
                cases.append(TestCase("call", args, output, name))
            else:
                cases.append(TestCase("stdin", _lines(row["input"]), _lines(row["output"])))
        return cases
    raise ValueError(f"tests must be a JSON string, dict or list, got {type(tests).__name__}")


def extract_code(response: str) -> str | None:
    """The last fenced Python (or untagged) code block of a model response; None if there is none."""
    blocks = _FENCE_RE.findall(response)
    return blocks[-1] if blocks else None


# ---------------------------------------------------------------------------------------------- comparison


def _token_match(actual: str, expected: str, rel_tol: float, abs_tol: float) -> bool:
    if actual == expected:
        return True
    if rel_tol == 0 and abs_tol == 0:
        return False
    try:
        a, e = float(actual), float(expected)
    except ValueError:
        return False
    return math.isclose(a, e, rel_tol=rel_tol, abs_tol=abs_tol)


def outputs_match(actual: str, expected: str, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Line-by-line comparison ignoring trailing whitespace and trailing blank lines; numbers within tolerance."""
    a_lines = [line.rstrip() for line in actual.rstrip().splitlines()]
    e_lines = [line.rstrip() for line in expected.rstrip().splitlines()]
    if a_lines == e_lines:
        return True
    if len(a_lines) != len(e_lines):
        return False
    for a, e in zip(a_lines, e_lines, strict=True):
        a_tok, e_tok = a.split(), e.split()
        if len(a_tok) != len(e_tok):
            return False
        if not all(_token_match(x, y, rel_tol, abs_tol) for x, y in zip(a_tok, e_tok, strict=True)):
            return False
    return True


def values_match(actual: Any, expected: Any, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """Structural equality of JSON values with numeric tolerance; tuples were already lists."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, int | float) and isinstance(expected, int | float):
        return actual == expected or math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            values_match(a, e, rel_tol, abs_tol) for a, e in zip(actual, expected, strict=True)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            values_match(actual[k], expected[k], rel_tol, abs_tol) for k in actual
        )
    return actual == expected


# ---------------------------------------------------------------------------------------------- grading


class CodeVerifier:
    """Grades solutions against test cases in the sandbox; owns a thread pool (close it, or use `with`)."""

    def __init__(self, config: CodeRewardConfig | None = None):
        self.config = config or CodeRewardConfig()
        cfg = self.config
        self.sandbox = Sandbox(
            cfg.limits(),
            python=cfg.python,
            work_root=cfg.work_root,
            uid_base=cfg.uid_base,
            uid_span=cfg.uid_span,
            namespaces=cfg.namespaces,
            site_packages=cfg.site_packages,
        )
        self._threads = cf.ThreadPoolExecutor(max_workers=cfg.max_parallel, thread_name_prefix="sandbox")

    def run_case(self, code: str, case: TestCase) -> CaseResult:
        """One sandboxed run of `code` on `case`, graded."""
        if case.kind == "call":
            result = self.sandbox.run(code, call=(case.fn_name or "", case.input))
        else:
            result = self.sandbox.run(code, stdin=case.input)
        return self._grade(result, case)

    def score(
        self,
        code: str,
        tests: Sequence[TestCase] | str | Mapping[str, Any],
        fn_name: str | None = None,
        *,
        parallel: bool = True,
    ) -> CodeResult:
        """Run every case (on the thread pool unless `parallel=False`) and collect the results."""
        cases = tests if _is_cases(tests) else parse_tests(tests, fn_name)
        if parallel:
            results = list(self._threads.map(lambda c: self.run_case(code, c), cases))
        else:
            results = [self.run_case(code, c) for c in cases]
        return CodeResult(tuple(results), format=1.0)

    def score_response(self, response: str, tests: Any, fn_name: str | None = None) -> CodeResult:
        """Extract the last code block of a model response and score it; no block scores 0 with format 0."""
        code = extract_code(response)
        if code is None:
            return CodeResult((), format=0.0)
        return self.score(code, tests, fn_name)

    def score_batch(self, items: Sequence[tuple[str, Any, str | None]]) -> list[CodeResult]:
        """`score` over (code, tests, fn_name) triples with all their cases sharing the thread pool."""
        parsed = [(code, tests if _is_cases(tests) else parse_tests(tests, fn)) for code, tests, fn in items]
        futures = [[self._threads.submit(self.run_case, code, c) for c in cases] for code, cases in parsed]
        return [CodeResult(tuple(f.result() for f in fs), format=1.0) for fs in futures]

    def _grade(self, r: SandboxResult, case: TestCase) -> CaseResult:
        cfg = self.config
        stderr_tail = r.stderr[-400:].decode("utf-8", "replace")
        verdict: Verdict
        detail = ""
        if r.error is not None:
            verdict, detail = "sandbox_error", r.error
        elif r.output_limited:
            verdict, detail = "output_limit", f"stdout exceeded {cfg.max_output_bytes} bytes"
        elif r.timed_out or r.signal == signal.SIGXCPU or (r.signal == signal.SIGKILL and r.cpu_s >= cfg.cpu_limit_s):
            verdict, detail = "timeout", f"wall {r.wall_s:.2f}s, cpu {r.cpu_s:.2f}s"
        elif r.memory_error:
            verdict, detail = "memory_limit", f"MemoryError under {cfg.memory_mb} MiB"
        elif r.signal is not None or r.exit_code != 0:
            how = f"signal {r.signal}" if r.signal is not None else f"exit code {r.exit_code}"
            verdict, detail = "runtime_error", f"{how}: {stderr_tail}"
        else:
            verdict, detail = self._compare(r.stdout, case)
        return CaseResult(verdict, r.wall_s, r.cpu_s, detail, r.containment)

    def _compare(self, stdout: bytes, case: TestCase) -> tuple[Verdict, str]:
        cfg = self.config
        if case.kind == "stdin":
            text = stdout.decode("utf-8", "replace")
            if outputs_match(text, case.expected, cfg.float_rel_tol, cfg.float_abs_tol):
                return "passed", ""
            return "wrong_answer", f"got {text[:200]!r}, expected {case.expected[:200]!r}"
        at = stdout.rfind(RESULT_MARK)
        if at < 0:
            return "runtime_error", "the function returned no result"
        try:
            value = json.loads(stdout[at + len(RESULT_MARK) :].split(b"\n", 1)[0])
        except ValueError:
            return "wrong_answer", "the result line is not JSON"
        expected = case.expected
        wrapped = isinstance(expected, list) and len(expected) == 1
        if values_match(value, expected, cfg.float_rel_tol, cfg.float_abs_tol) or (
            wrapped and values_match(value, expected[0], cfg.float_rel_tol, cfg.float_abs_tol)
        ):
            return "passed", ""
        return "wrong_answer", f"got {value!r:.200}, expected {expected!r:.200}"

    def close(self) -> None:
        self._threads.shutdown(wait=True)

    def __enter__(self) -> CodeVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_cases(tests: Any) -> TypeGuard[Sequence[TestCase]]:
    return isinstance(tests, Sequence) and not isinstance(tests, str) and all(isinstance(t, TestCase) for t in tests)
