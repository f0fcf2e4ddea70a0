"""Image-text samples at pack time: each image's token cost reserved in the sample's tokens.

A sample is an image (encoded bytes in ``--image-field``: a tar's ``0001.png`` beside ``0001.txt``,
a Parquet column of bytes) and its text (``--text-field``, tokenized). Its tokens are the image's
placeholders, ``--image-token-id`` repeated K times, then the text's ids (then ``--eos-id``): K is
what the image costs the model, ``--image-tokens K`` for every image, or ``--image-patch P``: one
token per P×P patch of the image's size, read from its header, at most ``--image-max-tokens``.

So the sample's length, the index and the plan count the image like text, packing reserves its
place in a row, and the loader finds where each image goes from the placeholders alone (an image
is never cut across rows: image datasets pack with ``no-split``). The manifest records the image
field and placeholder id (``length.image``), which the loader reads.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from .tokenize import TOKENS_FIELD, Tokenize


def image_token_id(tok: Any, given: int | None) -> int:
    """The placeholder id: ``given``, or the tokenizer's ``<image>`` token."""
    if given is not None:
        return int(given)
    found = tok.token_to_id("<image>")
    if found is None:
        raise ShardtoolError(
            "--image-field needs the id that stands for an image's tokens: give --image-token-id N "
            "(the tokenizer has no <image> token)"
        )
    return int(found)


class ImageText:
    """A `Tokenize` whose samples start with their image's placeholders (the per-sample path)."""

    def __init__(
        self,
        text: Tokenize,
        *,
        image_field: str,
        image_tokens: int | None,
        image_patch: int | None,
        image_max_tokens: int | None,
        image_token: int | None,
    ):
        if (image_tokens is None) == (image_patch is None):
            raise ShardtoolError(
                "--image-field needs the image's token cost: --image-tokens K (every image) or "
                "--image-patch P (a token per P×P patch of its size), one of them"
            )
        for name, v in (("--image-tokens", image_tokens), ("--image-patch", image_patch)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ShardtoolError(f"{name} must be an integer ≥ 1, got {v!r}")
        if image_max_tokens is not None and (image_patch is None or image_max_tokens < 1):
            raise ShardtoolError("--image-max-tokens caps --image-patch's count: give it with --image-patch, ≥ 1")
        self.text = text
        self.tok, self.vocab, self.dtype, self.eos = text.tok, text.vocab, text.dtype, text.eos
        self.image_field = image_field
        self.fixed, self.patch, self.cap = image_tokens, image_patch, image_max_tokens
        self.token_id = image_token_id(self.tok, image_token)
        if not 0 <= self.token_id < max(self.vocab, 1):
            raise ShardtoolError(f"--image-token-id {self.token_id} is not an id of the tokenizer ({self.vocab} ids)")

    def manifest(self) -> dict[str, Any]:
        """What the loader needs: ``length.image`` in the manifest."""
        cost: dict[str, Any] = {"tokens": self.fixed} if self.fixed else {"patch": self.patch, "max": self.cap}
        return {"field": self.image_field, "token_id": self.token_id, **cost}

    def cost(self, data: bytes) -> int:
        """The image's token count: fixed, or its P×P patches (its size from its header), capped."""
        if self.fixed is not None:
            return self.fixed
        try:
            from PIL import Image
        except ImportError:
            raise ShardtoolError(
                "--image-patch reads image sizes with Pillow: pip install 'shardtool[vision]'"
            ) from None
        with Image.open(io.BytesIO(data)) as im:  # the header only: no pixels are decoded
            w, h = im.size
        n = math.ceil(w / self.patch) * math.ceil(h / self.patch)
        return min(n, self.cap) if self.cap else n

    def row(self, obj: dict, source: str, where: str) -> dict:
        data = obj.get(self.image_field)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            what = "missing" if self.image_field not in obj else f"a {type(data).__name__}, not image bytes"
            raise BadSampleError(f"--image-field {self.image_field!r} is {what}", source=source, position=where)
        try:
            k = self.cost(bytes(data))
        except ShardtoolError:
            raise
        except Exception as e:  # PIL's UnidentifiedImageError, truncated headers
            raise BadSampleError(
                f"--image-field {self.image_field!r}: not a readable image ({type(e).__name__}: {e})",
                source=source,
                position=where,
            ) from None
        out = self.text.row(obj, source, where)
        out[TOKENS_FIELD] = np.concatenate([np.full(k, self.token_id, self.dtype), out[TOKENS_FIELD]])
        return out

    def batch(self, batch: Any) -> None:
        return None  # each image's header is read: the per-sample path


def image_fields(fields: list[FieldSpec], image_field: str) -> None:
    """Refuse an image field that is not a field of the samples, or not bytes."""
    spec = next((f for f in fields if f.name == image_field), None)
    if spec is None:
        names = ", ".join(f.name for f in fields)
        raise ShardtoolError(f"--image-field {image_field!r} is not a field of the samples (fields: {names})")
    if spec.storage != "raw":
        raise ShardtoolError(f"--image-field {image_field!r} holds {spec.storage} values, not encoded image bytes")
