"""What a run measures about itself: per-step figures for metrics.parquet and the log, MFU, and the
host/device memory peak of each phase (load, steady state, export) for TRAINED and the report."""

from __future__ import annotations

import os
import resource
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from wattgate.gpus import peak_bf16_flops
from wattgate.records.trained import Memory, PhasePeak, RankMemory, SourceValidation, Validation
from wattgate.run_tables import (
    LOSS,
    LOSS_TOKENS,
    PERPLEXITY,
    SECONDS,
    STEP,
    TOKENS,
    MetricsTable,
    eval_sources_of,
    source_loss_column,
    source_tokens_column,
)
from wattgate.train.tensorboard import TensorBoardLog, open_tensorboard

GIB = 1 << 30
METRICS_FLUSH_EVERY = 50  # steps; also at every checkpoint and at the end


def model_flops_utilization(tokens_per_s: float, n_params: int, world: int, gpu_model: str) -> float | None:
    """6 x params FLOPs per trained token (forward + backward) over the GPUs' peak; attention not counted."""
    peak = peak_bf16_flops(gpu_model)
    if not peak:
        return None
    return 6 * n_params * tokens_per_s / (world * peak)


def folder_bytes(folder) -> int:
    """Bytes of the files under a folder (0 if it is gone)."""
    total = 0
    for p in Path(folder).rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


# ---------------------------------------------------------------- memory peaks per phase


def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set of this process since the last reset (Linux VmHWM; else the lifetime peak)."""
    kib = _proc_status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib * 1024


def current_rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    return (kib or 0) * 1024


def reset_peak_rss() -> bool:
    """Start a new peak: writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PhaseMemory:
    """Host RSS and CUDA peaks of consecutive phases of one rank, each peak reset at the phase start."""

    device: torch.device
    phases: dict[str, PhasePeak] = field(default_factory=dict)
    _start: float = 0.0
    _rss_at_start: int = 0

    def start(self) -> None:
        reset_peak_rss()
        self._rss_at_start = current_rss_bytes()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def end(self, phase: str) -> None:
        cuda = self.device.type == "cuda"
        self.phases[phase] = PhasePeak(
            host_peak_gib=peak_rss_bytes() / GIB,
            host_at_start_gib=self._rss_at_start / GIB,
            seconds=time.perf_counter() - self._start,
            cuda_peak_gib=torch.cuda.max_memory_allocated(self.device) / GIB if cuda else None,
            cuda_reserved_peak_gib=torch.cuda.max_memory_reserved(self.device) / GIB if cuda else None,
        )
        self.start()

    def gather(self) -> list[dict]:
        """Every rank's phases (RankMemory's JSON), on every rank (one small collective)."""
        mine = RankMemory(rank=dist.get_rank(), host=socket.gethostname(), phases=self.phases).to_json()
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return every


def memory_summary(per_rank: list[dict]) -> Memory:
    """TRAINED's memory block: per-rank figures, and the maximum over ranks of each phase."""
    return Memory.of_ranks(per_rank)


# ---------------------------------------------------------------- per-step figures


@dataclass
class StepLog:
    """Rank 0's record of every step: metrics rows, TensorBoard scalars, the periodic log line, tokens for the
    summary. The TensorBoard writer opens at rank 0's first step under the metrics file's folder (the run folder)
    when `tensorboard` (train.tensorboard) is true, and closes after the last step."""

    metrics: MetricsTable | None  # None on ranks other than 0
    log_every: int
    n_params: int
    world: int
    gpu_model: str
    on_cuda: bool
    tokens_done: int = 0
    step_times: list = field(default_factory=list)  # per step, the slowest rank's time (the throughput ledger)
    checkpoints: int = 0
    checkpoint_s: float = 0.0
    checkpoint_bytes: int = 0  # the last checkpoint's size on disk
    tensorboard: bool = True  # train.tensorboard: event files under <run>/tensorboard/ (rank 0)
    board: TensorBoardLog | None = field(default=None, repr=False)
    _board_opened: bool = field(default=False, repr=False)

    def record(
        self,
        g: int,
        epoch: int,
        start: int,
        total: int,
        gathered: list[list[float]],
        lr: float,
        grad_norm: float,
        now: float,
    ) -> None:
        """`gathered`: per rank [loss sum, loss tokens, tokens, step s, data wait s] of optimizer step g."""
        step_tokens = int(sum(float(t[2]) for t in gathered))
        self.tokens_done += step_tokens
        self.step_times.append(max(float(t[3]) for t in gathered))
        if self.metrics is None:
            return
        self.metrics.add(
            [
                {
                    "step": g + 1,
                    "rank": r,
                    "epoch": epoch,
                    "loss": float(t[0] / max(t[1], 1)),
                    "tokens": int(t[2]),
                    "loss_tokens": int(t[1]),
                    "step_time_s": float(t[3]),
                    "data_wait_s": float(t[4]),
                    "lr": lr,
                    "time": now,
                    "grad_norm": grad_norm,
                }
                for r, t in enumerate(gathered)
            ]
        )
        self._board_step(g, total, gathered, step_tokens, lr, grad_norm)
        if (g + 1) % self.log_every and g != start and g + 1 != total:
            return
        step_time, data_wait = float(gathered[0][3]), float(gathered[0][4])
        loss = sum(float(t[0]) for t in gathered) / max(sum(float(t[1]) for t in gathered), 1)
        mfu = (
            model_flops_utilization(step_tokens / step_time, self.n_params, self.world, self.gpu_model)
            if self.on_cuda
            else None
        )
        print(
            f"train: step {g + 1}/{total} epoch {epoch} loss {loss:.4f} grad_norm {grad_norm:.3f} "
            f"lr {lr:.2e} {step_tokens / step_time:.0f} tok/s "
            f"data_wait {100 * data_wait / step_time:.2f}%" + (f" MFU {100 * mfu:.1f}%" if mfu else ""),
            flush=True,
        )

    def _board_step(
        self, g: int, total: int, gathered: list[list[float]], step_tokens: int, lr: float, grad_norm: float
    ) -> None:
        if not self._board_opened:
            self._board_opened = True
            assert self.metrics is not None  # rank 0's: `record` returns before this on the other ranks
            self.board = open_tensorboard(self.metrics.path.parent, self.tensorboard, first_step=g + 1)
        if self.board is None:
            return
        loss = sum(float(t[0]) for t in gathered) / max(sum(float(t[1]) for t in gathered), 1)
        slowest = max(float(t[3]) for t in gathered)
        self.board.add_step(
            g + 1,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_s=step_tokens / slowest if slowest > 0 else 0.0,
            data_wait_s=max(float(t[4]) for t in gathered),
        )

    def close(self) -> None:
        """Flush and close the TensorBoard writer (after the last step; safe to call again)."""
        if self.board is not None:
            self.board.close()
            self.board = None

    def record_eval(self, row: dict) -> None:
        """A validation pass's row of eval.parquet, on TensorBoard too (rank 0; the caller keeps the table)."""
        if not self._board_opened:  # a run resumed at its last step evaluates before any step is recorded
            self._board_opened = True
            assert self.metrics is not None  # rank 0 records the validation passes
            self.board = open_tensorboard(self.metrics.path.parent, self.tensorboard, first_step=row[STEP])
        per_source = {name: row[source_loss_column(name)] for name in eval_sources_of(row)}
        if self.board is not None:
            self.board.add_eval(row[STEP], loss=row[LOSS], perplexity=row[PERPLEXITY], per_source=per_source)
        sources = "".join(f", {name} {loss:.4f}" for name, loss in per_source.items() if loss is not None)
        print(
            f"train: validation after step {row[STEP]}: loss {row[LOSS]:.4f} perplexity {row[PERPLEXITY]:.3f}"
            f"{sources} ({row[TOKENS]} tokens, {row[SECONDS]:.2f} s)",
            flush=True,
        )

    def record_checkpoint(self, seconds: float, folder) -> None:
        self.checkpoints += 1
        self.checkpoint_s += seconds
        self.checkpoint_bytes = folder_bytes(folder)
        if self.board is not None:
            self.board.flush()  # curves on disk at least as far as the checkpoint

    def flush_due(self, g: int, checkpoint_now: bool) -> bool:
        return self.metrics is not None and (checkpoint_now or (g + 1) % METRICS_FLUSH_EVERY == 0)


# ---------------------------------------------------------------- TRAINED's figures


def loss_summary(rows: list[dict]) -> tuple[float | None, float | None]:
    """First and final step loss (token-weighted over ranks) from metrics rows."""
    per_step: dict[int, list[dict]] = {}
    for row in rows:
        per_step.setdefault(row[STEP], []).append(row)

    def step_loss(step_rows):
        return sum(r[LOSS] * r[LOSS_TOKENS] for r in step_rows) / max(1, sum(r[LOSS_TOKENS] for r in step_rows))

    if not per_step:
        return None, None
    return step_loss(per_step[min(per_step)]), step_loss(per_step[max(per_step)])


def validation_summary(rows: list[dict], exported_step: int | None, export_from: str) -> Validation | None:
    """TRAINED's `validation`: the final and the best pass (loss and step), and which step final/ holds."""
    if not rows:
        return None
    final = max(rows, key=lambda r: r[STEP])
    best = min(rows, key=lambda r: (r[LOSS], -r[STEP]))
    sources = eval_sources_of(final)
    return Validation(
        final_loss=final[LOSS],
        final_step=final[STEP],
        best_loss=best[LOSS],
        best_step=best[STEP],
        evaluations=len(rows),
        export_from=export_from,
        exported_step=exported_step,
        # two or more held-out sources: each one's final and best pass
        per_source=tuple(source_summary(rows, final, name) for name in sources) if sources else None,
    )


def source_summary(rows: list[dict], final: dict, name: str) -> SourceValidation:
    """TRAINED's `validation.per_source` entry: a source's loss at the final pass and its best pass."""
    column = source_loss_column(name)
    scored = [r for r in rows if r.get(column) is not None]
    best = min(scored, key=lambda r: (r[column], -r[STEP])) if scored else None
    return SourceValidation(
        name=name,
        final_loss=final.get(column),
        tokens=final.get(source_tokens_column(name)),
        best_loss=best[column] if best else None,
        best_step=best[STEP] if best else None,
    )


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where unknown): the start-up before a stage's code."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0
