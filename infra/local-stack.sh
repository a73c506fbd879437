#!/usr/bin/env bash
# The compose stack natively on loopback: infra/local-stack.sh up|down|status|env [--port SERVICE=PORT]
# State (data, logs, generated secrets) in $TRAINGATE_STACK_DIR (default ./.traingate/stack).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${TRAINGATE_PYTHON:-$here/../.venv/bin/python}"
[[ -x "$py" ]] || py="$(command -v python3)"
exec "$py" "$here/local_stack.py" "$@"
