"""The XLA flags of the test suite, for its own process (conftest) and the subprocesses tests start.

The suite's time is mostly XLA:CPU compiling small programs (backend compiles were 94 of the 112 s of
tests/test_engine.py + test_paged_kv.py), so its code generator is set for compile time, not speed:
- LLVM's optimisation level 0 for the generated kernels (the whole suite ~9:40 -> ~7 min on 2 cores);
- XLA:CPU's classic elemental emitters, not its MLIR fusion emitters, and one LLVM module per program, not
  a program split for parallel code generation (which 2 cores cannot use): those two files 112 -> 65 s,
  tests/test_train_step.py 33 -> 18 s (backend compiles 22.8 -> 8.7 s), measured 2026-12-04.
Matmuls run in precompiled libraries either way, and what each program computes is fixed by XLA's HLO, not
the code generator, though rounding may differ in the last bit. So every process of the suite compiles with
the same flags: the tests that compare a subprocess's numbers with their own bit for bit would otherwise
compare two code generators.
"""

LLVM_LEVEL = "--xla_backend_optimization_level=0"
CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
SUITE_FLAGS = f"{LLVM_LEVEL} {CLASSIC_EMITTERS}"


def xla_flags(devices: int, classic_emitters: bool = True) -> str:
    """XLA_FLAGS for a process of the suite with `devices` virtual CPU devices; `classic_emitters=False` keeps
    XLA:CPU's own fusion emitters (what a user's machine fuses, e.g. for a measured memory peak)."""
    flags = SUITE_FLAGS if classic_emitters else LLVM_LEVEL
    return f"--xla_force_host_platform_device_count={devices} {flags}"
