#!/usr/bin/env bash
# Create .venv-jetstream (JetStream interop, requirements-jetstream.txt) on first use and reinstall when a
# requirements file or pyproject.toml changed; a no-op otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-jetstream
stamp="$venv/.installed"
digest="$(cat requirements.txt requirements-jetstream.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ]; then
  echo "installing requirements-jetstream.txt into $venv ..." >&2
  bash scripts/install_requirements.sh "$venv" requirements-jetstream.txt
  echo "$digest" > "$stamp"
fi
