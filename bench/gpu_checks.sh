#!/usr/bin/env bash
# Every GPU check of the telemetry work in one pass, for a node with an NVIDIA GPU:
#   1. the NVML sampler on an idle GPU (power source, columns filled, GPM);
#   2. sampler overhead (bench/sampler.py) with real NVML;
#   3. calibrate: known phases -> a calibrated triage table + its labelled samples;
#   4. the CUDA/NCCL train path (bf16 FSDP2, world 1) under the sampler and the watcher;
#   5. real-size load and step (issue 9): a Qwen3-shaped model (QWEN_SIZE=1.7b|4b) written as bf16
#      safetensors, sharded load, seq_len 8192 packed, bf16, activation checkpointing on and off:
#      steady-state MFU, tokens/s, peak memory against the gate's estimate, load and export time.
# Usage: [STEPS="1 2 3 4 5"] bash bench/gpu_checks.sh OUTDIR [SECONDS_PER_PHASE]
# Needs python3 with torch (CUDA), nvidia-ml-py, pyarrow, pandas, transformers, tokenizers, jsonschema.
set -u -o pipefail
OUT=${1:?usage: gpu_checks.sh OUTDIR [SECONDS_PER_PHASE]}
PHASE_S=${2:-15}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
W="$PY -m wattgate"
t0=$(date +%s)
STEPS=${STEPS:-1 2 3 4 5}
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
if want 5; then
stamp "5. real-size model: sharded load, seq_len 8192, bf16, activation checkpointing on/off"
work=/tmp/wattgate-real
rm -rf "$work"; mkdir -p "$work"
$PY - "$work" "${QWEN_SIZE:-1.7b}" <<'EOF'
import sys, torch, yaml
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
from wattgate.data.synthetic import write_random_pretokenized
work, size = Path(sys.argv[1]), sys.argv[2]
shapes = {"1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
          "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True)}
config = AutoConfig.for_model("qwen3", vocab_size=151936, head_dim=128, max_position_embeddings=40960,
                              rope_theta=1000000, rms_norm_eps=1e-6, **shapes[size])
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.to_empty(device="cuda")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.save_pretrained(str(work / "model"))  # bf16 safetensors, like a downloaded checkpoint
del model
torch.cuda.empty_cache()
lengths = torch.randint(256, 8192, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
write_random_pretokenized(work / "pretokenized", lengths, 151936, seed=0)
for ac in (True, False):
    c = {"run_name": f"ac-{ac}", "model": {"path": str(work / "model")},
         "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_model": "H200"},
         "train": {"seq_len": 8192, "micro_batch_size": 1, "grad_accum": 4, "epochs": 1, "max_steps": 20,
                   "warmup_steps": 2, "checkpoint_every": 1000, "checkpoint_at_epoch_end": False,
                   "activation_checkpointing": ac, "log_every": 5}}
    yaml.safe_dump(c, open(work / f"ac-{ac}.yaml", "w"))
EOF
for ac in True False; do
  C="$work/ac-$ac.yaml"
  $W pack --config "$C" --pretokenized "$work/pretokenized" --out "$work/plan-$ac" &&
  $W gate --config "$C" --pretokenized "$work/pretokenized" --plan "$work/plan-$ac" --out "$work/gate-$ac"
  $PY -m torch.distributed.run --standalone --nproc-per-node=1 -m wattgate train --config "$C" \
    --pretokenized "$work/pretokenized" --plan "$work/plan-$ac" --out "$work/train-$ac" 2>&1 | grep -v Warning
  echo "train (activation checkpointing $ac) exit status $?"
done
$PY - "$work" <<'EOF'
import json, sys
import pyarrow.parquet as pq
from pathlib import Path
from wattgate.train.metrics import model_flops_utilization
work = Path(sys.argv[1])
for ac in ("True", "False"):
    try:
        t = json.loads((work / f"train-{ac}" / "TRAINED").read_text())
        g = json.loads((work / f"gate-{ac}" / "gate.json").read_text())
    except OSError as exc:
        print(f"activation checkpointing {ac}: no result ({exc})")
        continue
    m = pq.read_table(work / f"train-{ac}" / "metrics.parquet").to_pandas()
    steady = m[m.step > 5]  # past compile and allocator warm-up
    tps = steady.tokens.sum() / steady.groupby("step").step_time_s.max().sum()
    worst = t["memory"]["max_over_ranks"]
    estimates = g.get("memory_estimate_phases") or {}
    print(f"AC {ac}: {t['params'] / 1e9:.2f}B params, load {t['load_s']:.1f} s, export {t['export_s']:.1f} s, "
          f"steady {tps:.0f} tok/s, MFU {100 * model_flops_utilization(tps, t['params'], 1, 'h200'):.1f}% "
          f"(6N, attention not counted)")
    for p in ("load", "steady", "export"):
        est = estimates.get(p, {}).get("total_bytes")
        measured = worst[p].get("cuda_peak_gib", float("nan"))
        ratio = f", measured/estimated {measured * 2**30 / est:.3f}" if est else ""
        print(f"  {p}: CUDA peak {measured:.2f} GiB (reserved {worst[p].get('cuda_reserved_peak_gib', float('nan')):.2f}), "
              f"host peak {worst[p]['host_peak_gib']:.2f} GiB; gate estimate "
              f"{(est or float('nan')) / 2**30:.2f} GiB{ratio}")
EOF
fi
stamp "done"
