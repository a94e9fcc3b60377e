"""The XLA flags of the test suite, for its own process (conftest) and the subprocesses tests start.

LLVM's optimisation level 0 for XLA:CPU's generated kernels: the suite mostly compiles small programs (the
whole suite ~9:40 -> ~7 min on 2 cores); matmuls run in precompiled libraries either way, and what each
program computes is fixed by XLA, not LLVM, though rounding may differ in the last bit. So every process of
the suite compiles at the same level: the tests that compare a subprocess's numbers with their own bit for
bit would otherwise compare two code generators.
"""

SUITE_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process of the suite with `devices` virtual CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {SUITE_FLAGS}"
