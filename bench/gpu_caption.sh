#!/usr/bin/env bash
# One H200 (or any single CUDA GPU), about 8-9 minutes: where a caption batch's time
# goes for the 7B-architecture Qwen2.5-VL, plain generate against the fast path, and
# 1, 2 and 4 model copies sharing the card. Needs python with torch, transformers
# (4.5x or 5.x), torchvision and Pillow -- no pyspark, no vLLM, no network, no project
# install. Run from the repository root:
#
#     OUT=/some/folder bash bench/gpu_caption.sh
#
# The log goes to $OUT/gpu_caption.log (and to stdout). Steps, each under its own time
# limit so that one slow step cannot take the others' time; a step that runs out of time
# says so in the log and the next one starts:
#
#   1. build the random 7B checkpoint (~40 s, reused by the later steps), then batch 128:
#      a warm-up batch per variant (compiles the fast path's decode step; checks its
#      greedy tokens against plain generate's, row for row), then plain and fast
#      alternating, 2 repeats, 256 images, every batch profiled (limit 300 s);
#   2. batch 64 the same, 1 repeat, 128 images (120 s);
#   3. 1, 2 and 4 copies of the model as processes sharing the GPU, plain generate at
#      batch 32 (the smallest batch last), 128 images split between the copies (150 s).
#
# The limits add up to 570 s: give the device tool's run timeout_s=600.
#
# Override with environment variables: PYTHON, WORKDIR (the checkpoint; default
# /tmp/lakeshard-gpu-bench), IMAGES, LIMIT1/LIMIT2/LIMIT3 (seconds per step), and for a
# smoke run of the script itself on a CPU: ARCH, DEVICE, EXTRA (more bench arguments),
#     ARCH=tiny DEVICE=cpu IMAGES=8 EXTRA="--max-new-tokens 4 --max-pixels 3136" \
#         OUT=/tmp/smoke bash bench/gpu_caption.sh
set -u
OUT=${OUT:-.}
PYTHON=${PYTHON:-python}
WORKDIR=${WORKDIR:-/tmp/lakeshard-gpu-bench}
IMAGES=${IMAGES:-256}
LOG="$OUT/gpu_caption.log"
mkdir -p "$OUT" "$WORKDIR"
# shellcheck disable=SC2206  # EXTRA is split into arguments on purpose
BENCH=(bench/caption_throughput.py --bare --arch "${ARCH:-qwen2_5_vl_7b}"
       --device "${DEVICE:-cuda:0}" --images "$IMAGES" --max-new-tokens 200
       --workdir "$WORKDIR" ${EXTRA:-})

step() {  # step LIMIT_SECONDS NAME ARGS...: one bench run under a time limit, logged
    local limit=$1 name=$2
    shift 2
    echo "=== $name ($(date -u +%FT%TZ), limit ${limit} s): ${BENCH[*]} $*" | tee -a "$LOG"
    timeout --signal=INT --kill-after=20 "$limit" "$PYTHON" -u "${BENCH[@]}" "$@" 2>&1 \
        | grep --line-buffered -v -e "Loading weights" -e "fast processor by default" \
        | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || echo "=== $name: exit $rc (124: out of time)" | tee -a "$LOG"
}

{
    echo "=== lakeshard gpu_caption.sh at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
    nproc
} 2>&1 | tee "$LOG"

step "${LIMIT1:-300}" "batch 128, plain vs fast" \
    --batch-sizes 128 --variants plain,fast --repeats 2
step "${LIMIT2:-120}" "batch 64, plain vs fast" \
    --batch-sizes 64 --variants plain,fast --repeats 1 --images "$((IMAGES / 2))"
step "${LIMIT3:-150}" "copies per GPU" \
    --batch-sizes 32 --copies 1,2,4 --copies-variant plain --images "$((IMAGES / 2))"
echo "=== done $(date -u +%FT%TZ)" | tee -a "$LOG"
