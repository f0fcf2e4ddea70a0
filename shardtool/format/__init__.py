"""The dataset format: manifest, per-shard sample index, tar and Arrow shards, atomic publish."""

from .dataset import Dataset, open_dataset, open_range
from .decode import decode_sample
from .errors import BadSampleError, FormatError, PickleRefusedError, ShardtoolError
from .fields import FieldSpec, decode_bytes, encode, infer_field, length_of
from .manifest import LENGTHS_NAME, MANIFEST_NAME, Manifest, ShardInfo, manifest_hash
from .sindex import ShardIndex
from .writer import ShardFileWriter, publish_manifest

__all__ = [
    "BadSampleError",
    "Dataset",
    "FieldSpec",
    "FormatError",
    "LENGTHS_NAME",
    "MANIFEST_NAME",
    "Manifest",
    "PickleRefusedError",
    "ShardFileWriter",
    "ShardIndex",
    "ShardInfo",
    "ShardtoolError",
    "decode_bytes",
    "decode_sample",
    "encode",
    "infer_field",
    "length_of",
    "manifest_hash",
    "open_dataset",
    "open_range",
    "publish_manifest",
]
