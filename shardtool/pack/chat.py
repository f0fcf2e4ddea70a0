"""Chat data at pack time: conversations rendered by a chat template, tokenized, with a loss mask
that is 1 on the assistant's tokens only.

The template is Jinja, as Hugging Face tokenizers carry it (``chat_template`` in
``tokenizer_config.json``, a ``chat_template.jinja`` beside it, a ``transformers`` tokenizer's
attribute) or as a file given with ``--chat-template``. It is rendered in a sandbox with
``messages``, ``add_generation_prompt=False``, ``bos_token``, ``eos_token`` and
``raise_exception``, as ``apply_chat_template`` renders it.

Which characters are the assistant's:
- Where the template marks them with ``{% generation %}…{% endgeneration %}`` (Hugging Face's
  generation markers, what ``return_assistant_tokens_mask`` uses), exactly those.
- Otherwise, per assistant message: from its content's first character to the end of its turn as
  the template renders it (so the end-of-turn marker the model must learn to emit is trained; the
  role header before the content and the whitespace after the turn are not). A turn is found by
  rendering the conversation one message longer at a time; a template whose rendering of the
  first i messages is not the beginning of the first i + 1 is refused (add generation markers).

A token is the assistant's when its first character is (the tokenizer's offsets). The mask is
stored as field ``loss_mask`` (uint8) beside ``tokens``; the loader's packed batches carry it and
set the labels of every other token to -100 (loader/tokenfields.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from .tokenize import TOKENS_FIELD, TokenIds, json_list, load_tokenizer, replaced_fields, tokens_spec

LOSS_MASK_FIELD = "loss_mask"
# Private-use characters: the generation markers' places in the rendered text, taken out after.
_OPEN, _CLOSE = "\ue000", "\ue001"


def find_template(tokenizer: Any, chat_template: str | None) -> tuple[str, dict[str, str]]:
    """(the template's source, its special tokens {bos_token, eos_token}). ``chat_template``: a
    path to a Jinja file, or None for the tokenizer's own."""
    specials = {"bos_token": "", "eos_token": ""}
    for name in specials:
        value = getattr(tokenizer, name, None)
        if isinstance(value, str):
            specials[name] = value
    if chat_template is not None:
        if not os.path.isfile(chat_template):
            what = "not a regular file" if os.path.exists(chat_template) else "no such file"
            raise ShardtoolError(f"--chat-template {chat_template!r}: {what} (give a Jinja chat template file)")
        with open(chat_template, encoding="utf-8") as f:
            return f.read(), specials
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own:
        return own, specials
    if isinstance(tokenizer, (str, os.PathLike)):
        folder = os.fspath(tokenizer)
        if not os.path.exists(folder):  # said before "it has no template", which sent users looking for one
            load_tokenizer(tokenizer)  # raises, naming the path
        folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                return f.read(), specials
        config = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                cfg = json.load(f)
            for name in specials:
                value = cfg.get(name)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    specials[name] = value
            found = cfg.get("chat_template")
            if isinstance(found, list):  # named templates: the default one
                found = next((t.get("template") for t in found if t.get("name") == "default"), None)
            if isinstance(found, str) and found:
                return found, specials
    raise ShardtoolError(
        "--chat-field needs a chat template: the tokenizer has none (no chat_template in its "
        "tokenizer_config.json, no chat_template.jinja beside it); give one with --chat-template FILE"
    )


def compile_template(source: str):
    """The template in a sandboxed Jinja environment, with the generation tag."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ShardtoolError("--chat-field needs jinja2: pip install 'shardtool[tokenize]'") from None

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source), "generation" in source and "endgeneration" in source
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ShardtoolError(f"the chat template does not parse: {e}") from None


def chat_fields(fields: list[FieldSpec], chat_field: str, keep: bool, dtype: str) -> list[FieldSpec]:
    """The dataset's fields: tokens and loss_mask where the conversation was (it after them if kept)."""
    mask = FieldSpec(LOSS_MASK_FIELD, "loss_mask.npy", "npy", "array", "u1")
    return replaced_fields(fields, chat_field, "--chat-field", [tokens_spec(dtype), mask], keep=keep)


class Chat(TokenIds):
    """Adds tokens and loss_mask to sample dicts (the per-sample path; record batches go there too)."""

    def __init__(
        self, tokenizer: Any, *, chat_field: str, chat_template: str | None, eos_id: int | None, keep_text: bool
    ):
        self.source, self.specials = find_template(tokenizer, chat_template)
        compile_template(self.source)  # a template that does not parse fails here, not in a worker
        super().__init__(tokenizer, eos_id)
        self.chat_field = chat_field
        self.keep_text = keep_text
        self._template: Any = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_template": None}  # compiled again in each pack worker

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans [a, b) that are the assistant's."""
        if self._template is None:
            self._template = compile_template(self.source)
        template, marked = self._template
        if not marked:
            return self._by_turns(template, messages)
        text = template.render(messages=messages, add_generation_prompt=False, **self.specials)
        spans, out, at = [], [], 0
        for i, piece in enumerate(text.split(_OPEN)):
            head, sep, tail = piece.partition(_CLOSE) if i else ("", "", piece)
            if i and not sep:
                raise ValueError("a {% generation %} block is not closed")
            if i:
                start = at
                out.append(head)
                at += len(head)
                spans.append((start, at))
            out.append(tail)
            at += len(tail)
        return "".join(out), spans

    def _by_turns(self, template, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        prev, spans = "", []
        for i, m in enumerate(messages):
            text = template.render(messages=messages[: i + 1], add_generation_prompt=False, **self.specials)
            if not text.startswith(prev):
                raise ValueError(
                    "the chat template renders the first messages differently once another follows, so "
                    "turns cannot be told apart: add {% generation %} markers around the assistant's part"
                )
            if m.get("role") == "assistant":
                turn = text[len(prev) :]
                content = m.get("content")
                first = turn.find(content) if isinstance(content, str) and content else -1
                start = len(prev) + (first if first >= 0 else 0)
                spans.append((start, len(prev) + len(turn.rstrip())))
            prev = text
        return prev, spans

    def row(self, obj: dict, source: str, where: str) -> dict:
        messages = json_list(obj.get(self.chat_field))
        if messages is None or not all(isinstance(m, dict) for m in messages):
            what = "missing" if self.chat_field not in obj else "not a list of messages ({role, content} objects)"
            raise BadSampleError(f"--chat-field {self.chat_field!r} is {what}", source=source, position=where)
        if any(_OPEN in str(m.get("content", "")) or _CLOSE in str(m.get("content", "")) for m in messages):
            raise BadSampleError(
                "a message holds U+E000/U+E001, which mark generation blocks", source=source, position=where
            )
        try:
            text, spans = self.render(messages)
        except Exception as e:  # jinja's errors, raise_exception in the template, unclosed blocks
            raise BadSampleError(
                f"the chat template fails on this conversation: {e}", source=source, position=where
            ) from None
        enc = self.tok.encode(text, add_special_tokens=False)
        starts = np.fromiter((a for a, _ in enc.offsets), dtype=np.int64, count=len(enc.ids))
        mask = np.zeros(len(starts) + len(self.eos), np.uint8)
        for a, b in spans:
            mask[: len(starts)] |= (starts >= a) & (starts < b)
        if self.eos and len(starts):
            mask[-1] = mask[-2]  # the eos after the conversation is trained where its last token is
        ids = np.asarray(enc.ids + self.eos, dtype=self.dtype)
        out = {}
        for k, v in obj.items():
            if k == self.chat_field:
                out[TOKENS_FIELD] = ids
                out[LOSS_MASK_FIELD] = mask
                if not self.keep_text:
                    continue
            out[k] = v
        return out

    def batch(self, batch: Any) -> None:
        return None  # conversations are rendered one by one: the per-sample path
