"""`wattgate triage`: traces in (files.py), phases labelled (labelling.py), phases.parquet (phases.py),
phase_summary.csv, triage.json and triage.md (markdown.py) out.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pyarrow.compute as pc

from wattgate.power.triage import power_only
from wattgate.triage_tables import (
    TriageSettings,
    TriageTable,
)
from wattgate.power.triage.phases import (
    PHASES_SCHEMA,
    START,
    gap_summary,
    peer_departures,
    phase_summary,
    phases_meta,
    totals,
    write_phases,
)
from wattgate.power.triage.arrays import small_pages
from wattgate.power.triage.files import check_files_apart, recorded_caps, trace_chunks, watcher_stragglers, write_texts
from wattgate.power.triage.labelling import check_limits, triage_ingested
from wattgate.power.triage.markdown import triage_markdown
from wattgate.power.triage.runinfo import load_run_info, map_ranks
from wattgate.power.triage.stragglers import no_lag
from wattgate.power.triage.windows import ingest, ingest_energy
from wattgate.run_files import check_output, claim_output
from wattgate.records.base import Where
from wattgate.records.triage import (
    STATUS_NO_TELEMETRY,
    STATUS_OK,
    Energy,
    PauseRecord,
    PhaseTotal,
    PowerOnly,
    RankPlace,
    Ranks,
    Signals,
    TableUsed,
    Triage,
)
from wattgate.trace import GPU, HOST


# every setting at its default: the table detected from the traces' device names
DEFAULT_SETTINGS = TriageSettings()


def run_triage(
    trace_paths, out_dir, run_dir: str | os.PathLike | None = None, settings: TriageSettings = DEFAULT_SETTINGS
) -> Triage:
    """`wattgate triage`: traces (one per host) -> phases.parquet, phase_summary.csv, triage.json (the Triage
    record returned), triage.md; `run_dir`: the run's heartbeats and metrics, when it has them."""
    with small_pages():
        return _run_triage(trace_paths, out_dir, run_dir, settings)


def _run_triage(trace_paths, out_dir, run_dir: str | os.PathLike | None, settings: TriageSettings) -> Triage:
    window_s, deadlock_after_s = settings.window_s, settings.deadlock_after_s
    paths = [Path(p) for p in ([trace_paths] if isinstance(trace_paths, (str, os.PathLike)) else trace_paths)]
    out_dir = Path(out_dir)
    check_output(out_dir, "triage")  # before any work: a folder triage did not write is refused
    metas, chunks, again = trace_chunks(paths)
    check_limits(window_s, deadlock_after_s)
    notes: list[str] = []  # damaged heartbeat records: skipped and named (the phases there rest on power)
    with ThreadPoolExecutor(max_workers=1) as early:  # the run's own record is read while the traces are
        reading = early.submit(load_run_info, run_dir, metas, on_bad=notes.append) if run_dir else None
        acc = ingest(chunks, window_s)
    check_files_apart(acc, paths, metas)
    names = sorted({name for m in metas for name in m.device_names()})
    empty = acc.empty
    caps = recorded_caps(metas)
    if empty and not settings.has_table:
        table, source = None, None
    else:
        table = settings.table(names, list(caps.values()))
        source = settings.table_source(table, names)
    info = reading.result() if reading is not None else None
    for note in notes:
        print(f"triage: warning: {note}", file=sys.stderr, flush=True)
    if empty:
        phases, energy = PHASES_SCHEMA.empty_table(), {}
    else:
        energy = ingest_energy(acc, again)
        assert table is not None  # chosen whenever the traces have samples
        phases = triage_ingested(
            acc, table, window_s, deadlock_after_s, info, caps, settings.power_cap_w, settings.straggler_share
        )
    power_seen, util_seen = acc.power, acc.util
    del acc
    learned = phases_meta(phases, strict=True)
    claim_output(out_dir, "triage")
    # phases.parquet is written on another thread (Arrow lets go of the GIL) while the summaries are made, two of
    # them on a third (each reads the phases only); it is done before the files that describe it (the report checks
    # they are newer)
    with ThreadPoolExecutor(max_workers=2) as pool:
        written = pool.submit(
            write_phases,
            phases,
            out_dir / "phases.parquet",
            window_s,
            table.gpu_model if table else None,
            {k: lv.to_json() for k, lv in learned.levels.items()},
            learned.filled_s,
        )
        peers = pool.submit(peer_departures, phases, window_s)
        found = pool.submit(power_only.pauses, phases)
        summary = phase_summary(phases)

        where = Where(str(out_dir / "triage.json"), "triage")
        stragglers = learned.stragglers
        if empty and run_dir:
            stragglers = watcher_stragglers(run_dir)
        signals = Signals(
            power=power_seen,
            util=util_seen,
            heartbeats=bool(info and info.has_heartbeats),
            metrics=bool(info and info.has_metrics),
        )
        # without heartbeats the pauses rest on power alone (rule 4): say what was missing and how they were read
        found = found.result()
        t0 = float(pc.min(phases.column(START)).as_py()) if phases.num_rows else None
        po = None
        if not signals.heartbeats and not empty:
            inferred = any(m.gpu_index_inferred for m in metas)
            limits = power_only.limits(asdict(signals), deadlock_after_s, inferred)
            po = PowerOnly.from_json(
                limits | {"verdict": power_only.verdict(found, t0, window_s)}, where, "power_only."
            )
        ranks = None
        if info is not None and not empty:
            keys = [(h, int(g)) for h, g in summary[[HOST, GPU]].drop_duplicates().itertuples(index=False)]
            mapped = map_ranks(info, keys)
            ranks = Ranks(
                mapped={str(r): RankPlace(host=keys[g][0], gpu=keys[g][1]) for r, g in mapped.items()},
                unmapped=tuple(sorted(set(info.states) - set(mapped))),
            )
        result = Triage(
            status=STATUS_NO_TELEMETRY if empty else STATUS_OK,
            traces=tuple(sorted(str(p) for p in paths)),
            hosts=tuple(sorted(pc.unique(phases.column(HOST)).to_pylist())),
            gpus=0 if empty else len(summary[[HOST, GPU]].drop_duplicates()),
            table=_table_used(table),
            table_source=source,
            window_s=window_s,
            deadlock_after_s=deadlock_after_s,
            run_dir=str(run_dir) if run_dir else None,
            signals=signals,
            # built as computed, unchecked: a figure that could not be computed is written as null
            phases={ph: PhaseTotal(**v) for ph, v in totals(summary).items()},
            gaps=gap_summary(phases, window_s, learned.filled_s),
            levels=learned.levels,
            peers=peers.result(),
            # per GPU "host:gpu": the energy the report shows (energy.records), from the same samples
            energy={k: Energy.from_json(v, where, f"energy.{k}.") for k, v in energy.items()},
            # the GPUs everyone waited for (stragglers.py); without GPU telemetry, the watcher's rank CPU time
            stragglers=stragglers,
            lag=learned.lag or no_lag(settings.straggler_share),
            notes=tuple(notes),
            pauses=tuple(PauseRecord.from_json(p.record(t0), where, f"pauses[{i}].") for i, p in enumerate(found)),
            power_only=po,
            ranks=ranks,
        )
        written.result()
    # every text made before any is written: a failure leaves no triage.json without its triage.md
    csv, md = summary.to_csv(index=False, float_format="%.10g").encode(), triage_markdown(result, summary).encode()
    write_texts(out_dir, csv, result, md)
    return result


def _table_used(table: TriageTable | None) -> TableUsed | None:
    return None if table is None else TableUsed(**asdict(table))
