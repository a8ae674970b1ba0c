"""Traces as the NVML sampler writes them, for the triage tests that need its layout."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from wattgate.trace import schema_with_meta


def sampler_files(synth, folder, counter_every: int = 30):
    """Each host's rows as a sampler writes them: tick by tick, one time per tick, GPUs in index order, the
    energy counter on every counter_every-th tick."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for host in sorted({h for h, _ in synth.gpus}):
        t = synth.table.filter(pc.equal(synth.table.column("host"), host))
        gpu, time_ = t.column("gpu").to_numpy(), t.column("time").to_numpy()
        t = t.take(np.lexsort((time_, gpu)))
        k = len(np.unique(gpu))
        ticks = t.column("time").to_numpy().reshape(k, -1).min(axis=0)
        t = t.set_column(t.schema.get_field_index("time"), "time", pa.array(np.tile(ticks, k)))
        p = t.column("power_w").to_numpy().astype(np.float64).reshape(k, -1)
        energy = np.cumsum(np.c_[np.zeros(k), np.diff(ticks) * p[:, 1:]], axis=1) + 1e6
        energy[:, np.arange(energy.shape[1]) % counter_every != 0] = np.nan
        e = energy.ravel()
        t = t.set_column(t.schema.get_field_index("energy_j"), "energy_j", pa.array(e, mask=np.isnan(e)))
        t = t.take(np.arange(t.num_rows).reshape(k, -1).T.ravel())
        paths.append(folder / f"{host}.parquet")
        pq.write_table(t.cast(schema_with_meta(synth.meta(host))), paths[-1], row_group_size=5000)
    return paths
