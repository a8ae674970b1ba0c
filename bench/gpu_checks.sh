#!/usr/bin/env bash
# Every GPU check of the telemetry work in one pass, for a node with an NVIDIA GPU:
#   1. the NVML sampler on an idle GPU (power source, columns filled, GPM);
#   2. sampler overhead (bench/sampler.py) with real NVML;
#   3. calibrate: known phases -> a calibrated triage table + its labelled samples;
#   4. the CUDA/NCCL train path (bf16 FSDP2, world 1) under the sampler and the watcher.
# Usage: [STEPS="1 2 3 4"] bash bench/gpu_checks.sh OUTDIR [SECONDS_PER_PHASE]
# Needs python3 with torch (CUDA), nvidia-ml-py, pyarrow, pandas, transformers, tokenizers, jsonschema.
set -u -o pipefail
OUT=${1:?usage: gpu_checks.sh OUTDIR [SECONDS_PER_PHASE]}
PHASE_S=${2:-15}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
W="$PY -m wattgate"
t0=$(date +%s)
STEPS=${STEPS:-1 2 3 4}
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

stamp "0. machine"
nvidia-smi --query-gpu=name,driver_version,power.limit,power.draw,clocks.sm --format=csv
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

if want 1; then
stamp "1. sampler, 8 s on the idle GPU"
$W sample --out "$OUT/sampler-idle.parquet" --duration 8
$PY - "$OUT/sampler-idle.parquet" <<'EOF'
import sys
from wattgate.telemetry.trace import read_trace, trace_meta
t = read_trace(sys.argv[1]); d = t.to_pandas(); m = trace_meta(t)
print("rows", len(d), "power source", m.get("power_source"), "gpus", [(g["name"], g.get("gpm")) for g in m["gpus"]])
print("non-null columns:", [c for c in d.columns if d[c].notna().any()])
print(d.drop(columns=["host"]).describe().T[["mean", "min", "max"]].round(2).to_string())
EOF

fi
if want 2; then
stamp "2. sampler overhead"
$PY bench/sampler.py --seconds 10 --gpus 8

fi
if want 3; then
stamp "3. calibrate (${PHASE_S} s per phase)"
$W calibrate --gpu-model h200 --out "$OUT/h200.yaml" --seconds "$PHASE_S" --samples "$OUT/calibration-trace.parquet"

fi
if want 4; then
stamp "4. CUDA train path under sampler + watcher"
work=/tmp/wattgate-gpu
rm -rf "$work"; mkdir -p "$work"
$PY - "$work" <<'EOF'
import sys, yaml
work = sys.argv[1]
c = yaml.safe_load(open("config/config.yaml"))
c["run_name"] = "gpu"
c["data"]["inputs"] = [f"{work}/corpus.jsonl"]
c["demo_corpus"]["num_docs"] = 20000
c["cluster"].update(gpus_per_node=1, gpu_model="H200")
c["train"].update(seq_len=2048, micro_batch_size=4, grad_accum=2, epochs=1, checkpoint_every=40, warmup_steps=5)
c["model"]["config"].update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
c["watcher"] = {"hang_after_s": 30}
yaml.safe_dump(c, open(f"{work}/config.yaml", "w"))
EOF
C="$work/config.yaml"
$W demo-corpus --config "$C" --out "$work/corpus.jsonl" &&
$W train-tokenizer --config "$C" --out "$work/tokenizer" &&
$W pretokenize --config "$C" --tokenizer "$work/tokenizer" --out "$work/pretokenized" &&
$W pack --config "$C" --pretokenized "$work/pretokenized" --out "$work/plan" &&
$W gate --config "$C" --pretokenized "$work/pretokenized" --plan "$work/plan" --out "$work/gate" &&
$W launch --config "$C" --pretokenized "$work/pretokenized" --plan "$work/plan" --out "$work/train"
echo "launch exit status $?"
cat "$work/train/TRAINED" "$work/train/watcher.json" 2>/dev/null
grep -h "estimated peak" "$work/gate/gate.md" 2>/dev/null
tar -C "$work" -czf "$OUT/train-run.tar.gz" config.yaml gate/gate.json train/TRAINED train/watcher.json \
  train/metrics.parquet train/telemetry train/heartbeat 2>/dev/null
fi
stamp "done"
