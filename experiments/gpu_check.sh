#!/usr/bin/env bash
# The GPU tables, in three parts that each run as one command:
#
# - scale: plain JAX, fused BP, and DDG / FDG on K = 1..n stages over the n GPUs of this
#   machine, with FDG's three memory policies, for the FDG paper's Table 6 models (ResNet-56
#   and WRN-28-10, batch 128). On one GPU the stages share it (K = 1, 2): that measures the
#   overhead of staging, not a speedup.
# - gpt: AsyncPP's GPT (8 blocks, d = 768, 12 heads, context 512) in tokens/s and model FLOPs
#   utilisation against $PEAK_TFLOPS (default 495, an H100's or H200's dense TF32 peak: the
#   runs are float32, whose matmuls JAX runs on TF32 tensor cores at its default precision;
#   989 is the dense bf16 one).
# - sync: the synchronous side beside FDG as docs/benchmarks.md measures it on the CPU
#   (ResNet-20 batch 64, K = 2, M = 4: GPipe, 1F1B, interleaved 1F1B and ZB-V at V = 2, ZB-H1,
#   PipeDream-2BW), with the host's microseconds per dispatched call against the bare loop's;
#   `--model gpt --batch-size 32` for the GPT's table. With fewer than 2 GPUs the stages share one.
#
#   bash experiments/gpu_check.sh                   # all three; $PYTHON, else .venv/bin/python, else python
#   bash experiments/gpu_check.sh scale --stages 1,2,4,8   # flags after the part go to the benchmark
#   bash experiments/gpu_check.sh sync --model gpt --batch-size 32
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then python=$PYTHON
elif [ -x .venv/bin/python ]; then python=.venv/bin/python
else python=$(command -v python || command -v python3 || true)
fi
if [ -z "$python" ]; then
  echo "error: no python found; set PYTHON=/path/to/python (with dgrad installed)" >&2
  exit 2
fi
case "${1:-all}" in
  scale | gpt | sync | all) part=${1:-all}; shift $(( $# > 0 )) ;;
  -*) part=all ;;
  *) echo "error: unknown part '$1'; use scale, gpt, sync or all (then benchmark flags)" >&2
     exit 2 ;;
esac
probe="import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))"
if ! gpus=$("$python" -c "$probe" 2>/tmp/gpu_check.$$); then
  echo "error: $python could not list JAX's devices ($(tail -n 1 /tmp/gpu_check.$$)); install" \
    "dgrad there, or set PYTHON=/path/to/python" >&2
  rm -f /tmp/gpu_check.$$
  exit 2
fi
rm -f /tmp/gpu_check.$$
if [ "$gpus" -eq 0 ]; then
  echo "error: no GPU found by JAX; install the cuda12 extra: pip install -e '.[cuda12]'" >&2
  exit 2
fi
stages=$(seq -s, 1 "$(( gpus > 1 ? gpus : 2 ))")
wants() { [ "$part" = "$1" ] || [ "$part" = all ]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if wants scale; then
  for model in resnet56 wrn28-10; do
    "$python" -m experiments.benchmark --model "$model" --batch-size 128 --stages "$stages" \
      --split balanced --policies --windows 5 --steps 5 "$@"
  done
fi
if wants gpt; then
  "$python" -m experiments.benchmark --model gpt --layers 8 --dim 768 --heads 12 --context 512 \
    --batch-size 16 --stages "$stages" --split balanced --methods ddg,fdg,1f1b \
    --microbatches 4 --windows 5 --steps 5 --peak-tflops "${PEAK_TFLOPS:-495}" "$@"
fi
if wants sync; then
  "$python" -m experiments.benchmark --stages 2 --microbatches 4 --virtual-stages 2 \
    --methods gpipe,1f1b,zb,2bw,fdg --windows 3 --steps 3 "$@"
fi
