"""TensorBoard event files (train.tensorboard): rank 0 writes loss, lr, grad norm, tokens/s and data wait
per optimizer step under the run folder; a resumed run hides what the killed attempt logged past its
checkpoint; off, other ranks and a missing package write nothing, and training goes on."""

import sys

import numpy as np
import pytest
import torch

from wattgate.train.metrics import StepLog
from wattgate.run_tables import MetricsTable
from wattgate.train.tensorboard import TAGS

from conftest import make_run, run_train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step_log(run, rank0=True, **kw) -> StepLog:
    metrics = MetricsTable(run / "metrics.parquet") if rank0 else None
    return StepLog(metrics, log_every=100, n_params=1000, world=2, gpu_model="cpu", on_cuda=False, **kw)


def gathered(loss_sum, loss_tokens, tokens, step_s, wait_s):
    """Two ranks' [loss sum, loss tokens, tokens, step s, data wait s]; rank 1 is slower and waits longer."""
    return [
        torch.tensor([loss_sum, loss_tokens, tokens, step_s, wait_s], dtype=torch.float64),
        torch.tensor([loss_sum, loss_tokens, tokens, 2 * step_s, 2 * wait_s], dtype=torch.float64),
    ]


def test_step_log_writes_every_tag_per_step(tmp_path):
    log = step_log(tmp_path)
    for g in range(3):
        log.record(
            g, 0, 0, 3, gathered(10.0 * (g + 1), 5, 100, 0.5, 0.01), lr=1e-3 * (g + 1), grad_norm=0.5 + g, now=1.0 + g
        )
    assert log.board is not None  # open until the run ends: the last step's validation pass still writes
    log.record_eval({"step": 3, "loss": 2.5, "perplexity": 12.18, "tokens": 40, "seconds": 0.1})
    log.close()
    assert log.board is None
    curves = scalars(tmp_path / "tensorboard")
    assert set(curves) == set(TAGS)
    assert curves["eval/loss"] == [(3, pytest.approx(2.5))]
    assert [s for s, _ in curves["train/loss"]] == [1, 2, 3]
    assert [v for _, v in curves["train/loss"]] == pytest.approx([2.0, 4.0, 6.0])  # (2 x sum) / (2 x tokens)
    assert [v for _, v in curves["train/lr"]] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert [v for _, v in curves["train/grad_norm"]] == pytest.approx([0.5, 1.5, 2.5])
    assert [v for _, v in curves["train/tokens_per_s"]] == pytest.approx([200.0] * 3)  # 200 tokens / slowest 1 s
    assert [v for _, v in curves["train/data_wait_s"]] == pytest.approx([0.02] * 3)  # the longest wait


def test_resume_hides_the_steps_a_killed_attempt_logged_past_its_checkpoint(tmp_path):
    first = step_log(tmp_path)
    for g in range(3):  # killed after step 3; its last checkpoint was step 1
        first.record(g, 0, 0, 4, gathered(1.0, 1, 10, 1.0, 0.0), lr=0.1, grad_norm=1.0, now=0.0)
    first.board.flush()
    again = step_log(tmp_path)
    for g in range(1, 4):
        again.record(g, 0, 1, 4, gathered(9.0, 1, 10, 1.0, 0.0), lr=0.1, grad_norm=1.0, now=0.0)
    again.close()  # the writer queues events on a thread: read only what it has written out
    loss = scalars(tmp_path / "tensorboard")["train/loss"]
    assert loss == [(1, pytest.approx(1.0)), (2, pytest.approx(9.0)), (3, pytest.approx(9.0)), (4, pytest.approx(9.0))]


def test_off_and_other_ranks_write_nothing(tmp_path):
    off = step_log(tmp_path / "off", tensorboard=False)
    other = step_log(tmp_path / "rank1", rank0=False)
    for log in (off, other):
        log.record(0, 0, 0, 1, gathered(1.0, 1, 10, 1.0, 0.0), lr=0.1, grad_norm=1.0, now=0.0)
    assert not (tmp_path / "off" / "tensorboard").exists()
    assert not (tmp_path / "rank1").exists()


def test_missing_package_is_one_warning_line_and_training_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    log = step_log(tmp_path)
    for g in range(2):
        log.record(g, 0, 0, 2, gathered(1.0, 1, 10, 1.0, 0.0), lr=0.1, grad_norm=1.0, now=0.0)
    err = [line for line in capsys.readouterr().err.splitlines() if "tensorboard" in line]
    assert len(err) == 1 and "WARNING" in err[0] and "train.tensorboard: false" in err[0]
    assert len(log.metrics.rows) == 4 and not (tmp_path / "tensorboard").exists()


@pytest.mark.slow
def test_a_real_cpu_run_writes_its_curves_under_the_run_folder(tmp_path):

    lengths = np.random.default_rng(5).integers(10, 64, 40).tolist()
    make_run(tmp_path, lengths, gpus=2, validation_fraction=0.2)  # validation after the last step: eval/*
    out = tmp_path / "out"
    run_train(tmp_path, 2, out)
    curves = scalars(out / "tensorboard")
    assert set(curves) == set(TAGS)
    assert [s for s, _ in curves["eval/loss"]] == [max(s for s, _ in curves["train/loss"])]
    steps = [s for s, _ in curves["train/loss"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 2
    assert all(v > 0 for _, v in curves["train/tokens_per_s"])
