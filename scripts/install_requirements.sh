#!/usr/bin/env bash
# Install a requirements file and this package (editable, no deps) into a virtualenv, creating it first if
# needed. Usage: install_requirements.sh VENV REQ_FILE [--compile-bytecode]
# uv does the install (a pinned uv, put into the virtualenv by its own pip): it resolves and unpacks in
# parallel and reuses its cache, so the test environments install in well under a minute where pip took 2
# (.venv) and 6 (.venv-jetstream, TensorFlow) minutes on 2 cores. Wheels that pip is pointed at through
# PIP_FIND_LINKS (a machine's local wheel directory, e.g. the CPU build of torch) are offered to uv as well.
# --compile-bytecode writes the .pyc of every installed module (uv leaves that to the first import, and
# where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, every process compiles jax, flax ... anew:
# `import areal_jax.jobs.train` took 4.0-6.3 s without them and 1.8-2.1 s with them on the 2-core machine,
# in each of the ~100 processes a test run starts).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$1"
req="$2"
uv_version=0.13.8
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if [ "$("$venv/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$uv_version"
fi
find_links=()
for links in ${PIP_FIND_LINKS:-}; do
  find_links+=(--find-links "$links")
done
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" "${find_links[@]}" -r "$req"
"$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --no-deps -e .
if [ "${3:-}" = --compile-bytecode ]; then
  # (compileall, not uv's flag: uv compiles only when it installed something, compileall what has no .pyc yet.
  # Left out: the big packages only the tests' own two worker processes import (torch and transformers for
  # the parity checks, anthropic's client, what torch pulls in): 20 s of the install's 38 s, ~5 s of imports
  # in each worker. Its status is not checked: a module written for a newer Python, never imported here, fails
  # to compile.)
  "$venv/bin/python" -m compileall -q -j 0 -x '/site-packages/(torch|transformers|anthropic|sympy|networkx|pip)/' \
    "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
fi
