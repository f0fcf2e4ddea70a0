"""`shardtool --version` and `shardtool.__version__`: the installed package's version, whose one
source is pyproject.toml; and the changelog has an entry for it."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

import shardtool
from helpers.runcli import REPO, repo_env, shardtool_cli


def _pyproject_version() -> str:
    with open(f"{REPO}/pyproject.toml") as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


def test_version_is_the_installed_metadata():
    assert shardtool.__version__ == importlib.metadata.version("shardtool")
    assert "__version__" in dir(shardtool)


def test_cli_prints_the_version_on_stdout():
    res = shardtool_cli("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"shardtool {importlib.metadata.version('shardtool')}\n" and not res.stderr


def test_importing_shardtool_does_not_read_the_metadata():
    # The lookup costs ~0.1 s; only asking for the version pays it.
    code = "import sys, shardtool; assert 'importlib.metadata' not in sys.modules; print(shardtool.__version__)"
    res = subprocess.run([sys.executable, "-c", code], env=repo_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr


def test_the_changelog_has_an_entry_for_this_version():
    version = _pyproject_version()
    with open(f"{REPO}/CHANGELOG.md") as f:
        headings = re.findall(r"^## \[?([0-9][^\]\s]*)", f.read(), re.M)
    assert headings and headings[0] == version, (
        f"CHANGELOG.md's latest entry is {headings[:1]}, pyproject says {version}"
    )
