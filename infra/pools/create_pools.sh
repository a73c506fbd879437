#!/usr/bin/env bash
# Create the work pools and their GPU-slot concurrency limits, idempotently.
# A GPU class is a work pool; its GPUs are slots of a global concurrency limit of the same name
# (a job takes all of its slots at once, so two half-started jobs can never deadlock the pool).
set -euo pipefail
pool() {  # name type slots
  prefect work-pool inspect "$1" >/dev/null 2>&1 || prefect work-pool create "$1" --type "$2"
  prefect gcl inspect "$1" >/dev/null 2>&1 || prefect gcl create "$1" --limit "$3"
}
pool cpu-local process "${CPU_SLOTS:-2}"
pool gpu-a100  docker  "${A100_SLOTS:-64}"
pool gpu-h100  docker  "${H100_SLOTS:-32}"
cd "${TRAINGATE_CODE_DIR:-/opt/traingate}"
prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml
