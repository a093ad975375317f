"""Subword tokens: a byte-level BPE trained on a corpus' training split (Hugging Face
`tokenizers`), kept in a cache folder and reused.

`bpe_corpus(corpus, vocab_size, cache)` turns a byte-level `Corpus` into one of BPE
tokens. The tokenizer is trained once per (corpus fingerprint, vocabulary size) on the
training split alone, saved as `bpe-<hash>-<size>.json` beside the token arrays it
produced, and loaded from there by every later run; the test split is only encoded.
Byte-level pre-tokenization keeps every byte representable, so no text is lost; the
fingerprint adds the tokenizer and both splits' token counts, which bits per byte need
(loss / ln 2 x tokens / bytes).

>>> import numpy as np, tempfile
>>> from dgrad.data.text import Corpus, save_whole
>>> text = np.frombuffer(b"def f(x):\\n    return x + 1\\n" * 200, np.uint8)
>>> subwords = bpe_corpus(Corpus(text, text[:300], 256, {"sha256": "ab"}), 300, tempfile.mkdtemp())
>>> subwords.vocab_size <= 300, len(subwords.train) < len(text)  # as many merges as it finds
(True, True)
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from dgrad.data.text import Corpus, save_whole

CHUNK_BYTES = 1 << 16  # texts are encoded in pieces cut at newlines, in parallel


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        from dgrad.data.tfds_source import DatasetNotFoundError

        raise DatasetNotFoundError(
            "Subword tokens need Hugging Face tokenizers: pip install 'dgrad[text]'."
        ) from None
    return tokenizers


def _pieces(data: np.ndarray) -> list[str]:
    """`data` (UTF-8 bytes) as text cut after newlines into pieces of about CHUNK_BYTES;
    the pieces joined give the text back."""
    raw, pieces, start = data.tobytes(), [], 0
    while start < len(raw):
        end = raw.find(b"\n", start + CHUNK_BYTES)
        end = len(raw) if end < 0 else end + 1
        pieces.append(raw[start:end].decode("utf-8", errors="replace"))
        start = end
    return pieces


def train_bpe(data: np.ndarray, vocab_size: int):
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `data` (UTF-8 bytes).

    >>> import numpy as np
    >>> tokenizer = train_bpe(np.frombuffer(b"hello hello world " * 50, np.uint8), 270)
    >>> tokenizer.decode(tokenizer.encode("hello world").ids)
    'hello world'
    """
    tokenizers = _tokenizers()
    Tokenizer, decoders, models = tokenizers.Tokenizer, tokenizers.decoders, tokenizers.models
    pre_tokenizers, trainers = tokenizers.pre_tokenizers, tokenizers.trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_pieces(data), trainer=trainer)
    return tokenizer


def encode(tokenizer, data: np.ndarray) -> np.ndarray:
    """`data` (UTF-8 bytes) as one flat array of token ids (uint16 below 65,536 tokens).

    >>> import numpy as np
    >>> text = np.frombuffer(b"ab ab ab\\n" * 10, np.uint8)
    >>> tokens = encode(train_bpe(text, 260), text)
    >>> tokens.dtype, len(tokens) < len(text)
    (dtype('uint16'), True)
    """
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.int32
    encoded = tokenizer.encode_batch(_pieces(data), add_special_tokens=False)
    return np.fromiter((i for e in encoded for i in e.ids), dtype)


def bpe_corpus(corpus: Corpus, vocab_size: int, cache: str | pathlib.Path) -> Corpus:
    """`corpus` in the tokens of a byte-level BPE of `vocab_size` trained on its training
    split, from `cache` when a run made them before (see the module's docstring).

    >>> import numpy as np, tempfile
    >>> text = np.frombuffer(b"one two three\\n" * 100, np.uint8)
    >>> cache = tempfile.mkdtemp()
    >>> first = bpe_corpus(Corpus(text, text, 256, {"sha256": "cd"}), 280, cache)
    >>> again = bpe_corpus(Corpus(text, text, 256, {"sha256": "cd"}), 280, cache)  # reused
    >>> bool(np.array_equal(first.train, again.train)), sorted(p.suffix for p in
    ...     __import__("pathlib").Path(cache).iterdir())
    (True, ['.json', '.npy', '.npy'])
    """
    Tokenizer = _tokenizers().Tokenizer
    if vocab_size <= 256:
        raise ValueError(f"A BPE vocabulary of {vocab_size} tokens: use more than the 256 bytes.")
    cache = pathlib.Path(cache)
    key = json.dumps(corpus.fingerprint, sort_keys=True)
    stem = f"bpe-{hashlib.sha256(key.encode()).hexdigest()[:12]}-{vocab_size}"
    saved = cache / f"{stem}.json"
    arrays = {split: cache / f"{stem}-{split}.npy" for split in ("train", "test")}
    if saved.exists() and all(path.exists() for path in arrays.values()):
        tokens = {split: np.load(path) for split, path in arrays.items()}
        size = Tokenizer.from_file(str(saved)).get_vocab_size()
    else:
        tokenizer = train_bpe(corpus.train, vocab_size)
        tokens = {"train": encode(tokenizer, corpus.train), "test": encode(tokenizer, corpus.test)}
        size = tokenizer.get_vocab_size()
        for split, path in arrays.items():
            save_whole(path, tokens[split])
        tokenizer.save(str(saved) + ".partial")
        pathlib.Path(str(saved) + ".partial").rename(saved)  # last: the arrays are whole
    fingerprint = {
        **corpus.fingerprint,
        "tokenizer": f"bpe-{vocab_size}",
        "tokenizer_file": saved.name,
        "train_bytes": int(corpus.train.size),
        "train_tokens": int(tokens["train"].size),
        "test_bytes": int(corpus.test.size),
        "test_tokens": int(tokens["test"].size),
    }
    return Corpus(tokens["train"], tokens["test"], size, fingerprint)


def load_tokenizer(cache: str | pathlib.Path, fingerprint: dict):
    """The tokenizer a run with this corpus `fingerprint` trained (for decoding samples).

    >>> import numpy as np, tempfile
    >>> text = np.frombuffer(b"alpha beta\\n" * 100, np.uint8)
    >>> cache = tempfile.mkdtemp()
    >>> corpus = bpe_corpus(Corpus(text, text, 256, {"sha256": "ef"}), 270, cache)
    >>> tokenizer = load_tokenizer(cache, corpus.fingerprint)
    >>> tokenizer.decode([int(t) for t in corpus.test]) == text.tobytes().decode()  # lossless
    True
    """
    path = pathlib.Path(cache) / fingerprint["tokenizer_file"]
    return _tokenizers().Tokenizer.from_file(str(path))
