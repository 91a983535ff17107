#!/usr/bin/env bash
# Set up the public reference planner for benchmarks/vs_reference.py: AutoParallel
# (github.com/meta-pytorch/autoparallel) at its approximate-solver commit 8eda68d, in a
# venv of its own with torch 2.13.0 and PuLP 3.3.2. Idempotent: a step already done is
# skipped, so the script can be run again after an interruption.
#
#   bash benchmarks/setup_reference.sh
#   REF_MIRROR=/path/to/autoparallel.git bash benchmarks/setup_reference.sh   # no network
#
# Environment (all optional):
#   REF_ROOT     where the source and the venv go
#                (default ${XDG_CACHE_HOME:-$HOME/.cache}/sharding-planner-reference)
#   REF_SRC      the exported source tree (default $REF_ROOT/autoparallel)
#   REF_VENV     the venv (default $REF_ROOT/venv); its bin/python is what
#                vs_reference.py runs (--ref-python, or REF_VENV / REF_PYTHON)
#   REF_MIRROR   a local git directory (bare or not) that holds commit 8eda68d: the
#                source is exported from it instead of cloning the public repository
#   PYTHON       the interpreter the venv is made from (default python3.11, the version
#                the project's venv uses)
#   PIP_ARGS     extra arguments for pip install (e.g. an index that has the CPU build
#                of torch 2.13.0)
set -euo pipefail

REF_COMMIT=8eda68d266fa7667d0fe432774ac7c78324a6d6b   # 8eda68d
REF_URL=https://github.com/meta-pytorch/autoparallel
TORCH_VERSION=2.13.0
PULP_VERSION=3.3.2
NUMPY_VERSION=2.4.6

REF_ROOT=${REF_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/sharding-planner-reference}
REF_SRC=${REF_SRC:-$REF_ROOT/autoparallel}
REF_VENV=${REF_VENV:-$REF_ROOT/venv}
REF_MIRROR=${REF_MIRROR:-}
PYTHON=${PYTHON:-python3.11}
read -r -a PIP_EXTRA <<< "${PIP_ARGS:-}"

say() { printf 'setup_reference: %s\n' "$*" >&2; }

# 1. The source at 8eda68d, exported (git archive) into $REF_SRC; .ref-commit records
#    the full commit it came from.
marker="$REF_SRC/.ref-commit"
if [[ -f "$marker" ]] && [[ "$(cat "$marker")" == "$REF_COMMIT" ]]; then
    say "source: $REF_SRC already at $(cat "$marker")"
else
    if [[ -n "$REF_MIRROR" ]]; then
        gitdir=$REF_MIRROR
        say "source: exporting $REF_COMMIT from the local mirror $gitdir"
    else
        gitdir=$(mktemp -d)
        trap 'rm -rf "$gitdir"' EXIT
        say "source: cloning $REF_URL"
        git clone --quiet --no-checkout "$REF_URL" "$gitdir"
        # the commit is the head of the branch kaijian/approx_solver_pr (pull request
        # 484); fetch it by its full hash should the branch be gone
        git -C "$gitdir" rev-parse --quiet --verify "$REF_COMMIT^{commit}" > /dev/null \
            || git -C "$gitdir" fetch --quiet origin "$REF_COMMIT"
    fi
    full=$(git -C "$gitdir" rev-parse --verify "$REF_COMMIT^{commit}")
    rm -rf "$REF_SRC.tmp"
    mkdir -p "$REF_SRC.tmp"
    git -C "$gitdir" archive "$full" | tar -x -C "$REF_SRC.tmp"
    echo "$full" > "$REF_SRC.tmp/.ref-commit"
    rm -rf "$REF_SRC"
    mv "$REF_SRC.tmp" "$REF_SRC"
    say "source: $REF_SRC at $full"
fi

# 2. The venv and its packages (pip skips what is already installed at that version).
if [[ ! -x "$REF_VENV/bin/python" ]]; then
    say "venv: $PYTHON -m venv $REF_VENV"
    "$PYTHON" -m venv "$REF_VENV"
fi
"$REF_VENV/bin/python" -m pip install --quiet "${PIP_EXTRA[@]}" \
    "torch==$TORCH_VERSION" "pulp==$PULP_VERSION" "numpy==$NUMPY_VERSION"
# The reference itself, editable, without its declared test-only dependency (filecheck):
# at run time it imports torch, pulp, numpy and the standard library.
"$REF_VENV/bin/python" -m pip install --quiet --no-deps -e "$REF_SRC"

# 3. Check: the versions, and that the reference imports.
"$REF_VENV/bin/python" - "$REF_SRC" <<'EOF'
import sys
from importlib.metadata import version
import autoparallel.api  # noqa: F401
import autoparallel.approximate_sharding  # noqa: F401
print("setup_reference: ok:", ", ".join(f"{n} {version(n)}" for n in ("torch", "pulp", "numpy")),
      "| autoparallel from", autoparallel.api.__file__.rsplit("/autoparallel/", 1)[0],
      "| python", sys.executable, file=sys.stderr)
EOF
echo "$REF_VENV/bin/python"
