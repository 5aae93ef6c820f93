#!/usr/bin/env bash
# The one entry point for a checkout: sets up .venv on first use (and again only when
# pyproject.toml changes), then runs what was asked.
#   bash dev.sh demo [ARGS]     the main job: `swarm demo` on the embedded default
#   bash dev.sh test [ARGS]     the test suite (pytest; tests/test_layers.py runs import-linter)
#   bash dev.sh bench [ARGS]    the benchmarks; figures go to benchmarks/results/
#   bash dev.sh study [--quick] the staleness study of every loss, in stages that resume (benchmarks/staleness_stages.py)
#   bash dev.sh swarm ARGS      any `swarm` command
set -euo pipefail
cd "$(dirname "$0")"

VENV=.venv
PYTHON_BIN=${PYTHON:-python3}
STAMP=$VENV/.setup-stamp
WANT=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)

uv_install() {  # ARGS: `uv pip install ARGS` into .venv, with pip's constraints and find-links
    local constraint find_links
    constraint=${PIP_CONSTRAINT:-$("$VENV/bin/python" -m pip config get global.constraint 2>/dev/null || true)}
    find_links=${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}
    local -a options=(-q --python "$VENV/bin/python" --compile-bytecode)
    for file in $constraint; do [[ -f $file ]] && options+=(--constraint "$file"); done
    for place in $find_links; do [[ -d $place ]] && options+=(--find-links "$place"); done
    "$VENV/bin/python" -m uv pip install "${options[@]}" "$@"
}

setup() {
    if [[ -f $STAMP && "$(cat "$STAMP")" == "$WANT" ]]; then
        return
    fi
    echo "dev.sh: setting up $VENV (only on first use or after pyproject.toml changes)" >&2
    [[ -x $VENV/bin/python ]] || "$PYTHON_BIN" -m venv "$VENV"
    # Without CUDA, take the CPU build of torch first so that nothing pulls the multi-gigabyte
    # CUDA wheels; the project's own range (torch>=2.4) is then already satisfied. The rest through
    # uv there: the same packages as pip picks (the same `pip freeze` but uv itself) in half the time
    # (a fresh 2-core machine: 75 s for the whole set-up, against 148 s), which CI spends before every
    # run. uv reads no pip configuration: a constraints file and find-links pip has are passed on.
    # Bytecode compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, every process
    # would otherwise compile what it imports. Should uv not install or not run, pip does it all; on a
    # CUDA machine pip does it all anyway (torch's build is its to choose there, as the README says).
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
        if ! { "$VENV/bin/python" -m pip install -q "uv>=0.5,<1" && uv_install -e ".[dev]"; }; then
            echo "dev.sh: uv could not install the project; pip installs it instead" >&2
            "$VENV/bin/python" -m pip install -q -e ".[dev]"
        fi
    else
        "$VENV/bin/python" -m pip install -q -e ".[dev]"
    fi
    echo "$WANT" >"$STAMP"
}

cmd=${1:-demo}
shift || true
setup
export PATH="$PWD/$VENV/bin:$PATH"
case "$cmd" in
    demo) exec swarm demo "$@" ;;
    test)
        # The project's bytecode, written once: the suite starts some 800 Python processes (peers,
        # CLI commands), and where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) each one
        # would compile the modules it imports again, 0.7 CPU s a peer on the 2-core machine
        # (`import peers.sampler`: 4.9 s without the files, 4.2 s with). Python reads the files
        # whatever that setting says; an edited module is compiled afresh (its stamp no longer matches).
        # A module that does not compile is pytest's to report, with the test that imports it.
        python -m compileall -q -j 0 swarm peers bootstrap benchmarks tests >/dev/null || true
        # pytest exits 5 when it collected nothing: that is a failure here, not a pass.
        set +e
        # two lanes, one per core (tests/conftest.py puts each file in one)
        python -m pytest -n 2 --dist loadgroup "$@"
        rc=$?
        [[ $rc -eq 5 ]] && echo "dev.sh: no tests were collected" >&2 && exit 1
        exit $rc
        ;;
    bench) exec python -m benchmarks "$@" ;;
    study) exec python -m benchmarks.staleness_stages "$@" ;;
    swarm) exec swarm "$@" ;;
    setup) ;;
    *) echo "dev.sh: unknown command '$cmd' (use demo, test, bench, study, swarm or setup)" >&2; exit 2 ;;
esac
