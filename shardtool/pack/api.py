"""``shardtool.pack(...)``: sources → shards + manifest (or a task fragment in a job array)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..format.errors import ShardtoolError
from ..format.manifest import MANIFEST_NAME
from ..format.sizes import parse_size
from ..plan.env import array_ids, array_task
from . import outdir
from .chat import Chat, chat_fields
from .foreign import default_length
from .imagetext import (
    ClassCaption,
    ImageText,
    Interleaved,
    class_caption_fields,
    image_fields,
    interleaved_fields,
)
from .inputs import class_names, counted_units, first_sample_fields, source_units
from .options import check_options, strip_file_scheme
from .partition import Partition
from .procs import run_jobs
from .progress import Progress
from .publish import PackResult, length_definition, publish_pack
from .schema import check_length_option, check_max_length_option
from .skips import PackWarning, check_fraction_option
from .sources import classify
from .tokenize import TOKENS_FIELD, Tokenize, tokenized_fields
from .units import idle_note, positions, split_contiguous
from .worker import Job
from .workunit import inputs_seen

__all__ = ["DEFAULT_MAX_SAMPLE_BYTES", "DEFAULT_SHARD_SIZE", "PackResult", "length_definition", "pack"]

DEFAULT_SHARD_SIZE = 256 << 20
DEFAULT_MAX_SAMPLE_BYTES = 256 << 20


def pack(
    sources: Any,
    out: str,
    *,
    format: str = "tar",
    key: str | None = None,
    length: str | None = None,
    length_fn: str | None = None,
    shard_size: int | str | None = None,
    samples_per_shard: int | None = None,
    workers: int = 1,
    num_tasks: int | None = None,
    task_index: int | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
    quiet: bool = True,
    max_sample_bytes: int | str | None = None,
    env: Mapping[str, str] | None = None,
    per_file: bool = False,
    max_length: int | None = None,
    max_length_policy: str = "drop",
    max_skip_fraction: float | None = None,
    total: int | None = None,
    tokenizer: Any = None,
    text_field: str | None = None,
    chat_field: str | None = None,
    chat_template: str | None = None,
    image_field: str | None = None,
    interleaved_field: str | None = None,
    image_tokens: int | None = None,
    image_patch: int | None = None,
    image_max_tokens: int | None = None,
    image_token_id: int | None = None,
    eos_id: int | None = None,
    keep_text: bool = False,
    compression: str | None = None,
    label_from_dir: bool = False,
    record_batch_size: int | str | None = None,
    partition: Partition | None = None,
) -> PackResult:
    """Pack ``sources`` into ``out``.

    ``sources``: a path or a list of paths (directories of files, JSONL, Parquet, Arrow,
    WebDataset tars); a ``pyarrow.Table``, ``RecordBatchReader`` or ``pyarrow.dataset.Dataset``; a
    Hugging Face ``datasets.Dataset`` or ``IterableDataset``; or an iterable of dicts (a list, a
    generator; ``total=`` tells the progress bar how many). Tables, datasets and lists are split by
    rows over ``workers``; a stream (generator, RecordBatchReader, IterableDataset) is read once,
    in order, by one process. Anything else is a TypeError listing what is accepted.

    Keyword options mirror ``shardtool pack`` (see ``shardtool pack --help``). The set of samples
    does not depend on ``workers`` or ``num_tasks``; for fixed values the output is byte-identical
    run to run, and the same rows give the same dataset from any kind of source. With
    ``num_tasks > 1`` (or ``SLURM_ARRAY_TASK_COUNT`` set) this packs task ``task_index``'s slice
    and writes a fragment; ``merge(out)`` (``from shardtool.pack import merge``) then writes the
    manifest. ``partition`` (`shardtool.pack.engines` sets it) packs all of ``sources`` as task
    ``partition.index`` of ``partition.count``, keyed from sample ``partition.first`` of
    ``partition.total``: one partition of a Ray Dataset or Spark DataFrame.

    ``key``: the column holding each sample's key (it is the key, not also a field).
    ``tokenizer`` (a path to a ``tokenizer.json``, a ``tokenizers.Tokenizer`` or a ``transformers``
    fast tokenizer) with ``text_field``: the text becomes field ``tokens`` (token ids, uint16 when
    the vocabulary has at most 65,536 ids, else uint32; ``eos_id`` appended when given), which is
    the length field; ``keep_text`` keeps the text too. ``chat_field`` instead (a list of
    ``{"role", "content"}`` messages per sample): each conversation is rendered with the chat
    template (``chat_template``, a Jinja file; default the tokenizer's own) and tokenized, and an
    assistant-only ``loss_mask`` (uint8, 1 on the assistant's tokens) is stored beside ``tokens``
    (`shardtool.pack.chat`); ``keep_text`` keeps the messages too. ``image_field`` with
    ``text_field`` (image-text pairs): each sample's tokens are its image's placeholders
    (``image_token_id``, default the tokenizer's ``<image>``) repeated by its token cost — fixed
    ``image_tokens``, or one per ``image_patch``-pixel square patch of its size, at most
    ``image_max_tokens`` — then the text's ids; the image bytes stay in their field
    (`shardtool.pack.imagetext`). ``interleaved_field`` instead of ``text_field``: documents of text
    and images in their order, each a list of parts (a string or ``{"text": ...}``, or
    ``{"image": bytes or a path beside the source file}``), with the same image options. ``compression`` (``"zstd"`` or ``"lz4"``,
    Arrow shards only) compresses each record batch. ``record_batch_size`` (bytes or a size
    like ``"256KiB"``; Arrow shards only) is the payload at which a record batch is cut: by
    default 1 MiB, at most 256 rows for plain shards and 8,192 for compressed ones. A reader
    decompresses whole batches, each about once per pass; smaller batches cost less memory per
    process reading a compressed dataset in place and decompress slower.
    ``per_file=True`` packs every file of a directory source as one sample with fields ``bin``
    (its bytes) and ``path`` (its path relative to the directory), keyed by that path made safe.
    ``label_from_dir=True`` reads each directory as torchvision's ImageFolder does (``ROOT/CLASS/
    .../FILE.EXT``): one file = one sample keyed like ``per_file``, its bytes under its last
    extension lower-cased (``png``) and its class index under ``cls`` (WebDataset's integer
    label); the class names, sorted as torchvision's ``class_to_idx``, are recorded in the
    manifest (``Manifest.extra["classes"]``).
    ``max_length`` drops samples longer than it (``max_length_policy="drop"``) or cuts the
    ``length`` field's 1-D array to it (``"truncate"``); both are counted in the result.
    ``max_skip_fraction`` implies ``skip_bad`` and fails the pack, publishing nothing, when more
    than that fraction of the samples was skipped.

    Raises :class:`BadSampleError` naming the file (or source) and position of bad input (unless
    ``skip_bad``, which counts and lists it) and :class:`ShardtoolError` for bad options. A
    failed pack removes the shards and directories it created.
    """
    compression = check_options(
        format,
        length,
        length_fn,
        workers,
        compression,
        tokenizer,
        text_field,
        chat_field,
        chat_template,
        image_field,
        interleaved_field,
    )
    sources = classify(sources)
    if not sources:
        raise ShardtoolError("no sources given")
    shard_size = parse_size(shard_size, what="--shard-size", positive=True)
    record_batch_size = parse_size(record_batch_size, what="--record-batch-size", positive=True)
    if record_batch_size is not None and format != "arrow":
        raise ShardtoolError("--record-batch-size applies to Arrow shards (--format arrow)")
    if samples_per_shard is not None and samples_per_shard < 1:
        raise ShardtoolError("--samples-per-shard must be ≥ 1")
    if shard_size is None and samples_per_shard is None:
        shard_size = DEFAULT_SHARD_SIZE
    max_sample_bytes = (
        parse_size(max_sample_bytes, what="--max-sample-bytes", positive=True) or DEFAULT_MAX_SAMPLE_BYTES
    )
    max_skip_fraction = check_fraction_option(max_skip_fraction)
    skip_bad = skip_bad or max_skip_fraction is not None
    array = None
    if partition is not None:  # one partition of an engine's dataset (shardtool.pack.engines)
        T, I = partition.count, partition.index
    else:
        T, I = array_task(num_tasks, task_index, env=os.environ if env is None else env)
        array = array_ids(T, task_index, env=os.environ if env is None else env)
    out = strip_file_scheme(out)
    if "://" in out:
        raise ShardtoolError(
            f"output {out!r}: pack writes to a local or mounted path (copy it to object storage after)"
        )

    skipped: list[str] = []
    if per_file and label_from_dir:
        raise ShardtoolError(
            "give --per-file or --label-from-dir, not both (--label-from-dir is one file per "
            "sample too, with a class label)"
        )
    units = source_units(sources, skip_bad=skip_bad, skipped=skipped, per_file=per_file, label_from_dir=label_from_dir)
    if not units:
        raise ShardtoolError(
            "no samples found in the sources: "
            + ", ".join(map(str, sources))
            + (f" ({len(skipped)} skipped; first: {skipped[0]})" if skipped else "")
        )
    extra = class_names(units)
    if key is not None and any(u.kind in ("tree", "files", "images", "tar") for u in units):
        raise ShardtoolError("--key applies to JSONL/Parquet/Arrow sources; file trees and tars take keys from names")
    source_fields = first_sample_fields(units, max_sample_bytes=max_sample_bytes, skip_bad=skip_bad, key_field=key)
    fields = source_fields
    tok: Interleaved | Chat | ImageText | Tokenize | None = None
    if length is None and length_fn is None and tokenizer is None:
        length = default_length(units)  # a Megatron dataset's documents are measured in tokens
    image_cost = dict(
        image_tokens=image_tokens,
        image_patch=image_patch,
        image_max_tokens=image_max_tokens,
        image_token=image_token_id,
    )
    if tokenizer is not None:
        if interleaved_field is not None:
            tok = Interleaved(tokenizer, parts_field=interleaved_field, eos_id=eos_id, **image_cost)
            fields = interleaved_fields(source_fields, interleaved_field, tok.dtype.str.lstrip("<>=|"))
        elif chat_field is not None:
            tok = Chat(
                tokenizer, chat_field=chat_field, chat_template=chat_template, eos_id=eos_id, keep_text=keep_text
            )
            fields = chat_fields(source_fields, chat_field, keep_text, tok.dtype.str.lstrip("<>=|"))
        elif text_field is None:  # --image-field alone: an ImageFolder's classes
            if image_field is None:  # check_options refuses a tokenizer with none of the four fields
                raise ShardtoolError(
                    "--tokenizer needs --text-field, --chat-field, --interleaved-field or --image-field"
                )
            if not extra.get("classes"):
                raise ShardtoolError(
                    "--image-field pairs images with the text of --text-field, or with their class names "
                    "(an ImageFolder packed with --label-from-dir)"
                )
            image_fields(source_fields, image_field)
            captions = ClassCaption(tokenizer, extra["classes"], eos_id=eos_id)
            fields = class_caption_fields(source_fields, captions.dtype.str.lstrip("<>=|"))
            tok = ImageText(captions, image_field=image_field, **image_cost)
        else:
            text_tok = Tokenize(tokenizer, text_field=text_field, eos_id=eos_id, keep_text=keep_text)
            fields = tokenized_fields(source_fields, text_field, keep_text, text_tok.dtype.str.lstrip("<>=|"))
            tok = text_tok
            if image_field is not None:
                image_fields(source_fields, image_field)
                tok = ImageText(text_tok, image_field=image_field, **image_cost)
        length = TOKENS_FIELD
    check_length_option(fields, length)
    truncate = check_max_length_option(fields, length, max_length, max_length_policy)
    if key is not None and key == length:
        raise ShardtoolError(f"--length {length!r} is the --key column, which is the key, not a field")

    units = counted_units(units, skip_bad=skip_bad, skipped=skipped)
    streaming = any(u.stream for u in units)
    if streaming and T > 1:
        raise ShardtoolError(
            "a stream (a generator, RecordBatchReader or IterableDataset) is read once, by one "
            "process: it cannot be split over job-array tasks (pack it with num_tasks=1)"
        )
    pos = positions(units)
    count = total if streaming and total is not None else pos[-1]
    if partition is not None:
        if streaming:
            raise ShardtoolError("a partition is packed from its rows in memory, not from a stream")
        count = partition.total
    key_width = max(9, len(str(max(count - 1, 0))))

    if partition is None:
        t0, t1 = split_contiguous([u.weight for u in units], T)[I]
        my_units, my_pos = units[t0:t1], pos[t0:t1]
    else:  # the partition is the task's whole share; its keys continue the partitions before it
        my_units, my_pos = units, [p + partition.first for p in pos[:-1]]
    idle = idle_note(units, my_units, T if partition is None else 1, 1 if streaming else workers)
    dest = out
    if overwrite and T == 1 and os.path.exists(os.path.join(out, MANIFEST_NAME)):
        # The old dataset stays published until the new one is whole: a failed or killed pack
        # leaves it as it was.
        out = outdir.overwrite_staging(dest)
    jobs = []
    for w, (a, b) in enumerate(split_contiguous([u.weight for u in my_units], 1 if streaming else workers)):
        jobs.append(
            Job(
                out=out,
                fmt=format,
                fields=fields,
                units=my_units[a:b],
                positions=my_pos[a:b],
                task=I,
                worker=w,
                key_field=key,
                length_field=length,
                length_fn=length_fn,
                key_width=key_width,
                shard_size=shard_size,
                samples_per_shard=samples_per_shard,
                skip_bad=skip_bad,
                max_sample_bytes=max_sample_bytes,
                max_length=max_length,
                truncate=truncate,
                source_fields=source_fields,
                tokenize=tok,
                compression=compression,
                record_batch_size=record_batch_size,
                running_positions=streaming,
            )
        )
    before = outdir.snapshot(out)
    outdir.prepare(out, task=I, num_tasks=T, overwrite=overwrite)

    if total is None and all(u.count >= 0 for u in my_units):
        total = sum(u.count for u in my_units)
    bar = Progress(total=total, quiet=quiet)
    try:
        try:
            results = run_jobs(jobs, bar)
        finally:
            bar.close()
        length_def = length_definition(fields, length, length_fn)
        if tok is not None and tok.eos:
            length_def["eos_id"] = tok.eos[0]  # every document ends with it: a loader must not append another
        if isinstance(tok, (ImageText, Interleaved)):
            length_def["image"] = tok.manifest()  # where the loader finds each image and its place
        seen = inputs_seen(units, len(skipped)) if partition is None and T > 1 else None
        result = publish_pack(
            out, format, fields, length_def, results, skipped, T, I, max_skip_fraction, compression, extra, seen, array
        )
        if out != dest:
            outdir.swap_in(dest, out)
            result.out, result.manifest = dest, os.path.join(dest, MANIFEST_NAME)
    except BaseException:
        outdir.undo(out, before, task=I, num_tasks=T)  # a killed or failed worker cannot clean up its own
        if out != dest:
            outdir.drop_staging(dest)
        raise
    result.seconds = bar.elapsed
    if idle is not None:
        result.warnings.append(idle)
    for text in result.warnings:
        warnings.warn(text, PackWarning, stacklevel=2)
    return result
