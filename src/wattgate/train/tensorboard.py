"""TensorBoard event files for a run's training curves (`train.tensorboard`, default true).

Rank 0 writes one scalar per optimizer step for each tag in TAGS (and per validation pass one
`eval/loss/<source>` for each held-out source, with two or more) under `<run>/tensorboard/`
(`results/train/<run_name>/tensorboard/` under Snakemake), so `tensorboard --logdir results/train`
shows every run side by side. metrics.parquet stays the record the report reads; these files are
for watching a run live and comparing runs in the tool everyone already has open.

The writer is torch.utils.tensorboard's SummaryWriter, which needs the `tensorboard` package
(the `tensorboard` and `test` extras install it). Without it, training goes on: one warning line
names the setting and the fix. On resume the writer opens with `purge_step` at the first step it
records, so the steps a killed attempt logged past its last checkpoint are hidden, not doubled.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

FOLDER = "tensorboard"
# tag -> what it is (one value per optimizer step, x axis = global step, 1-based like metrics.parquet)
TAGS = {
    "train/loss": "the step's loss: token-weighted over ranks (loss sum / loss tokens of the global batch)",
    "train/lr": "the learning rate the step used",
    "train/grad_norm": "the total gradient norm before clipping",
    "train/tokens_per_s": "the step's tokens over all ranks / the slowest rank's step time",
    "train/data_wait_s": "the longest data wait of any rank in the step (batch build and host-to-device copy)",
    "eval/loss": "the validation pass's loss after this step: summed token losses / loss tokens over all ranks",
    "eval/perplexity": "exp(eval/loss)",
}
# with two or more held-out sources (a mixture), per validation pass too: one source's summed token
# losses / its loss tokens over all ranks (eval.parquet's `loss/<source>`)
SOURCE_TAG = "eval/loss/{source}"
FLUSH_SECS = 10  # a killed job loses at most this much of the curves


def tensorboard_available() -> bool:
    """Whether torch.utils.tensorboard can write event files here."""
    try:
        importlib.import_module("tensorboard")  # torch.utils.tensorboard needs it
    except ImportError:
        return False
    return True


class TensorBoardLog:
    """An event-file writer for one run folder (rank 0 only)."""

    def __init__(self, logdir: Path, purge_step: int | None = None, flush_secs: int = FLUSH_SECS):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step, flush_secs=flush_secs)

    def add_step(
        self, step: int, *, loss: float, lr: float, grad_norm: float, tokens_per_s: float, data_wait_s: float
    ) -> None:
        values = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens_per_s,
            "train/data_wait_s": data_wait_s,
        }
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), global_step=step)

    def add_eval(self, step: int, *, loss: float, perplexity: float, per_source: dict | None = None) -> None:
        self.writer.add_scalar("eval/loss", float(loss), global_step=step)
        self.writer.add_scalar("eval/perplexity", float(perplexity), global_step=step)
        for source, value in (per_source or {}).items():
            if value is not None:
                self.writer.add_scalar(SOURCE_TAG.format(source=source), float(value), global_step=step)
        self.writer.flush()  # a pass is rare and worth having on disk at once

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(run_dir: Path, enabled: bool, first_step: int = 1) -> TensorBoardLog | None:
    """The run's writer under `run_dir/tensorboard/`, or None when off or not installed (one warning line)."""
    if not enabled:
        return None
    if not tensorboard_available():
        print(
            "train: WARNING: train.tensorboard is true but the tensorboard package is not installed; "
            "no event files are written (pip install tensorboard, or set train.tensorboard: false)",
            file=sys.stderr,
            flush=True,
        )
        return None
    return TensorBoardLog(Path(run_dir) / FOLDER, purge_step=first_step if first_step > 1 else None)
