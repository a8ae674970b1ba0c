"""Checkpoints verified by content: a flipped bit or overwritten bytes are found at resume (the previous intact
checkpoint is used and the run ends bitwise equal to an uninterrupted one), damaged checkpoints and those above
the resume point are moved aside and never count toward checkpoint_keep, and a full disk during a checkpoint is
one line and exit 2."""

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from wattgate.records.checkpoint import Position
from wattgate.artifacts import write_json_atomic
from wattgate.config import run_config
from wattgate.data.synthetic import write_random_pretokenized
from wattgate.pack.plan import build_plan
from wattgate.train import checkpoint as ckpt
from conftest import TINY

# the tiny Qwen3 and run helpers of tests/test_train.py, copied (a test module never imports another)
LENGTHS = [5 + (i * 37) % 55 for i in range(60)]


def make_run(tmp: Path, gpus: int, **train) -> None:
    """Pretokenized data, a plan and a config file for a CPU run with `gpus` ranks."""
    pretok = tmp / "pretokenized"
    if not pretok.exists():
        write_random_pretokenized(pretok, LENGTHS, 96, 0, shard_docs=7)
    t = {"seq_len": 64, "micro_batch_size": 1, "grad_accum": 2, "epochs": 1, "warmup_steps": 0, "lr": 1e-2}
    config = run_config(
        {
            "run_name": "t",
            "train": t | {"log_every": 1} | train,
            "model": {"config": TINY},
            "cluster": {"nodes": 1, "gpus_per_node": gpus},
        }
    )
    build_plan(config, pretok, tmp / f"plan-{gpus}")
    (tmp / f"config-{gpus}.yaml").write_text(yaml.safe_dump(config.to_json()))


def train_command(tmp: Path, gpus: int, out: Path) -> list[str]:
    args = ["-m", "wattgate", "train", "--config", str(tmp / f"config-{gpus}.yaml")]
    args += ["--pretokenized", str(tmp / "pretokenized"), "--plan", str(tmp / f"plan-{gpus}"), "--run-dir", str(out)]
    if gpus == 1:  # a world of one, run by hand: stderr is the CLI's alone
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *args]


def run_train(tmp: Path, gpus: int, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(train_command(tmp, gpus, out), capture_output=True, text=True, env=env, timeout=300)


def final_params(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "final").glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def flip_bit(path: Path, start: int = 0, length: int | None = None) -> None:
    """One bit flipped in the middle of bytes [start, start + length) of `path` (default: the whole file)."""
    data = bytearray(path.read_bytes())
    data[start + (len(data) - start if length is None else length) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def overwrite_4k(path: Path, start: int = 0, length: int | None = None) -> None:
    """4 KiB of 0xFF over the middle of bytes [start, start + length) of `path` (default: the whole file)."""
    length = path.stat().st_size - start if length is None else length
    assert length >= 4096
    with open(path, "r+b") as f:
        f.seek(start + (length - 4096) // 2)
        f.write(b"\xff" * 4096)


def tensor_bytes(folder: Path, victim: str) -> tuple[int, int]:
    """(offset, length) in DCP file `victim` of its largest tensor's own bytes (inside that item's torch.save
    zip record): damage there leaves every structure intact, so only a content hash can tell."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata()
    item = max((s for s in md.storage_data.values() if s.relative_path == victim), key=lambda s: s.length)
    raw = (folder / victim).read_bytes()[item.offset : item.offset + item.length]
    entry = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26 : entry.header_offset + 30])
    return item.offset + entry.header_offset + 30 + name_len + extra_len, entry.file_size


def steps_in(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir()), key=lambda n: (len(n), n)) if folder.is_dir() else []


# ---------------------------------------------------------------- end to end: damaged newest checkpoint


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 2-rank run (checkpoints every 3 steps, the last 2 kept) and its folder."""
    tmp = tmp_path_factory.mktemp("integrity")
    make_run(tmp, 2, checkpoint_every=3, checkpoint_keep=2)
    out = tmp / "straight"
    proc = run_train(tmp, 2, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, out


@pytest.mark.slow
@pytest.mark.parametrize(("damage", "victim"), [(flip_bit, "__1_0.distcp"), (overwrite_4k, "__0_0.distcp")])
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_file_and_the_run_ends_bitwise_equal(
    straight, damage, victim
):
    tmp, done = straight
    total = json.loads((done / "TRAINED").read_text())["steps"]
    # the run as killed after its last checkpoint, before the export, with that checkpoint then damaged on disk
    out = tmp / f"{damage.__name__}"
    shutil.copytree(done, out)
    (out / "TRAINED").unlink()
    shutil.rmtree(out / "final")
    kept = steps_in(out / "checkpoints")
    newest, previous = out / "checkpoints" / kept[-1], int(kept[-2].split("-")[1])
    assert newest.name == f"step-{total}"
    size = (newest / victim).stat().st_size
    damage(newest / victim, *tensor_bytes(newest, victim))  # a weight or optimizer value, not a structure
    assert (newest / victim).stat().st_size == size  # same size: before content hashes this loaded silently

    proc = run_train(tmp, 2, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(lines) == 1, proc.stderr
    assert f"{newest}: {victim} has xxh3_128 " in lines[0] and "its bytes changed" in lines[0]
    assert f"moved to {out / 'checkpoints.damaged' / newest.name}" in lines[0]
    assert json.loads((out / "TRAINED").read_text())["resumed_from_step"] == previous
    a, b = final_params(done), final_params(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the damaged one is kept for inspection outside checkpoints/; the resumed run wrote its own step again
    assert steps_in(out / "checkpoints.damaged") == [newest.name]
    assert ckpt.verify(newest) == (True, "")


# ---------------------------------------------------------------- checkpoint_keep and prune, in one process


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def save(root: Path, step: int, keep: int) -> Path:
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return ckpt.save_checkpoint(root, model, optimizer, Position(epoch=0, step=step), keep, {})


def test_state_json_records_every_files_bytes_and_hash_as_written(world_of_one, tmp_path):
    folder = save(tmp_path / "checkpoints", 3, 2)
    state = json.loads((folder / "state.json").read_text())
    assert state["hash_algorithm"] == "xxh3_128"
    assert set(state["files"]) == {".metadata", "__0_0.distcp", "rng-rank-0.pt"}
    for name, record in state["files"].items():
        assert record == {"bytes": (folder / name).stat().st_size, "hash": ckpt.file_hash(folder / name)}


def test_damaged_checkpoints_are_moved_aside_and_do_not_count_toward_checkpoint_keep(world_of_one, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4, 5):
        save(root, step, keep=5)
    flip_bit(root / "step-5" / "__0_0.distcp")
    (root / "step-4" / ".metadata").write_bytes(b"")  # truncated
    assert ckpt.latest_complete(root) == root / "step-3"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "step-5: __0_0.distcp has xxh3_128" in err[0] and "step-4: .metadata is 0 bytes" in err[1]
    assert steps_in(root) == ["step-1", "step-2", "step-3"]
    assert steps_in(tmp_path / "checkpoints.damaged") == ["step-4", "step-5"]
    # the run goes on from step 3 with checkpoint_keep 2: its own new checkpoints are the ones kept
    save(root, 4, keep=2)
    save(root, 5, keep=2)
    assert steps_in(root) == ["step-4", "step-5"]
    assert ckpt.latest_complete(root) == root / "step-5"
    # damaged again at the same step: both copies are kept aside, neither in checkpoints/
    flip_bit(root / "step-5" / "rng-rank-0.pt")
    assert ckpt.latest_complete(root) == root / "step-4"
    assert len(list((tmp_path / "checkpoints.damaged").glob("step-5*"))) == 2


def test_a_restart_from_step_0_keeps_its_new_checkpoints_over_stale_higher_ones(world_of_one, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    for step in (7, 8):
        save(root, step, keep=2)
        overwrite_4k(root / f"step-{step}" / "__0_0.distcp")
    assert ckpt.latest_complete(root) is None  # nothing intact: the run starts over at step 0
    assert steps_in(root) == [] and steps_in(tmp_path / "checkpoints.damaged") == ["step-7", "step-8"]
    for step in (1, 2, 3):
        save(root, step, keep=2)
    assert steps_in(root) == ["step-2", "step-3"]
    # and prune itself never counts (nor deletes) a checkpoint above the step just saved
    (root / "step-9").mkdir()
    save(root, 4, keep=2)
    assert steps_in(root) == ["step-3", "step-4", "step-9"]


def test_a_state_json_without_hashes_is_skipped_with_one_line(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    d = root / "step-3"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * 10)
    write_json_atomic(d / "state.json", {"step": 3, "files": {"__0_0.distcp": {"bytes": 10}}})
    assert ckpt.latest_complete(root) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-3: state.json is not a checkpoint state (missing key 'hash_algorithm')" in err[0]


# ---------------------------------------------------------------- a full disk during a checkpoint


@pytest.fixture
def small_tmpfs_checkpoints(tmp_path):
    """The run folder's checkpoints/ on a 64 KiB tmpfs: the first checkpoint cannot fit."""
    mnt = tmp_path / "out" / "checkpoints"
    mnt.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root in a namespace that allows it)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_at_any_file_of_a_checkpoint_raises_the_os_error_naming_that_file(world_of_one, tmp_path):
    """Free space from 8 KiB up until a checkpoint fits: the write fails at each of its files in turn (DCP's,
    .metadata, the RNG state, state.json), always as the OSError naming the file (DCP wraps it in its
    CheckpointException, torch.save in a RuntimeError)."""
    named = set()
    for kib in range(8, 400, 4):
        mnt = tmp_path / f"mnt-{kib}"
        mnt.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(mnt)]
        if subprocess.run(cmd, capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root in a namespace that allows it)")
        try:
            save(mnt / "checkpoints", 1, 2)
            break
        except OSError as exc:
            assert exc.errno == 28 and Path(exc.filename).parent == mnt / "checkpoints" / "step-1.tmp", exc
            named.add(Path(exc.filename).name)
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert {"__0_0.distcp", "rng-rank-0.pt", "state.json"} <= named, named


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_and_exit_2(small_tmpfs_checkpoints, tmp_path):
    make_run(tmp_path, 1, checkpoint_every=2)
    proc = run_train(tmp_path, 1, tmp_path / "out")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"wattgate train: error: {small_tmpfs_checkpoints / 'step-2.tmp'}/")
    assert "No space left on device" in lines[0]
    assert steps_in(small_tmpfs_checkpoints) == ["step-2.tmp"]  # never published, never a resume candidate
