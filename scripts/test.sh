#!/usr/bin/env bash
# The test command (README): CPU environment with real vLLM, then the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/toolkit -x`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/ensure_env.sh")"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider "${@:-tests}"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
fi
exit "$status"
