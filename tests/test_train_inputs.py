"""What trains is what the gate verified: before the first step every rank hashes its share of the shards against
manifest.json's shard_hashes (which the gate checked), and all ranks stop with one line naming the changed file. A
byte flipped in a shard after the gate trained silently."""

import os
import subprocess

import numpy as np


from conftest import CADENCE, make_run, torchrun

LENGTHS = np.random.default_rng(4).integers(5, 60, 60).tolist()


def train(tmp, out) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(torchrun(tmp, 2, out), capture_output=True, text=True, env=env, timeout=300)


def flip_a_byte(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def wattgate_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("wattgate train: ")]


def test_a_shard_changed_after_the_plan_stops_every_rank_before_the_first_step(tmp_path):
    make_run(tmp_path, LENGTHS, gpus=2, **CADENCE)
    shards = sorted((tmp_path / "pretokenized").glob("shard-*.parquet"))
    flip_a_byte(shards[-1])  # the last one: the second rank's share
    proc = train(tmp_path, tmp_path / "run")
    assert proc.returncode != 0
    said = "\n".join(wattgate_lines(proc))
    assert f"{shards[-1]}: content hash" in said and "the gate verified" in said, proc.stderr[-2000:]
    assert "rerun pretokenize, pack and gate" in said
    assert not (tmp_path / "run" / "metrics.parquet").exists() and not (tmp_path / "run" / "checkpoints").exists()
