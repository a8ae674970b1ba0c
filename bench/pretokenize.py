"""Pretokenize throughput: wattgate's `pretokenize()` vs a `datasets.load_dataset` + `.map` pipeline.

Both sides start from the same JSONL file and the same tokenizer folder and
must produce the same token ids for every document (checked). The baseline is
the usual recipe with `datasets` defaults: `load_dataset("json")` into a fresh
cache dir (Arrow cache on disk, as `datasets` does by default), then a batched
`.map` (1000 rows, one process) that writes its own cache file;
`load_from_cache_file=False` and the fresh cache dir keep reruns honest. Ours
is the full stage call: read JSONL, tokenize, write zstd Parquet shards and the
manifest (including its sha256 of inputs and tokenizer). Both timings include
loading the tokenizer.

    python bench/pretokenize.py [--quick] [--smoke] [--repeat N]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchlib import Parser, figure, positive_int  # noqa: E402
from wattgate.config import run_config, validate_config  # noqa: E402
from wattgate.data.demo_corpus import generate  # noqa: E402
from wattgate.data.pretokenize import pretokenize  # noqa: E402
from wattgate.data.tokenizer import load_tokenizer, save_hf_tokenizer, train_bpe  # noqa: E402

TEXT_BYTES = 20_000_000
CHAT_DOCS = 55_000  # ~280 bytes each: ~15 MB
TEXT_VOCAB, CHAT_VOCAB = 8192, 2048  # chat: the embedded default's vocabulary
TARGETS = {"text": 1.3, "chat": 1.3}  # ours / baseline tokens per second, chat as well as text
SMOKE_TEXT_BYTES, SMOKE_CHAT_DOCS = 200_000, 400

# ---------------------------------------------------------------- corpora


def make_vocabulary(rng: np.random.Generator, size: int) -> np.ndarray:
    """English-looking words: 1-4 syllables of consonant clusters and vowels, deduplicated."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "w", "br", "ch", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai"]
    codas = ["", "", "n", "r", "s", "t", "nd", "ng", "ll", "st"]
    words: dict[str, None] = {}
    while len(words) < size:
        syllables = int(rng.choice([1, 2, 3, 4], p=[0.35, 0.35, 0.2, 0.1]))
        words["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))] = None
    return np.array(list(words))


def make_text_docs(target_bytes: int, seed: int) -> list[str]:
    """Zipf-distributed words with punctuation; lognormal (heavy-tailed) document lengths in words."""
    rng = np.random.default_rng(seed)
    vocab = make_vocabulary(rng, 4000)
    freq = 1.0 / np.arange(1, len(vocab) + 1) ** 1.1
    n_words = target_bytes // 9  # ~9 bytes of JSONL per word (letters, punctuation, space)
    words = vocab[rng.choice(len(vocab), size=n_words, p=freq / freq.sum())]
    suffix = rng.choice(np.array(["", ",", ".", ".\n\n"]), size=n_words, p=[0.86, 0.06, 0.07, 0.01])
    tokens = np.char.add(words, suffix).tolist()
    lengths = np.clip(rng.lognormal(mean=5.0, sigma=1.0, size=n_words // 20), 5, 50_000).astype(np.int64)
    ends = np.cumsum(lengths)
    ends = ends[ends < n_words]
    starts = np.concatenate(([0], ends[:-1]))
    return [" ".join(tokens[s:e]).capitalize() for s, e in zip(starts.tolist(), ends.tolist())]


def write_jsonl(path: Path, rows: list[dict]) -> int:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path.stat().st_size


def make_tokenizer(texts, vocab_size: int, out: Path) -> Path:
    save_hf_tokenizer(train_bpe(texts, vocab_size=vocab_size, min_frequency=2), out)
    return out


# ---------------------------------------------------------------- the two pipelines


def run_ours(corpus: Path, tokenizer_dir: Path, out: Path) -> dict:
    config = validate_config(
        {
            "data": {"inputs": [str(corpus)]},
            # nothing may be cut or dropped, so both sides see every token
            "pretokenize": {"max_tokens": 1_000_000, "overlong": "truncate", "loss_on": "assistant"},
        }
    )
    return pretokenize(run_config(config), tokenizer_dir, out, progress=False)


def text_batch(tok):
    eos = tok.eos_token_id

    def fn(batch):
        enc = tok(batch["text"])
        # our text path ends every document with EOS (pretokenize.append_eos: true, the default)
        return {
            "input_ids": [ids + [eos] for ids in enc["input_ids"]],
            "attention_mask": [m + [1] for m in enc["attention_mask"]],
        }

    return fn


def chat_batch(tok):
    def fn(batch):
        texts = [tok.apply_chat_template(m, tokenize=False) for m in batch["messages"]]
        return tok(texts, add_special_tokens=False)

    return fn


def run_baseline(kind: str, corpus: Path, tokenizer_dir: Path, cache_dir: Path):
    tok = load_tokenizer(tokenizer_dir)
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache_dir))
    fn = text_batch(tok) if kind == "text" else chat_batch(tok)
    return ds.map(fn, batched=True, remove_columns=ds.column_names, load_from_cache_file=False)


# ---------------------------------------------------------------- checks and timing


def flat_ids(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, concatenated values) of a list column."""
    arr = column.combine_chunks()
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    return lengths, pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64)


def ours_ids(out: Path, manifest) -> tuple[np.ndarray, np.ndarray]:
    """Our token ids, shard by shard as the stage's Manifest lists them."""
    tables = [pq.read_table(out / name, columns=["input_ids"]) for name in manifest.shards]
    return flat_ids(pa.concat_tables(tables).column("input_ids"))


def first_mismatch(ours, theirs, tok) -> str:
    """A precise description of the first document whose ids differ."""
    (lo, vo), (lt, vt) = ours, theirs
    if len(lo) != len(lt):
        return f"document counts differ: ours {len(lo)}, baseline {len(lt)}"
    so, st = np.concatenate(([0], np.cumsum(lo))), np.concatenate(([0], np.cumsum(lt)))
    for d in range(len(lo)):
        a, b = vo[so[d] : so[d + 1]], vt[st[d] : st[d + 1]]
        if len(a) != len(b) or not np.array_equal(a, b):
            k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            window = slice(max(0, k - 3), k + 4)
            return (
                f"doc {d}: {len(a)} vs {len(b)} tokens, first difference at position {k}: "
                f"ours {a[window].tolist()} {tok.convert_ids_to_tokens(a[window].tolist())!r} vs "
                f"baseline {b[window].tolist()} {tok.convert_ids_to_tokens(b[window].tolist())!r}"
            )
    return "no difference"


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def compare(kind: str, corpus: Path, tokenizer_dir: Path, work: Path, repeat: int) -> dict:
    """Best of `repeat` runs of each side (each into fresh output and cache dirs), ids checked equal."""
    t_ours, t_base = [], []
    for i in range(repeat):
        manifest, t = timed(run_ours, corpus, tokenizer_dir, work / f"ours-{kind}-{i}")
        t_ours.append(t)
        mapped, t = timed(run_baseline, kind, corpus, tokenizer_dir, work / f"hf-cache-{kind}-{i}")
        t_base.append(t)
    ours = ours_ids(work / f"ours-{kind}-0", manifest)
    theirs = flat_ids(mapped.data.column("input_ids"))
    same = len(ours[0]) == len(theirs[0]) and np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    mismatch = None if same else first_mismatch(ours, theirs, load_tokenizer(tokenizer_dir))
    return {
        "kind": kind,
        "bytes": corpus.stat().st_size,
        "docs": manifest.num_docs,
        "rows": mapped.num_rows,
        "tokens": int(ours[0].sum()),
        "dropped": manifest.dropped,
        "t_ours": min(t_ours),
        "t_base": min(t_base),
        "mismatch": mismatch,
    }


def report(r: dict) -> None:
    ours, base = r["tokens"] / r["t_ours"], r["tokens"] / r["t_base"]
    ratio, target = ours / base, TARGETS[r["kind"]]
    print(
        f"== {r['kind']}: {r['bytes'] / 1e6:.1f} MB JSONL, {r['docs']:,} docs (baseline rows {r['rows']:,}), "
        f"{r['tokens']:,} tokens, dropped {r['dropped'] or 'none'}"
    )
    print(f"  datasets load_dataset+map  {r['t_base']:7.2f} s  {base:12,.0f} tokens/s")
    print(f"  wattgate pretokenize()     {r['t_ours']:7.2f} s  {ours:12,.0f} tokens/s")
    print(f"  ratio ours/baseline {ratio:.2f}x  target >= {target}x  {'PASS' if ratio >= target else 'FAIL'}")
    print(f"  ids identical to baseline: {'yes' if r['mismatch'] is None else 'NO: ' + r['mismatch']}")
    figure(
        "pretokenize",
        f"{r['kind']}, {r['tokens']:,} tokens, pretokenize() tokens/s",
        f"{ours:,.0f} tokens/s, {ratio:.2f}x the baseline (target >= {target}x)",
        f"datasets load_dataset + map {base:,.0f} tokens/s",
    )


def warm_up(work: Path, text_tok: Path, chat_tok: Path) -> None:
    """Tiny runs of both sides, so one-time setup (imports, template compilation) is timed on neither."""
    corpora = {"text": [{"text": "Warm up the tokenizer."}] * 50, "chat": generate(50, seed=1, max_turns=4)}
    for kind, tok_dir in (("text", text_tok), ("chat", chat_tok)):
        path = work / f"warm-{kind}.jsonl"
        write_jsonl(path, corpora[kind])
        run_ours(path, tok_dir, work / f"warm-ours-{kind}")
        run_baseline(kind, path, tok_dir, work / f"warm-cache-{kind}")


def main() -> None:
    smoke = f"{SMOKE_TEXT_BYTES:,} bytes of text, {SMOKE_CHAT_DOCS} chats"
    parser = Parser(description=__doc__.splitlines()[0], smoke=smoke)
    parser.add_argument("--quick", action="store_true", help="a short run: ~2 MB of each corpus")
    parser.add_argument("--repeat", type=positive_int, default=1, help="runs per side; the fastest counts")
    args = parser.parse_args()
    text_bytes, chat_docs = (
        (SMOKE_TEXT_BYTES, SMOKE_CHAT_DOCS) if args.smoke else (TEXT_BYTES // 10, CHAT_DOCS // 10) if args.quick
        else (TEXT_BYTES, CHAT_DOCS)
    )  # fmt: skip
    datasets.disable_progress_bars()

    with tempfile.TemporaryDirectory(prefix="wattgate-bench-") as tmp:
        work = Path(tmp)
        texts = make_text_docs(text_bytes, seed=0)
        chats = generate(chat_docs, seed=0, max_turns=24)
        write_jsonl(work / "text.jsonl", [{"text": t} for t in texts])
        write_jsonl(work / "chat.jsonl", chats)
        text_tok = make_tokenizer(texts, TEXT_VOCAB, work / "tok-text")
        chat_tok = make_tokenizer(
            (m["role"] + "\n" + m["content"] for c in chats for m in c["messages"]), CHAT_VOCAB, work / "tok-chat"
        )
        warm_up(work, text_tok, chat_tok)
        for kind, tok_dir in (("text", text_tok), ("chat", chat_tok)):
            report(compare(kind, work / f"{kind}.jsonl", tok_dir, work, args.repeat))


if __name__ == "__main__":
    main()
