"""requires-python says >= 3.10: the package must not use 3.11-only features unguarded.

``add_note`` (3.11+) goes through ``shardtool.format.errors.add_note``. Its 3.10 branch is run on
a real Python 3.10 interpreter where one is installed (pyenv or PATH); the helper's module is
loaded by file path there, since the interpreter has none of the package's dependencies.
"""

from __future__ import annotations

import glob
import os
import pickle
import re
import shutil
import subprocess
import traceback

import pytest

from shardtool.format.errors import BadSampleError, add_note

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERRORS_PY = os.path.join(ROOT, "shardtool", "format", "errors.py")


def _python310() -> str | None:
    """A Python 3.10 that runs (a pyenv shim on PATH may name one that is not installed)."""
    cands = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")), reverse=True)
    cands += [shutil.which("python3.10")] if shutil.which("python3.10") else []
    for exe in cands:
        try:
            r = subprocess.run(
                [exe, "-I", "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.stdout.strip() == "True":
            return exe
    return None


PY310 = _python310()
needs_310 = pytest.mark.skipif(PY310 is None, reason="no Python 3.10 interpreter installed (pyenv or PATH)")

ON_310 = r"""
import importlib.util, pickle, sys, traceback
assert sys.version_info[:2] == (3, 10), sys.version
assert not hasattr(BaseException, "add_note")
spec = importlib.util.spec_from_file_location("errors", sys.argv[1])
errors = importlib.util.module_from_spec(spec)
sys.modules["errors"] = errors
spec.loader.exec_module(errors)

def fail():
    try:
        raise errors.BadSampleError("line is bad", source="in.jsonl", position="line 3")
    except errors.BadSampleError as e:
        raise errors.add_note(e, "while packing unit 7")

try:
    fail()
except errors.BadSampleError as e:
    assert e.__notes__ == ["while packing unit 7"], e.__notes__
    assert e.source == "in.jsonl" and e.reason == "line is bad"
    printed = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    assert "in.jsonl (line 3): line is bad" in printed and "while packing unit 7" in printed, printed
    back = pickle.loads(pickle.dumps(e))
    assert "while packing unit 7" in str(back) and back.__notes__ == e.__notes__
os_err = FileNotFoundError(2, "No such file")
errors.add_note(os_err, "reading shard 3")
assert os_err.__notes__ == ["reading shard 3"] and os_err.errno == 2 and os_err.args == (2, "No such file")
print("ok")
"""


@needs_310
@pytest.mark.timeout(60)
def test_add_note_on_python_310_keeps_the_real_error():
    r = subprocess.run([PY310, "-I", "-c", ON_310, ERRORS_PY], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@needs_310
@pytest.mark.timeout(120)
def test_package_sources_parse_on_python_310():
    files = [
        f
        for d in ("shardtool", "loader", "cache")
        for f in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)
    ]
    script = (
        "import sys\nfor p in sys.argv[1:]:\n    compile(open(p, encoding='utf-8').read(), p, 'exec')\n"
        "print(len(sys.argv) - 1)"
    )
    r = subprocess.run([PY310, "-I", "-c", script, *files], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and r.stdout.strip() == str(len(files)), r.stderr


def test_add_note_uses_the_native_notes_where_they_exist():
    e = BadSampleError("bad", source="x.jsonl")
    assert add_note(e, "in unit 2") is e
    assert e.__notes__ == ["in unit 2"] and str(e) == "x.jsonl: bad"  # 3.11+ prints notes itself
    assert "in unit 2" in "".join(traceback.format_exception(e))
    assert pickle.loads(pickle.dumps(e)).__notes__ == ["in unit 2"]


def test_no_direct_add_note_calls_in_shardtool():
    """Every note goes through the helper."""
    offenders = []
    paths = {
        os.path.realpath(f)
        for d in ("shardtool", "loader", "cache")
        for f in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)
    }
    for path in sorted(paths):
        if path == ERRORS_PY:
            continue
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            if re.search(r"\.add_note\(", line):
                offenders.append(f"{os.path.relpath(path, ROOT)}:{n}")
    assert not offenders
