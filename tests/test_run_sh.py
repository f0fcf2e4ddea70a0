"""tests/run.sh as a user calls it, and the pins it keeps while installing (tests/helpers/keep_pins.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return {**env, **extra}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("verbosity", [[], ["-q"], ["-v"]])
def test_run_sh_keeps_pytests_closing_line_whatever_verbosity_the_user_adds(tmp_path, verbosity):
    # `bash tests/run.sh -q ...` (the README's command plus a user's -q) once gave pytest -q -q,
    # which drops the closing "N passed" line.
    (tmp_path / "test_tiny.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    cp = subprocess.run(
        ["bash", str(REPO / "tests" / "run.sh"), *verbosity, str(tmp_path / "test_tiny.py")],
        env=_env(SHARDTOOL_NO_INSTALL="1", PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert re.search(r"^.*\b2 passed\b", cp.stdout, re.M), cp.stdout


def _fake_dist(site: Path, name: str, *requires: str) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(60)
def test_keep_pins_keeps_an_installed_tools_exact_pins_and_nothing_else(tmp_path):
    # The shape that printed pip's resolver ERROR: awscli pins botocore exactly, our test extra
    # (moto, s3fs) would upgrade it. A range, a marker-bound pin and two tools pinning one package
    # to different versions give no constraint.
    site = tmp_path / "site"
    _fake_dist(site, "awscli", "botocore (==1.43.11)", "docutils (<=0.19,>=0.18.1)")
    _fake_dist(site, "othertool", 'colorama==0.4.0; extra == "color"', "rsa==4.0")
    _fake_dist(site, "thirdtool", "rsa==4.7")
    cp = subprocess.run(
        [sys.executable, str(REPO / "tests" / "helpers" / "keep_pins.py")],
        env=_env(PYTHONPATH=str(site)),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert cp.returncode == 0, cp.stderr
    pins = set(cp.stdout.split())
    assert "botocore==1.43.11" in pins
    assert not any(p.startswith(("docutils", "colorama", "rsa")) for p in pins), pins
