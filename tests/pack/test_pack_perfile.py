"""Real file trees: ``--per-file`` (one file = one sample), safe unique keys from paths, and what
--skip-bad reports (each skipped file with its reason, a loud warning, --max-skip-fraction)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardtool
from helpers.data_gen import dir_digest, image_samples, read_all, write_tree
from helpers.runcli import shardtool_cli
from shardtool.format.errors import BadSampleError, ShardtoolError
from shardtool.format.keys import MAX_KEY_BYTES, key_problem, keys_for_paths
from shardtool.pack.skips import PackWarning
from shardtool.pack.verify import verify

LONG_NAME = "chapter-" + "x" * 240 + ".html"


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def doc_tree(root) -> dict[str, bytes]:
    """A tree like /usr/share/doc: dotted directory names, files without extensions, mixed and
    double extensions, names that map to one key, non-ASCII and over-long names, hidden entries,
    links. Returns what --per-file must pack: relative path -> bytes."""
    root = str(root)
    want = {
        "README": b"top readme\n",
        "libfoo1.2/copyright": b"(c) foo\n",
        "libfoo1.2/changelog.Debian.gz": bytes(range(256)) * 3,
        "libfoo1.2/html/index.html": b"<html>foo</html>",
        "libfoo1.2/html/style.css": b"body {}",
        "python3.11/site-packages/pkg.name/LICENSE": b"MIT",
        "python3.11/site-packages/pkg.name/notes.txt": b"notes",
        "man/ls.1.gz": b"\x1f\x8b fake gzip",
        "man/Makefile": b"all:\n",
        "clash/a.b": b"dotted",  # a.b and a_b both spell the key clash__a_b
        "clash/a_b": b"underscored",
        "caf\u00e9/\u00fcber.txt": b"non-ascii",
        "long/" + LONG_NAME: b"long name",
        "empty": b"",
    }
    for rel, data in want.items():
        _write(os.path.join(root, rel), data)
    _write(os.path.join(root, ".git/config"), b"hidden dir")  # hidden: ignored
    _write(os.path.join(root, "man/.hidden"), b"hidden file")
    os.symlink("../README", os.path.join(root, "man/README.link"))  # a link to a file: followed
    want["man/README.link"] = want["README"]
    os.symlink("libfoo1.2", os.path.join(root, "foo-link"))  # a link to a directory: not descended
    return want


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["tar", "arrow"])
def test_per_file_packs_a_real_tree(tmp_path, fmt):
    src = tmp_path / "doc"
    want = doc_tree(src)
    # Basename grouping (the default) refuses such a tree, and says what to do instead.
    with pytest.raises(BadSampleError, match=r"README: file has no '<key>.<field>' name \(pack with --per-file"):
        shardtool.pack(str(src), str(tmp_path / "grouped"))
    assert not os.path.exists(tmp_path / "grouped")

    r = shardtool.pack(str(src), str(tmp_path / "o"), per_file=True, samples_per_shard=4, format=fmt)
    assert r.samples == len(want) and r.skipped == [] and r.warnings == []
    ds = shardtool.open_dataset(str(tmp_path / "o"))
    assert [(f.name, f.storage) for f in ds.manifest.fields] == [("bin", "raw"), ("path", "text")]
    got = {s["path"]: s["bin"] for s in ds}
    assert got == want  # every file once, its bytes untouched, under its relative path
    keys = [s["__key__"] for s in ds]
    assert len(set(keys)) == len(keys) and all(key_problem(k) is None for k in keys)
    paths = [s["path"] for s in ds]
    assert paths == sorted(want)  # dataset order is path order
    by_path = dict(zip(paths, keys))
    assert by_path["libfoo1.2/html/index.html"] == "libfoo1_2__html__index_html"
    assert by_path["README"] == "README" and by_path["empty"] == "empty"
    assert by_path["clash/a.b"].startswith("clash__a_b-") and by_path["clash/a_b"].startswith("clash__a_b-")
    assert len(by_path["long/" + LONG_NAME].encode()) <= MAX_KEY_BYTES
    assert verify(str(tmp_path / "o"))["ok"]


@pytest.mark.timeout(120)
def test_several_real_trees_per_file_are_named_under_their_common_parent(tmp_path):
    """Three stdlib packages share file names (``__init__.py``, ...): named from each root, they
    had one key, and the pack failed ("duplicate key '__init___py'")."""
    lib = os.path.dirname(os.__file__)
    trees = [os.path.join(lib, name) for name in ("email", "json", "encodings")]
    want = {
        os.path.relpath(os.path.join(d, f), lib).replace(os.sep, "/")
        for t in trees
        for d, dirs, files in os.walk(t)
        if not any(part.startswith(".") for part in os.path.relpath(d, t).split(os.sep) if part != ".")
        for f in files
        if not f.startswith(".")
    }
    shardtool.pack(trees, str(tmp_path / "o"), per_file=True, format="arrow", workers=2)
    ds = shardtool.open_dataset(str(tmp_path / "o"))
    got = {s["path"]: s["bin"] for s in ds}
    assert set(got) == want and {"email/__init__.py", "json/__init__.py", "encodings/__init__.py"} <= want
    assert got["json/__init__.py"] == open(os.path.join(lib, "json", "__init__.py"), "rb").read()
    assert len({s["__key__"] for s in ds}) == len(want)
    alone = shardtool.open_dataset(shardtool.pack([trees[1]], str(tmp_path / "one"), per_file=True).out)
    assert "__init__.py" in {s["path"] for s in alone}  # one tree: paths as in it, as before


@pytest.mark.timeout(120)
def test_per_file_is_deterministic_and_independent_of_workers(tmp_path):
    src = tmp_path / "doc"
    doc_tree(src)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shardtool.pack(str(src), a, per_file=True, samples_per_shard=3)
    shardtool.pack(str(src), b, per_file=True, samples_per_shard=3)
    assert dir_digest(a) == dir_digest(b)
    w = str(tmp_path / "w")
    shardtool.pack(str(src), w, per_file=True, samples_per_shard=3, workers=3)
    assert read_all(w) == read_all(a)


@pytest.mark.timeout(120)
def test_per_file_bad_files_are_listed_one_by_one(tmp_path):
    src = tmp_path / "doc"
    want = doc_tree(src)
    os.symlink("gone.txt", src / "man" / "dangling")
    os.mkfifo(src / "man" / "pipe")
    with pytest.raises(BadSampleError, match=r"dangling: symbolic link with no target"):
        shardtool.pack(str(src), str(tmp_path / "o"), per_file=True)
    assert not os.path.exists(tmp_path / "o")
    r = shardtool.pack(str(src), str(tmp_path / "o"), per_file=True, skip_bad=True)
    assert r.samples == len(want) and len(r.skipped) == 2
    assert any(s.endswith("man/dangling: symbolic link with no target") for s in r.skipped)
    assert any(s.endswith("man/pipe: not a regular file (a FIFO, socket or device)") for s in r.skipped)
    p = shardtool_cli("pack", str(src), "-o", str(tmp_path / "cli"), "--per-file", "--skip-bad", "-q")
    assert p.returncode == 0, p.stderr
    assert "skipped: " + str(src / "man" / "dangling") + ": symbolic link with no target" in p.stderr
    assert f"packed {len(want)} samples" in p.stdout and "skipped 2" in p.stdout


@pytest.mark.timeout(60)
def test_grouped_tree_skip_bad_skips_the_file_not_the_whole_tree(tmp_path):
    src = write_tree(str(tmp_path / "t"), image_samples(6))
    open(os.path.join(src, "NOTES"), "wb").close()
    os.makedirs(os.path.join(src, "v1.2"))
    open(os.path.join(src, "v1.2", "0001.jpg"), "wb").close()
    r = shardtool.pack(src, str(tmp_path / "o"), skip_bad=True)
    assert r.samples == 6 and len(r.skipped) == 2
    assert any("NOTES: file has no '<key>.<field>' name" in s for s in r.skipped)
    assert any("0001.jpg: key 'v1.2__0001' contains '.'" in s for s in r.skipped)


def _mostly_bad_tree(root, good: int, bad: int) -> str:
    for i in range(good):
        _write(os.path.join(root, f"doc{i}.txt"), f"doc {i}".encode())
    for i in range(bad):
        os.symlink(f"missing{i}", os.path.join(root, f"broken{i}"))
    return str(root)


@pytest.mark.timeout(120)
def test_most_skipped_warns_and_max_skip_fraction_fails_publishing_nothing(tmp_path):
    src = _mostly_bad_tree(tmp_path / "src", good=3, bad=7)  # 7 of 10 skipped
    with pytest.warns(PackWarning, match=r"MOST SAMPLES WERE SKIPPED: 7 of 10 \(70%\)"):
        r = shardtool.pack(src, str(tmp_path / "loud"), per_file=True, skip_bad=True)
    assert r.samples == 3 and len(r.warnings) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under the limit: no warning
        ok = shardtool.pack(src, str(tmp_path / "ok"), per_file=True, max_skip_fraction=0.7)
    assert ok.samples == 3 and os.path.exists(tmp_path / "ok" / "index.json")

    # A fresh OUT: the failed pack leaves no trace of itself.
    with pytest.raises(
        ShardtoolError,
        match=r"7 of 10 samples were skipped \(70.0%\), more than "
        r"--max-skip-fraction 0.5; nothing was published",
    ):
        shardtool.pack(src, str(tmp_path / "fresh"), per_file=True, max_skip_fraction=0.5)
    assert not os.path.exists(tmp_path / "fresh")
    # An OUT that holds other things: they stay, nothing of the failed pack does.
    out = tmp_path / "kept"
    _write(str(out / "NOTES.md"), b"mine")
    _write(str(out / "shards" / "mine.bin"), b"mine too")
    with pytest.raises(ShardtoolError, match="more than --max-skip-fraction"):
        shardtool.pack(src, str(out), per_file=True, max_skip_fraction=0.5)
    assert dir_digest(str(out)) == {"NOTES.md": b"mine", os.path.join("shards", "mine.bin"): b"mine too"}

    p = shardtool_cli("pack", src, "-o", str(tmp_path / "cli"), "--per-file", "--skip-bad", "-q")
    assert p.returncode == 0 and "WARNING: MOST SAMPLES WERE SKIPPED: 7 of 10" in p.stderr
    p = shardtool_cli("pack", src, "-o", str(tmp_path / "cli2"), "--per-file", "--max-skip-fraction", "0.25", "-q")
    assert p.returncode == 1 and "more than --max-skip-fraction 0.25" in p.stderr
    assert not os.path.exists(tmp_path / "cli2")
    p = shardtool_cli("pack", src, "-o", str(tmp_path / "cli3"), "--per-file", "--skip-bad", "--json")
    assert p.returncode == 0 and len(json.loads(p.stdout)["skipped"]) == 7


@pytest.mark.timeout(120)
def test_max_skip_fraction_in_a_job_array_touches_no_other_task(tmp_path):
    src = tmp_path / "src"
    for i in range(8):
        _write(str(src / f"a{i:02d}.txt"), b"good")
    for i in range(8):  # sorted after the good ones: all in the second task's slice
        os.symlink("missing", str(src / f"z{i:02d}"))
    out = str(tmp_path / "o")
    r0 = shardtool.pack(str(src), out, per_file=True, num_tasks=2, task_index=0, max_skip_fraction=0.5)
    assert r0.fragment and r0.samples > 0
    before = dir_digest(out)
    with pytest.raises(ShardtoolError, match="more than --max-skip-fraction 0.5"):
        shardtool.pack(str(src), out, per_file=True, num_tasks=2, task_index=1, max_skip_fraction=0.5)
    assert dir_digest(out) == before  # task 0's shards and fragment untouched, nothing of task 1


# Relative paths of distinct files: 1-4 components of printable text without '/' or NUL.
_component = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1, max_size=30
).filter(lambda c: c not in (".", ".."))
_rel_paths = st.lists(st.lists(_component, min_size=1, max_size=4).map("/".join), min_size=1, max_size=30, unique=True)


@settings(max_examples=300, deadline=None)
@given(_rel_paths, st.randoms(use_true_random=False))
def test_keys_for_paths_are_valid_unique_and_order_free(rels, rnd):
    keys = keys_for_paths(rels)
    assert len(set(keys)) == len(keys)
    assert all(key_problem(k) is None for k in keys), [(r, k, key_problem(k)) for r, k in zip(rels, keys)]
    shuffled = list(zip(rels, keys))
    rnd.shuffle(shuffled)
    assert keys_for_paths([r for r, _ in shuffled]) == [k for _, k in shuffled]
