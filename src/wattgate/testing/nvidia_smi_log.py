"""A synthetic trace written as an nvidia-smi CSV log (a foreign log for the importers' tests and benches)."""

from __future__ import annotations

from pathlib import Path

from wattgate.testing.synthetic_trace import SyntheticTrace
from wattgate.trace import GPU, POWER_W, TIME, UTIL_GPU


def write_nvidia_smi_csv(
    synth: SyntheticTrace,
    path: Path,
    name: str | None = None,
    na_every: int = 0,
    burst_gap_s: float = 0.002,
    index: bool = True,
) -> Path:
    """The trace as `nvidia-smi --query-gpu=timestamp,index,name,power.draw,utilization.gpu --format=csv -lms 100`
    writes it: one burst per sample (GPUs in index order, rows `burst_gap_s` apart), values with units, and
    every `na_every`-th row's power `[N/A]` (0: none). One host; the i-th sample of every GPU is burst i."""
    import datetime as dt

    df = synth.table.select([TIME, GPU, POWER_W, UTIL_GPU]).to_pandas().sort_values([GPU, TIME])
    per_gpu = df.groupby(GPU)
    n = int(per_gpu.size().min())
    gpus = sorted(per_gpu.groups)
    first = float(df[TIME].min())
    rows = []
    interval = 1.0 / synth.hz
    for i in range(n):
        for g in gpus:
            rows.append((first + i * interval + g * burst_gap_s, g))
    power = {g: grp[POWER_W].to_numpy()[:n] for g, grp in per_gpu}
    util = {g: grp["util_gpu"].to_numpy()[:n] for g, grp in per_gpu}
    device = name or synth.device_name
    lines = ["timestamp, index, name, power.draw [W], utilization.gpu [%]"]
    for k, (t, g) in enumerate(rows):
        i = k // len(gpus)
        stamp = dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        p = "[N/A]" if na_every and k % na_every == na_every - 1 else f"{power[g][i]:.2f} W"
        cells = [stamp] + ([str(g)] if index else []) + [device, p, f"{util[g][i]:.0f} %"]
        lines.append(", ".join(cells))
    if not index:
        lines[0] = lines[0].replace(" index,", "")
    path.write_text("\n".join(lines) + "\n")
    return path
