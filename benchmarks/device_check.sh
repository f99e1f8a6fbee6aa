#!/usr/bin/env bash
# GPU checks of the executor: tensor buffers on CUDA (direct and staged, pull and push, checked
# byte for byte) and the staged benchmark with CUDA buffers. Run it on a machine with an NVIDIA
# GPU, a CUDA build of torch and NIXL, from the repository root:
#
#   bash benchmarks/device_check.sh          # about 5 minutes; logs in $OUT or /tmp/kvplan-device
#
# Needs: python3 with torch (CUDA), numpy, attrs, pytest, hypothesis, and NIXL (pip install -e
# ".[nixl]"; nixl-cu13 instead of nixl-cu12 for a CUDA 13 torch). A machine without network can
# take NIXL as a wheel in .whl/ (installed from there to /tmp/site, nothing else is fetched);
# prepare it where the network is:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl nixl-cu13==1.5.1
# Output: env.txt (GPU, torch, which NIXL module), tests.txt (pytest), bench_staged_cuda.md.
# Which UCX transport carries GPU bytes: benchmarks/device_ucx_probe.py (UCX_PROTO_INFO=y).
# Status: ran on one NVIDIA H200 on 2026-12-04 (105 s; results in docs/performance.md, "On a
# GPU"); the CPU half of each check runs in the test suite.
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
# and DRAM + VRAM buffers on one rank (one NIXL transfer per memory kind pair)
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_nixl_tensors.py \
  tests/test_nixl_memkinds.py \
  2>&1 | tee "$OUT/tests.txt"
# the scattered hetero-TP request with CUDA buffers: direct, staged, and a device copy
timeout 420 python3 benchmarks/bench_staged.py --device cuda --reps 3 2>&1 \
  | tee "$OUT/bench_staged_cuda.md"
