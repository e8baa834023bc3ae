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
# lightning) are not installed there, so their tests skip: they pin their own torch. torchft (ft) is, below.
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
# torchft (the ft extra: tests/ecosystem/test_torchft.py) where it installs: --no-deps keeps this torch (torchft
# declares torch>=2.7 and opentelemetry, which goes in beside it); where it does not, those tests skip
"$venv/bin/python" -c "import torchft" 2>/dev/null || {
  "$venv/bin/pip" install -q --no-deps torchft==0.2.0 &&
    "$venv/bin/pip" install -q opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
} || echo "torchft did not install in $venv: tests/ecosystem/test_torchft.py skips"
echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') in $venv"
exec "$venv/bin/python" -m pytest -q "$@"
