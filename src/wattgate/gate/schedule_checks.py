"""The gate's checks of the step schedule: `schedule` (steps, warmup, checkpoint and validation cadence) and
`segments` (a plan continuing a run on another world size: the segments chain, and the learning rate and the
tokens per step go on across the boundary).
"""

from __future__ import annotations

import numpy as np

from wattgate.gate.checks import Check, _listed
from wattgate.gate.inputs import PackRows
from wattgate.records.plan import Plan
from wattgate.records.run_config import RunConfig
from wattgate.schedule import learning_rate


def check_schedule(plan: Plan, config: RunConfig) -> Check:
    """At least one step; warmup shorter than the run; notes on a checkpoint cadence longer than the run."""
    t = config.train
    planned = plan.segments[-1].end_step if plan.segments else plan.epochs * plan.steps_per_epoch
    max_steps = t.max_steps
    total = min(planned, max_steps) if max_steps else planned  # the trainer stops at train.max_steps
    capped = f" (train.max_steps {max_steps})" if max_steps and max_steps < planned else ""
    problems = []
    if total < 1:
        problems.append("the plan has no optimizer step")
    if t.warmup_steps >= total:
        problems.append(f"train.warmup_steps {t.warmup_steps} >= total steps {total}{capped}")
    late = []  # the loop checkpoints at the last step whatever checkpoint_every says: a smoke run is fine
    if total >= 1 and t.checkpoint_every > total:
        late.append(
            f"train.checkpoint_every {t.checkpoint_every} > total steps {total}{capped}: "
            f"the only checkpoint is the one at the last step ({total})"
        )
    notes = "".join(f"; note: {n}" for n in late + validation_schedule_notes(plan, config, total))
    if problems:
        return Check("schedule", False, _listed(problems) + notes)
    evals = f", validation every {t.eval_every}" if plan.validation is not None and t.eval_every else ""
    return Check(
        "schedule",
        True,
        f"{total} steps{capped}, warmup {t.warmup_steps}, checkpoint every {t.checkpoint_every}{evals}{notes}",
    )


def validation_schedule_notes(plan: Plan, config: RunConfig, total: int) -> list[str]:
    """What the validation schedule will and will not do, for `schedule` (notes: none of these fails)."""
    t = config.train
    notes = []
    has_split = plan.validation is not None
    if t.eval_every and not has_split:
        notes.append(f"train.eval_every {t.eval_every} without data.validation: no validation runs")
    elif has_split and t.eval_every > total:
        notes.append(
            f"train.eval_every {t.eval_every} > total steps {total}: validation only at epoch ends and the last step"
        )
    if t.export_from == "best" and not has_split:
        notes.append("train.export_from best without data.validation: final/ is the last step's")
    return notes


def _steps_of(packs: PackRows) -> int:
    return len(np.unique(packs.epoch * (int(packs.step.max()) + 1) + packs.step)) if len(packs) else 0


def check_segments(plan: Plan, config: RunConfig, packs: PackRows, prefix: PackRows | None, problems: tuple) -> Check:
    """A plan that continues a run on another world size: its segments chain, the prefix is what ran, and the
    learning rate and the tokens per step go on across the boundary (pack/segments.py)."""
    segs = plan.segments
    if not segs:
        return Check("segments", True, "one segment: the plan starts at step 0")
    probs = list(problems)
    if segs[0].first_step != 0:
        probs.append(f"segment 0 starts at step {segs[0].first_step}, not 0")
    for k, (a, b) in enumerate(zip(segs, segs[1:])):
        if a.end_step != b.first_step:
            probs.append(
                f"segment {k} ends at step {a.end_step} but segment {k + 1} starts at "
                f"{b.first_step}: steps would be skipped or repeated"
            )
    boundary, end = segs[-1].first_step, segs[-1].end_step
    if end - boundary != _steps_of(packs):
        probs.append(f"the current segment has {_steps_of(packs)} steps, plan.json says {end - boundary}")
    # counted in packs, segment by segment: step numbers restart in each segment's packs.parquet, so the
    # prefix's (epoch, step) keys of two segments coincide and cannot count its steps
    ran = [(g.end_step - g.first_step) * g.world_size * g.micro_batch_size * g.grad_accum for g in segs[:-1]]
    if prefix is not None and not problems and len(prefix) != sum(ran):
        probs.append(
            f"the consumed prefix holds {len(prefix)} packs, but its segments ran {sum(ran)} before the boundary "
            f"at step {boundary} ({' + '.join(map(str, ran))}: steps x ranks x micro-batch x grad_accum)"
        )
    resumed = plan.resumed_from.step if plan.resumed_from is not None else None
    if resumed != boundary:
        probs.append(f"the checkpoint it continues is at step {resumed}, the boundary at {boundary}")
    if probs:
        return Check("segments", False, _listed(probs))
    # the learning rate: the prefix ran towards its own total; the continuation schedules the new total
    t = config.train
    old_total = end if segs[-2].plan_total_steps is None else segs[-2].plan_total_steps

    def lr(step: int, total: int) -> float:
        return learning_rate(step, total, t.lr, t.warmup_steps, t.min_lr_ratio)

    before, ran, now = lr(boundary - 1, old_total), lr(boundary, old_total), lr(boundary, end)
    jump, step_change = abs(now - ran), abs(ran - before)
    tokens_before = float(prefix.num_tokens.sum()) / max(boundary, 1) if prefix is not None else float("nan")
    tokens_after = float(packs.num_tokens.sum()) / max(_steps_of(packs), 1)
    ratio = tokens_after / tokens_before if tokens_before == tokens_before and tokens_before > 0 else float("nan")
    old, new = segs[-2], segs[-1]
    old_pps = old.world_size * old.micro_batch_size * old.grad_accum
    new_pps = new.world_size * new.micro_batch_size * new.grad_accum
    closest = max(1, round(old_pps / (new.world_size * new.micro_batch_size)))
    detail = (
        f"{len(segs)} segments: steps 0-{boundary} on {old.world_size} ranks (grad_accum "
        f"{old.grad_accum}), {boundary}-{end} on {new.world_size} (grad_accum "
        f"{new.grad_accum}); lr at the boundary {now:.3g} (the prefix's schedule: {ran:.3g}, one step "
        f"before {before:.3g}); tokens per step {tokens_before:.0f} -> {tokens_after:.0f} (x{ratio:.3f}), "
        f"{old_pps} -> {new_pps} packs per step"
    )
    bad = []
    if jump > max(2 * step_change, 1e-6 * t.lr):
        bad.append(f"lr jumps by {jump:.3g} at the boundary (a step moves it {step_change:.3g})")
    if new.grad_accum != closest and new_pps != old_pps:
        bad.append(f"grad_accum {new.grad_accum} is not the closest to the old global batch ({closest})")
    if bad:
        return Check("segments", False, "; ".join(bad) + ": " + detail)
    return Check("segments", True, detail)
