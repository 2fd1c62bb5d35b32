#!/usr/bin/env bash
# gpu-check on the lent GPU machine, with its own python3 and packages (docs/gpu-check.md): no
# venv is built and no registry is asked. What the check needs beyond that machine's image
# travels as wheels in gpu-wheels/ (`make gpu-wheels` here), installed into a folder of their
# own; the JSON goes to $OUT where the device tool sets it, else to build/. Arguments go to
# `python -m checks.gpu` (--quick, --only NAME, --dry-run, ...).
set -u
cd "$(dirname "$0")/../.."
py=${GPU_PYTHON:-python3}
if compgen -G "gpu-wheels/*.whl" > /dev/null; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/infersight-gpu-site.XXXXXX")
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" gpu-wheels/*.whl \
    || echo "gpu-check: the carried wheels did not install; going on without them"
  export PYTHONPATH="$site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export INFERSIGHT_HOME=${INFERSIGHT_HOME:-$(mktemp -d "${TMPDIR:-/tmp}/infersight-home.XXXXXX")}
export QT_QPA_PLATFORM=offscreen PYTHONUNBUFFERED=1
out=${OUT:-build}
mkdir -p "$out"
"$py" -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}")' 2>&1
exec "$py" -m checks.gpu --json "$out/gpu-check.json" "$@"
