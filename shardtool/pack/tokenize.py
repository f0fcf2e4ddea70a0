"""Tokenization at pack time: a text field becomes a field of token ids (the length field).

The tokenizer is Hugging Face ``tokenizers`` (Rust; ``pip install shardtool[tokenize]``): a
``tokenizer.json`` path, a ``tokenizers.Tokenizer``, or a ``transformers`` fast tokenizer (its
backend tokenizer). It is never fetched from the network. Each pack worker encodes whole batches
(``encode_batch``); ids are stored in the smallest unsigned dtype that holds the vocabulary
(uint16 for up to 65,536 ids, else uint32), so the ids equal ``tokenizer.encode(text).ids``
(plus ``eos_id`` when given) and the sample's length is their count.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec

TOKENS_FIELD = "tokens"


def load_tokenizer(tokenizer: Any):
    """A ``tokenizers.Tokenizer`` from a path to ``tokenizer.json`` (or a directory holding one)
    or from a tokenizer object; ShardtoolError/TypeError otherwise."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ShardtoolError(
                f"--tokenizer {os.fspath(tokenizer)!r}: no such file (give the path of a "
                "tokenizer.json, or a directory holding one; tokenizers are never downloaded)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ShardtoolError(
                "--tokenizer needs the tokenizers package: pip install 'shardtool[tokenize]'"
            ) from None
        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception subclass for a bad file
            raise ShardtoolError(f"--tokenizer {path}: not a readable tokenizer.json ({e})") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' PreTrainedTokenizerFast
    if backend is not None:
        tokenizer = backend
    if hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "get_vocab_size"):
        return tokenizer
    raise TypeError(
        f"tokenizer must be a path to a tokenizer.json, a tokenizers.Tokenizer or a transformers fast "
        f"tokenizer, not {type(tokenizer).__name__}"
    )


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding ids 0..vocab_size-1."""
    return "u2" if vocab_size <= 1 << 16 else "u4"


def replaced_fields(
    fields: list[FieldSpec], field: str, option: str, new: list[FieldSpec], *, keep: bool = False
) -> list[FieldSpec]:
    """The dataset's fields once ``option``'s ``field`` is turned into the fields ``new``, in its
    place (``keep``: it after them); ShardtoolError when it is not a field or a new one is taken."""
    names = [f.name for f in fields]
    if field not in names:
        raise ShardtoolError(f"{option} {field!r} is not a field of the samples (fields: {', '.join(names)})")
    for spec in new:
        if spec.name in names:
            raise ShardtoolError(f"the samples already have a field {spec.name!r}; {option} would replace it")
    out = []
    for f in fields:
        out += [*new, *([f] if keep else [])] if f.name == field else [f]
    return out


def tokens_spec(dtype: str) -> FieldSpec:
    return FieldSpec(TOKENS_FIELD, "tokens.npy", "npy", "array", dtype)


def tokenized_fields(fields: list[FieldSpec], text_field: str, keep_text: bool, dtype: str) -> list[FieldSpec]:
    """The dataset's fields: the token field where the text field was (the text after it, if kept)."""
    out = replaced_fields(fields, text_field, "--text-field", [tokens_spec(dtype)], keep=keep_text)
    spec = next(f for f in fields if f.name == text_field)
    if spec.storage != "text" and not (spec.storage == "raw" and spec.encoding == "txt"):  # a tar's .txt: UTF-8
        raise ShardtoolError(f"--text-field {text_field!r} holds {spec.storage} values, not text")
    return out


class TokenIds:
    """A loaded tokenizer and what every kind of pack-time tokenizing keeps beside it: its
    vocabulary size, the dtype its ids are stored in, and the eos list (``[eos_id]`` or ``[]``)."""

    def __init__(self, tokenizer: Any, eos_id: int | None):
        self.tok = load_tokenizer(tokenizer)
        self.vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.dtype = np.dtype(token_dtype(self.vocab))
        if eos_id is not None and not 0 <= eos_id < max(self.vocab, 1):
            raise ShardtoolError(f"--eos-id {eos_id} is not an id of the tokenizer (vocabulary of {self.vocab})")
        self.eos = [] if eos_id is None else [eos_id]


def json_list(value: Any) -> list | None:
    """A list field's value: the list, or one held as JSON text (a JSONL field read as text); else None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, list) else None


class Tokenize(TokenIds):
    """Adds the token field to record batches (whole) or sample dicts (one by one)."""

    def __init__(self, tokenizer: Any, *, text_field: str, eos_id: int | None, keep_text: bool):
        super().__init__(tokenizer, eos_id)
        self.text_field = text_field
        self.keep_text = keep_text
        self._encode = getattr(self.tok, "encode_batch_fast", None) or self.tok.encode_batch

    def _ids(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [e.ids + self.eos for e in self._encode(texts)] if self.eos else [e.ids for e in self._encode(texts)]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in ids], out=offsets[1:])
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(offsets[-1]))
        return offsets, flat

    def batch(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        """``batch`` with the token field; None if the text column is not clean strings."""
        names = batch.schema.names
        if self.text_field not in names:
            return None
        col = batch.column(names.index(self.text_field))
        if col.null_count or not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            return None
        offsets, flat = self._ids(col.to_pylist())
        if offsets[-1] >= 1 << 31:
            return None
        tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))
        arrays, out_names = [], []
        for name, c in zip(names, batch.columns):
            if name == self.text_field:
                arrays.append(tokens)
                out_names.append(TOKENS_FIELD)
                if not self.keep_text:
                    continue
            arrays.append(c)
            out_names.append(name)
        return pa.RecordBatch.from_arrays(arrays, names=out_names)

    def row(self, obj: dict, source: str, where: str) -> dict:
        """One sample dict with the token field (the per-sample path)."""
        text = obj.get(self.text_field)
        if isinstance(text, (bytes, bytearray, memoryview)):  # a tar member or file: UTF-8 text
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadSampleError(
                    f"--text-field {self.text_field!r} is not UTF-8 text ({e})", source=source, position=where
                ) from None
        if not isinstance(text, str):
            what = "missing" if self.text_field not in obj else f"a {type(text).__name__}, not text"
            raise BadSampleError(f"--text-field {self.text_field!r} is {what}", source=source, position=where)
        out = {}
        for k, v in obj.items():
            if k == self.text_field:
                out[TOKENS_FIELD] = self._ids([text])[1]
                if not self.keep_text:
                    continue
            out[k] = v
        return out
