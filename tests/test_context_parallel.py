"""Context parallelism's core (src/wattgate/context_layout.py, src/wattgate/train/context_parallel.py): the split of
packed rows over a context group, attention exact within documents over the group with either kernel, and a loss
whose shards sum to the whole rows'.

The split, the shards' targets, the two kernels' agreement and the attention of a group of one are checked in this
process; the
gathered attention on real processes (tests/dist/context_parallel.py: 4 gloo ranks, C = 2 and C = 4, three dense
families) against one rank holding the rows, for the summed loss and every parameter's gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from wattgate import context_layout as layout
from wattgate.errors import InputError, first_line
from wattgate.train.context_parallel import (
    ContextAttention,
    context_loss_sum,
    context_attention,
    check_context_split,
    row_positions,
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


# ---------------------------------------------------------------- the split of a row over the context ranks


def random_rows(rng, count: int, seq_len: int, mean_log: float) -> list[list[int]]:
    """Rows of lognormal document lengths, some filled, some ending in padding."""
    rows = []
    for _ in range(count):
        docs, left = [], seq_len
        while left > 0 and rng.random() > 0.05:
            n = int(min(left, max(1, rng.lognormal(mean_log, 1.0))))
            docs.append(n)
            left -= n
        rows.append(docs)
    return rows


def brute_pairs(docs: list[int], seq_len: int, held: np.ndarray) -> int:
    """The causal within-document pairs of the queries at row positions `held` (padding a document of its own)."""
    keys = np.zeros(seq_len, dtype=np.int64)
    start = 0
    for n in [*docs, seq_len - sum(docs)]:
        keys[start : start + n] = np.arange(1, n + 1)
        start += n
    return int(keys[held].sum())


@pytest.mark.parametrize("seq_len, context", [(8, 1), (16, 2), (24, 3), (4096, 4), (4096, 8), (768, 3)])
def test_every_row_is_split_into_equal_shares_that_cover_it_once_each_in_row_order(seq_len, context):
    rows = random_rows(np.random.default_rng(seq_len + context), 40, seq_len, np.log(seq_len / 4))
    split = layout.split_rows(rows, seq_len, context)
    assert split.shape == (len(rows), context, seq_len // context)
    assert (np.sort(split.reshape(len(rows), -1), axis=1) == np.arange(seq_len)).all()
    assert (np.diff(split, axis=2) > 0).all()


@pytest.mark.parametrize("seq_len, context", [(16, 2), (48, 3), (4096, 4), (4096, 8), (65536, 8)])
def test_a_row_long_document_gives_every_context_rank_the_same_causal_work(seq_len, context):
    split = layout.split_rows([[seq_len]], seq_len, context)[0]
    pairs = [brute_pairs([seq_len], seq_len, split[r]) for r in range(context)]
    assert len(set(pairs)) == 1 and pairs[0] * context == seq_len * (seq_len + 1) // 2


@pytest.mark.parametrize("seq_len, context", [(1024, 2), (4096, 4), (4096, 8), (6144, 3)])
def test_the_per_row_split_counts_its_pairs_exactly_and_evens_them_out_better_than_head_tail(seq_len, context):
    rows = random_rows(np.random.default_rng(context), 300, seq_len, np.log(seq_len / 6))
    sizes = [np.asarray(r, dtype=np.int64) for r in rows]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    n = layout.chunk_count(seq_len, context)
    costs, chunks = layout.split_costs(np.concatenate(sizes), offsets, seq_len, context)
    loads = layout.rank_loads(costs, chunks)
    split = layout.positions_of(chunks, seq_len)
    for i in range(0, len(rows), 37):  # the pairs each rank is charged are the pairs its positions have
        assert loads[i].tolist() == [brute_pairs(rows[i], seq_len, split[i, r]) for r in range(context)]
    head_tail = layout.rank_loads(costs, layout.head_tail(len(rows), context, n))
    assert (loads.max(axis=1) <= head_tail.max(axis=1)).all()
    ratio = loads.max(axis=1).sum() / loads.mean(axis=1).sum()
    assert ratio < 1.03 < head_tail.max(axis=1).sum() / head_tail.mean(axis=1).sum(), ratio


def test_the_trainer_splits_rows_from_the_plan_as_from_the_rows_own_positions():
    rows = random_rows(np.random.default_rng(5), 12, 512, np.log(60))
    batch = packed_rows(512, rows)
    assert torch.equal(row_positions(batch, 4), torch.from_numpy(layout.split_rows(rows, 512, 4)))


@pytest.mark.parametrize("seq_len, context", [(100, 4), (6, 2), (10, 0)])
def test_a_row_that_does_not_split_into_2c_chunks_is_a_one_line_error_naming_parallel_context(seq_len, context):
    with pytest.raises(InputError) as caught:
        check_context_split(seq_len, context)
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
            index = shard["query_index"]
            assert torch.equal(shard["targets"], targets.gather(1, index))
            assert torch.equal(shard["input_ids"], batch["input_ids"].gather(1, index))
            assert torch.equal(shard["position_ids"], batch["position_ids"].gather(1, index))
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
    index = torch.arange(4).unsqueeze(0)
    ctx = ContextAttention(None, index, index, torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(InputError, match="softcap"):
        context_attention(torch.nn.Module(), q, q, q, None, softcap=50.0, wattgate_context=ctx)
    with pytest.raises(InputError, match="without its context"):
        context_attention(torch.nn.Module(), q, q, q, None)


# ---------------------------------------------------------------- flex attention (the CUDA kernel) against sdpa


@pytest.mark.filterwarnings("ignore::UserWarning")  # flex attention warns that it runs unfused on CPU
@pytest.mark.parametrize("window", [None, 7])
def test_flex_attention_attends_exactly_what_sdpa_attends_on_a_split_row(window):
    rows = [[40, 3, 1, 60], [128], [17, 90]]  # rows 0 and 2 end in padding
    batch = packed_rows(128, rows)
    split = row_positions(batch, 4)
    doc_ids = shard_rows(batch, 4, 0)["doc_ids"]
    g = torch.Generator().manual_seed(1)
    for rank in (0, 3):
        query_index, key_index = split[:, rank], split.flatten(1)
        q = torch.randn(3, 4, 32, 16, generator=g)
        k, v = torch.randn(3, 2, 128, 16, generator=g), torch.randn(3, 2, 128, 16, generator=g)
        outs = []
        for kernel in ("sdpa", "flex"):
            ctx = ContextAttention(None, query_index, key_index, doc_ids, kernel)
            # a group of one: the "gathered" keys are the row's, in the group's order (key_index)
            out = context_attention(torch.nn.Module(), q, k, v, None, sliding_window=window, wattgate_context=ctx)
            outs.append(out)
        assert outs[0][0].shape == outs[1][0].shape == (3, 32, 4, 16)
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_on_flex_context_attention_scores_the_rows_as_on_sdpa(family):
    batch = packed_rows(128, [[60, 2, 1, 65], [20, 25]])
    model = tiny_model(family, 128)
    use_context_attention(model)
    with torch.no_grad():
        shard = shard_rows(batch, 1, 0)
        sdpa, flex = (float(context_loss_sum(model, shard, None, kernel)) for kernel in ("sdpa", "flex"))
    assert flex == pytest.approx(sdpa, rel=LOSS_RTOL)


def test_the_trainer_runs_the_kernel_the_gate_planned_for_and_sdpa_where_flex_cannot_train(monkeypatch):
    from wattgate.context_layout import planned_context_kernel
    from wattgate.train import context_parallel

    for requested in ("auto", "sdpa", "eager", "flex_attention"):
        assert planned_context_kernel(requested, on_gpu=False) == ("flex" if requested == "flex_attention" else "sdpa")
    assert context_parallel.context_kernel("auto", "cpu") == "sdpa"
    with pytest.raises(InputError, match="flex_attention has no backward here"):
        context_parallel.context_kernel("flex_attention", "cpu")
    monkeypatch.setattr(context_parallel, "flex_attention_trainable", lambda device_type: device_type == "cuda")
    assert (
        [context_parallel.context_kernel(r, "cuda") for r in ("auto", "flex_attention", "sdpa")]
        == [planned_context_kernel(r, on_gpu=True) for r in ("auto", "flex_attention", "sdpa")]
        == ["flex", "flex", "sdpa"]
    )


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
