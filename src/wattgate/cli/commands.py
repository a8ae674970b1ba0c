"""What each `wattgate <stage>` subcommand does with its parsed arguments: one call into the stage's package
(imported inside, so that `wattgate --help` and a stage's start stay fast)."""

from __future__ import annotations

import sys
from dataclasses import replace

from wattgate.errors import EXIT_STOPPED, InputError, StageFailed


def _demo_corpus(args, config) -> None:
    from wattgate.data.demo_corpus import KINDS, write_demo_corpus

    c = config.demo_corpus
    kind = getattr(args, "kind", "chat")
    docs = c.num_docs if kind == "chat" else c.notes_docs or max(1, c.num_docs // 4)
    n = write_demo_corpus(args.out, docs, c.seed, c.max_turns, kind)
    print(f"demo-corpus: {n} {KINDS[kind]} -> {args.out}")


def _train_tokenizer(args, config) -> None:
    from wattgate.data.tokenizer import train_tokenizer

    tok = train_tokenizer(config, args.out, args.corpus)
    print(f"train-tokenizer: vocab {tok.get_vocab_size()} -> {args.out}")


def _pretokenize(args, config) -> None:
    from wattgate.data.pretokenize import pretokenize

    tokenizer = args.tokenizer or config.tokenizer.path
    if not tokenizer:
        raise InputError("pretokenize: no tokenizer: pass --tokenizer DIR or set tokenizer.path")
    m = pretokenize(config, tokenizer, args.out)
    print(
        f"pretokenize: {m.num_docs} docs, {m.num_tokens} tokens ({m.num_loss_tokens} trained on), "
        f"{len(m.shards)} shard(s), dropped {m.dropped or 'none'} -> {args.out}"
    )
    if v := m.validation:
        print(
            f"pretokenize: validation ({v.source}): {v.num_docs} docs, {v.num_tokens} tokens held out; "
            f"{v.train_docs} docs train"
        )


def _pack(args, config) -> None:
    from wattgate.pack.plan import build_plan

    plan = build_plan(config, args.pretokenized, args.out)
    s = plan.stats
    if v := plan.validation:
        print(
            f"pack: validation pass: {v.num_docs} docs in {v.num_packs} packs ({v.strategy}, "
            f"{v.empty_packs} empty), {v.micro_batches_per_rank} micro-batch(es) of {v.micro_batch_size} "
            "on every rank"
        )
    if plan.segments and plan.resumed_from is not None:
        r = plan.resumed_from
        print(
            f"pack: continues step {r.step} of {r.checkpoint} in segment {len(plan.segments)}: "
            f"{s.segment_packs} packs, {plan.segments[-1].end_step - r.step} more steps -> {args.out}"
        )
        return
    steps = set(s.per_rank_steps_per_epoch or ())
    print(
        f"pack: {plan.strategy}, {s.packs_per_epoch} packs/epoch, efficiency {s.efficiency:.4f} "
        f"(bound {s.efficiency_bound:.4f}), "
        f"steps/epoch per rank {sorted(steps)}, max rank cost ratio (step) {s.max_rank_cost_ratio_step:.3f} "
        f"-> {args.out}"
    )


def _gate(args, config) -> None:
    from wattgate.gate.run import run_gate

    report = run_gate(config, args.pretokenized, args.plan, args.out)
    failed = report.failed_checks
    for c in report.checks:
        mark = "ok  " if c.passed else "FAIL"
        print(f"gate: {mark} {c.name}: {c.detail}", file=sys.stderr if not c.passed else sys.stdout)
    if not failed:
        print(f"gate: PASSED ({len(report.checks)} checks in {report.elapsed_s:.3f} s) -> {args.out}/PASSED")
        return
    names = ", ".join(c.name for c in failed)
    if not config.gate.enforce:
        print(
            f"gate: WARNING: FAILED ({names}) but gate.enforce is false: continuing on purpose. See {args.out}/gate.md",
            file=sys.stderr,
        )
        return
    raise StageFailed(f"{len(failed)} check(s) failed: {names}; see {args.out}/gate.md")


def _train(args, config) -> None:
    import os

    from wattgate.run_files import TRAIN_LOCK, claim_output
    from wattgate.train.loop import train
    from wattgate.train.run_lock import hold_run_lock

    if os.environ.get("RANK", "0") == "0":  # rank 0 holds the run folder for the job, launched or not
        claim_output(args.run, "train")
        hold_run_lock(args.run, TRAIN_LOCK, "wattgate train (rank 0)")
    train(config, args.pretokenized, args.plan, args.run)


def _load_check(args, config) -> None:
    from wattgate.train.loadcheck import load_check

    load_check(config, args.out, args.export)


def _launch(args, config) -> int | None:
    """One attempt of the train job. Its outcome is kept in the run folder (train/attempts.py), so Snakemake's
    retry (`--attempt` 2, 3, ...) of a failure a retry would repeat ends at once instead of training again."""
    from wattgate.train.attempts import Outcome, check_retry, record_outcome

    if args.attempt > 1:
        check_retry(args.run, args.attempt)
    try:
        outcome = _launch_outcome(args, config)
    except (InputError, StageFailed) as exc:  # refused before the job started: every retry would be refused too
        outcome = Outcome(2 if isinstance(exc, InputError) else 1, str(exc), retry=False)
    try:
        record_outcome(args.run, args.attempt, outcome)
    except OSError as exc:  # said first: the attempt's own line (a full disk's failed write, say) stays the last
        print(f"launch: WARNING: cannot record the outcome in {args.run} ({exc.strerror})", file=sys.stderr)
    if outcome.exit_status in (0, EXIT_STOPPED):
        return outcome.exit_status or None
    raise (InputError if outcome.exit_status == 2 else StageFailed)(outcome.line)


def _launch_outcome(args, config):
    """Run the job and say how it ended: exit status, its one line, and whether a retry may succeed (a stop, a
    dead rank, a lost peer, a hang: yes; a rank's own error, such as a non-finite loss or a full disk: no)."""
    from wattgate.train.launch import run_launch

    result = run_launch(config, args.config, args.pretokenized, args.plan, args.run, args.gate)
    return replace(_result_outcome(args, result), attempt=result.attempt)


def _result_outcome(args, result):
    """How the job ended, from launch's result: its watcher's verdict, a graceful stop, the first failed rank."""
    from wattgate.telemetry.failures import status_text, stopped_line
    from wattgate.train.attempts import Outcome

    w = result.watcher
    if w is not None and w.reached:  # a verdict the watcher reached
        acted = "stopped the job" if w.action == "kill" else "warned"
        message = f"watcher {acted}: {w.reason}; see {args.run}/watcher.json"
        if result.returncode != 0 or w.action == "kill":
            return Outcome(1, message, retry=True)  # the gate proved the plan: a hang is the cluster's, not the run's
        print(f"launch: WARNING: {message}", file=sys.stderr)
    if result.stopped is not None:
        line = stopped_line(result.stopped)
        print(f"launch: {line}", file=sys.stderr)
        return Outcome(EXIT_STOPPED, line, retry=True)
    if result.returncode == 0:
        return Outcome(0, None, retry=False)
    where = f"see {args.run}/watcher.json and the log above" if result.watcher else "see the log above"
    if result.failure is not None:
        # a rank's own input or OS error (a full disk) is exit 2, as from any stage; a dead rank is a failure (1)
        f = result.failure
        return Outcome(f.exit_status, f"{f.line}; {where}", retry=f.retriable)
    if result.hard_stop is not None:
        return Outcome(1, f"stopped at once by a second {result.hard_stop} (no stop checkpoint); rerun to resume", True)
    return Outcome(1, f"training exited with {status_text(result.returncode)}; {where} and {args.run}/heartbeat/", True)


def _sample(args, config) -> int:
    from wattgate.telemetry.sampler import run_sampler

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_sampler(str(args.out), args.interval, args.flush_every, command or None, args.duration)


def _watch(args, config) -> None:
    from wattgate.telemetry.watch import run_watch

    record = run_watch(config, args.run, args.pid, args.slurm_job, args.out)
    if record.verdict not in ("healthy", "running") and record.action == "kill":
        raise StageFailed(record.reason)


def _variant(args, config) -> None:
    from wattgate.experiments import write_variant_config

    derived = write_variant_config(config, args.experiment, args.variant, args.out)
    t, c = derived.train, derived.cluster
    print(
        f"variant: {derived.run_name}: {c.nodes} node(s) x {c.gpus_per_node}, grad_accum "
        f"{t.grad_accum}, data_cache {t.data_cache}, {t.max_steps} steps -> {args.out}"
    )


def _compare(args, config) -> None:
    from wattgate.experiments import compare

    notes: list[str] = []
    table = compare(args.experiment, args.runs, args.out, note=notes.append)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"compare: {len(table)} run(s) -> {args.out}/table.csv")
    for text in notes:  # what was left out of the table, and why (table.md lists them too)
        print(f"compare: note: {text}")


def _import_trace(args, config) -> None:
    from wattgate.power.importers import import_trace, write_trace
    from wattgate.trace import GPU, HOST, check_trace_output, trace_meta

    check_trace_output(args.out, "import-trace")  # before the parse: a file that is not a trace is never replaced
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    table, _ = import_trace(
        args.source, args.files, args.host, args.skip_bad_lines, fields, args.tz, args.gpu_index, args.columns
    )
    write_trace(table, args.out)
    meta = trace_meta(table)  # the record the trace carries
    gpus = len({(h, g) for h, g in zip(table.column(HOST).to_pylist(), table.column(GPU).to_pylist())})
    skipped = sum(n for k, n in (meta.skipped_lines or {}).items() if k != "truncated_final_line")
    print(
        f"import-trace: {table.num_rows} rows, {gpus} GPU(s) on {len(meta.hosts or ())} host(s)"
        + (f", {skipped} bad line(s) skipped" if skipped else "")
        + ("; GPU index inferred from sampling bursts" if meta.gpu_index_inferred else "")
        + f" -> {args.out}"
    )
    for note in meta.notes or ():
        print(f"import-trace: note: {note}")


def _triage(args, config) -> None:
    from wattgate.power.triage import run_triage
    from wattgate.trace import trace_files
    from wattgate.triage_tables import TriageSettings, positive_seconds, share_value, window_seconds

    # the run's settings, unless given on the command line (a flag's 0, NaN or inf is refused by its name)
    window_s = None if args.window is None else window_seconds(args.window, "--window")
    deadlock_after_s = None if args.hang_after is None else positive_seconds(args.hang_after, "--hang-after")
    share = None if args.straggler_share is None else share_value(args.straggler_share, "--straggler-share")
    s = TriageSettings.merge(config, args.table, args.gpu_model, window_s, deadlock_after_s, args.power_cap_w, share)
    traces = [f for p in args.trace for f in (trace_files(p) if p.is_dir() else [p])]
    result = run_triage(traces, args.out, run_dir=args.run, settings=s)
    shown = ", ".join(f"{ph} {100 * v.share:.1f}%" for ph, v in result.phases.items())
    print(f"triage: {result.gpus} GPU(s), {shown or result.status} -> {args.out}")
    for e in result.stragglers:
        who = f"{e.host}:{e.gpu}" if e.gpu is not None else f"rank {e.rank} on {e.host}"
        print(f"triage: straggler {who} ({e.cause}): {e.evidence}")


def _report(args, config) -> None:
    from wattgate.report import ReportSources, run_report

    if args.run is None and not args.trace:
        raise InputError(
            "report: pass --run-dir DIR (a train run) or --trace FILE... (e.g. from wattgate import-trace)"
        )
    sources = ReportSources(
        power_dir=args.power,
        gate_dir=args.gate,
        config=config,
        trace_paths=args.trace,
        gpu_model=args.gpu_model,
        table_path=args.table,
        power_cap_w=args.power_cap_w,
    )
    s = run_report(args.run, args.out, sources)
    energy = s.energy
    if energy.kwh is not None:
        assert energy.method is not None  # energy_summary sets a method whenever it sets kwh
        kwh = f"{energy.kwh:.4g} kWh ({energy.method.replace('_', ' ')})"
    else:
        kwh = "no GPU telemetry"
    tokens = "n/a" if s.tokens is None else s.tokens  # as the page says: no metrics is not zero tokens
    print(f"report: {s.run.name}: {tokens} tokens, {kwh}, {len(s.anomalies)} anomaly(ies) -> {args.out}/index.html")


def _calibrate(args, config) -> None:
    from wattgate.power.calibrate import calibrate

    calibrate(
        args.gpu_model,
        args.out,
        args.seconds,
        interval_s=args.interval,
        device_index=args.device,
        samples_out=args.samples,
    )
