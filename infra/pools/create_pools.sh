#!/usr/bin/env bash
# The pools bootstrap (the compose stack's pools-bootstrap service; infra/local-stack.sh runs it too):
# waits until the Prefect API answers (a server that starts late), then creates the work pools of
# $TRAINGATE_POOLS_CONFIG with their queues, slot limits and locations (`traingate pools bootstrap`,
# idempotent; refuses a pool without an absolute TRAINGATE_STATE_DIR), then the deployments.
set -euo pipefail
: "${PREFECT_API_URL:?set PREFECT_API_URL to the Prefect server API}"
cd "${TRAINGATE_CODE_DIR:-/opt/traingate}"
wait_s="${TRAINGATE_API_WAIT_S:-300}"
deadline=$((SECONDS + wait_s))
until python -c 'import os, sys, urllib.request as u; u.urlopen(os.environ["PREFECT_API_URL"].rstrip("/") + "/health", timeout=5)' 2>/dev/null; do
  if (( SECONDS >= deadline )); then
    echo "create_pools: the Prefect API at $PREFECT_API_URL did not answer within ${wait_s}s (TRAINGATE_API_WAIT_S)" >&2
    exit 1
  fi
  sleep 2
done
traingate pools bootstrap "${TRAINGATE_POOLS_CONFIG:-examples/pools.yaml}"
prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
