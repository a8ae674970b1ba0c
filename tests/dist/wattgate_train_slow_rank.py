"""(Named wattgate_... as the watcher reads a rank process by `wattgate` in its command line.) Run under torchrun by
tests/test_straggler_ranks.py: `wattgate train` with one rank really slowed, the way a
throttled device or a busy host would slow it: before each of its micro-batches' loss forward the rank named by
WATTGATE_TEST_SLOW_RANK spins on its CPU for WATTGATE_TEST_SLOW_S seconds, so every other rank waits for it in
the next collective. Arguments: the `wattgate train` flags."""

import os
import sys
import time

from wattgate import cli
from wattgate.train import loop

slow_rank, spin_s = int(os.environ["WATTGATE_TEST_SLOW_RANK"]), float(os.environ["WATTGATE_TEST_SLOW_S"])
original = loop.summed_token_loss


def summed_token_loss(model, tensors, kind, chunk_tokens):
    if int(os.environ.get("RANK", "0")) == slow_rank:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:  # a busy loop: this rank's process uses its core the whole time
            pass
    return original(model, tensors, kind, chunk_tokens)


loop.summed_token_loss = summed_token_loss
sys.exit(cli.main(["train", *sys.argv[1:]]))
