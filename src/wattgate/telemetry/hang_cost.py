"""What a hang the watcher stopped cost, against what it would have cost without the watcher."""

from __future__ import annotations

from dataclasses import dataclass

from wattgate.durations import fmt_hours
from wattgate.forecast.failure import NCCL_DEFAULT_TIMEOUT_S
from wattgate.records.run_config import RunConfig
from wattgate.records.watcher import HangCost, Verdict, WatcherRecord, WithoutWatcher


def hang_cost(
    last_progress: float,
    killed_at: float,
    gpus: int,
    power_w: float | None,
    timeout_s: float | None,
    job_limit_s: float | None,
    job_started: float,
) -> HangCost:
    """What the hang the watcher stopped cost (last progress to the kill), against what it would have cost
    without the watcher: until the collective timeout, or, if that does not fire, the job's time limit.

    power_w: the job's GPUs' total draw in the stall (None without telemetry)."""
    spent_s = max(killed_at - last_progress, 0.0)
    timeout = timeout_s or NCCL_DEFAULT_TIMEOUT_S
    spent_gpu_hours = round(spent_s * gpus / 3600, 6)
    spent_kwh = round(power_w * spent_s / 3.6e6, 9) if power_w is not None else None
    without = WithoutWatcher(
        timeout_s=timeout,
        gpu_hours=round(timeout * gpus / 3600, 6),
        kwh=round(power_w * timeout / 3.6e6, 9) if power_w is not None else None,
    )
    if job_limit_s:
        rest = max(job_limit_s - (last_progress - job_started), timeout)
        without = without.replace(
            job_limit_s=job_limit_s,
            until_limit_s=round(rest, 3),
            limit_gpu_hours=round(rest * gpus / 3600, 6),
            limit_kwh=round(power_w * rest / 3.6e6, 9) if power_w is not None else None,
        )
    saved = f"{max(without.gpu_hours - spent_gpu_hours, 0):.3g}"
    until_limit = ""
    if job_limit_s:
        assert without.limit_gpu_hours is not None and without.until_limit_s is not None  # set just above
        saved += f"-{max(without.limit_gpu_hours - spent_gpu_hours, 0):.3g}"
        until_limit = f" or up to {fmt_hours(without.until_limit_s)} (the Slurm job's time limit)"
    energy = f", {spent_kwh:.3g} kWh" if spent_kwh is not None else ""
    line = (
        f"the hang cost {fmt_hours(spent_s)} on {gpus} GPUs = "
        f"{spent_gpu_hours:.3g} GPU-hours{energy} "
        f"from the last progress to the kill; without the watcher it would have waited "
        f"{fmt_hours(timeout)} (the collective timeout){until_limit}: {saved} GPU-hours saved"
    )
    return HangCost(
        spent_s=round(spent_s, 3),
        gpus=gpus,
        spent_gpu_hours=spent_gpu_hours,
        spent_kwh=spent_kwh,
        power_w=round(power_w, 1) if power_w is not None else None,
        without_watcher=without,
        line=line,
    )


@dataclass(frozen=True)
class CostBasis:
    """What a hang would have cost without the watcher: the collective timeout, and the Slurm job's time limit."""

    collective_timeout_s: float | None = None
    job_limit_s: float | None = None

    @classmethod
    def from_config(cls, config: RunConfig) -> CostBasis:
        slurm = config.cluster.launcher != "local"
        return cls(
            config.train.collective_timeout_s,
            config.cluster.slurm.train.runtime_min * 60.0 if slurm else None,
        )


def watcher_cost(
    record: WatcherRecord, verdict: Verdict, power: dict, world: int, basis: CostBasis, started: float
) -> HangCost:
    """watcher.json's cost: GPU-hours and energy from the last progress to the kill, and, for a confirmed deadlock
    only, what it would have cost without the watcher (a stall that may have been slow work saved nothing sure)."""
    # the watcher records the verdict's detection and then the kill before it costs them
    assert record.detected_at is not None and record.killed_at is not None
    last_progress = record.detected_at - float(verdict.stalled_for_s or 0.0)
    draws = [p for p, _, _ in power.values() if p == p]  # NaN: no reading
    gpus = len(power) or world
    cost = hang_cost(
        last_progress,
        record.killed_at,
        gpus,
        sum(draws) if draws else None,
        basis.collective_timeout_s,
        basis.job_limit_s,
        started,
    )
    if verdict.confirmed:
        return cost
    energy = f", {cost.spent_kwh:.3g} kWh" if cost.spent_kwh is not None else ""
    line = (
        f"the stall cost {fmt_hours(cost.spent_s)} on {gpus} GPUs = {cost.spent_gpu_hours:.3g} GPU-hours"
        f"{energy} from the last progress to the kill; {verdict.verdict} is not a confirmed deadlock, "
        "so no saving is claimed"
    )
    return cost.replace(without_watcher=None, line=line)
