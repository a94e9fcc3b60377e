#!/usr/bin/env bash
# Create .venv-jetstream (JetStream interop, requirements-jetstream.txt) on first use and reinstall when a
# requirements file or pyproject.toml changed; a no-op otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-jetstream
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
stamp="$venv/.installed"
digest="$(cat requirements.txt requirements-jetstream.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ]; then
  echo "installing requirements-jetstream.txt into $venv ..." >&2
  "$venv/bin/python" -m pip install --quiet -r requirements-jetstream.txt
  "$venv/bin/python" -m pip install --quiet --no-deps -e .
  echo "$digest" > "$stamp"
fi
