#!/usr/bin/env bash
# The GPU checks of the executor (tensor buffers, staged legs on CUDA), as one short script for
# a session that is lent a GPU machine. It has never run on one: no GPU was lent to the
# sessions that wrote it; expect to fix small things on the first try.
#
# That machine (NVIDIA H200 image) has python3 3.12 with a CUDA build of torch, numpy, attrs,
# hypothesis and pytest, but no NIXL and no network. Carry NIXL as a wheel, prepared here once
# from the repository root (59 MB; the tree that travels may hold 64 MiB):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1
# (cu13 matches that image's torch; take nixl-cu12 for a CUDA 12 torch). Then run on the
# device, with carry [".whl"], the command `bash benchmarks/device_check.sh` (about 5 min).
# Logs land in $OUT (the device tool returns them) or /tmp/kvplan-device.
set -uo pipefail
OUT=${OUT:-/tmp/kvplan-device}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
{
  nvidia-smi -L
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  python3 -c "import kvplan_nixl._nixl as n; print('nixl from', n.nixl_agent.__module__)"
} 2>&1 | tee "$OUT/env.txt"
# tensor buffers on the CPU and on CUDA, direct and staged, pull and push, checked byte for byte
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_nixl_tensors.py \
  2>&1 | tee "$OUT/tests.txt"
# the scattered hetero-TP request with CUDA buffers: direct, staged, and a device copy
timeout 420 python3 benchmarks/bench_staged.py --device cuda --reps 3 2>&1 \
  | tee "$OUT/bench_staged_cuda.md"
