#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): the CUDA tests, then one GRPO step ours vs TRL on a Qwen2.5-0.5B-shaped
# model in bfloat16. Usage: bash bench/gpu_check.sh [--dry-run] [--json PATH] [options of bench/gpu_check.py]
#
# Python: the repository's .venv where there is one (here, CI), else python3 (the lent GPU machine, where
# the working tree arrives without .venv). On that machine the packages it lacks travel as wheels in
# .gpu-wheels (`make gpu-wheels`, carried by the device tool): they are installed into a private folder
# first, put in front on PYTHONPATH, when that Python is the one they were downloaded for (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
export PYTHONUNBUFFERED=1
wheels=(.gpu-wheels/*.whl)
if [[ -e "${wheels[0]}" ]] && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
  echo "gpu check: installing ${#wheels[@]} wheels from .gpu-wheels into $site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The repository's packages (contract, worker, ...) are not installed on the GPU machine.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" bench/gpu_check.py "$@"
