"""Reward throughput: sandboxed code verdicts per second run in parallel vs serially (same batch, same run),
and math-verify answers per second through the killable process pool.

The code batch mixes passing, wrong and timing-out (infinite loop) solutions over stdin and call-based
cases. Prints `name: value unit` lines; the last line is `ratio sandbox_parallel_vs_serial: X.XX`.
"""

from __future__ import annotations

import argparse
import os
import time

from areal_jax.rewards.code import CodeRewardConfig, CodeVerifier, TestCase
from areal_jax.rewards.math import MathRewardConfig, MathVerifier

STDIN_CASES = [TestCase("stdin", f"{a} {b}\n", f"{a + b}\n") for a, b in [(1, 2), (40, 2), (-7, 7)]]
CALL_CASES = [TestCase("call", [[3, 1, 2]], [1, 2, 3], "sort_list"), TestCase("call", [[]], [], "sort_list")]
PROGRAMS = [
    ("passing", "a, b = map(int, input().split())\nprint(a + b)\n", STDIN_CASES),
    ("wrong", "a, b = map(int, input().split())\nprint(a - b)\n", STDIN_CASES),
    ("passing", "def sort_list(xs):\n    return sorted(xs)\n", CALL_CASES),
    ("wrong", "def sort_list(xs):\n    return xs\n", CALL_CASES),
    ("timeout", "while True:\n    pass\n", STDIN_CASES[:1]),
]
MATH_ITEMS = [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}"),
    ("\\boxed{[1, 2)}", "[1,2)"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("The answer is 15000.", "15,000"),
    ("\\boxed{\\{1, 2\\}}", "\\{2,1\\}"),
    ("\\boxed{7}", "-7"),
    ("we get 41 in the end", "42"),
]


def code_batch(copies: int) -> list[tuple[str, list[TestCase], None]]:
    return [(code, cases, None) for _ in range(copies) for _, code, cases in PROGRAMS]


def bench_code(copies: int, timeout_s: float, parallel: int) -> float:
    """Prints serial and parallel cases/s of one mixed batch; returns parallel / serial."""
    cfg = CodeRewardConfig(timeout_s=timeout_s, memory_mb=512, max_parallel=parallel)
    batch = code_batch(copies)
    cases = sum(len(tests) for _, tests, _ in batch)
    with CodeVerifier(cfg) as verifier:
        verifier.score(*batch[0][:2])  # warm the page cache and the thread pool
        started = time.perf_counter()
        serial = [verifier.score(code, tests, parallel=False) for code, tests, _ in batch]
        serial_s = time.perf_counter() - started
        started = time.perf_counter()
        parallel_results = verifier.score_batch(batch)
        parallel_s = time.perf_counter() - started
    verdicts = [r.verdict for r in serial]
    if verdicts != [r.verdict for r in parallel_results]:
        raise RuntimeError(f"serial and parallel verdicts differ: {verdicts}")
    containment = serial[0].cases[0].containment
    print(f"sandbox_cases: {cases} cases")
    print(f"sandbox_timeout_cases: {sum(v == 'timeout' for v in verdicts)} cases")
    print(f"sandbox_max_parallel: {parallel} runs")
    print(f"sandbox_namespaces: {int(bool(containment.get('net') and containment.get('pid')))} bool")
    print(f"sandbox_serial_throughput: {cases / serial_s:.2f} cases/s")
    print(f"sandbox_parallel_throughput: {cases / parallel_s:.2f} cases/s")
    return serial_s / parallel_s


def bench_math(repeats: int, workers: int) -> None:
    items = MATH_ITEMS * repeats
    with MathVerifier(MathRewardConfig(timeout_s=2.0, num_workers=workers)) as verifier:
        verifier.score_batch(MATH_ITEMS)  # start the workers and parse the golds once
        started = time.perf_counter()
        rewards = verifier.score_batch(items)
        elapsed = time.perf_counter() - started
        started = time.perf_counter()
        hung = verifier.score("\\boxed{9^{9^{9^{9}}}}", "1")
        recovered = verifier.score("\\boxed{1}", "1")
        recovery_s = time.perf_counter() - started
    if hung.status != "timeout" or recovered.correct != 1.0:
        raise RuntimeError(f"pool did not recover from a hung answer: {hung}, {recovered}")
    print(f"math_answers: {len(items)} answers")
    print(f"math_correct_fraction: {sum(r.correct for r in rewards) / len(rewards):.2f} fraction")
    print(f"math_throughput: {len(items) / elapsed:.1f} answers/s")
    print(f"math_hung_answer_then_next: {recovery_s:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small batches; under a minute on 2 cores")
    parser.add_argument("--parallel", type=int, default=max(4, 2 * (os.cpu_count() or 1)))
    args = parser.parse_args()
    copies, repeats, timeout_s = (3, 25, 1.0) if args.quick else (12, 200, 2.0)
    bench_math(repeats, workers=min(4, os.cpu_count() or 1))
    ratio = bench_code(copies, timeout_s, args.parallel)
    print(f"ratio sandbox_parallel_vs_serial: {ratio:.2f}")


if __name__ == "__main__":
    main()
