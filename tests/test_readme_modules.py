"""Every `python -m MODULE` the README and the examples tell a user to run works outside the checkout.

The repository's top-level `benchmarks/` folder is importable as `benchmarks` only from the
checkout's root; installed, it is `shardtool.benchmarks`. So the module names are run here from
another directory, with only the `shardtool` package importable — as after `pip install`. A
command the README says is for a checkout (on the same line: "from a checkout") is left out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "examples").glob("*.sh"))]
# `python -m X`, `python3 -m X`, and the scripts' `"$PY" -m X`, also broken across a line.
PATTERN = re.compile(r'(?:\bpython3?|"\$PY")\s+-m\s+([A-Za-z_][\w.]*)')


def documented_modules() -> dict[str, str]:
    """module -> where it is documented (file:line), for modules a user runs anywhere."""
    found = {}
    for doc in DOCS:
        text = doc.read_text()
        for m in PATTERN.finditer(text):
            line_no = text.count("\n", 0, m.start()) + 1
            lines = text.splitlines()[line_no - 1 : line_no + 1]
            if any("from a checkout" in line for line in lines):
                continue
            found.setdefault(m.group(1), f"{doc.relative_to(REPO)}:{line_no}")
    return found


def test_the_docs_name_the_benchmark_modules_by_their_installed_name():
    modules = documented_modules()
    assert "shardtool.benchmarks.corpus" in modules  # the quickstart's first step, by hand
    wrong = {m: where for m, where in modules.items() if m.split(".")[0] in ("benchmarks", "loader", "cache")}
    assert not wrong, f"importable only from the checkout's root, use shardtool.<name>: {wrong}"


@pytest.mark.timeout(600)
def test_every_documented_module_runs_outside_the_checkout(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "shardtool").symlink_to(REPO / "shardtool")  # the package alone, as installed
    env = dict(os.environ, PYTHONPATH=str(site))
    failed = {}
    for module, where in documented_modules().items():
        cp = subprocess.run(
            [sys.executable, "-m", module, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        if cp.returncode != 0:
            failed[f"{module} ({where})"] = cp.stderr.strip().splitlines()[-1:]
    assert not failed, failed
