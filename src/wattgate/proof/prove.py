"""The collective proof: dry-run one rank of every group of the planned world's ranks that issue the same
collectives by construction (wattgate.proof.ranks; wattgate.proof.dryrun) over one step of each step class, and
prove that every rank issues the identical collective sequence at start-up, in every class, at the end, on the
graceful stop path and on a resume, and that every rank's sequence of classes (from the plan) is the same.

Both together mean every step of the run issues the same collectives on every rank, given the premise the dry
run cannot check: a step's collectives depend on its class only, never on the data's values. Dense decoders meet
it as they are; a Mixture-of-Experts model, whose router decides which experts' parameters get gradients, meets it
by construction (train/moe.py: every FSDP2 unit reduce-scatters all its parameters), and the proof checks that on
the most skewed routing: rank 0 dry-run again with no token reaching any expert must issue the same collectives
(proof/experts.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from wattgate.config import context_degree, expert_degree, replicate_degree
from wattgate.errors import InputError
from wattgate.proof.classes import class_divergence, first_steps, plans_by_rank
from wattgate.proof.depth import layer_pattern, meta_model, proxy_depths, scaled_count
from wattgate.proof.dryrun import RankRecord, dry_run_rank
from wattgate.proof.ranks import MeshPlaces, group_records, rank_groups, shard_dims
from wattgate.proof.record import Collective, fingerprint, ranks_text
from wattgate.proof.workers import frozen_heap, run_tasks
from wattgate.model_spec import load_model_spec
from wattgate.run_files import read_plan
from wattgate.train.rank_inputs import Paths
from wattgate.train.moe import experts_modules
from wattgate.records.gate import (
    CollectiveDivergence,
    Collectives,
    Depth,
    ExpertsKernel,
    Fingerprint,
    Moe,
    ProofClass,
    StarvedDivergence,
    StepFingerprint,
)
from wattgate.records.run_config import RunConfig


def first_difference(mine: list[Collective], ref: list[Collective]) -> tuple[int, str, str] | None:
    """(index, rank 0's collective, this rank's) at the first place two sequences differ, or None."""
    for i in range(max(len(mine), len(ref))):
        a = ref[i] if i < len(ref) else None
        b = mine[i] if i < len(mine) else None
        if a != b:
            return i, str(a) if a else "nothing (its sequence ended)", str(b) if b else "nothing (its sequence ended)"
    return None


def _phases(rec: RankRecord, labels: dict[int, str]) -> list[tuple[str, int | None, list[Collective]]]:
    stop = rec.stop_step + 1 if rec.stop_step is not None else None
    return (
        [("start-up", None, rec.startup)]
        + [(labels.get(g, "?"), g + 1, rec.steps.get(g, [])) for g in sorted(labels)]
        + [("export and summary", None, rec.end)]
        + [("graceful stop", stop, rec.stop)]
        + [("resume", None, rec.resume)]
    )


def collective_divergence(records: list[RankRecord], labels: list[dict[int, str]]) -> CollectiveDivergence | None:
    """The first place some rank's collectives differ from rank 0's: rank, phase or step class, the step, the
    collective's index within that phase, and both collectives; `labels` each rank's class label per step."""
    ref = _phases(records[0], labels[0])
    for rec in records[1:]:
        for (phase, step, seq), (_, _, ref_seq) in zip(_phases(rec, labels[rec.rank]), ref):
            diff = first_difference(seq, ref_seq)
            if diff is not None:
                i, expected, got = diff
                return CollectiveDivergence(
                    rank=rec.rank,
                    phase=phase,
                    step=step,
                    index=i,
                    rank0=expected,
                    this_rank=got,
                    group=own_group(rec, [*ref_seq[i : i + 1], *seq[i : i + 1]]),
                )
    return None


def own_group(rec: RankRecord, at: list[Collective]) -> str | None:
    """`rec`'s own group of the mesh dimension the first of `at` (rank 0's collective, then this rank's) issues on:
    the group that hangs when the two differ ("dp_replicate (ranks 1, 3)"); None on the 1-D mesh."""
    for collective in at:
        ranks = rec.mesh_groups.get(collective.group)
        if ranks is not None:
            return f"{collective.group} ({ranks_text(ranks)})"
    return None


def divergence_line(d: CollectiveDivergence) -> str:
    where = f"step {d.step} (class {d.phase})" if d.step else d.phase
    on = f" in its group {d.group}" if d.group else ""
    return (
        f"rank {d.rank} diverges from rank 0 at {where}, collective #{d.index + 1}{on}: rank 0 issues "
        f"{d.rank0}, rank {d.rank} issues {d.this_rank}"
    )


def drift(records: list[RankRecord], classes: list[list], first: int) -> str | None:
    """The loop's own step classes (Trainer.step_class) against the plan's: they are one function, so a
    difference means the plan files and what the trainer read disagree."""
    for rec in records:
        for g, key in rec.classes.items():
            planned = classes[rec.rank][g - first].key()
            if key != planned:
                return f"rank {rec.rank} step {g + 1}: the trainer ran class {key}, the plan says {planned}"
    return None


def class_table(
    records: list[RankRecord], classes: list[list], first: int, depth: Depth, per_period: dict[int, int]
) -> tuple[ProofClass, ...]:
    """Per class (rank 0's steps): how many steps, its first, its fingerprint and collective count
    (`per_period`: each dry-run step's collectives per period of layers, to scale them to the real depth)."""
    first_of: dict = {}
    steps: dict = {}
    for i, c in enumerate(classes[0]):
        first_of.setdefault(c, first + i + 1)
        steps[c] = steps.get(c, 0) + 1
    rows = []
    for c, first_step in first_of.items():
        g = first_step - 1
        seq = records[0].steps.get(g, [])
        rows.append(
            ProofClass(
                label=c.label,
                key=c.key(),
                steps=steps[c],
                first_step=first_step,
                fingerprint=fingerprint(seq),
                collectives=len(seq),
                sequence=tuple(str(x) for x in seq),  # what the watcher names when a rank stops (collective_hints.py)
                beats=tuple(records[0].beats.get(g, [])),
                collectives_at_depth=scaled_count(len(seq), per_period.get(g), depth, records[0].layers),
            )
        )
    return tuple(rows)


def class_runs(seq: list, first: int) -> list[list[int]]:
    """Rank 0's class at every step, run-length encoded: [first 1-based step, last, index into `classes`]."""
    order: dict = {}
    runs: list[list[int]] = []
    for i, c in enumerate(seq):
        k = order.setdefault(c, len(order))
        if runs and runs[-1][2] == k and runs[-1][1] == first + i:
            runs[-1][1] = first + i + 1
        else:
            runs.append([first + i + 1, first + i + 1, k])
    return runs


def prove_collectives(config: RunConfig, pretokenized: Path, plan_dir: Path, work: Path | None = None) -> Collectives:
    """The proof's report (gate.json `collectives`): `passed`, `detail` (one line), the classes and their
    fingerprints, the start-up and end fingerprints, the depth scaling, and the seconds it took."""
    with frozen_heap():
        return _prove(config, pretokenized, plan_dir, work, time.perf_counter())


def _prove(config: RunConfig, pretokenized: Path, plan_dir: Path, work: Path | None, t0: float) -> Collectives:
    plan, _ = read_plan(plan_dir)
    context = context_degree(config)
    world = plan.world_size * context  # the plan's are the data-parallel ranks: C ranks train each one's plan
    plans = [p for p in plans_by_rank(plan, plan_dir, config.train) for _ in range(context)]
    classes = [p.classes for p in plans]
    first = plan.first_step
    steps = first_steps(classes, first)
    labels = [{g: seq[g - first].label if g - first < len(seq) else "no step" for g in steps} for seq in classes]
    depth = layer_pattern(config.model)
    if depth.moe and not experts_modules(meta_model(config.model)):  # nothing the dry run can starve
        return refused(world, depth, no_experts_line(depth), t0)
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="wattgate-proof-")) if own else Path(work)
    proxy, pair = proxy_depths(depth)
    groups = rank_groups(plans, shard_dims(depth), mesh_places(config, world))
    ranks = [g[0] for g in groups]  # one dry run per group, rank 0 first
    per_period: dict[int, int] = {}  # per dry-run step: its collectives per period of layers (none: unscaled)
    try:
        paths = {r: Paths(Path(pretokenized), Path(plan_dir), work / f"rank-{r}") for r in ranks}
        # rank 0 first: what it sends reaches the others through the relay (proof/relay.py), a fresh folder
        relay = Path(tempfile.mkdtemp(prefix="relay-", dir=work))
        tasks: list[tuple] = [(config, paths[r], r, steps, proxy, True, False, relay) for r in ranks]
        if pair is not None:  # rank 0 at one period more: each period's collectives
            tasks.append((config, Paths(Path(pretokenized), Path(plan_dir), work / "one-period-more"), 0, steps, pair))
        if depth.moe:  # rank 0 again, no token reaching any expert: routing must move no collective
            starved_paths = Paths(Path(pretokenized), Path(plan_dir), work / "starved")
            tasks.append((config, starved_paths, 0, steps, proxy, True, True))
        done = run_tasks(dry_run_rank, tasks)
        records: list[RankRecord] = done[: len(ranks)]
        starved = done.pop() if depth.moe else None
        if pair is not None:
            per_period = {g: len(done[-1].steps.get(g, [])) - len(records[0].steps.get(g, [])) for g in steps}
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    rank0 = records[0]
    table = class_table(records, classes, first, depth, per_period)
    plan_diff = class_divergence(classes, first)
    coll_diff = collective_divergence(records, labels)
    loop_drift = drift(records, classes, first)
    problems = []
    if coll_diff:
        problems.append(divergence_line(coll_diff))
    moe = moe_section(rank0, starved, labels[0], depth) if starved is not None else None
    if moe is not None and moe.divergence:
        problems.append(starved_line(moe.divergence, depth))
    if plan_diff:
        problems.append(
            f"rank {plan_diff.rank}'s step {plan_diff.step} is '{plan_diff.label}' where rank 0's is "
            f"'{plan_diff.rank0_class}'"
        )
    if loop_drift:
        problems.append(loop_drift)
    proxy_layers = rank0.layers if records else 0
    n = sum(1 for r in table if len(r.key))
    detail = "; ".join(problems) or (
        f"{world} ranks ({len(groups)} group(s) of ranks that issue the same by construction, one dry-run each) issue "
        f"identical collectives in start-up, {n} step class(es), the export, a graceful stop and a resume "
        f"({sum(r.collectives for r in table)} collectives per rank over the classes at "
        f"{proxy_layers} proxy layers)" + (moe_note(moe) if moe is not None else "")
    )
    return Collectives(
        passed=not problems,
        detail=detail,
        world_size=world,
        ranks_run=len(records),
        rank_groups=group_records(groups),
        proxy_layers=proxy_layers,
        depth=depth,
        steps_run=tuple(g + 1 for g in steps),
        classes=table,
        class_runs=tuple(tuple(run) for run in class_runs(classes[0], first)),
        startup=Fingerprint(fingerprint=fingerprint(rank0.startup), collectives=len(rank0.startup)),
        end=Fingerprint(fingerprint=fingerprint(rank0.end), collectives=len(rank0.end)),
        # the stop path (train/stop.py): a step every rank agreed to stop at, its checkpoint and STOPPED
        stop=StepFingerprint(
            step=rank0.stop_step + 1 if rank0.stop_step is not None else None,
            fingerprint=fingerprint(rank0.stop),
            collectives=len(rank0.stop),
        ),
        # a resume (train/loop.py Trainer.load): the checkpoint every rank agrees on and DCP's load of it
        resume=StepFingerprint(
            step=rank0.resume_step, fingerprint=fingerprint(rank0.resume), collectives=len(rank0.resume)
        ),
        divergence=coll_diff,
        class_divergence=plan_diff,
        moe=moe,
        elapsed_s=round(time.perf_counter() - t0, 2),
    )


def mesh_places(config: RunConfig, world: int) -> MeshPlaces:
    expert = expert_degree(config)
    experts = load_model_spec(config).num_experts if expert > 1 else 0
    shard = world // replicate_degree(config)
    return MeshPlaces(shard=shard, expert=expert, experts=experts, context=context_degree(config))


def moe_section(routed: RankRecord, starved: RankRecord, labels: dict[int, str], depth: Depth) -> Moe:
    """gate.json `collectives.moe`: the experts' kernel in training and in the dry run, and where rank 0's
    collectives with no token reaching any expert first differ from its routed run's (None: nowhere)."""
    assert depth.moe is not None  # the starved run is made for a Mixture-of-Experts model only
    diff = None
    for (phase, step, seq), (_, _, ref) in zip(_phases(starved, labels), _phases(routed, labels)):
        found = first_difference(seq, ref)
        if found is not None:
            i, expected, got = found
            diff = StarvedDivergence(phase=phase, step=step, index=i, routed=expected, starved=got)
            break
    return Moe(
        why=depth.moe,
        experts_kernel=ExpertsKernel.from_json(routed.experts or {}, "the dry run's experts kernel"),
        starved_rank=starved.rank,
        divergence=diff,
    )


def starved_line(d: StarvedDivergence, depth: Depth) -> str:
    where = f"step {d.step} (class {d.phase})" if d.step else d.phase
    return (
        f"{depth.model} is a Mixture-of-Experts model ({depth.moe}) whose collectives follow its routing: with "
        f"no token reaching any expert, rank 0 issues {d.starved} at {where}, collective #{d.index + 1}, where "
        f"with its tokens routed it issues {d.routed} (FSDP2 reduce-scatters only the parameters that got a "
        "gradient; a rank whose router skips an expert would hang the others): every FSDP2 unit must reduce-scatter "
        "all its parameters (train/moe.py)"
    )


def moe_note(moe: Moe) -> str:
    kernel = moe.experts_kernel
    ran = (
        f"experts kernel {kernel.dry_run}"
        if kernel.dry_run == kernel.training
        else f"experts kernel {kernel.dry_run} for training's {kernel.training}, which fake tensors cannot run"
    )
    return (
        f"; Mixture-of-Experts ({moe.why}): rank {moe.starved_rank} with no token reaching any expert issues the "
        f"same collectives as with its tokens routed ({ran})"
    )


def no_experts_line(depth: Depth) -> str:
    return (
        f"{depth.model} is a Mixture-of-Experts model ({depth.moe}) without a transformers experts module (a "
        "class named *Experts, as Qwen3-MoE, Mixtral and GPT-OSS have): the proof cannot dry-run its experts or "
        "check that its routing moves no collective; set gate.collectives: false to run it unproven"
    )


def refused(world: int, depth: Depth, line: str, t0: float) -> Collectives:
    """The report of a proof refused before any dry run (a model whose collectives it cannot prove): its
    depth, no class and no divergence."""
    return Collectives(
        passed=False,
        detail=line,
        world_size=world,
        ranks_run=0,
        proxy_layers=0,
        depth=depth,
        classes=(),
        elapsed_s=round(time.perf_counter() - t0, 2),
    )


def safe_prove(config: RunConfig, pretokenized: Path, plan_dir: Path) -> Collectives:
    """prove_collectives; a dry run that cannot start or breaks is a failed proof with its reason, never a
    traceback out of the gate."""
    try:
        return prove_collectives(config, pretokenized, plan_dir)
    except InputError as exc:
        return Collectives(passed=False, detail=f"the dry run could not start: {exc}", elapsed_s=None)
    except Exception as exc:  # noqa: BLE001 - any failure of the dry run is this check's failure, named
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        return Collectives(passed=False, detail=f"the dry run failed: {type(exc).__name__}: {first}", elapsed_s=None)
