"""The README's two set-up commands, exactly as written, in a fresh venv (CI step `freshvenv`).

A fresh machine has none of the packages this machine has accumulated: a dependency the
scripts use but do not install (matplotlib for the quickstart's plot) passes every other test
and fails the first command a user runs. So a copy of the checkout is set up from nothing — a
`python3 -m venv` without system site packages, no PYTHONPATH — and both commands run there as
the README writes them. Slow (installs, then the whole quickstart: minutes), so it is marked
``freshvenv``: left out of the default run, run by `.ci/run` as its own step.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# One quick test, so the suite's run stays short; tests/run.sh's install part runs as written, and
# pytest still collects (imports) every test module, so a test dependency it failed to install is an error.
QUICK_TEST = "test_every_option_has_help_text"
# What pip prints in red when an install breaks another installed package's requirement: a clean
# set-up prints none (tests/helpers/keep_pins.py, benchmarks/setup_peers.sh).
RESOLVER_ERROR = "ERROR: pip's dependency resolver"


def readme_setup_commands() -> list[str]:
    """The commands of the README's "Set-up: two commands" block, comments stripped."""
    text = README.read_text()
    section = text.split("## Set-up: two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def _checkout_copy(dest: Path) -> Path:
    """The checkout as a fresh clone has it: no build outputs, work files or caches."""
    junk = shutil.ignore_patterns(
        ".git", "_work", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", ".venv"
    )
    shutil.copytree(REPO, dest, symlinks=True, ignore=junk)
    return dest


def _fresh_env() -> dict:
    """A user's shell before `source venv/bin/activate`: none of this run's Python settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CONDA", "PYTEST", "SHARDTOOL_NO_INSTALL", "OMP_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _in_venv(venv: Path, command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``command`` in bash with ``venv`` activated; the whole process group killed past ``timeout``."""
    script = f'source "{venv}/bin/activate" && {command}'
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=_fresh_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its ranks and their workers too
        out, _ = proc.communicate()
        pytest.fail(f"{command!r} in a fresh venv ran past {timeout:g} s\n{out[-6000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def test_readme_states_the_two_commands():
    assert readme_setup_commands() == ["bash examples/quickstart.sh", "bash tests/run.sh"]


@pytest.mark.freshvenv
@pytest.mark.timeout(3000)
def test_readme_setup_commands_pass_in_a_fresh_venv(tmp_path):
    quickstart, tests = readme_setup_commands()
    repo = _checkout_copy(tmp_path / "checkout")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=_fresh_env())
    bare = _in_venv(venv, 'python3 -c "import torch"', repo, 60)
    assert bare.returncode != 0, "the fresh venv already sees torch: it is not fresh"

    cp = _in_venv(venv, quickstart, repo, 1500)
    assert cp.returncode == 0, f"{quickstart} exited {cp.returncode}\n{cp.stdout[-6000:]}"
    assert "checks: equal steps, exactly once, remainder as planned: OK" in cp.stdout, cp.stdout[-4000:]
    assert RESOLVER_ERROR not in cp.stdout, cp.stdout[-4000:]
    work = repo / "_work" / "quickstart"
    assert (work / "loader-stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    where = _in_venv(venv, 'python3 -c "import shardtool; print(shardtool.__file__)"', venv, 60)
    assert where.stdout.strip() == str(repo / "shardtool" / "__init__.py"), where.stdout

    cp = _in_venv(venv, f"{tests} -k {QUICK_TEST}", repo, 1200)
    assert cp.returncode == 0, f"{tests} -k {QUICK_TEST} exited {cp.returncode}\n{cp.stdout[-6000:]}"
    assert re.search(r"\b1 passed\b", cp.stdout), cp.stdout[-4000:]
    assert RESOLVER_ERROR not in cp.stdout, cp.stdout[-4000:]
