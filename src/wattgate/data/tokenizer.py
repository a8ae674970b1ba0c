"""Byte-level BPE training and offline tokenizer loading.

The embedded default trains a small tokenizer on the corpus; real configs point
`tokenizer.path` at a local model directory (e.g. a Qwen3 checkout). Both are
loaded the same way: `AutoTokenizer.from_pretrained(dir)` with the hub off.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from wattgate.artifacts import atomic_dir
from wattgate.config import input_paths
from wattgate.data.records import BadRecordPolicy, Fields, read_records
from wattgate.errors import InputError
from wattgate.records.run_config import RunConfig

PAD_TOKEN = "<|endoftext|>"
BOS_TURN = "<|im_start|>"
EOS_TURN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TURN, EOS_TURN]

# ChatML, as Qwen uses it. The {% generation %} markers let transformers'
# `return_assistant_tokens_mask` (and TRL's assistant_only_loss) see the same
# assistant spans that pretokenize marks in loss_mask.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{%- else -%}{{- message['content'] + '<|im_end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _offline() -> None:
    # Never reach for a hub: tokenizers and models come from local folders only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int):
    """Train a byte-level BPE tokenizer (digits split one by one, as Qwen does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out: str | Path) -> None:
    """Save as a Hugging Face tokenizer folder (tokenizer.json, config, chat template)."""
    _offline()
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TURN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[BOS_TURN],
        model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    with atomic_dir(out) as tmp:
        hf.save_pretrained(str(tmp))


def load_tokenizer(path: str | Path):
    """Load a tokenizer from a local folder, never from a hub."""
    _offline()
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: tokenizer folder not found (set tokenizer.path, or null to train one)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{path}: cannot load tokenizer ({first})") from None
    if tok is None or getattr(tok, "backend_tokenizer", None) is None:
        raise InputError(f"{path}: tokenizer has no fast (Rust) backend; wattgate needs tokenizer.json")
    return tok


# Files that define a tokenizer; a model folder's weights are not among them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_sha256(path: str | Path) -> str:
    """Hash of the tokenizer's own files, so a multi-GB model folder is not read to hash it."""
    from wattgate.artifacts import sha256_tree

    files = sorted(p for p in Path(path).iterdir() if p.name in TOKENIZER_FILES)
    return sha256_tree(files)


def training_texts(records: Iterator) -> Iterator[str]:
    """Texts a tokenizer learns from: plain text, or each chat turn's role and content."""
    for rec in records:
        if rec.text is not None:
            yield rec.text
        else:
            for m in rec.messages:
                yield m["role"] + "\n" + m["content"]


# A trained vocab below this share of tokenizer.vocab_size means the corpus ran out of pairs to merge (a few
# percent short is normal for a small corpus with min_frequency > 1, and not worth a warning).
SHORT_VOCAB_FRACTION = 0.9


def train_tokenizer(config: RunConfig, out: str | Path, corpus: list[str | Path] | None = None):
    """The train-tokenizer stage: BPE on the corpus (`corpus`, else data.inputs), its records read and
    checked as pretokenize reads them; saved as a Hugging Face tokenizer folder. Returns the tokenizer.

    A corpus with no usable record is refused (a bytes-only tokenizer is no tokenizer); one too small to
    reach tokenizer.vocab_size gets a warning line, since the smaller vocab still works."""
    d, p, t = config.data, config.pretokenize, config.tokenizer
    paths, source = (corpus, "--corpus") if corpus else (input_paths(d), "data.inputs")
    policy = BadRecordPolicy(p.on_bad_record, Counter())
    fields = Fields(d.text_field, d.messages_field, max_chars=p.max_doc_chars)
    kept = Counter()
    records = _counted(read_records(paths, fields, policy, source), kept)
    tok = train_bpe(training_texts(records), t.vocab_size, t.min_frequency)
    named = f"{', '.join(map(str, paths))} ({source})"
    dropped = sum(policy.dropped.values())
    if not kept["records"]:
        why = f"{dropped} bad record(s) dropped: {dict(policy.dropped)}" if dropped else "no records in it"
        raise InputError(f"{named}: no document to train the tokenizer on ({why}); give it a corpus with text")
    if tok.get_vocab_size() < SHORT_VOCAB_FRACTION * t.vocab_size:
        print(
            f"train-tokenizer: warning: {named}: {kept['records']} record(s) give a vocab of only "
            f"{tok.get_vocab_size()}, not tokenizer.vocab_size {t.vocab_size}; train on a bigger corpus "
            "or lower tokenizer.vocab_size",
            file=sys.stderr,
        )
    save_hf_tokenizer(tok, out)
    return tok


def _counted(records: Iterator, counts: Counter) -> Iterator:
    for rec in records:
        counts["records"] += 1
        yield rec
