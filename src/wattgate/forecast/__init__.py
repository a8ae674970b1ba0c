"""What a plan will cost before it is submitted, and what a failure would have cost.

The train job's wall time is forecast term by term:
- start-up: process launch, imports and process-group init (measured on an
  earlier run of the same shape, else ASSUMED_STARTUP_S);
- load: the input weights read at the storage bandwidth (measured, else
  model bytes / bandwidth);
- steps: each optimizer step takes as long as its costliest rank, in the
  planner's own cost model (tokens + attn_weight x sum of squared document
  lengths, pack/assign.py), divided by a throughput in cost units per second
  per rank; under parallel.context C a launched rank does 1/C of its data
  rank's rows, so the plan's costs are divided by C (walltime.py
  per_context_rank; the key/value all-gathers are not modelled);
- checkpoints: the DCP checkpoint size divided by the storage bandwidth, at
  every step the trainer checkpoints (checkpoint_steps, the trainer's rule);
- export: final/ divided by the storage bandwidth.
GPU-hours are wall time x the launch's ranks; energy is the triage table's levels (compute
for steps, the wait level for checkpoints, idle for the rest) x the time in
each, GPUs only.

The throughput comes from the best source available, named in gate.json:
- measured: the newest run of the same model shape, world size (the launch's
  ranks), parallel.context and GPU model in results/throughput.jsonl (the
  ledger train appends to);
- calibrated: 6 x params FLOPs per token over the bf16 matmul rate `wattgate
  calibrate` measured on this GPU model x forecast.assumed_mfu;
- analytic: the same over the datasheet peak (train/metrics.py) x
  forecast.assumed_mfu;
- host-matmul (CPU runs only): the same over an fp32 matmul timed on the
  gate's host for ~0.3 s, shared by the ranks per node.

A failure's cost: where the ranks' collective sequences first diverge
(first_divergence) is where the run would hang; reaching it costs the
forecast time to that step, then the ranks wait until the collective timeout
kills the job, or, if the watchdog does not fire (the field report's silent
multi-hour hang), until the Slurm job's time limit.

The modules: throughput.py (the sources), walltime.py (the forecast and the
budget check), failure.py (where a run would hang and what that costs). The
ledger is wattgate/ledger.py; a hang the watcher stopped is costed by
telemetry/hang_cost.py.
"""
