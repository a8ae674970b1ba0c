"""Records to (ids, loss_mask) arrays: the chat template, the tokenizer and the loss mask, batch by batch.

`encoded_batches` keeps input order whatever runs where. Small inputs are encoded on one thread beside the
reader (the tokenizer is Rust and releases the GIL). Large ones go to worker processes, one per usable core:
a chat record's template rendering and loss-mask spans are Python, and on one interpreter they held chat data
at about 1.1x a `datasets.map` pipeline (bench/pretokenize.py). A worker reports a record its template refuses
as (where, why), and the reading process applies the bad-record policy in input order, so counts, the first
error named and the output bytes are the same as on one thread.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wattgate.data.chat import ChatRenderer, TemplateError
from wattgate.data.records import (
    BadRecord,
    BadRecordPolicy,
    CorpusRecord,
    Fields,
    chat_order_notes,
    parse_raw,
    raw_records,
)
from wattgate.data.tokenizer import load_tokenizer
from wattgate.errors import InputError, StageFailed
from wattgate.forking import MAX_WORKERS, fork_allowed, usable_cores

# Worker processes start (Python, transformers, the tokenizer) in about a second each: below this much input
# the single-thread pipeline finishes first.
WORKER_MIN_INPUT_BYTES = 8 << 20
PARALLELISM = "TOKENIZERS_PARALLELISM"
TEMPLATE_ERROR = "template_error"  # the bad-record reason of a chat the template refuses


def spans_to_mask(encoding, n: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose first character lies in an assistant span, else 0."""
    mask = np.zeros(n, dtype=np.int8)
    for start, end in spans:
        first = _first_token_at_or_after(encoding, start, end)
        if first is None:
            continue
        last = encoding.char_to_token(end - 1)
        while last is None and end - 1 > start:
            end -= 1
            last = encoding.char_to_token(end - 1)
        if last is not None and last >= first:
            mask[first : last + 1] = 1
    return mask


def _first_token_at_or_after(encoding, start: int, end: int) -> int | None:
    for pos in range(start, end):
        tok = encoding.char_to_token(pos)
        if tok is None:
            continue
        # a token that began before the span belongs to the prompt
        return tok if encoding.token_to_chars(tok)[0] >= start else tok + 1
    return None


@dataclass
class EncodedBatch:
    """One batch's documents in input order, its bad records (parse or template) and irregular chats."""

    records: int
    docs: list[tuple[np.ndarray, np.ndarray]]
    bad: list[tuple[int, str, str, str]] = field(default_factory=list)  # (position in batch, where, reason, detail)
    notes: Counter = field(default_factory=Counter)  # chat_order_notes
    chats_rendered: int = 0


class Tokenize:
    """Turns batches of records into (ids, loss_mask) arrays with one tokenizer. Pure per batch (`encode`),
    so it runs the same on a thread or in a worker process; `account` applies a batch's template failures to
    the bad-record policy in the reading process."""

    def __init__(self, tokenizer, fields: Fields, loss_on: str, append_eos: bool, source: str):
        self.tok = tokenizer
        self.fields = fields
        self.backend = tokenizer.backend_tokenizer
        self.loss_on = loss_on
        self.eos_id = tokenizer.eos_token_id if append_eos else None
        if append_eos and self.eos_id is None:
            raise InputError(f"{source}: tokenizer has no eos_token; set pretokenize.append_eos: false")
        self.chat = None
        self.source = source
        self.chats_rendered = 0
        self.template_failed = 0
        self.first_template_failure: tuple[str, str] | None = None  # (where, why)

    def _chat(self) -> ChatRenderer:
        if self.chat is None:
            self.chat = ChatRenderer(self.tok, self.source)
        return self.chat

    def encode(self, raw: list[tuple[str, Any]]) -> EncodedBatch:
        """The batch's documents: texts as they are, chats rendered by the template with their assistant spans."""
        runs, batch = self.prepare(raw)
        return self.finish(runs, self.encodings(runs), batch)

    def prepare(self, raw: list[tuple[str, Any]]) -> tuple[list, EncodedBatch]:
        """Parse a batch of raw records (`raw_records`) and group them in runs of text and chat records, in
        input order, each as what the tokenizer encodes: texts as they are, chats rendered by the template."""
        batch, records = EncodedBatch(records=len(raw), docs=[]), []
        for i, (where, item) in enumerate(raw):
            try:
                record = parse_raw(item, self.fields, where)
            except BadRecord as bad:
                batch.bad.append((i, where, bad.reason, bad.detail))
                continue
            if record is None:
                continue
            if record.messages is not None:
                batch.notes.update(chat_order_notes(record.messages))
            records.append((i, record))
        runs = []
        for is_chat, group in itertools.groupby(records, key=lambda r: r[1].messages is not None):
            group = list(group)
            runs.append((is_chat, self._render(group, batch) if is_chat else [r.text for _, r in group]))
        return runs, batch

    def encodings(self, runs: list) -> list:
        """The tokenizer's encodings of each run (Rust, without the GIL)."""
        return [
            self.backend.encode_batch([text for text, _ in items], add_special_tokens=False)
            if is_chat
            else self.backend.encode_batch_fast(items, add_special_tokens=True)
            for is_chat, items in runs
        ]

    def finish(self, runs: list, encodings: list, batch: EncodedBatch) -> EncodedBatch:
        for (is_chat, items), encs in zip(runs, encodings):
            if is_chat:
                batch.docs += [self._chat_doc(enc, spans) for enc, (_, spans) in zip(encs, items)]
            else:
                batch.docs += [self._text_doc(enc.ids) for enc in encs]
        return batch

    def account(self, batch: EncodedBatch, policy: BadRecordPolicy) -> None:
        """Count the batch's renderings and irregular chats, and hand its bad records to `policy` in input order
        (which may stop the stage at the first)."""
        self.chats_rendered += batch.chats_rendered
        policy.noted.update(batch.notes)
        for _, where, reason, detail in sorted(batch.bad):
            if reason == TEMPLATE_ERROR:
                self.template_failed += 1
                self.first_template_failure = self.first_template_failure or (where, detail)
                detail = f"chat template failed: {detail}"
            policy.handle(where, BadRecord(reason, detail))

    def _chat_doc(self, enc, spans) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = np.ones(len(ids), dtype=np.int8) if self.loss_on == "all" else spans_to_mask(enc, len(ids), spans)
        return ids, mask

    def _text_doc(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if self.eos_id is not None:
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=np.int8)

    def _render(self, records: list[tuple[int, CorpusRecord]], batch: EncodedBatch) -> list:
        chat = self._chat()
        rendered = []
        for i, r in records:
            assert r.messages is not None  # prepare hands only chat records here
            try:
                rendered.append(chat.render(r.messages))
            except TemplateError as exc:
                batch.bad.append((i, r.where, TEMPLATE_ERROR, str(exc)))
                continue
            batch.chats_rendered += 1
        return rendered

    def check_template_rendered_any(self) -> None:
        """A template that fails on every chat record is broken or does not fit the corpus: dropping them all
        as bad records (on_bad_record: skip) would lose every chat silently, so the stage stops."""
        if self.template_failed and not self.chats_rendered:
            assert self.first_template_failure is not None  # account keeps the first whenever it counts one
            where, why = self.first_template_failure
            raise InputError(
                f"{self._chat().template_file}: the chat template failed on all {self.template_failed} chat "
                f"records (first, {where}: {why}); fix the template or use a tokenizer whose template fits this "
                "corpus"
            )


# ---------------------------------------------------------------- worker processes

_worker_tokenize: Tokenize | None = None


def _start_worker(tokenizer_dir: str, fields: Fields, loss_on: str, append_eos: bool) -> None:
    global _worker_tokenize
    _worker_tokenize = Tokenize(load_tokenizer(tokenizer_dir), fields, loss_on, append_eos, tokenizer_dir)


def _encode_in_worker(raw: list[tuple[str, Any]]) -> EncodedBatch:
    assert _worker_tokenize is not None  # the pool's initializer, _start_worker, sets it
    return _worker_tokenize.encode(raw)


def encode_workers(paths: Iterable[str | Path], fields: Fields) -> int:
    """Worker processes for these inputs: one per usable core for a large chat corpus, else 0 (one thread beside
    the reader). Text needs none: its encoding is all the tokenizer's, which already uses every core from the
    thread, and workers would only add the copying of batches (1.32x `datasets.map` with them, 1.57x without)."""
    if sys.platform != "linux" or not fork_allowed():  # workers are forked (wattgate.forking)
        return 0
    files = [Path(p) for p in paths]
    cores = min(usable_cores(), MAX_WORKERS)
    size = sum(p.stat().st_size for p in files if p.is_file())
    if cores < 2 or size < WORKER_MIN_INPUT_BYTES or not any(_starts_with_chat(p, fields) for p in files):
        return 0
    return cores


def _starts_with_chat(path: Path, fields: Fields, looked_at: int = 16) -> bool:
    """Whether the first good record among the first few of `path` is a chat (a missing or unreadable input is
    the reader's to name)."""
    try:
        for where, raw in itertools.islice(raw_records([path], fields), looked_at):
            try:
                record = parse_raw(raw, fields, where)
            except BadRecord:
                continue
            if record is not None:
                return record.messages is not None
    except InputError:
        pass
    return False


def _start_workers(workers: int, tokenizer_dir: str | Path, tokenize: Tokenize) -> ProcessPoolExecutor:
    """`workers` forked processes, started now, before the stage's own threads (the progress bar's; see
    wattgate.forking). A fork copies the loaded modules, where a fresh interpreter spent 2.5 s importing them (as
    `datasets` forks for `map(num_proc=...)`). TOKENIZERS_PARALLELISM=false as they fork: each is one core's
    worker, and the tokenizer's thread pool does not survive a fork."""
    executor = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_start_worker,
        initargs=(str(tokenizer_dir), tokenize.fields, tokenize.loss_on, tokenize.eos_id is not None),
    )
    before = os.environ.get(PARALLELISM)
    os.environ[PARALLELISM] = "false"
    try:
        executor.submit(int).result()  # a fork start method forks every worker at the first submit
    finally:
        if before is None:
            del os.environ[PARALLELISM]
        else:
            os.environ[PARALLELISM] = before
    return executor


@dataclass
class _ThreadJob:
    tokenize: Tokenize
    runs: list
    batch: EncodedBatch
    encodings: Future

    def result(self) -> EncodedBatch:
        return self.tokenize.finish(self.runs, self.encodings.result(), self.batch)


class EncodePool:
    """Where batches are encoded: one thread beside the reader, or `workers` processes (started once per stage,
    each loading the tokenizer from its folder)."""

    def __init__(self, tokenize: Tokenize, tokenizer_dir: str | Path, workers: int):
        self.tokenize = tokenize
        self.workers = workers
        if workers:
            self.executor: Executor = _start_workers(workers, tokenizer_dir, tokenize)
        else:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wattgate-encode")

    def submit(self, raw: list[tuple[str, Any]]) -> Future | _ThreadJob:
        """Start encoding a batch; `.result()` is its EncodedBatch. On one thread only the tokenizer's part
        runs beside the reader: the Python parts stay on the reading thread, which holds the GIL anyway."""
        if self.workers:
            return self.executor.submit(_encode_in_worker, raw)
        runs, batch = self.tokenize.prepare(raw)
        return _ThreadJob(self.tokenize, runs, batch, self.executor.submit(self.tokenize.encodings, runs))

    @staticmethod
    def result(job: Future | _ThreadJob) -> EncodedBatch:
        """The batch, or one line when a worker died (the OS killed it, most often for memory)."""
        try:
            return job.result()
        except BrokenProcessPool:
            raise StageFailed(
                "pretokenize: an encode worker process ended abruptly (killed by the OS, most often out of memory); "
                "give the job more memory, or fewer cores so fewer workers run"
            ) from None

    def in_flight(self) -> int:
        """Batches kept in flight: each worker busy and one more queued, so none waits on the reader."""
        return 2 * self.workers if self.workers else 1

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _batched(it, n: int):
    it = iter(it)
    while batch := list(itertools.islice(it, n)):
        yield batch


def encoded_batches(raw: Iterator[tuple[str, Any]], pool: EncodePool, batch_size: int) -> Iterator[EncodedBatch]:
    """The encoded batches of `raw` records (`raw_records`), in input order, with up to `pool.in_flight()`
    batches being encoded while the next are read. An unreadable input the reader stops at comes after every
    batch before it: those are finished first, so a bad record in them is named before it."""
    pending: list[Future | _ThreadJob] = []
    batches = _batched(raw, batch_size)
    while True:
        try:
            batch = next(batches, None)
        except InputError:
            for job in pending:
                yield pool.result(job)
            raise
        if batch is not None:
            pending.append(pool.submit(batch))
        if pending and (batch is None or len(pending) > pool.in_flight()):
            yield pool.result(pending.pop(0))
        if batch is None and not pending:
            return
