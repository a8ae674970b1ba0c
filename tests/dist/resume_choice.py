"""Run under torchrun by tests/test_resume_and_launch.py: each rank looks at its own checkpoints folder
(as two nodes with different directory caches would) and must resume from rank 0's choice."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from wattgate.records.checkpoint import RunIdentity
from wattgate.train.distributed import setup_rank
from wattgate.train.loop import resume_checkpoint

rank, world, device = setup_rank(60, Path(sys.argv[1]))
view = Path(sys.argv[1 + rank])  # rank r sees folder r
identity = RunIdentity.read(Path(sys.argv[3]))
choice = resume_checkpoint(view, identity if rank == 0 else None, rank)
every: list = [None] * world
dist.all_gather_object(every, str(choice))
if rank == 0:
    Path(sys.argv[4]).write_text(json.dumps(every))
dist.destroy_process_group()
