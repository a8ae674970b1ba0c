"""`wattgate load-check`: the train stage's model load (and optionally its export), alone, measured.

Run under torchrun with the train job's world size to learn, before a long job, whether each
rank's shard loads, how long it takes and what it costs in host and device memory. It writes
`load-check.json` (and `final/` with --export) into --out.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from wattgate.artifacts import write_json_atomic
from wattgate.config import context_degree, expert_degree, replicate_degree
from wattgate.run_files import claim_output
from wattgate.train.distributed import setup_rank
from wattgate.model_spec import export_dtype_name
from wattgate.records.trained import LOAD, LoadCheck
from wattgate.train.mesh import data_parallel_mesh
from wattgate.train.metrics import GIB, PhaseMemory, memory_summary
from wattgate.train.model import build_meta_model, count_params, load_sharded_model
from wattgate.train.weights import DTYPES, export_hf_folder
from wattgate.records.run_config import RunConfig

STAGE = "loadcheck"


def load_check(config: RunConfig, out: Path, export: bool) -> LoadCheck:
    train = config.train
    export_dtype = export_dtype_name(config)
    # every rank, before any writes: a run folder's final/ (or anything else) is never replaced; what another
    # rank can have made by now (the marker, the NCCL trace folder of init_distributed) is load-check's own
    claim_output(out, STAGE)
    rank, world, device = setup_rank(train.collective_timeout_s, out)
    try:
        # imports the model's code outside the measured phase, with a kernel it runs (GPT-OSS and Gemma 2 have no sdpa)
        build_meta_model(config.model, "eager")
        memory = PhaseMemory(device)
        memory.start()
        t0 = time.perf_counter()
        degrees = (replicate_degree(config), expert_degree(config), context_degree(config))
        mesh = data_parallel_mesh(device.type, world, *degrees)
        model, source = load_sharded_model(config.model, train, mesh, device)
        dist.barrier()
        load_s = time.perf_counter() - t0
        memory.end("load")
        if export:
            export_hf_folder(model, out, DTYPES[export_dtype], int(train.export_max_shard_gib * GIB), [])
            memory.end("export")
        peaks = memory_summary(memory.gather())
        report = LoadCheck(
            world_size=world,
            device=device.type,
            params=count_params(model),
            source=source,
            load_s=load_s,
            export_dtype=export_dtype if export else None,
            memory=peaks,
        )
        if rank == 0:
            write_json_atomic(out / "load-check.json", report.to_json())
            worst = peaks.max_over_ranks[LOAD]
            print(
                f"load-check: {report.params / 1e6:.1f}M params on {world} rank(s) from {source} in "
                f"{load_s:.2f} s; peak host RSS {worst.host_peak_gib:.2f} GiB per rank -> {out}",
                flush=True,
            )
        return report
    finally:
        dist.destroy_process_group()
