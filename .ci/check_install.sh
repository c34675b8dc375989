#!/usr/bin/env bash
# CI: the install commands resolve against PyPI alone, as they do for a user. Any pip configuration
# of the machine (files and PIP_* variables: here a local CPU torch build, which requires no triton)
# is switched off, so a pin that only the local build satisfies fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
export PIP_CONFIG_FILE=/dev/null
pip=("${PYTHON:-python3}" -m pip --isolated --disable-pip-version-check)
# Certificates only say whom to trust on the way to PyPI; they do not change what resolves.
if [[ -n "${PIP_CERT:-}" ]]; then pip+=(--cert "$PIP_CERT"); fi

resolve() {
    echo "check_install: resolving 'pip install $*' against PyPI" >&2
    if ! "${pip[@]}" install --dry-run --ignore-installed "$@" >"$log" 2>&1; then
        grep -v -e '^Collecting ' -e 'Downloading ' -e '━' "$log" | tail -n 40 >&2
        echo "check_install: FAILED: 'pip install $*' does not resolve against PyPI" >&2
        exit 1
    fi
    grep '^Would install' "$log" >&2
}

resolve -e '.[test]'
resolve .
echo "check_install: both installs resolve against PyPI" >&2
