"""Running the ``shardtool`` command of this checkout in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def repo_env() -> dict:
    """This environment, with this checkout importable first."""
    return dict(os.environ, PYTHONPATH=REPO)


def shardtool_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m shardtool ARGS``: captured text output, never hanging past ``timeout``."""
    return subprocess.run(
        [sys.executable, "-m", "shardtool", *args], env=repo_env(), capture_output=True, text=True, timeout=timeout
    )
