"""What the train job's check before its first step costs (train/input_check.py): every rank hashes its share of
the shards and of model.path's 256 MiB chunks against what the gate verified, one rank the tokenizer.

Two inputs. The embedded default's size of corpus (3,000 documents of up to 512 tokens, synthetic shards of the
pretokenize schema; the default model is a random init, so no model file) on 2 ranks, as the default runs. And a
model-sized safetensors file (`--gb`, 8 by default; Qwen3-32B is 65 GB) in its chunks: the time per rank at world
1, 8 and 16 (each rank's share timed on its own, one after the other here, and the slowest share taken). Baseline,
in the same run: reading the same bytes without hashing them (what any check that reads the file pays). Also the
gate's side: hashing the whole folder the first time, and again when nothing changed (the stat reuse).

    python bench/launch_hashes.py [--gb 8] [--smoke]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from benchlib import Parser, figure, positive_float
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.config import run_config, validate_config
from wattgate.pack.plan import build_plan
from wattgate.run_files import read_plan
from wattgate.train.input_check import changed_data
from wattgate.train.model_hashes import CHUNK_BYTES, changed_model_files, hash_model_folder

BENCH = "launch_hashes"


def write_model_file(path: Path, size: int) -> None:
    """`size` bytes that do not compress or repeat per chunk (a chunk's hash is of its own bytes)."""
    rng = np.random.default_rng(0)
    block = rng.bytes(1 << 26)
    with open(path, "wb") as f:
        written = 0
        while written < size:
            n = min(len(block), size - written)
            f.write(block[:n])
            written += n
            block = block[7:] + block[:7]  # a rotation: no two blocks the same


def read_all(path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 24):
            pass
    return time.perf_counter() - start


def slowest_share(hashes, world: int) -> float:
    times = []
    for rank in range(world):
        start = time.perf_counter()
        assert changed_model_files(hashes, rank, world) == []
        times.append(time.perf_counter() - start)
    return max(times)


def default_corpus(tmp: Path) -> None:
    lengths = np.random.default_rng(1).integers(16, 512, 3000).tolist()
    write_random_pretokenized(tmp / "pretokenized", lengths, 2048, 0, validation_fraction=0.05)
    config = validate_config({"train": {"seq_len": 512}})
    build_plan(run_config(config), tmp / "pretokenized", tmp / "plan")
    plan, _ = read_plan(tmp / "plan")
    for world in (1, 2):
        start = time.perf_counter()
        for rank in range(world):
            assert changed_data(tmp / "pretokenized", plan, rank, world) == []
        per_rank = (time.perf_counter() - start) / world
        size = sum(p.stat().st_size for p in (tmp / "pretokenized").glob("shard-*.parquet"))
        figure(
            BENCH,
            f"the default's shards ({size / 1e6:.1f} MB), world {world}",
            f"{per_rank * 1000:.1f} ms a rank",
            "none (the check is all of it; no model file: a random init)",
        )


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0], smoke="a 96 MiB file")
    parser.add_argument("--gb", type=positive_float, default=8.0, help="the model file's size, GB (1e9 bytes)")
    args = parser.parse_args()
    size = (96 << 20) if args.smoke else int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="wattgate-bench-hashes-") as tmp:
        tmp = Path(tmp)
        default_corpus(tmp)
        folder = tmp / "model"
        folder.mkdir()
        write_model_file(folder / "model.safetensors", size)
        (folder / "config.json").write_text("{}")
        read_s = min(read_all(folder / "model.safetensors") for _ in range(2))  # the second from the page cache
        start = time.perf_counter()
        hashes, _ = hash_model_folder(folder)
        gate_s = time.perf_counter() - start
        start = time.perf_counter()
        _, reread = hash_model_folder(folder, hashes)
        rerun_s = time.perf_counter() - start
        chunks = len(hashes.files["model.safetensors"].chunks)
        read = f"reading the {size / 1e9:.2f} GB without hashing {read_s:.2f} s ({size / read_s / 1e9:.1f} GB/s)"
        figure(
            BENCH,
            f"the gate hashing a {size / 1e9:.2f} GB model file ({chunks} chunks of {CHUNK_BYTES >> 20} MiB)",
            f"{gate_s:.2f} s ({gate_s / read_s:.2f}x the read); a rerun {rerun_s * 1000:.1f} ms ({reread} bytes read)",
            read,
        )
        for world in (1, 8, 16):
            share = slowest_share(hashes, world)
            figure(
                BENCH,
                f"the launch check of that file, world {world}",
                f"{share:.2f} s the slowest rank ({share / read_s:.2f}x the whole read)",
                read,
            )


if __name__ == "__main__":
    main()
