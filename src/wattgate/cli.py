"""`wattgate <stage>`: one subcommand per stage, the same under Snakemake and by hand.

Exit status: 0 success, 1 the stage ran and found a failure, 2 usage or input
error with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wattgate.errors import EXIT_STOPPED, InputError, StageFailed, first_line


def _demo_corpus(args, config) -> None:
    from wattgate.data.demo_corpus import write_demo_corpus

    c = config["demo_corpus"]
    n = write_demo_corpus(args.out, c["num_docs"], c["seed"], c["max_turns"])
    print(f"demo-corpus: {n} conversations -> {args.out}")


def _train_tokenizer(args, config) -> None:
    from wattgate.data.tokenizer import train_tokenizer

    tok = train_tokenizer(config, args.out, args.corpus)
    print(f"train-tokenizer: vocab {tok.get_vocab_size()} -> {args.out}")


def _pretokenize(args, config) -> None:
    from wattgate.data.pretokenize import pretokenize

    tokenizer = args.tokenizer or config["tokenizer"]["path"]
    if not tokenizer:
        raise InputError("pretokenize: no tokenizer: pass --tokenizer DIR or set tokenizer.path")
    m = pretokenize(config, tokenizer, args.out)
    print(
        f"pretokenize: {m['num_docs']} docs, {m['num_tokens']} tokens ({m['num_loss_tokens']} trained on), "
        f"{len(m['shards'])} shard(s), dropped {m['dropped'] or 'none'} -> {args.out}"
    )
    if v := m.get("validation"):
        print(
            f"pretokenize: validation ({v['source']}): {v['num_docs']} docs, {v['num_tokens']} tokens held out; "
            f"{v['train_docs']} docs train"
        )


def _pack(args, config) -> None:
    from wattgate.pack.plan import build_plan

    plan = build_plan(config, args.pretokenized, args.out)
    s = plan["stats"]
    if v := plan.get("validation"):
        print(
            f"pack: validation pass: {v['num_docs']} docs in {v['num_packs']} packs ({v['strategy']}, "
            f"{v['empty_packs']} empty), {v['micro_batches_per_rank']} micro-batch(es) of {v['micro_batch_size']} "
            "on every rank"
        )
    if plan.get("segments"):
        r = plan["resumed_from"]
        print(
            f"pack: continues step {r['step']} of {r['checkpoint']} in segment {len(plan['segments'])}: "
            f"{s['segment_packs']} packs, {plan['segments'][-1]['end_step'] - r['step']} more steps -> {args.out}"
        )
        return
    steps = {tuple(x) for x in s["per_rank_steps_per_epoch"]}
    print(
        f"pack: {plan['strategy']}, {s['packs_per_epoch']} packs/epoch, efficiency {s['efficiency']:.4f}, "
        f"steps/epoch per rank {sorted(steps)}, max rank cost ratio (step) {s['max_rank_cost_ratio_step']:.3f} "
        f"-> {args.out}"
    )


def _gate(args, config) -> None:
    from wattgate.gate.run import run_gate

    report = run_gate(config, args.pretokenized, args.plan, args.out)
    failed = [c for c in report["checks"] if not c["passed"]]
    for c in report["checks"]:
        mark = "ok  " if c["passed"] else "FAIL"
        print(f"gate: {mark} {c['name']}: {c['detail']}", file=sys.stderr if not c["passed"] else sys.stdout)
    if not failed:
        print(f"gate: PASSED ({len(report['checks'])} checks in {report['elapsed_s']:.3f} s) -> {args.out}/PASSED")
        return
    names = ", ".join(c["name"] for c in failed)
    if not config["gate"]["enforce"]:
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
    record_outcome(args.run, args.attempt, outcome)
    if outcome.exit_status in (0, EXIT_STOPPED):
        return outcome.exit_status or None
    raise (InputError if outcome.exit_status == 2 else StageFailed)(outcome.line)


def _launch_outcome(args, config):
    """Run the job and say how it ended: exit status, its one line, and whether a retry may succeed (a stop, a
    dead rank, a lost peer, a hang: yes; a rank's own error, such as a non-finite loss or a full disk: no)."""
    from wattgate.telemetry.failures import status_text, stopped_line
    from wattgate.train.attempts import Outcome
    from wattgate.train.launch import run_launch

    result = run_launch(config, args.config, args.pretokenized, args.plan, args.run, args.gate)
    w = result.watcher or {}
    if w.get("verdict") not in (None, "running", "healthy", "stopped", "failed"):  # a verdict the watcher reached
        acted = "stopped the job" if w.get("action") == "kill" else "warned"
        message = f"watcher {acted}: {w.get('reason')}; see {args.run}/watcher.json"
        if result.returncode != 0 or w.get("action") == "kill":
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
    if record["verdict"] not in ("healthy", "running") and record.get("action") == "kill":
        raise StageFailed(record["reason"])


def _variant(args, config) -> None:
    from wattgate.experiments import write_variant_config

    derived = write_variant_config(config, args.experiment, args.variant, args.out)
    t, c = derived["train"], derived["cluster"]
    print(
        f"variant: {derived['run_name']}: {c['nodes']} node(s) x {c['gpus_per_node']}, grad_accum "
        f"{t['grad_accum']}, data_cache {t['data_cache']}, {t['max_steps']} steps -> {args.out}"
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
    from wattgate.trace import check_trace_output

    check_trace_output(args.out, "import-trace")  # before the parse: a file that is not a trace is never replaced
    fields = [f.strip() for f in args.fields.split(",")] if args.fields else None
    table, meta = import_trace(
        args.source, args.files, args.host, args.skip_bad_lines, fields, args.tz, args.gpu_index, args.columns
    )
    write_trace(table, args.out)
    gpus = len({(h, g) for h, g in zip(table["host"].to_pylist(), table["gpu"].to_pylist())})
    skipped = sum(n for k, n in meta["skipped_lines"].items() if k != "truncated_final_line")
    print(
        f"import-trace: {table.num_rows} rows, {gpus} GPU(s) on {len(meta['hosts'])} host(s)"
        + (f", {skipped} bad line(s) skipped" if skipped else "")
        + ("; GPU index inferred from sampling bursts" if meta["gpu_index_inferred"] else "")
        + f" -> {args.out}"
    )
    for note in meta["notes"]:
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
    result = run_triage(
        traces,
        args.out,
        table_path=s.table_path,
        gpu_model=s.gpu_model,
        run_dir=args.run,
        window_s=s.window_s,
        deadlock_after_s=s.deadlock_after_s,
        power_cap_w=s.power_cap_w,
        straggler_share=s.straggler_share,
    )
    shown = ", ".join(f"{ph} {100 * v['share']:.1f}%" for ph, v in result["phases"].items())
    print(f"triage: {result['gpus']} GPU(s), {shown or result['status']} -> {args.out}")
    for e in result["stragglers"]:
        who = f"{e['host']}:{e['gpu']}" if e.get("gpu") is not None else f"rank {e['rank']} on {e['host']}"
        print(f"triage: straggler {who} ({e['cause']}): {e['evidence']}")


def _report(args, config) -> None:
    from wattgate.report import run_report

    if args.run is None and not args.trace:
        raise InputError(
            "report: pass --run-dir DIR (a train run) or --trace FILE... (e.g. from wattgate import-trace)"
        )
    s = run_report(
        args.run,
        args.out,
        power_dir=args.power,
        gate_dir=args.gate,
        config=config,
        trace_paths=args.trace,
        gpu_model=args.gpu_model,
        table_path=args.table,
        power_cap_w=args.power_cap_w,
    )
    energy = s["energy"]
    kwh = (
        f"{energy['kwh']:.4g} kWh ({energy['method'].replace('_', ' ')})"
        if energy["kwh"] is not None
        else "no GPU telemetry"
    )
    print(
        f"report: {s['run']['name']}: {s['tokens'] or 0} tokens, {kwh}, {len(s['anomalies'])} anomaly(ies) "
        f"-> {args.out}/index.html"
    )


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


def add_power_cap(p: argparse.ArgumentParser) -> None:
    """--power-cap-w, shared by triage and report (both may triage an imported log)."""
    p.add_argument(
        "--power-cap-w",
        type=_positive_float,
        metavar="W",
        help="the GPUs' power cap in W: at the cap is compute whatever the utilization, and for a GPU "
        "no table ships for (V100, L40S, ...) a table is derived from it (an imported log records "
        "no cap; the sampler records NVML's enforced limit)",
    )


class DeprecatedAlias(argparse.Action):
    """An old flag name kept for one release: it sets what the new flag sets and prints one line to stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: warning: {option_string} is deprecated, use {self.new} (the old name goes in the next "
            "release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_flag(p: argparse.ArgumentParser, flag: str, old: str, required: bool = False, **kwargs) -> None:
    """`flag`, with `old` as its deprecated alias (DeprecatedAlias): one or the other, `required` or not."""
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument(flag, **kwargs)
    kwargs.pop("help", None)
    group.add_argument(
        old,
        dest=kwargs.pop("dest", flag.lstrip("-").replace("-", "_")),
        action=DeprecatedAlias,
        new=flag,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def add_run_folder(p: argparse.ArgumentParser, old: str, required: bool, help: str) -> None:
    """--run-dir DIR, the run folder (results/train/<run>: checkpoints, heartbeat/, metrics, final/, watcher.json)
    on every command that writes or reads it, as args.run; `old`: its name there before (train, launch: --out;
    watch, triage, report: --run), a deprecated alias for one release. Not --run: torchrun's parser refuses it
    anywhere on its command line, the rank's arguments included, as an ambiguous abbreviation of its --run-path."""
    add_flag(p, "--run-dir", old, required=required, dest="run", type=Path, metavar="DIR", help=help)


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a power cap of 0 or NaN W would derive a meaningless table)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {text})")
    return value


def build_parser() -> argparse.ArgumentParser:
    from wattgate.triage_tables import DEFAULT_DEADLOCK_AFTER_S, DEFAULT_STRAGGLER_SHARE, DEFAULT_WINDOW_S

    parser = argparse.ArgumentParser(prog="wattgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")

    def stage(name: str, func, help: str, *paths: str, run: bool = False) -> argparse.ArgumentParser:
        """A subcommand taking --config, the named input folders, and --out (`run`: --run-dir, the run folder)."""
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
        for path in paths:
            p.add_argument(f"--{path}", required=True, type=Path)
        if run:
            add_run_folder(p, "--out", True, "the run folder it writes (results/train/<run>)")
        else:
            p.add_argument("--out", required=True, type=Path)
        p.set_defaults(func=func)
        return p

    stage("demo-corpus", _demo_corpus, "write the seeded demo chat corpus (JSONL)")
    p = stage("train-tokenizer", _train_tokenizer, "train a byte-level BPE tokenizer on the corpus")
    p.add_argument("--corpus", nargs="+", type=Path, help="corpus files (default: data.inputs)")
    p = stage("pretokenize", _pretokenize, "tokenize the corpus into Arrow shards")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: tokenizer.path)")
    stage("pack", _pack, "pack-and-balance: equal micro-batches on every rank", "pretokenized")
    stage("gate", _gate, "invariant gate: prove the plan safe before any GPU job", "pretokenized", "plan")
    stage(
        "train", _train, "train one rank (run under torchrun; see `wattgate launch`)", "pretokenized", "plan", run=True
    )
    p = stage(
        "launch",
        _launch,
        "start the train stage on every rank (torchrun; srun on Slurm)",
        "pretokenized",
        "plan",
        run=True,
    )
    p.add_argument(
        "--gate",
        type=Path,
        help="the gate's output folder whose marker must name this plan (default: gate/ beside the plan folder)",
    )
    p.add_argument(
        "--attempt",
        type=_positive_int,
        default=1,
        help="Snakemake's try of this job (retries: 2, 3, ...): a retry after a failure a retry would repeat "
        "(a rank's own error: non-finite, an input or OS error) ends at once naming it",
    )

    p = sub.add_parser(
        "load-check",
        help="the train stage's sharded model load (and export) alone, measured "
        "(run under torchrun with the train job's ranks)",
    )
    p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
    p.add_argument("--out", required=True, type=Path, help="folder for load-check.json (and final/ with --export)")
    p.add_argument("--export", action="store_true", help="also export final/ as the train stage would")
    p.set_defaults(func=_load_check)

    p = sub.add_parser("sample", help="NVML telemetry sampler for this node (optionally beside a command)")
    p.add_argument("--out", required=True, help="trace file; {host} becomes this node's name")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    p.add_argument("--flush-every", type=float, default=2.0, help="seconds between crash-safe flushes")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until signalled)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: sample while CMD runs, exit with its status")
    p.set_defaults(func=_sample, config=None)

    p = sub.add_parser("watch", help="hang watcher: heartbeats + power; kills a deadlocked job")
    p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
    add_run_folder(p, "--run", True, "the run folder the job writes (heartbeat/, telemetry/)")
    p.add_argument("--pid", type=int, help="root of the job's process tree (killed on a verdict)")
    p.add_argument("--slurm-job", help="Slurm job id (scancel on a verdict)")
    p.add_argument("--out", type=Path, help="verdict file (default RUN/watcher.json)")
    p.set_defaults(func=_watch)

    p = sub.add_parser("variant", help="the config of one measurement run (scaling: w<N>; dataio: shared|local)")
    p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
    p.add_argument("--experiment", required=True, choices=["scaling", "dataio"])
    p.add_argument("--variant", required=True, help="w<N> (scaling) or shared|local (dataio)")
    p.add_argument("--out", required=True, type=Path, help="the variant's config (YAML)")
    p.set_defaults(func=_variant)

    p = sub.add_parser("compare", help="table and plot of finished measurement runs")
    p.add_argument("--experiment", required=True, choices=["scaling", "dataio"])
    p.add_argument("--runs", required=True, nargs="+", type=Path, help="variant folders (config.yaml, train/)")
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=_compare, config=None)

    p = sub.add_parser(
        "import-trace", help="nvidia-smi / DCGM / Zeus / any CSV logs -> a wattgate trace (for triage, report)"
    )
    p.add_argument("--from", dest="source", required=True, choices=["nvidia-smi", "dcgm", "zeus", "csv"])
    p.add_argument("files", nargs="+", type=Path, help="log file(s)")
    p.add_argument("--out", required=True, type=Path, help="trace file (Parquet)")
    p.add_argument("--host", help="host name for the rows (default: DCGM's Hostname label, else the file name)")
    p.add_argument("--fields", help="nvidia-smi logs written with noheader: the --query-gpu list, comma-separated")
    p.add_argument(
        "--columns",
        help="--from csv: trace field=header name[:unit], comma-separated, e.g. "
        "time=timestamp,gpu=gpu_index,power_w=power_mW:mW (time and power_w required; time units "
        "s, ms, us, ns or ISO-8601; no gpu means one GPU)",
    )
    p.add_argument(
        "--tz", default="UTC", help="time zone of timestamps written without one (nvidia-smi, csv; default UTC)"
    )
    p.add_argument("--gpu-index", type=int, default=0, help="GPU of a legacy one-GPU Zeus log (default 0)")
    p.add_argument("--skip-bad-lines", action="store_true", help="count unreadable lines instead of stopping")
    p.set_defaults(func=_import_trace, config=None)

    p = sub.add_parser("triage", help="label each GPU's 1 s windows: compute/communication/.../deadlock/idle")
    p.add_argument("--config", type=Path, help="run config: table, window and hang limit from it")
    p.add_argument(
        "--trace", required=True, nargs="+", type=Path, help="trace file(s), one per node, or a run's telemetry folder"
    )
    p.add_argument("--table", help="triage table (YAML); default: shipped table for --gpu-model or the trace's GPUs")
    p.add_argument("--gpu-model", help="a100, h100, h200, b200, b300 (default: from the trace's device names)")
    add_run_folder(p, "--run", False, "the run folder (results/train/<run>): heartbeats and metrics sharpen the labels")
    add_power_cap(p)
    p.add_argument(
        "--window", type=float, help=f"window length in seconds (default {DEFAULT_WINDOW_S:g}, or telemetry.window_s)"
    )
    add_flag(
        p,
        "--hang-after",
        "--deadlock-after",
        type=float,
        metavar="S",
        help="a low-power busy wait this long that never ends is a deadlock, as the watcher's hang limit "
        f"(default {DEFAULT_DEADLOCK_AFTER_S:g}, or watcher.hang_after_s)",
    )
    p.add_argument(
        "--straggler-share",
        type=float,
        help="a GPU is a straggler when its peers waited for it in more than this share of the windows they "
        f"waited (default {DEFAULT_STRAGGLER_SHARE:g}, or telemetry.straggler_share)",
    )
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=_triage)

    p = sub.add_parser("report", help="summary.json and a self-contained index.html for a run (or a bare trace)")
    add_run_folder(p, "--run", False, "the run folder (results/train/<run>)")
    p.add_argument(
        "--trace",
        nargs="+",
        type=Path,
        help="trace file(s) or folder(s): power-only mode, or in place of RUN/telemetry",
    )
    p.add_argument("--gpu-model", help="a100, h100, h200, b200, b300, for traces that name no GPU")
    p.add_argument(
        "--table",
        type=Path,
        help="triage table (YAML, as for `wattgate triage --table`), e.g. for a GPU with no shipped table",
    )
    add_power_cap(p)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--power", type=Path, help="triage output (default results/power/<run>; else triage runs here)")
    p.add_argument("--gate", type=Path, help="gate output folder (default results/gate beside results/train)")
    p.add_argument("--config", type=Path, help="run config (YAML; default results/config.yaml beside the run)")
    p.set_defaults(func=_report)

    p = sub.add_parser("calibrate", help="measure known phases' power on this node's GPU; write a triage table")
    p.add_argument("--gpu-model", required=True, help="model name for the table (a100, h100, h200, b200, b300, ...)")
    p.add_argument("--out", required=True, type=Path, help="triage table (YAML)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--interval", type=float, default=0.1, help="sampling period (default 0.1)")
    p.add_argument("--device", type=int, default=0, help="CUDA device for the single-GPU phases")
    p.add_argument("--samples", type=Path, help="also write the calibration samples as a trace (+ .labels.parquet)")
    p.set_defaults(func=_calibrate, config=None)
    return parser


OS_ERROR_ADVICE = {
    "ENOSPC": "free space there or point {flag} elsewhere",
    "EDQUOT": "free space in your quota or point {flag} elsewhere",
    "EROFS": "the filesystem is read-only: point {flag} at a writable folder",
    "EACCES": "check the permissions of the file and its folder",
    "EPERM": "check the permissions of the file and its folder",
    "ENOENT": "check the path",
}


def os_error_line(exc: OSError, flag: str = "--out") -> str:
    """'<file>: <what happened> (<what to do>)' for an OSError from anywhere in a stage; `flag`: the option naming
    where the stage writes (--run-dir for train and launch)."""
    import errno

    code = errno.errorcode.get(exc.errno or 0, "")
    where = exc.filename if exc.filename is not None else "(no file named)"
    what = exc.strerror or str(exc)
    advice = OS_ERROR_ADVICE.get(code)
    return f"{where}: {what}" + (f" ({advice.format(flag=flag)})" if advice else "")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from wattgate.config import load_config

    try:
        config = load_config(args.config) if args.config is not None else None
        rc = args.func(args, config)
        if isinstance(rc, int):
            return rc
    except InputError as exc:  # a trainer refused by another's lock writes nothing into that run folder
        return _failed(args, f"error: {exc}", 2, record=type(exc).__name__ != "RunLocked")
    except StageFailed as exc:
        return _failed(args, f"failed: {exc}", 1)
    except OSError as exc:  # disk full, read-only, permission, missing file: one line, never a traceback
        flag = "--run-dir" if args.stage in ("train", "launch") else "--out"
        return _failed(args, f"error: {os_error_line(exc, flag)}", 2)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", 130)
    except Exception as exc:  # a traceback follows; a training rank still leaves its one line for the verdict
        _record_rank_error(args, f"{type(exc).__name__}: {first_line(exc)}", 1)
        raise
    return 0


def _failed(args, text: str, code: int, record: bool = True) -> int:
    print(f"wattgate {args.stage}: {text}", file=sys.stderr)
    if record:
        _record_rank_error(args, text.partition(": ")[2] or text, code)
    return code


def _record_rank_error(args, text: str, code: int) -> None:
    """A training rank's failure record beside its heartbeat (its line, exit status, step and phase), for the
    watcher's verdict and launch's line; only into a run folder train has claimed (never a foreign --run-dir)."""
    import os

    if args.stage != "train" or "RANK" not in os.environ:
        return
    from wattgate.artifacts import marker_stage
    from wattgate.heartbeats import write_rank_error

    if marker_stage(args.run) == "train":
        write_rank_error(args.run, int(os.environ["RANK"]), text, code)


if __name__ == "__main__":
    sys.exit(main())
