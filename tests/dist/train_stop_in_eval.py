"""Run under torchrun by tests/test_graceful_stop.py: `wattgate train` asked to stop inside the validation pass after
step WATTGATE_TEST_STOP_IN_EVAL (every rank, at the pass's first stop check, which this program makes every
micro-batch), the way a time limit can land in a long pass. Arguments: the `wattgate train` flags."""

import os
import sys

from wattgate import cli
from wattgate.train import loop
from wattgate.train.stop import StopRequest

step_at = int(os.environ["WATTGATE_TEST_STOP_IN_EVAL"])
loop.EVAL_STOP_CHECK_MICROS = 1  # a stop check after every validation micro-batch
original = loop.Trainer.evaluate


class AskedInEval(StopRequest):
    """A request that exists only inside the validation pass after `step_at`."""

    in_pass = False

    def reason(self):
        return "a stop inside the validation pass (test)" if self.in_pass else super().reason()


def evaluate(self, step, epoch):
    if not isinstance(self.stop_request, AskedInEval):
        self.stop_request = AskedInEval(self.stop_request.run_dir)
    self.stop_request.in_pass = step == step_at
    try:
        return original(self, step, epoch)
    finally:
        self.stop_request.in_pass = False


loop.Trainer.evaluate = evaluate
sys.exit(cli.main(["train", *sys.argv[1:]]))
