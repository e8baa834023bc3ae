#!/usr/bin/env bash
# Run the tests on another torch release, in a virtual environment of its own:
#
#     bash tools/test_torch.sh 2.11.0                  # the default selection (slow tests left out)
#     bash tools/test_torch.sh 2.11.0 -m ''            # the whole suite, slow tests included (.ci/run)
#     bash tools/test_torch.sh 2.14.1 tests/api/test_fully_shard.py -x
#
# The environment is ${FSDP_COMPOSE_VENVS:-~/.cache/fsdp_compose/venvs}/torch-VERSION, made once and reused
# while it holds that torch. Releases other than the local 2.13 CPU build come from the registry as CUDA
# builds (about 5 GB, about 2 minutes here); they import and run on the CPU. The extras (hf, ao,
# lightning) are not installed there, so their tests skip: they pin their own torch.
set -euo pipefail
version=${1:?usage: bash tools/test_torch.sh TORCH_VERSION [pytest arguments]}
shift
cd "$(dirname "$0")/.."
venv="${FSDP_COMPOSE_VENVS:-$HOME/.cache/fsdp_compose/venvs}/torch-$version"
has_torch() {
  "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null
}
if ! has_torch; then
  rm -rf "$venv"
  python -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version" typing_extensions numpy pytest expecttest cloudpickle
fi
"$venv/bin/pip" install -q --no-deps -e .
echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
exec "$venv/bin/python" -m pytest -q "$@"
