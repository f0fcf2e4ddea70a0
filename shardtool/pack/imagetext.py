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
import os
from typing import Any

import numpy as np

from ..format.errors import BadSampleError, ShardtoolError
from ..format.fields import FieldSpec
from .tokenize import TOKENS_FIELD, TokenIds, Tokenize, json_list, replaced_fields, tokens_spec


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


class ImageCost:
    """What an image costs in tokens, and the id of its placeholders."""

    def __init__(
        self,
        tok: Any,
        vocab: int,
        *,
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
        self.fixed, self.patch, self.cap = image_tokens, image_patch, image_max_tokens
        self.token_id = image_token_id(tok, image_token)
        if not 0 <= self.token_id < max(vocab, 1):
            raise ShardtoolError(f"--image-token-id {self.token_id} is not an id of the tokenizer ({vocab} ids)")

    def manifest(self, **where: str) -> dict[str, Any]:
        """What the loader needs: ``length.image`` in the manifest (``where``: the images' fields)."""
        cost: dict[str, Any] = {"tokens": self.fixed} if self.fixed else {"patch": self.patch, "max": self.cap}
        return {**where, "token_id": self.token_id, **cost}

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

    def checked_cost(self, data: Any, what: str, source: str, where: str) -> int:
        """`cost` of an image value, or BadSampleError naming ``what`` and the sample."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadSampleError(f"{what} is a {type(data).__name__}, not image bytes", source=source, position=where)
        try:
            return self.cost(bytes(data))
        except ShardtoolError:
            raise
        except Exception as e:  # PIL's UnidentifiedImageError, truncated headers
            raise BadSampleError(
                f"{what}: not a readable image ({type(e).__name__}: {e})", source=source, position=where
            ) from None


class ImageText(ImageCost):
    """A `Tokenize` whose samples start with their image's placeholders (the per-sample path)."""

    def __init__(self, text: Tokenize | ClassCaption, *, image_field: str, **cost: Any):
        super().__init__(text.tok, text.vocab, **cost)
        self.text = text
        self.tok, self.vocab, self.dtype, self.eos = text.tok, text.vocab, text.dtype, text.eos
        self.image_field = image_field

    def manifest(self, **where: str) -> dict[str, Any]:
        return super().manifest(field=self.image_field)

    def row(self, obj: dict, source: str, where: str) -> dict:
        if self.image_field not in obj:
            raise BadSampleError(f"--image-field {self.image_field!r} is missing", source=source, position=where)
        k = self.checked_cost(obj[self.image_field], f"--image-field {self.image_field!r}", source, where)
        out = self.text.row(obj, source, where)
        out[TOKENS_FIELD] = np.concatenate([np.full(k, self.token_id, self.dtype), out[TOKENS_FIELD]])
        return out

    def batch(self, batch: Any) -> None:
        return None  # each image's header is read: the per-sample path


class ClassCaption(TokenIds):
    """An ImageFolder's image captioned by its class name (``--label-from-dir`` with
    ``--image-field`` and no ``--text-field``): the tokens of the name of class ``cls``."""

    def __init__(self, tokenizer: Any, classes: list[str], *, eos_id: int | None):
        super().__init__(tokenizer, eos_id)
        self.classes = list(classes)

    def row(self, obj: dict, source: str, where: str) -> dict:
        label = obj.get("cls")
        if isinstance(label, (bytes, bytearray)) and label.isdigit():  # a file tree's cls member: the digits
            label = int(label)
        if not isinstance(label, int) or not 0 <= label < len(self.classes):
            raise BadSampleError(
                f"class label {label!r} is not one of the {len(self.classes)} classes", source=source, position=where
            )
        ids = self.tok.encode(self.classes[label], add_special_tokens=False).ids + self.eos
        return {**obj, TOKENS_FIELD: np.asarray(ids, dtype=self.dtype)}


def class_caption_fields(fields: list[FieldSpec], dtype: str) -> list[FieldSpec]:
    """The dataset's fields: the tokens before the class label, which stays."""
    return replaced_fields(fields, "cls", "--label-from-dir", [tokens_spec(dtype)], keep=True)


def image_fields(fields: list[FieldSpec], image_field: str) -> None:
    """Refuse an image field that is not a field of the samples, or not bytes."""
    spec = next((f for f in fields if f.name == image_field), None)
    if spec is None:
        names = ", ".join(f.name for f in fields)
        raise ShardtoolError(f"--image-field {image_field!r} is not a field of the samples (fields: {names})")
    if spec.storage != "raw":
        raise ShardtoolError(f"--image-field {image_field!r} holds {spec.storage} values, not encoded image bytes")


IMAGES_FIELD, SIZES_FIELD = "images", "image_bytes"


class Interleaved(TokenIds, ImageCost):
    """Documents of text and images in their order (``--interleaved-field``): a list of parts, each
    a string or ``{"text": ...}``, or ``{"image": ...}`` holding the image's bytes (Parquet, Arrow,
    Python sources) or its path relative to the source file (JSONL). Tokens: each text part's ids
    and each image's placeholders in the document's order (then the eos); the images are stored
    back to back in field ``images``, their byte sizes in ``image_bytes``."""

    def __init__(self, tokenizer: Any, *, parts_field: str, eos_id: int | None, **cost: Any):
        TokenIds.__init__(self, tokenizer, eos_id)
        ImageCost.__init__(self, self.tok, self.vocab, **cost)
        self.parts_field = parts_field

    def manifest(self, **where: str) -> dict[str, Any]:
        return super().manifest(field=IMAGES_FIELD, sizes=SIZES_FIELD)

    def _image(self, value: Any, source: str, where: str, i: int) -> bytes:
        if isinstance(value, str):  # a path beside the source file
            path = value if os.path.isabs(value) else os.path.join(os.path.dirname(source), value)
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise BadSampleError(
                    f"part {i}: image {value!r} cannot be read ({e})", source=source, position=where
                ) from None
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        raise BadSampleError(
            f"part {i}: an image is bytes or a path, not {type(value).__name__}", source=source, position=where
        )

    def row(self, obj: dict, source: str, where: str) -> dict:
        parts = json_list(obj.get(self.parts_field))
        if parts is None:
            what = "missing" if self.parts_field not in obj else "not a list of text and image parts"
            raise BadSampleError(f"--interleaved-field {self.parts_field!r} is {what}", source=source, position=where)
        ids: list[np.ndarray] = []
        images: list[bytes] = []
        for i, part in enumerate(parts):
            text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) else None
            image = part.get("image") if isinstance(part, dict) else None
            if (text is None) == (image is None):
                raise BadSampleError(
                    f"--interleaved-field {self.parts_field!r} part {i} is neither text nor one image "
                    '(a string, {"text": ...} or {"image": ...})',
                    source=source,
                    position=where,
                )
            if text is not None:
                ids.append(np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype))
            else:
                data = self._image(image, source, where, i)
                k = self.checked_cost(data, f"--interleaved-field {self.parts_field!r} part {i}", source, where)
                ids.append(np.full(k, self.token_id, self.dtype))
                images.append(data)
        ids.append(np.asarray(self.eos, dtype=self.dtype))
        out = {k: v for k, v in obj.items() if k != self.parts_field}
        out[TOKENS_FIELD] = np.concatenate(ids)
        out[IMAGES_FIELD] = b"".join(images)
        out[SIZES_FIELD] = np.array([len(b) for b in images], dtype=np.int64)
        return out

    def batch(self, batch: Any) -> None:
        return None  # each image's header is read: the per-sample path


def interleaved_fields(fields: list[FieldSpec], parts_field: str, dtype: str) -> list[FieldSpec]:
    """The dataset's fields: tokens, images and their sizes where the parts were."""
    new = [
        tokens_spec(dtype),
        FieldSpec.raw(IMAGES_FIELD),
        FieldSpec(SIZES_FIELD, "image_bytes.npy", "npy", "array", "i8"),
    ]
    return replaced_fields(fields, parts_field, "--interleaved-field", new)
