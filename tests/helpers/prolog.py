"""Running examples/slurm/prolog.sh as SLURM would: no PATH, a minimal environment, a config file."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
PROLOG = os.path.join(REPO, "examples", "slurm", "prolog.sh")


def _script(path: str, body: str) -> str:
    with open(path, "w") as f:
        f.write(body)
    os.chmod(path, 0o755)
    return path


def prolog_conf(directory, hosts: list[str], cache_root, *, active: list[str] | None = None, **settings) -> str:
    """A warm.conf (the admin's settings only), a fake scontrol that expands the job's node list to
    ``hosts`` and a fake squeue that lists ``active`` job ids (None: squeue fails), in ``directory``;
    ``settings`` are further config variables (JOBS=4, MAX_BYTES=1M, ...)."""
    scontrol = _script(
        os.path.join(directory, "scontrol"),
        "#!/bin/bash\n# fake: expands the node list the way scontrol show hostnames does\n"
        "[ \"$1 $2\" = 'show hostnames' ] || exit 1\nprintf '" + "\\n".join(hosts) + "\\n'\n",
    )
    listing = "exit 1\n" if active is None else "printf '" + "".join(f"{j}\\n" for j in active) + "'\n"
    squeue = _script(os.path.join(directory, "squeue"), "#!/bin/bash\n# fake: the job ids SLURM lists\n" + listing)
    conf = os.path.join(directory, "warm.conf")
    lines = {
        "SHARDTOOL_PYTHON": sys.executable,
        "SCONTROL": scontrol,
        "SQUEUE": squeue,
        "CACHE_ROOT": str(cache_root),
        **settings,
    }
    with open(conf, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in lines.items()))
    return conf


def run_prolog(
    conf: str,
    node: str,
    *,
    job_id: str,
    nodelist: str,
    num_nodes: int,
    comment: str | None = None,
    workdir: str | None = None,
    timeout: float = 100,
) -> subprocess.CompletedProcess:
    """The prolog on ``node`` for a job submitted with ``--comment COMMENT``, with only what a prolog
    has (plus PYTHONPATH so this checkout's code runs)."""
    env = {
        "SLURM_JOB_ID": job_id,
        "SLURMD_NODENAME": node,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(num_nodes),
        "SHARDTOOL_WARM_CONF": conf,
        "PYTHONPATH": REPO,
    }
    if comment is not None:
        env["SLURM_JOB_COMMENT"] = comment
    if workdir is not None:
        env["SLURM_JOB_WORK_DIR"] = workdir
    return subprocess.run(["/bin/bash", PROLOG], env=env, capture_output=True, text=True, timeout=timeout)
