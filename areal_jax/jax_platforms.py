"""Which JAX platforms a command starts, where `libtpu` is installed on a machine without TPU chips.

The test environment installs `libtpu` (requirements-dev.txt) so that `areal-jax compile` can compile for Cloud
TPU topologies on any machine. JAX then also tries its TPU backend at start-up, which on a machine without TPU
chips fails after libtpu prints errors about the TPU host it cannot find (start-up time is the same: measured in
docs/tpu.md). `quiet_absent_tpu` leaves the TPU backend out there, before JAX starts a backend; compiling for
a topology does not need it (`areal_jax/compile/topology.py`).
"""

from __future__ import annotations

import importlib.util
import os

# the PJRT plugin modules of JAX's CUDA builds (requirements-cuda.txt)
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is absent
        return False


def platforms_without_tpu() -> str:
    """JAX_PLATFORMS naming every platform this machine can start but TPU: CUDA where its plugin is installed
    and a GPU is visible, then CPU."""
    from jax._src import hardware_utils  # JAX's own test for visible accelerators (no backend starts)

    cuda = any(_installed(m) for m in _CUDA_PLUGINS) and hardware_utils.has_visible_nvidia_gpu()
    return "cuda,cpu" if cuda else "cpu"


def quiet_absent_tpu() -> None:
    """Set JAX_PLATFORMS (for this process, its JAX config and its subprocesses) to the platforms but TPU when
    it is unset, `libtpu` is installed and this machine has no TPU chip. Call before any JAX backend starts."""
    if "JAX_PLATFORMS" in os.environ or not _installed("libtpu"):
        return
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
        return
    import jax

    platforms = platforms_without_tpu()
    os.environ["JAX_PLATFORMS"] = platforms
    jax.config.update("jax_platforms", platforms)
