#!/usr/bin/env bash
# The main job (README): a tiny model built locally, run through real vLLM with atom active,
# and the same with atom off (ATOM_DISABLE_VLLM_PLUGIN=1); prints what atom activated and
# whether the greedy outputs match.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/scripts/ensure_env.sh")"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
exec "$venv/bin/python" scripts/demo.py "$@"
