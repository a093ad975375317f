#!/usr/bin/env bash
# The GPU table: plain JAX, fused BP, and DDG / FDG on K = 1..n stages over the n GPUs of
# this machine, with FDG's three memory policies, for the FDG paper's Table 6 models
# (ResNet-56 and WRN-28-10, batch 128). On one GPU the stages share it (K = 1, 2): that
# measures the overhead of staging, not a speedup. Then the GPT rows: AsyncPP's GPT (8
# blocks, d = 768, 12 heads, context 512) in tokens/s and model FLOPs utilisation against
# $PEAK_TFLOPS (default 495, an H100's or H200's dense TF32 peak: the runs are float32, whose
# matmuls JAX runs on TF32 tensor cores at its default precision; 989 is the dense bf16 one).
#
#   bash experiments/gpu_check.sh            # uses .venv/bin/python, or $PYTHON
#   bash experiments/gpu_check.sh --stages 1,2,4,8   # flags given go to both benchmarks
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
gpus=$("$python" -c "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))")
if [ "$gpus" -eq 0 ]; then
  echo "error: no GPU found by JAX; install the cuda12 extra: pip install -e '.[cuda12]'" >&2
  exit 2
fi
stages=$(seq -s, 1 "$(( gpus > 1 ? gpus : 2 ))")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
for model in resnet56 wrn28-10; do
  "$python" -m experiments.benchmark --model "$model" --batch-size 128 --stages "$stages" \
    --split balanced --policies --windows 5 --steps 5 "$@"
done
"$python" -m experiments.benchmark --model gpt --layers 8 --dim 768 --heads 12 --context 512 \
  --batch-size 16 --stages "$stages" --split balanced --methods ddg,fdg,1f1b \
  --microbatches 4 --windows 5 --steps 5 --peak-tflops "${PEAK_TFLOPS:-495}" "$@"
