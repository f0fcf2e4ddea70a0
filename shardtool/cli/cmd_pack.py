"""shardtool pack SRC... -o OUT"""

from __future__ import annotations

import json
import sys
import textwrap

from ..format.keys import KEY_RULES
from ._args import output_error, size_arg

HELP = "pack files, JSONL, Parquet/Arrow or WebDataset tars into indexed shards (optionally tokenizing text)"
DESCRIPTION = """\
Pack raw samples into an indexed dataset (index.json + shards/ + per-shard sample index).

Sources (any mix):
  DIR                     files grouped into samples by basename, WebDataset style:
                          0001.jpg + 0001.json -> one sample with fields jpg, json;
                          key = the directory path ('/' -> '__') + '__' + the name up to
                          its first '.'; every sample must have the same fields
  DIR with --per-file     one file = one sample, for any tree (names without extensions,
                          dots in directory names, mixed file types): fields
                            bin   the file's bytes, undecoded (tar member KEY.bin)
                            path  its path relative to DIR, '/'-separated (text,
                                  tar member KEY.path.txt)
                          key = that path with '/' -> '__' and '.', '\\', control
                          characters -> '_' (a/b.c/d.txt -> a__b_c__d_txt); paths that
                          would share a key, or a key over 200 bytes, get '-' + 8 hex
                          digits of a hash of the path (deterministic)
  DIR with --label-from-dir
                          an ImageFolder tree DIR/CLASS/.../FILE.EXT (torchvision's layout):
                          one file = one sample, keyed as with --per-file, fields
                            EXT   the file's bytes under its last extension, lower-cased
                                  (x.symbolic.png -> png; every file needs the same one)
                            cls   its class index (tar member KEY.cls, decimal text)
                          classes = the sorted names of DIR's subdirectories, as torchvision's
                          class_to_idx, recorded in index.json ("extra": {"classes": [...]});
                          a file directly in DIR has no class and is bad input
  *.jsonl[.gz|.zst]       one sample per line (a JSON object; its keys are the fields)
  *.parquet, *.arrow      one sample per row (columns are the fields)
  *.tar[.gz]              existing WebDataset shards, re-sharded and indexed
  MDS_DIR                 a MosaicML Streaming dataset (its index.json lists "shards")
  LITDATA_DIR             a LitData optimize() output (index.json with "chunks")
  PREFIX[.bin|.idx]       a Megatron/NeMo indexed dataset: one sample per document,
                          field tokens (the .idx dtype), length = its token count
  (To use tars where they are, without rewriting them: shardtool index.)
(In Python, shardtool.pack() also takes a pyarrow Table, RecordBatchReader or dataset, a
Hugging Face Dataset or IterableDataset, or a list or generator of dicts.)

In a DIR, hidden files and directories (names starting with '.') are ignored; symbolic
links to files are followed, links to directories are not descended.

{rules}
Keys come from file or member names, from --key FIELD (that column is the key, not also a
field), or are the running position (000000042).

Tokenizing: --tokenizer tokenizer.json --text-field text turns each sample's text into a field
'tokens' of token ids (Hugging Face tokenizers, batch-encoded in every worker; needs
pip install 'shardtool[tokenize]'; a local file only, never downloaded), stored as uint16 when
the vocabulary has at most 65,536 ids, else uint32, with --eos-id N appended to each; the length
is the token count. The text itself is dropped unless --keep-text.

Chat data: --tokenizer DIR --chat-field messages renders each conversation (a list of
{"role", "content"} messages) with the tokenizer's chat template (chat_template in its
tokenizer_config.json, or chat_template.jinja beside it; --chat-template FILE.jinja to give one),
tokenizes it, and stores an assistant-only 'loss_mask' (1 on the assistant's tokens: those inside
{% generation %} blocks where the template has them, else each assistant turn from its content to
its end-of-turn marker) beside 'tokens'. Packed batches carry the mask and train only there.

Image-text pairs: --tokenizer T --text-field txt --image-field png --image-patch 14
--image-max-tokens 576 (or --image-tokens 64) starts each sample's tokens with its image's
placeholders (--image-token-id, default the tokenizer's <image>), one per 14×14 patch of the image's
size read from its header, then the caption's ids; the image bytes stay. The loader's packed rows
reserve those places and carry each image with its row and offset. With --label-from-dir and no
--text-field, each image's caption is its class's name. --interleaved-field parts takes
documents of text and images in their order instead: a list of parts, each text or {"image": ...}
(bytes, or a path beside the JSONL file).

Compression: --format arrow --compression zstd|lz4 compresses each record batch (Arrow IPC
buffer compression; batches of 1 MiB, --record-batch-size to change it); the loader, cache, verify and inspect read such shards; tar shards are
never compressed (they stay WebDataset tars).

Bad input is an error naming the file and line/row/member. --skip-bad skips it instead:
every skipped sample, file, member or source is listed with its reason, and a pack that
skipped more than half warns loudly; --max-skip-fraction F (implies --skip-bad) instead fails the
pack, publishing nothing, when more than F of the samples were skipped. A failed pack
removes what it created in OUT.

Job arrays: with --num-tasks T --task-index I (defaults from SLURM_ARRAY_TASK_COUNT /
SLURM_ARRAY_TASK_ID) each task packs a disjoint slice; then `shardtool merge OUT`.

Examples:
  shardtool pack corpus.parquet -o ds --length tokens --shard-size 512MiB --workers 8
  shardtool pack corpus.jsonl -o ds --text-field text --tokenizer tok/tokenizer.json --eos-id 0 --workers 8
  shardtool pack corpus.parquet -o ds --format arrow --compression zstd --key id --length tokens
  shardtool pack corpus.jsonl -o ds --length tokens --max-length 4096 --max-length-policy truncate
  shardtool pack images/ -o ds --samples-per-shard 10000
  shardtool pack /usr/share/doc -o docs --per-file --skip-bad --max-skip-fraction 0.01
  shardtool pack imagenet/train -o ds --label-from-dir --format arrow --workers 8
""".replace("{rules}", textwrap.fill("Keys: " + KEY_RULES, 88))


def add_arguments(p) -> None:
    p.add_argument("sources", nargs="+", metavar="SRC", help="input files, directories or glob patterns")
    p.add_argument("-o", "--out", required=True, metavar="OUT", help="output dataset directory")
    p.add_argument("--format", choices=["tar", "arrow"], default="tar", help="shard format (default: tar)")
    p.add_argument(
        "--key",
        metavar="FIELD",
        help="take sample keys from FIELD (JSONL/Parquet/Arrow; FIELD is then "
        "not stored as a field); default: the running position, zero-padded",
    )
    p.add_argument(
        "--compression",
        choices=["zstd", "lz4", "none"],
        help="--format arrow only: compress each record batch (default none)",
    )
    p.add_argument(
        "--record-batch-size",
        metavar="SIZE",
        help="--format arrow only: cut record batches at SIZE payload bytes (default 1MiB); a "
        "reader of a compressed shard decompresses whole batches",
    )
    t = p.add_argument_group("tokenizing (see above)")
    t.add_argument("--tokenizer", metavar="PATH", help="a Hugging Face tokenizer.json (or a directory holding one)")
    t.add_argument("--text-field", metavar="FIELD", help="the text field to tokenize (with --tokenizer)")
    t.add_argument(
        "--chat-field",
        metavar="FIELD",
        help="the field of conversations to render with the chat template and tokenize, with an "
        "assistant-only loss_mask (with --tokenizer; instead of --text-field)",
    )
    t.add_argument(
        "--image-field",
        metavar="FIELD",
        help="image-text pairs: the field of encoded images (png, jpg) whose token cost is reserved "
        "before each sample's text (with --text-field; see above)",
    )
    t.add_argument(
        "--interleaved-field",
        metavar="FIELD",
        help='documents of text and images in order: a list of parts (text, or {"image": bytes or a '
        "path}) tokenized with each image's placeholders in its place (with --tokenizer; see above)",
    )
    t.add_argument("--image-tokens", type=int, metavar="K", help="every image costs K tokens")
    t.add_argument("--image-patch", type=int, metavar="P", help="an image costs a token per P×P patch of its size")
    t.add_argument("--image-max-tokens", type=int, metavar="M", help="at most M tokens per image (with --image-patch)")
    t.add_argument(
        "--image-token-id", type=int, metavar="N", help="the id of an image's placeholders (default: <image>)"
    )
    t.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template for --chat-field (default: the tokenizer's own)",
    )
    t.add_argument("--eos-id", type=int, metavar="N", help="append token id N to every sample's ids")
    t.add_argument("--keep-text", action="store_true", help="keep the text field as well as the token ids")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--length",
        metavar="FIELD",
        help="sample length = len(FIELD), or its value if an integer (default: payload bytes)",
    )
    g.add_argument(
        "--length-fn",
        metavar="MODULE:FUNCTION",
        help="sample length = FUNCTION(sample dict); "
        "MODULE is imported from sys.path or, failing that, the current directory",
    )
    p.add_argument(
        "--max-length",
        type=int,
        metavar="N",
        help="cap sample lengths at N (see --max-length-policy); the summary counts the samples dropped or truncated",
    )
    p.add_argument(
        "--max-length-policy",
        choices=["drop", "truncate"],
        default="drop",
        help="drop: skip samples longer than N (default; any length definition); truncate: cut the "
        "--length field's array to its first N elements, and every array field as long as it (a loss "
        "mask, stored labels) with it (needs --length naming a 1-D array field)",
    )
    p.add_argument(
        "--shard-size",
        metavar="SIZE",
        type=size_arg,
        help="target shard size, e.g. 1GiB (default 256MiB unless --samples-per-shard is given)",
    )
    p.add_argument("--samples-per-shard", type=int, metavar="N", help="at most N samples per shard")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes (default 1)")
    p.add_argument("--num-tasks", type=int, metavar="T", help="job-array size (default: $SLURM_ARRAY_TASK_COUNT or 1)")
    p.add_argument(
        "--task-index",
        type=int,
        metavar="I",
        help="this task, 0..T-1 (default: its place in the SLURM array, from $SLURM_ARRAY_TASK_ID)",
    )
    p.add_argument(
        "--per-file",
        action="store_true",
        help="directory sources: one file = one sample, fields bin (bytes) and path (relative path); see above",
    )
    p.add_argument(
        "--label-from-dir",
        action="store_true",
        help="directory sources as ImageFolder trees "
        "(DIR/CLASS/FILE): one file = one sample, fields EXT (its bytes) and cls (class index); see above",
    )
    p.add_argument("--skip-bad", action="store_true", help="skip bad samples/files/sources, counting and listing them")
    p.add_argument(
        "--max-skip-fraction",
        type=float,
        metavar="F",
        help="with skipping (implies --skip-bad): fail, "
        "publishing nothing, if more than F (0..1) of the samples were skipped",
    )
    p.add_argument(
        "--max-sample-bytes",
        metavar="SIZE",
        type=size_arg,
        help="refuse lines/members/files larger than this "
        "(default 256MiB; bounds memory on corrupt or compressed-bomb input)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing dataset in OUT (the new one is written beside it and replaces it only once whole)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    import warnings

    from ..pack.api import pack
    from ..pack.skips import PackWarning

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PackWarning)  # printed below, where they cannot be missed
            result = pack(
                args.sources,
                args.out,
                format=args.format,
                key=args.key,
                length=args.length,
                length_fn=args.length_fn,
                shard_size=args.shard_size,
                samples_per_shard=args.samples_per_shard,
                workers=args.workers,
                num_tasks=args.num_tasks,
                task_index=args.task_index,
                skip_bad=args.skip_bad,
                overwrite=args.overwrite,
                quiet=args.quiet or args.json,
                max_sample_bytes=args.max_sample_bytes,
                per_file=args.per_file,
                max_length=args.max_length,
                max_length_policy=args.max_length_policy,
                max_skip_fraction=args.max_skip_fraction,
                tokenizer=args.tokenizer,
                text_field=args.text_field,
                chat_field=args.chat_field,
                chat_template=args.chat_template,
                image_field=args.image_field,
                interleaved_field=args.interleaved_field,
                image_tokens=args.image_tokens,
                image_patch=args.image_patch,
                image_max_tokens=args.image_max_tokens,
                image_token_id=args.image_token_id,
                eos_id=args.eos_id,
                keep_text=args.keep_text,
                compression=args.compression,
                record_batch_size=args.record_batch_size,
                label_from_dir=args.label_from_dir,
            )
    except OSError as e:
        raise output_error(args.out, e) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        for s in result.skipped[:50]:
            print(f"skipped: {s}", file=sys.stderr)
        if len(result.skipped) > 50:
            print(f"skipped: … and {len(result.skipped) - 50} more (--json lists them all)", file=sys.stderr)
        print(result.summary())
    for text in result.warnings:
        print(f"WARNING: {text}", file=sys.stderr)
    return 0
