"""A run at parallel.expert 2 trains as at 1 (2 ranks on gloo, the tiny Qwen3-MoE), and a checkpoint saved at one
expert-parallel degree resumes at another (2 -> 1 and 1 -> 2): every step once over the data, the losses of the
uninterrupted run, and final/ the Hugging Face layout with the same tensors. Checkpoints hold the experts' logical
[experts, ...] tensors (DTensor placements), which torch.distributed.checkpoint reshards on load."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_resumed_as_straight, assert_trained_as, killed_after_first_checkpoint, make_run, run_train
from support.models import moe_config
from support.runs import with_sections

WORLD = 2
# EP 2 computes each expert's gradient on the rank holding it from the tokens the all-to-all brings, EP 1 on every
# rank from its own tokens, then reduce-scatters: the same sums in another order (fp32), which Adam magnifies where
# a second moment is tiny. A lost or repeated step moves parameters by about lr = 1e-2.
PARAM_TOLERANCE = 1e-4


def with_expert(tmp: Path, expert: int) -> None:
    with_sections(tmp, WORLD, model={"config": moe_config("qwen3_moe")}, parallel={"expert": expert})


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> tuple[Path, Path]:
    """The inputs and the uninterrupted training at EP 1: what each resume is compared with."""
    root = tmp_path_factory.mktemp("ep-straight")
    lengths = np.random.default_rng(5).integers(5, 60, 110).tolist()
    train = dict(grad_accum=1, epochs=1, checkpoint_every=3, export_dtype="float32")
    make_run(root, lengths, gpus=WORLD, validation_fraction=0.1, **train)
    with_expert(root, 1)
    straight = root / "straight"
    run_train(root, WORLD, straight)
    return root, straight


def own_copy(root: Path, tmp: Path) -> None:
    for name in ("pretokenized", f"plan-{WORLD}", f"config-{WORLD}.yaml"):  # the same inputs, the test's own copy
        (shutil.copytree if (root / name).is_dir() else shutil.copy)(root / name, tmp / name)


@pytest.mark.slow
def test_a_run_at_expert_degree_2_trains_as_at_1_and_its_final_folder_scores_as_reported(tmp_path, straight_run):
    """First-step losses and gradient norm, the validation loss after 8+ steps, and final/ scored by transformers
    (support/runs.py for the tolerances)."""
    root, straight = straight_run
    own_copy(root, tmp_path)
    with_expert(tmp_path, 2)
    run_train(tmp_path, WORLD, tmp_path / "ep2")
    print(assert_trained_as(tmp_path / "ep2", straight, tmp_path / "pretokenized"))
    assert json.loads((tmp_path / "ep2" / "TRAINED").read_text())["mesh"] == {"ep_shard": 1, "ep": 2}


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)])
def test_a_checkpoint_saved_at_one_expert_degree_resumes_at_the_other_every_step_once(
    tmp_path, straight_run, saved, resumed
):
    root, straight = straight_run
    own_copy(root, tmp_path)
    total = json.loads((straight / "TRAINED").read_text())["steps"]
    assert total >= 6

    out = tmp_path / "moved"
    with_expert(tmp_path, saved)
    killed_after_first_checkpoint(tmp_path, WORLD, out)
    with_expert(tmp_path, resumed)
    proc = run_train(tmp_path, WORLD, out)
    summary = json.loads((out / "TRAINED").read_text())
    assert 3 <= summary["resumed_from_step"] < total, proc.stdout
    # the data seen exactly once across the change of degree; final/ the Hugging Face layout whatever the degree
    final = assert_resumed_as_straight(out, straight, PARAM_TOLERANCE)
    assert any(".experts." in k for k in final)
