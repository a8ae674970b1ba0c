"""The `wattgate` command line: one subcommand per stage, its flags, and the deprecated aliases kept for one
release."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wattgate.cli.commands import (
    _calibrate,
    _compare,
    _demo_corpus,
    _gate,
    _import_trace,
    _launch,
    _load_check,
    _pack,
    _pretokenize,
    _report,
    _sample,
    _train,
    _train_tokenizer,
    _triage,
    _variant,
    _watch,
)

DESCRIPTION = "`wattgate <stage>`: one subcommand per stage, the same under Snakemake and by hand."


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


INPUT_FOLDERS = {
    "pretokenized": "the pretokenize stage's folder (manifest.json and shards; results/pretokenized/<run>)",
    "plan": "the pack stage's folder (plan.json, packs.parquet; results/plan/<run>)",
}
STAGE_OUT = {
    "demo-corpus": "the corpus file it writes (JSONL)",
    "train-tokenizer": "the tokenizer folder it writes",
    "pretokenize": "the folder it writes: manifest.json and the shards",
    "pack": "the folder it writes: plan.json and packs.parquet",
    "gate": "the folder it writes: gate.json, gate.md and the PASSED (or UNENFORCED) marker",
}


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

    parser = argparse.ArgumentParser(prog="wattgate", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")

    def command(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        """A subcommand whose own --help opens with what it does (the line `wattgate --help` lists)."""
        return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".", **kwargs)

    def stage(name: str, func, help: str, *paths: str, run: bool = False) -> argparse.ArgumentParser:
        """A subcommand taking --config, the named input folders, and --out (`run`: --run-dir, the run folder)."""
        p = command(name, help=help)
        p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
        for path in paths:
            p.add_argument(f"--{path}", required=True, type=Path, metavar="DIR", help=INPUT_FOLDERS[path])
        if run:
            add_run_folder(p, "--out", True, "the run folder it writes (results/train/<run>)")
        else:
            p.add_argument("--out", required=True, type=Path, help=STAGE_OUT[name])
        p.set_defaults(func=func)
        return p

    p = stage("demo-corpus", _demo_corpus, "write a seeded demo corpus (JSONL): chat, or plain-text notes")
    p.add_argument(
        "--kind",
        choices=("chat", "notes"),
        default="chat",
        help="chat: conversations (demo_corpus.num_docs); notes: plain-text paragraphs (demo_corpus.notes_docs)",
    )
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
        help=(
            "the gate's output folder whose marker must name this plan (default: results/gate/<run> for "
            "results/plan/<run>, else gate/ beside the plan folder)"
        ),
    )
    p.add_argument(
        "--attempt",
        type=_positive_int,
        default=1,
        help="Snakemake's try of this job (retries: 2, 3, ...): a retry after a failure a retry would repeat "
        "(a rank's own error: non-finite, an input or OS error) ends at once naming it",
    )

    p = command(
        "load-check",
        help="the train stage's sharded model load (and export) alone, measured "
        "(run under torchrun with the train job's ranks)",
    )
    p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
    p.add_argument("--out", required=True, type=Path, help="folder for load-check.json (and final/ with --export)")
    p.add_argument("--export", action="store_true", help="also export final/ as the train stage would")
    p.set_defaults(func=_load_check)

    p = command("sample", help="NVML telemetry sampler for this node (optionally beside a command)")
    p.add_argument("--out", required=True, help="trace file; {host} becomes this node's name")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    p.add_argument("--flush-every", type=float, default=2.0, help="seconds between crash-safe flushes")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until signalled)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD...: sample while CMD runs, exit with its status")
    p.set_defaults(func=_sample, config=None)

    p = command("watch", help="hang watcher: heartbeats + power; kills a deadlocked job")
    p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
    add_run_folder(p, "--run", True, "the run folder the job writes (heartbeat/, telemetry/)")
    p.add_argument("--pid", type=int, help="root of the job's process tree (killed on a verdict)")
    p.add_argument("--slurm-job", help="Slurm job id (scancel on a verdict)")
    p.add_argument("--out", type=Path, help="verdict file (default RUN/watcher.json)")
    p.set_defaults(func=_watch)

    p = command("variant", help="the config of one measurement run (scaling: w<N>; dataio: shared|local)")
    p.add_argument("--config", required=True, type=Path, help="run config (YAML)")
    p.add_argument("--experiment", required=True, choices=["scaling", "dataio"], help="the measurement it is for")
    p.add_argument("--variant", required=True, help="w<N> (scaling) or shared|local (dataio)")
    p.add_argument("--out", required=True, type=Path, help="the variant's config (YAML)")
    p.set_defaults(func=_variant)

    p = command("compare", help="table and plot of finished measurement runs")
    p.add_argument("--experiment", required=True, choices=["scaling", "dataio"], help="the measurement compared")
    p.add_argument(
        "--runs",
        required=True,
        nargs="+",
        type=Path,
        help=(
            "the variants' run folders (results/train/<run>; their configs and gates are read from "
            "results/config/<run>.yaml and results/gate/<run>)"
        ),
    )
    p.add_argument("--out", required=True, type=Path, help="the folder it writes: table.csv, table.md, plot.png")
    p.set_defaults(func=_compare, config=None)

    p = command("import-trace", help="nvidia-smi / DCGM / Zeus / any CSV logs -> a wattgate trace (for triage, report)")
    p.add_argument(
        "--from", dest="source", required=True, choices=["nvidia-smi", "dcgm", "zeus", "csv"], help="the logs' format"
    )
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

    p = command("triage", help="label each GPU's 1 s windows: compute/communication/.../deadlock/idle")
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
    p.add_argument("--out", required=True, type=Path, help="the folder it writes: phases.parquet, triage.json/.md")
    p.set_defaults(func=_triage)

    p = command("report", help="summary.json and a self-contained index.html for a run (or a bare trace)")
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
    p.add_argument("--out", required=True, type=Path, help="the folder it writes: summary.json and index.html")
    p.add_argument("--power", type=Path, help="triage output (default results/power/<run>; else triage runs here)")
    p.add_argument("--gate", type=Path, help="gate output folder (default results/gate/<run> beside results/train)")
    p.add_argument("--config", type=Path, help="run config (YAML; default results/config/<run>.yaml beside the run)")
    p.set_defaults(func=_report)

    p = command("calibrate", help="measure known phases' power on this node's GPU; write a triage table")
    p.add_argument("--gpu-model", required=True, help="model name for the table (a100, h100, h200, b200, b300, ...)")
    p.add_argument("--out", required=True, type=Path, help="triage table (YAML)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds per phase (default 20)")
    p.add_argument("--interval", type=float, default=0.1, help="sampling period (default 0.1)")
    p.add_argument("--device", type=int, default=0, help="CUDA device for the single-GPU phases")
    p.add_argument("--samples", type=Path, help="also write the calibration samples as a trace (+ .labels.parquet)")
    p.set_defaults(func=_calibrate, config=None)
    return parser
