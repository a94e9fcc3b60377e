#!/usr/bin/env bash
# Create .venv on first use and (re)install when a requirements file changed. Usage: ensure_venv.sh REQ_FILE
set -euo pipefail
cd "$(dirname "$0")/.."
req="${1:-requirements.txt}"
# (the install script's own text too: a change to how it installs reinstalls)
digest_of() { cat "$1" requirements.txt pyproject.toml scripts/install_requirements.sh | sha256sum | cut -d' ' -f1; }
# requirements-dev.txt includes requirements.txt: a .venv set up for the tests also runs the main job
dev_stamp=".venv/.installed-requirements-dev.txt"
if [ "$req" = requirements.txt ] && [ -f "$dev_stamp" ] && [ "$(cat "$dev_stamp")" = "$(digest_of requirements-dev.txt)" ]; then
  exit 0
fi
stamp=".venv/.installed-$(basename "$req")"
digest="$(digest_of "$req")"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ]; then
  echo "installing $req into .venv ..." >&2
  bash scripts/install_requirements.sh .venv "$req" --compile-bytecode
  echo "$digest" > "$stamp"
fi
