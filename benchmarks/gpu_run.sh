#!/usr/bin/env bash
# The one command for the GPU machine (docs/gpu-check.md), run from the repository root there:
#   bash benchmarks/gpu_run.sh            # OUT: the folder whose files come back (the device tool sets it)
# The check writes into a scratch folder (checkpoints, the HF export and the installed wheels are GBs and
# hundreds of files); only report.md, report.json, the stdout JSON lines, nvidia-smi and a tarball of the small
# logs are copied into $OUT, also after the inner timeout. Extra arguments go to gpu_check.py (e.g. --sdpa
# cudnn_attention).
set -u
OUT=${OUT:?set OUT to the folder that comes back}
LIMIT=${GPU_CHECK_LIMIT_S:-500}            # inner timeout: leaves the copy-back time inside the device call
BUDGET=${GPU_CHECK_BUDGET_S:-$((LIMIT - 40))} # sections that would not fit are skipped (the slowest come last)
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d /tmp/gpu-check.XXXXXX)
REPORT="$SCRATCH/report"

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
timeout -k 15 "$LIMIT" "$PY" benchmarks/gpu_check.py "$REPORT" --budget-s "$BUDGET" "$@" | tee "$OUT/sections.jsonl"
rc=${PIPESTATUS[0]}

cp "$REPORT/report.md" "$REPORT/report.json" "$OUT/" 2>/dev/null
(
    cd "$REPORT" 2>/dev/null &&
        tar czf "$OUT/logs.tgz" --ignore-failed-read *.log *.jsonl *.json *.yaml run-*/metrics.jsonl run-*/*.log 2>/dev/null
)
ls -la "$OUT"
echo "gpu_check exit $rc (124/137: the inner timeout); report: $OUT/report.md"
exit "$rc"
