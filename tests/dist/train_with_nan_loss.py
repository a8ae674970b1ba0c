"""Run under torchrun by tests/test_graceful_stop.py: `wattgate train` with a NaN loss injected on one rank at one
step (WATTGATE_TEST_NAN_AT="<1-based step>:<rank>"), the way a bad document or an overflow would make one, so the
non-finite guard is exercised by the real trainer. Arguments: the `wattgate train` flags."""

import os
import sys


from wattgate import cli
from wattgate.train import loop

step_at, rank_at = (int(x) for x in os.environ["WATTGATE_TEST_NAN_AT"].split(":"))
original = loop.Trainer.train_step


def train_step(self, batches, on_micro):
    step_loss, grad_norm, to_device_s, micro_losses = original(self, batches, on_micro)
    step = self.log.step_times.__len__() + self.start + 1  # the 1-based step being run (one record per step)
    if step == step_at and self.rank == rank_at:
        micro_losses[0] = micro_losses[0] * float("nan")
        step_loss = step_loss * float("nan")
    return step_loss, grad_norm, to_device_s, micro_losses


loop.Trainer.train_step = train_step
sys.exit(cli.main(["train", *sys.argv[1:]]))
