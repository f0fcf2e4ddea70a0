"""ImageFolder trees (``--label-from-dir``): real PNG icons in class folders become labelled
samples (field ``png``, integer ``cls``), classes in torchvision's order in the manifest, keys as
valid as ``--per-file``'s, and clear errors for trees that are not ImageFolder-shaped."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

import shardtool
from helpers.data_gen import read_all
from helpers.realdata import ICON_CLASSES, icon_tree
from helpers.runcli import shardtool_cli
from shardtool.format.errors import BadSampleError, ShardtoolError
from shardtool.format.keys import key_problem, path_key


def _manifest(out) -> dict:
    with open(os.path.join(out, "index.json")) as f:
        return json.load(f)


def _expected(made: dict[str, list[str]], root) -> dict[str, tuple[int, bytes]]:
    """relative path -> (class index, the real file's bytes), classes in sorted order."""
    classes = sorted(made)
    want = {}
    for cls, names in made.items():
        for n in names:
            with open(os.path.join(root, cls, n), "rb") as f:
                want[f"{cls}/{n}"] = (classes.index(cls), f.read())
    return want


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_python_pack_of_real_icons_labels_every_sample_by_its_directory(tmp_path, fmt):
    made = icon_tree(tmp_path / "icons", per_class=25)
    assert any(".symbolic.png" in n for names in made.values() for n in names)  # the names that broke the default
    out = str(tmp_path / "ds")
    result = shardtool.pack(str(tmp_path / "icons"), out, label_from_dir=True, format=fmt, samples_per_shard=40)
    want = _expected(made, tmp_path / "icons")
    assert result.samples == len(want) and not result.skipped
    m = _manifest(out)
    assert m["extra"]["classes"] == sorted(ICON_CLASSES) == sorted(made)
    assert [f["name"] for f in m["fields"]] == ["cls", "png"]
    got = read_all(out)
    assert len(got) == len(want)
    by_bytes = {data: cls for cls, data in want.values()}
    for key, sample in got.items():
        assert key_problem(key) is None
        assert sample["cls"] == by_bytes[sample["png"]]  # its own directory's index, as an int
    # keys spell the path (the per-file scheme), so each sample is traceable to its file
    assert set(got) == {path_key(rel) for rel in want}


def test_samples_come_in_path_order_with_per_file_keys(tmp_path):
    made = icon_tree(tmp_path / "icons", per_class=5)
    out = str(tmp_path / "ds")
    shardtool.pack(str(tmp_path / "icons"), out, label_from_dir=True)
    ds = shardtool.open_dataset(out)
    keys = [ds.read(0, i)["__key__"] for i in range(int(ds.shard_counts[0]))]
    ds.close()
    rels = sorted(f"{c}/{n}" for c, names in made.items() for n in names)
    assert keys == [r.replace("/", "__").replace(".", "_") for r in rels]


def test_cli_pack_writes_webdataset_members_png_and_cls(tmp_path):
    made = icon_tree(tmp_path / "icons", per_class=10)
    out = str(tmp_path / "ds")
    r = shardtool_cli("pack", str(tmp_path / "icons"), "-o", out, "--label-from-dir", "-q", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"] == sum(map(len, made.values()))
    classes = _manifest(out)["extra"]["classes"]
    shards = sorted(os.path.join(out, s["path"]) for s in _manifest(out)["shards"])
    members = {}
    for path in shards:
        with tarfile.open(path) as t:
            for m in t.getmembers():
                members[m.name] = t.extractfile(m).read()
    pngs = [n for n in members if n.endswith(".png")]
    assert len(pngs) == sum(map(len, made.values()))
    for name in pngs:
        key = name[: -len(".png")]
        assert "." not in key  # WebDataset splits at the first dot: key, then field "png"
        label = int(members[key + ".cls"].decode("ascii"))  # decimal text, WebDataset's .cls
        assert classes[label] == key.split("__")[0]
        assert members[name][:8] == b"\x89PNG\r\n\x1a\n"
    shown = shardtool_cli("inspect", out, "--no-peek")
    assert (
        shown.returncode == 0 and "classes (4, the cls field's labels): 0 actions, 1 devices, 2 legacy" in shown.stdout
    )


def test_the_default_and_per_file_modes_still_refuse_or_lose_the_label(tmp_path):
    """Why the mode exists: basename grouping misreads x.symbolic.png, --per-file has no label."""
    icon_tree(tmp_path / "icons", per_class=3, classes=("status",))
    shardtool.pack(str(tmp_path / "icons"), str(tmp_path / "a"))
    assert [f["name"] for f in _manifest(tmp_path / "a")["fields"]] == ["symbolic.png"]  # no decoder knows it
    shardtool.pack(str(tmp_path / "icons"), str(tmp_path / "b"), per_file=True)
    assert [f["name"] for f in _manifest(tmp_path / "b")["fields"]] == ["bin", "path"]


def test_classes_follow_torchvision_find_classes(tmp_path):
    root = tmp_path / "tree"
    for cls in ["zebra", "Ant", "b.c", "a-b", "a"]:  # case, dots and prefixes sort as sorted() does
        os.makedirs(root / cls / "sub")
        (root / cls / "sub" / "x.JPG").write_bytes(cls.encode())
    os.makedirs(root / ".hidden")
    (root / ".hidden" / "y.jpg").write_bytes(b"hidden")
    out = str(tmp_path / "ds")
    shardtool.pack(str(root), out, label_from_dir=True)
    m = _manifest(out)
    assert m["extra"]["classes"] == ["Ant", "a", "a-b", "b.c", "zebra"]
    assert [f["name"] for f in m["fields"]] == ["cls", "jpg"]  # last extension, lower-cased
    got = read_all(out)
    assert {s["jpg"].decode(): m["extra"]["classes"][s["cls"]] for s in got.values()} == {
        c: c for c in m["extra"]["classes"]
    }


def test_files_at_the_root_are_named_as_bad_input(tmp_path):
    root = tmp_path / "tree"
    os.makedirs(root / "cat")
    (root / "cat" / "1.png").write_bytes(b"png")
    (root / "stray.png").write_bytes(b"no class")
    with pytest.raises(BadSampleError, match=r"stray\.png.*directly in the root, not in a class directory"):
        shardtool.pack(str(root), str(tmp_path / "ds"), label_from_dir=True)
    r = shardtool.pack(str(root), str(tmp_path / "ds"), label_from_dir=True, skip_bad=True)
    assert r.samples == 1 and len(r.skipped) == 1 and "stray.png" in r.skipped[0]


def test_a_tree_without_class_directories_says_what_is_expected(tmp_path):
    root = tmp_path / "flat"
    os.makedirs(root)
    (root / "1.png").write_bytes(b"png")
    with pytest.raises(BadSampleError, match=r"no class directories.*ROOT/CLASS/.*FILE"):
        shardtool.pack(str(root), str(tmp_path / "ds"), label_from_dir=True)
    r = shardtool_cli("pack", str(root), "-o", str(tmp_path / "ds"), "--label-from-dir", "-q")
    assert r.returncode != 0 and "no class directories" in r.stderr and "Traceback" not in r.stderr


def test_mixed_extensions_name_the_odd_file_and_what_the_tree_holds(tmp_path):
    root = tmp_path / "tree"
    os.makedirs(root / "dog")
    for i in range(3):
        (root / "dog" / f"{i}.png").write_bytes(b"png")
    (root / "dog" / "odd.jpg").write_bytes(b"jpg")
    with pytest.raises(BadSampleError, match=r"odd\.jpg.*'jpg' differs from the tree's 'png' \(it holds 3 png, 1 jpg"):
        shardtool.pack(str(root), str(tmp_path / "ds"), label_from_dir=True)


def test_options_that_do_not_go_together_are_refused(tmp_path):
    icon_tree(tmp_path / "icons", per_class=1)
    with pytest.raises(ShardtoolError, match="--per-file or --label-from-dir"):
        shardtool.pack(str(tmp_path / "icons"), str(tmp_path / "ds"), label_from_dir=True, per_file=True)
    with pytest.raises(ShardtoolError, match="directories"):
        shardtool.pack([{"a": 1}], str(tmp_path / "ds"), label_from_dir=True)


def test_job_array_merge_keeps_the_classes(tmp_path):
    icon_tree(tmp_path / "icons", per_class=20)
    out = str(tmp_path / "ds")
    for t in range(2):
        shardtool.pack(str(tmp_path / "icons"), out, label_from_dir=True, num_tasks=2, task_index=t)
    from shardtool.pack import merge

    merge(out)
    assert _manifest(out)["extra"]["classes"] == sorted(ICON_CLASSES)
    assert len(read_all(out)) == 80
