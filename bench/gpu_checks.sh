#!/usr/bin/env bash
# Every GPU check of the telemetry work in one pass, for a node with an NVIDIA GPU:
#   1. the NVML sampler on an idle GPU (power source, columns filled, GPM);
#   2. sampler overhead (bench/sampler.py) with real NVML;
#   3. calibrate: known phases -> a calibrated triage table + its labelled samples;
#   4. the CUDA/NCCL train path (bf16 FSDP2, world 1) under the sampler and the watcher, with the clocks-event
#      reasons and SM clock the sampler recorded during its steps (issue 34);
#   5. real-size load and step (issue 9): a Qwen3-shaped model (QWEN_SIZE=1.7b|4b) written as bf16
#      safetensors, sharded load, seq_len 8192 packed, bf16, activation checkpointing on and off (AC_MODES):
#      steady-state MFU, tokens/s, peak memory against the gate's estimate, load and export time;
#   6. the loss (issue 23): Qwen3-1.7B and -4B shapes (LOSS_SIZES), seq_len 8192, bf16, one GPU, train.loss
#      full and chunked x micro_batch_size 1 and 2 (LOSS_MBS) x compile off and on (LOSS_COMPILE; activation
#      checkpointing on): tokens/s, MFU, torch.cuda.max_memory_allocated against the gate's steady estimate, each
#      in its own process;
#   7. the device mesh: a Qwen3-MoE-shaped model (64 experts, top 8) on every GPU of the node, seq_len 4096, bf16,
#      trained on the 1-D mesh, with HSDP (parallel.replicate 2) and with expert parallelism (parallel.expert 2):
#      steady tokens/s and CUDA peak memory per rank of each mesh against the 1-D run. NCCL runs one rank per GPU,
#      so it needs 2 or more GPUs: on a node with one it says so and runs nothing;
#   8. long rows: a Qwen3 shape (hidden 2048, 8 layers) at seq_len 32768 on every GPU of the node, one rank per row
#      (parallel.context 1) and each row split over 2 ranks (parallel.context 2): steady tokens/s and CUDA peak
#      memory per rank against C = 1 (2 or more GPUs, as step 7).
# Usage: [STEPS="1 2 3 4 5 6 7 8"] bash bench/gpu_checks.sh [--dry-run] OUTDIR [SECONDS_PER_PHASE]
# Needs python3 (or $PYTHON) with torch (CUDA), nvidia-ml-py, pyarrow, pandas, transformers, tokenizers, jsonschema.
# Run from the repository root. A command that fails is named at the end and the exit status is 1; the steps
# after it still run.
#
# --dry-run (or DRY_RUN=1): every step on this machine's CPU with stand-ins and tiny shapes, in a minute or two,
# so that a lent GPU's minutes are not spent on a traceback; tests/test_benchmarks.py runs it. NVML is
# bench/dry_run/pynvml.py (wattgate.testing's fake NVML: one "H200"), calibrate's phases run on the CPU
# (bench/dry_run/cuda_cli.py), 0.6 s each; the models are tiny (hidden 64, vocab 2048), seq_len 128-256, a few steps;
# step 5 runs activation checkpointing on only, step 6 micro_batch_size 2 and compile off only (inductor on a
# CPU takes minutes), steps 7 and 8 on two gloo ranks; the gates skip the collective proof (bench/gate.py's and bench/collectives.py's smoke runs
# run it). The work folders are under OUTDIR/work. Every figure it prints is the stand-ins', not a
# GPU's: it checks the script, not the hardware.
set -u -o pipefail
DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
  DRY_RUN=1
  shift
fi
OUT=${1:?usage: gpu_checks.sh [--dry-run] OUTDIR [SECONDS_PER_PHASE]}
if ((DRY_RUN)); then PHASE_S=${2:-0.6}; else PHASE_S=${2:-15}; fi
if ! [[ $PHASE_S =~ ^[0-9]*[.]?[0-9]+$ && $PHASE_S =~ [1-9] ]]; then
  echo "gpu_checks.sh: SECONDS_PER_PHASE must be a positive number of seconds, not '$PHASE_S'" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 2
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DRY_RUN
PY=${PYTHON:-python3}
W="$PY -m wattgate"
CALIBRATE="$W calibrate"
WORK_ROOT=/tmp
SAMPLE_S=8
if ((DRY_RUN)); then
  export PYTHONPATH=$PWD/bench/dry_run:$PYTHONPATH # the stand-in pynvml before the real one
  CALIBRATE="$PY bench/dry_run/cuda_cli.py calibrate"
  WORK_ROOT=$OUT/work
  SAMPLE_S=1
  QWEN_SIZE=tiny AC_MODES=${AC_MODES:-True}
  LOSS_SIZES=tiny LOSS_MBS=${LOSS_MBS:-2} LOSS_COMPILE=${LOSS_COMPILE:-0}
  mkdir -p "$WORK_ROOT"
fi
FAILED=()
trap 'FAILED+=("line $LINENO (status $?): $BASH_COMMAND")' ERR
t0=$(date +%s)
STEPS=${STEPS:-1 2 3 4 5 6 7 8}
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

stamp "0. machine"
if ((DRY_RUN)); then
  echo "dry run: CPU stand-ins (NVML: bench/dry_run/pynvml.py; CUDA: this CPU) and tiny shapes; the figures are theirs"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device: CPU')"
else
  nvidia-smi --query-gpu=name,driver_version,power.limit,power.draw,clocks.sm --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
fi

if want 1; then
stamp "1. sampler, $SAMPLE_S s on the idle GPU"
$W sample --out "$OUT/sampler-idle.parquet" --duration "$SAMPLE_S"
$PY - "$OUT/sampler-idle.parquet" <<'EOF'
import json, sys
from wattgate.trace import META_KEY, read_trace
t = read_trace(sys.argv[1]); d = t.to_pandas(); m = json.loads(t.schema.metadata[META_KEY])  # as the sampler wrote it
print("rows", len(d), "power source", m.get("power_source"), "gpus", [(g["name"], g.get("gpm")) for g in m["gpus"]])
print("non-null columns:", [c for c in d.columns if d[c].notna().any()])
print(d.drop(columns=["host"]).describe().T[["mean", "min", "max"]].round(2).to_string())
EOF

fi
if want 2; then
stamp "2. sampler overhead"
if ((DRY_RUN)); then
  $PY bench/sampler.py --smoke
else
  $PY bench/sampler.py --seconds 10 --gpus 8
fi

fi
if want 3; then
stamp "3. calibrate (${PHASE_S} s per phase)"
$CALIBRATE --gpu-model h200 --out "$OUT/h200.yaml" --seconds "$PHASE_S" --samples "$OUT/calibration-trace.parquet"

fi
if want 4; then
stamp "4. CUDA train path under sampler + watcher"
work=$WORK_ROOT/wattgate-gpu
rm -rf "$work"; mkdir -p "$work"
$PY - "$work" <<'EOF'
import os, sys, yaml
work = sys.argv[1]
c = yaml.safe_load(open("config/config.yaml"))
c["run_name"] = "gpu"
c["data"]["inputs"] = [f"{work}/corpus.jsonl"]
c["cluster"].update(gpus_per_node=1, gpu_model="H200")
c["watcher"] = {"hang_after_s": 30}
if os.environ["DRY_RUN"] == "1":  # the embedded default's tiny model, a few steps, no collective proof
    c["gate"]["collectives"] = False
    c["demo_corpus"]["num_docs"] = 300
    c["train"].update(seq_len=256, micro_batch_size=2, grad_accum=1, epochs=1, max_steps=6, checkpoint_every=4,
                      warmup_steps=1, eval_every=4)
    c["model"]["config"].update(max_position_embeddings=256)
else:
    c["demo_corpus"]["num_docs"] = 20000
    c["train"].update(seq_len=2048, micro_batch_size=4, grad_accum=2, epochs=1, checkpoint_every=40, warmup_steps=5)
    c["model"]["config"].update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                                num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
yaml.safe_dump(c, open(f"{work}/config.yaml", "w"))
EOF
C="$work/config.yaml"
$W demo-corpus --config "$C" --out "$work/corpus.jsonl" &&
$W train-tokenizer --config "$C" --out "$work/tokenizer" &&
$W pretokenize --config "$C" --tokenizer "$work/tokenizer" --out "$work/pretokenized" &&
$W pack --config "$C" --pretokenized "$work/pretokenized" --out "$work/plan" &&
$W gate --config "$C" --pretokenized "$work/pretokenized" --plan "$work/plan" --out "$work/gate" &&
$W launch --config "$C" --pretokenized "$work/pretokenized" --plan "$work/plan" --run-dir "$work/train"
echo "launch exit status $?"
cat "$work/train/TRAINED" "$work/train/watcher.json"
echo
# issue 34: the clocks-event reasons bitmask and the SM clock the sampler recorded during the training steps
$PY - "$work/train" "$work/gate" <<'EOF'
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
from wattgate.trace import REASON_BITS, read_trace, trace_files
run, gate = Path(sys.argv[1]), Path(sys.argv[2])
phases = json.loads((gate / "gate.json").read_text())["memory_estimate_phases"]
print("gate's memory estimate:", ", ".join(f"{p} {v['total_bytes'] / 2**30:.2f} GiB per {v['per']}" for p, v in phases.items()))
m = pq.read_table(run / "metrics.parquet").to_pandas()
t0, t1 = float((m["time"] - m["step_time_s"]).min()), float(m["time"].max())
for path in trace_files(run / "telemetry"):
    d = read_trace(path).to_pandas()
    d = d[(d["time"] >= t0) & (d["time"] <= t1)]
    print(path.name, len(d), "rows in the training steps; SM clock MHz", d["sm_clock_mhz"].describe().round(0).to_dict())
    for mask, n in d["clocks_event_reasons"].value_counts(dropna=False).items():
        names = [k for k, bit in REASON_BITS.items() if mask == mask and int(mask) & bit]
        print(f"  clocks_event_reasons {mask!r} ({', '.join(names) or 'none'}): {n} rows")
EOF
tar -C "$work" -czf "$OUT/train-run.tar.gz" config.yaml gate/gate.json train/TRAINED train/watcher.json \
  train/metrics.parquet train/telemetry train/heartbeat
fi
if want 5; then
stamp "5. real-size model: sharded load, seq_len 8192, bf16, activation checkpointing on/off"
work=$WORK_ROOT/wattgate-real
rm -rf "$work"; mkdir -p "$work"
$PY - "$work" "${QWEN_SIZE:-1.7b}" <<'EOF'
import os, sys, torch, yaml
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
from wattgate.data.synthetic import write_random_pretokenized
work, size = Path(sys.argv[1]), sys.argv[2]
dry = os.environ["DRY_RUN"] == "1"
shapes = {"1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
          "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
          "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True)}  # the dry run's
vocab, seq, head_dim = (2048, 128, 16) if dry else (151936, 8192, 128)
config = AutoConfig.for_model("qwen3", vocab_size=vocab, head_dim=head_dim, max_position_embeddings=40960,
                              rope_theta=1000000, rms_norm_eps=1e-6, **shapes[size])
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.to_empty(device="cpu" if dry else "cuda")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.save_pretrained(str(work / "model"))  # bf16 safetensors, like a downloaded checkpoint
del model
if not dry:
    torch.cuda.empty_cache()
docs = 200 if dry else 2000
lengths = torch.randint(seq // 32, seq, (docs,), generator=torch.Generator().manual_seed(0)).tolist()
write_random_pretokenized(work / "pretokenized", lengths, vocab, seed=0)
for ac in (True, False):
    c = {"run_name": f"ac-{ac}", "model": {"path": str(work / "model")},
         "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_model": "H200"},
         "train": {"seq_len": seq, "micro_batch_size": 1, "grad_accum": 1 if dry else 4, "epochs": 1,
                   "max_steps": 3 if dry else 20, "warmup_steps": 1 if dry else 2, "checkpoint_every": 1000,
                   "checkpoint_at_epoch_end": False, "activation_checkpointing": ac, "log_every": 1 if dry else 5}}
    if dry:
        c["gate"] = {"collectives": False}
    yaml.safe_dump(c, open(work / f"ac-{ac}.yaml", "w"))
EOF
for ac in ${AC_MODES:-True False}; do
  C="$work/ac-$ac.yaml"
  $W pack --config "$C" --pretokenized "$work/pretokenized" --out "$work/plan-$ac" &&
  $W gate --config "$C" --pretokenized "$work/pretokenized" --plan "$work/plan-$ac" --out "$work/gate-$ac"
  $PY -m torch.distributed.run --standalone --nproc-per-node=1 -m wattgate train --config "$C" \
    --pretokenized "$work/pretokenized" --plan "$work/plan-$ac" --run-dir "$work/train-$ac" 2>&1 | grep -v Warning
  echo "train (activation checkpointing $ac) exit status $?"
done
$PY - "$work" ${AC_MODES:-True False} <<'EOF'
import json, os, sys
import pyarrow.parquet as pq
from pathlib import Path
from wattgate.train.metrics import model_flops_utilization
work = Path(sys.argv[1])
warm = 1 if os.environ["DRY_RUN"] == "1" else 5  # steps before the steady state: compile and allocator warm-up
for ac in sys.argv[2:]:
    try:
        t = json.loads((work / f"train-{ac}" / "TRAINED").read_text())
        g = json.loads((work / f"gate-{ac}" / "gate.json").read_text())
    except OSError as exc:
        print(f"activation checkpointing {ac}: no result ({exc})")
        continue
    m = pq.read_table(work / f"train-{ac}" / "metrics.parquet").to_pandas()
    steady = m[m.step > warm]  # past compile and allocator warm-up
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
if want 6; then
stamp "6. loss: full vs chunked, micro_batch_size 1/2, compile off/on, seq_len 8192, bf16"
work=$WORK_ROOT/wattgate-loss
rm -rf "$work"; mkdir -p "$work"
cat > "$work/step.py" <<'EOF'
"""One variant in one process: sharded (world 1) random-init Qwen3 shape, AdamW, WARMUP + STEPS optimizer steps of
one packed micro-batch (documents of 2048 tokens); prints one JSON line. In the dry run (DRY_RUN=1), on the CPU,
the process's peak host RSS (VmHWM) stands in for torch.cuda's peak memory."""
import json, os, sys, time
from pathlib import Path
import torch
from torch.distributed.device_mesh import init_device_mesh
from wattgate.config import run_config, validate_config
from wattgate.gate.memory import GIB, estimate_memory
from wattgate.model_spec import load_model_spec
from wattgate.gate.run import fit_settings
from wattgate.train.data import IGNORE
from wattgate.train.distributed import setup_rank
from wattgate.train.optimizer import build_optimizer
from wattgate.train.loss import summed_token_loss
from wattgate.train.metrics import model_flops_utilization, peak_rss_bytes, reset_peak_rss
from wattgate.train.model import count_params, load_sharded_model

size, kind, mbs, compile_, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", Path(sys.argv[5])
dry = os.environ["DRY_RUN"] == "1"
WARMUP, STEPS, SEQ, DOC = (1, 2, 128, 64) if dry else (3, 10, 8192, 2048)
VOCAB, HEAD_DIM = (2048, 16) if dry else (151936, 128)
shapes = {"1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=True),
          "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True),
          "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True)}  # the dry run's
model_cfg = dict(model_type="qwen3", vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=40960,
                 rope_theta=1000000, rms_norm_eps=1e-6, **shapes[size])
config = validate_config({
    "run_name": "loss", "model": {"config": model_cfg},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_model": "H200"},
    "train": {"seq_len": SEQ, "micro_batch_size": mbs, "grad_accum": 1, "loss": kind, "compile": compile_,
              "activation_checkpointing": True}})
typed = run_config(config)
train = typed.train  # carries train.compile and train.loss
rank, world, device = setup_rank(600, out)
cuda = device.type == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
model, _ = load_sharded_model(config["model"], train, init_device_mesh(device.type, (1,)), device)
optimizer = build_optimizer(model, train)
ids = torch.randint(0, VOCAB, (mbs, SEQ), device=device)
position_ids = (torch.arange(SEQ, device=device) % DOC).repeat(mbs, 1)
labels = torch.where(position_ids > 0, ids, IGNORE)
tensors = {"input_ids": ids, "labels": labels, "position_ids": position_ids}
n_loss = int((labels != IGNORE).sum())
times = []
for i in range(WARMUP + STEPS):
    if i == WARMUP:
        sync()
        torch.cuda.reset_peak_memory_stats(device) if cuda else reset_peak_rss()
    t0 = time.perf_counter()
    (summed_token_loss(model, tensors, train.loss, train.loss_chunk_tokens) / n_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync()
    times.append(time.perf_counter() - t0)
step_s = sorted(times[WARMUP:])[STEPS // 2]
tps = mbs * SEQ / step_s
terms = estimate_memory(load_model_spec(typed), fit_settings(typed))
params = count_params(model)
peak = torch.cuda.max_memory_allocated(device) if cuda else peak_rss_bytes()
reserved = torch.cuda.max_memory_reserved(device) if cuda else peak
print(json.dumps({"size": size, "loss": kind, "mbs": mbs, "compile": compile_, "params_b": round(params / 1e9, 3),
                  "first_step_s": round(times[0], 1), "step_s": round(step_s, 3), "tokens_per_s": round(tps),
                  "mfu_pct": round(100 * model_flops_utilization(tps, params, 1, "h200"), 1),
                  "peak_gib": round(peak / GIB, 2), "reserved_gib": round(reserved / GIB, 2),
                  "gate_gib": round(sum(terms.values()) / GIB, 2), "gate_logits_gib": round(terms["logits"] / GIB, 2)}),
      flush=True)
EOF
((DRY_RUN)) && echo "dry run: compile on is left to the GPU (inductor on this CPU takes minutes)"
for size in ${LOSS_SIZES:-1.7b 4b}; do
  for kind in full chunked; do
    for mbs in ${LOSS_MBS:-1 2}; do
      for comp in ${LOSS_COMPILE:-0 1}; do
        if ! timeout 900 $PY -m torch.distributed.run --standalone --nproc-per-node=1 "$work/step.py" \
          "$size" "$kind" "$mbs" "$comp" "$work/out" 2>"$work/err-$size-$kind-$mbs-$comp.txt" | tee -a "$work/loss.jsonl"; then
          echo "$size $kind mbs $mbs compile $comp: failed (an OOM is a result too):"
          tail -3 "$work/err-$size-$kind-$mbs-$comp.txt"
          if ((DRY_RUN)); then FAILED+=("step 6: $size $kind mbs $mbs compile $comp"); fi
        fi
      done
    done
  done
done
$PY - "$work/loss.jsonl" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'size':>5} {'loss':>8} {'mbs':>3} {'compile':>7} {'tok/s':>7} {'MFU%':>5} {'peak GiB':>8} {'gate GiB':>8} "
      f"{'peak/gate':>9} {'1st step s':>10}")
for r in rows:
    print(f"{r['size']:>5} {r['loss']:>8} {r['mbs']:>3} {str(r['compile']):>7} {r['tokens_per_s']:>7} {r['mfu_pct']:>5} "
          f"{r['peak_gib']:>8} {r['gate_gib']:>8} {r['peak_gib'] / r['gate_gib']:>9.2f} {r['first_step_s']:>10}")
EOF
cp "$work/loss.jsonl" "$OUT/loss.jsonl"
fi
if want 7; then
stamp "7. the device mesh: 1-D, HSDP (replicate 2), expert parallelism (expert 2)"
work=$WORK_ROOT/wattgate-mesh
rm -rf "$work"; mkdir -p "$work"
if ((DRY_RUN)); then RANKS=2; else RANKS=$(nvidia-smi -L | grep -c '^GPU'); fi
if ((RANKS < 2)); then
  echo "step 7 needs 2 or more GPUs on the node (NCCL runs one rank per GPU); this node has $RANKS: not run"
else
$PY - "$work" "$RANKS" <<'EOF'
import os, sys, yaml
from pathlib import Path
import numpy as np
from wattgate.data.synthetic import write_random_pretokenized
work, ranks = Path(sys.argv[1]), int(sys.argv[2])
dry = os.environ["DRY_RUN"] == "1"
moe = dict(model_type="qwen3_moe", vocab_size=2048 if dry else 151936, hidden_size=64 if dry else 1024,
           intermediate_size=128 if dry else 3072, moe_intermediate_size=32 if dry else 512,
           num_hidden_layers=2 if dry else 8, num_attention_heads=4 if dry else 16, num_key_value_heads=2 if dry else 4,
           head_dim=16 if dry else 64, num_experts=8 if dry else 64, num_experts_per_tok=2 if dry else 8,
           norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
seq = 128 if dry else 4096
lengths = np.random.default_rng(0).integers(seq // 16, seq, 60 * ranks if dry else 400 * ranks).tolist()
write_random_pretokenized(work / "pretokenized", lengths, moe["vocab_size"], seed=0)
for name, parallel in (("1d", {}), ("hsdp", {"replicate": 2}), ("ep", {"expert": 2})):
    c = {"run_name": name, "model": {"config": moe}, "parallel": parallel,
         "cluster": {"nodes": 1, "gpus_per_node": ranks, "gpu_model": "H200"},
         "train": {"seq_len": seq, "micro_batch_size": 1, "grad_accum": 1, "epochs": 1,
                   "max_steps": 4 if dry else 30, "warmup_steps": 1, "checkpoint_every": 1000,
                   "checkpoint_at_epoch_end": False, "activation_checkpointing": True, "log_every": 1}}
    yaml.safe_dump(c, open(work / f"{name}.yaml", "w"))
EOF
$W pack --config "$work/1d.yaml" --pretokenized "$work/pretokenized" --out "$work/plan"
for mesh in 1d hsdp ep; do
  $PY -m torch.distributed.run --standalone --nproc-per-node="$RANKS" -m wattgate train --config "$work/$mesh.yaml" \
    --pretokenized "$work/pretokenized" --plan "$work/plan" --run-dir "$work/train-$mesh" 2>&1 | grep -v Warning | tail -2
  echo "train ($mesh) exit status $?"
done
$PY - "$work" <<'EOF'
import os, sys
sys.path.insert(0, "bench")
from benchlib import print_steady_figures
warm = 1 if os.environ["DRY_RUN"] == "1" else 5  # steps before the steady state
print_steady_figures(sys.argv[1], {m: f"train-{m}" for m in ("1d", "hsdp", "ep")}, warm, "1-D", with_mesh=True)
EOF
fi
fi
if want 8; then
stamp "8. long rows: context parallelism (parallel.context 2) against one rank per row"
work=$WORK_ROOT/wattgate-long
rm -rf "$work"; mkdir -p "$work"
if ((DRY_RUN)); then RANKS=2; else RANKS=$(nvidia-smi -L | grep -c '^GPU'); fi
if ((RANKS < 2)); then
  echo "step 8 needs 2 or more GPUs on the node (NCCL runs one rank per GPU); this node has $RANKS: not run"
else
$PY - "$work" "$RANKS" <<'EOF'
import os, sys, yaml
from pathlib import Path
import numpy as np
from wattgate.data.synthetic import write_random_pretokenized
work, ranks = Path(sys.argv[1]), int(sys.argv[2])
dry = os.environ["DRY_RUN"] == "1"
seq = 256 if dry else 32768
dense = dict(model_type="qwen3", vocab_size=2048 if dry else 151936, hidden_size=64 if dry else 2048,
             intermediate_size=128 if dry else 6144, num_hidden_layers=2 if dry else 8, num_attention_heads=4 if dry else 16,
             num_key_value_heads=2 if dry else 8, head_dim=16 if dry else 128, max_position_embeddings=seq,
             tie_word_embeddings=True)
# long documents: a quarter of a row to a whole one, enough rows for every rank's steps at both C
lengths = np.random.default_rng(0).integers(seq // 4, seq, 12 * ranks).tolist()
write_random_pretokenized(work / "pretokenized", lengths, dense["vocab_size"], seed=0)
for context in (1, 2):
    c = {"run_name": f"c{context}", "model": {"config": dense}, "parallel": {"context": context},
         "cluster": {"nodes": 1, "gpus_per_node": ranks, "gpu_model": "H200"},
         "train": {"seq_len": seq, "micro_batch_size": 1, "grad_accum": 1, "epochs": 1,
                   "max_steps": 3 if dry else 12, "warmup_steps": 1, "checkpoint_every": 1000,
                   "checkpoint_at_epoch_end": False, "activation_checkpointing": True, "log_every": 1}}
    yaml.safe_dump(c, open(work / f"c{context}.yaml", "w"))
EOF
for context in 1 2; do
  $W pack --config "$work/c$context.yaml" --pretokenized "$work/pretokenized" --out "$work/plan-c$context" &&
  $PY -m torch.distributed.run --standalone --nproc-per-node="$RANKS" -m wattgate train --config "$work/c$context.yaml" \
    --pretokenized "$work/pretokenized" --plan "$work/plan-c$context" --run-dir "$work/train-c$context" 2>&1 \
    | grep -v Warning | tail -2
  echo "train (context $context) exit status $?"
done
$PY - "$work" <<'EOF'
import os, sys
sys.path.insert(0, "bench")
from benchlib import print_steady_figures
warm = 1 if os.environ["DRY_RUN"] == "1" else 3  # steps before the steady state
print_steady_figures(sys.argv[1], {f"context {c}": f"train-c{c}" for c in (1, 2)}, warm, "C = 1")
EOF
fi
fi
trap - ERR
stamp "done"
if ((${#FAILED[@]})); then
  echo "gpu_checks.sh: ${#FAILED[@]} command(s) failed:"
  printf '  %s\n' "${FAILED[@]}"
  exit 1
fi
