#!/bin/sh
# The accelerator run (benchmarks/gpu.py --device gpu): device->host through Orbax's path
# against pinned-memory D2H, a snapshot every iteration of the pipeline example, a restore
# to the device against H2D; one JSON object on the last line of stdout. For a CUDA host
# with JAX's CUDA build installed (pip install -U "jax[cuda12]"); it stops itself after
# 8 minutes. Extra flags go to gpu.py (e.g. --mb 4096). The same program runs on the CPU
# backend: python benchmarks/gpu.py --device cpu (the tests run it so, with --quick).
set -eu
here=$(dirname "$0")
python=${PYTHON:-python3}
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu.sh: no NVIDIA GPU visible (nvidia-smi -L failed); CPU numbers:" \
         "$python $here/gpu.py --device cpu" >&2
    exit 2
fi
if ! "$python" -c 'import jax, sys; sys.exit(not any(d.platform == "gpu" for d in jax.devices()))'
then
    echo "gpu.sh: JAX sees no GPU; install its CUDA build: pip install -U 'jax[cuda12]'" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv >&2 || true
exec timeout --signal=TERM --kill-after=30 480 "$python" "$here/gpu.py" --device gpu --json "$@"
