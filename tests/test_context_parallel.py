"""Context parallelism's core (src/wattgate/train/context_parallel.py): head-tail sharding of packed rows, attention
exact within documents over a context group, and a loss whose shards sum to the whole rows'.

The head-tail split, the shards' targets and the attention of a group of one are checked in this process; the
gathered attention on real processes (tests/dist/context_parallel.py: 4 gloo ranks, C = 2 and C = 4, three dense
families) against one rank holding the rows, for the summed loss and every parameter's gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wattgate.errors import InputError, first_line
from wattgate.train.context_parallel import (
    ContextAttention,
    context_loss_sum,
    context_sdpa_attention,
    head_tail_indices,
    shard_rows,
    use_context_attention,
)
from wattgate.train.data import IGNORE
from wattgate.train.loss import forward_logits, loss_sum, shifted_targets

from support.architectures import tiny_config

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen3", "llama", "gemma3_text")  # tests/dist/context_parallel.py's
# fp32 sums of ~6,000 token losses (~6e4) differ by the order of additions: 2 ulp (1.3e-7 relative) measured
LOSS_RTOL = 1e-6
# each parameter's largest gradient difference against its own largest gradient: at most 6.2e-6 measured
GRAD_RTOL = 1e-4


# ---------------------------------------------------------------- head-tail sharding


@pytest.mark.parametrize("seq_len, context", [(8, 1), (16, 2), (24, 3), (4096, 4)])
def test_head_tail_indices_cover_the_row_once_over_the_context_ranks(seq_len, context):
    held = torch.cat([head_tail_indices(seq_len, context, r) for r in range(context)])
    assert held.numel() == seq_len
    assert torch.equal(held.sort().values, torch.arange(seq_len))


def test_head_tail_rank_holds_chunk_r_and_chunk_2c_minus_1_minus_r():
    assert head_tail_indices(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("seq_len, context", [(16, 2), (48, 3), (4096, 4), (4096, 8)])
def test_head_tail_gives_every_rank_the_same_causal_work_on_a_row_long_document(seq_len, context):
    # one document: query q attends to q + 1 keys
    pairs = [int((head_tail_indices(seq_len, context, r) + 1).sum()) for r in range(context)]
    assert len(set(pairs)) == 1
    assert pairs[0] * context == seq_len * (seq_len + 1) // 2


@pytest.mark.parametrize("seq_len, context", [(100, 4), (6, 2), (10, 0)])
def test_a_row_that_does_not_split_into_2c_chunks_is_a_one_line_error_naming_parallel_context(seq_len, context):
    with pytest.raises(InputError) as caught:
        head_tail_indices(seq_len, context, 0)
    message = str(caught.value)
    assert message.startswith("parallel.context:") and first_line(caught.value) == message


# ---------------------------------------------------------------- a shard's tensors


def packed_rows(seq_len: int, lengths: list[list[int]], vocab: int = 600, seed: int = 0) -> dict[str, torch.Tensor]:
    """[len(lengths), seq_len] rows as build_batch lays them out: documents, then a padding block (no loss,
    positions counting on from 0); each document's first label IGNORE."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), seq_len), generator=g)
    labels = ids.clone()
    positions = torch.zeros_like(ids)
    for row, docs in enumerate(lengths):
        start = 0
        for n in docs:
            positions[row, start : start + n] = torch.arange(n)
            labels[row, start] = IGNORE
            start += n
        positions[row, start:] = torch.arange(seq_len - start)
        labels[row, start:] = IGNORE
        ids[row, start:] = 0
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def test_shards_carry_each_positions_next_label_so_no_target_is_lost_at_a_chunk_boundary():
    batch = packed_rows(32, [[5, 1, 20, 6], [3, 9, 4]])  # row 1: its last 16 tokens (C = 2's last chunk) padding
    targets = shifted_targets(batch["labels"])
    for context in (1, 2, 4):
        shards = [shard_rows(batch, context, r) for r in range(context)]
        for shard in shards:
            assert torch.equal(shard["targets"], targets[:, shard["query_index"]])
            assert torch.equal(shard["input_ids"], batch["input_ids"][:, shard["query_index"]])
            assert torch.equal(shard["position_ids"], batch["position_ids"][:, shard["query_index"]])
        tokens = sum(int((s["targets"] != IGNORE).sum()) for s in shards)
        assert tokens == int((batch["labels"][:, 1:] != IGNORE).sum())
    # the document numbers restart where positions do; padding is a document of its own
    assert shard_rows(batch, 2, 0)["doc_ids"][1].unique_consecutive().numel() == 4


# ---------------------------------------------------------------- the attention, one process


def tiny_model(family: str, seq_len: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(tiny_config(family, layers=2), max_position_embeddings=seq_len)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("family", FAMILIES)
def test_context_attention_of_a_group_of_one_equals_transformers_sdpa_on_packed_rows(family):
    batch = packed_rows(64, [[30, 2, 1, 31], [20, 25]])
    model = tiny_model(family, 64)
    with torch.no_grad():
        expected = float(loss_sum(forward_logits(model, batch), batch["labels"]))
        use_context_attention(model)
        got = float(context_loss_sum(model, shard_rows(batch, 1, 0), None))
    assert got == pytest.approx(expected, rel=LOSS_RTOL)


def test_a_model_still_on_its_own_attention_is_refused():
    batch = packed_rows(16, [[16]])
    with pytest.raises(InputError, match="parallel.context: .*'sdpa'"):
        context_loss_sum(tiny_model("llama", 16), shard_rows(batch, 2, 0), None)


def test_an_attention_feature_it_does_not_implement_is_refused_not_ignored():
    q = torch.zeros(1, 1, 4, 8)
    index = torch.arange(4)
    ctx = ContextAttention(None, index, index, torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(InputError, match="softcap"):
        context_sdpa_attention(torch.nn.Module(), q, q, q, None, softcap=50.0, wattgate_context=ctx)
    with pytest.raises(InputError, match="without its context"):
        context_sdpa_attention(torch.nn.Module(), q, q, q, None)


# ---------------------------------------------------------------- real processes: C = 2 and C = 4 on 4 gloo ranks


@pytest.fixture(scope="module")
def context_report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("context") / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(REPO / "tests/dist/context_parallel.py"), str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("context", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_context_shards_losses_sum_to_the_whole_rows_loss(context_report, family, context):
    entry = context_report["families"][family]
    assert entry["loss_tokens"] > 0
    assert entry[str(context)]["loss_diff"] <= LOSS_RTOL * abs(entry["loss"])


@pytest.mark.parametrize("context", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_context_groups_summed_gradients_equal_the_whole_rows_for_every_parameter(context_report, family, context):
    assert context_report["families"][family][str(context)]["grad_max_rel_diff"] <= GRAD_RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_documents_seeing_each_other_would_move_the_loss_far_beyond_the_tolerance(context_report, family):
    entry = context_report["families"][family]
    assert entry["leak_loss_diff"] > 100 * LOSS_RTOL * abs(entry["loss"])
