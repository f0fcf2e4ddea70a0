"""Running examples/slurm/prolog.sh as SLURM would: no PATH, a minimal environment, a config file."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROLOG = os.path.join(REPO, "examples", "slurm", "prolog.sh")


def prolog_conf(directory, dataset: str, hosts: list[str], cache_root, **settings) -> str:
    """A warm.conf (and a fake scontrol that expands the job's node list to ``hosts``) in ``directory``;
    ``settings`` are further config variables (JOBS=4, MESH="pp=2,dp=2", ...)."""
    scontrol = os.path.join(directory, "scontrol")
    with open(scontrol, "w") as f:
        f.write("#!/bin/bash\n# fake: expands the node list the way scontrol show hostnames does\n"
                "[ \"$1 $2\" = 'show hostnames' ] || exit 1\nprintf '" + "\\n".join(hosts) + "\\n'\n")
    os.chmod(scontrol, 0o755)
    conf = os.path.join(directory, "warm.conf")
    lines = {"SHARDTOOL_PYTHON": sys.executable, "SCONTROL": scontrol, "DATASET_URL": dataset,
             "CACHE_ROOT": str(cache_root), **settings}
    with open(conf, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in lines.items()))
    return conf


def run_prolog(conf: str, node: str, *, job_id: str, nodelist: str, num_nodes: int,
               timeout: float = 100) -> subprocess.CompletedProcess:
    """The prolog on ``node``, with only what a prolog has (plus PYTHONPATH so this checkout's code runs)."""
    env = {"SLURM_JOB_ID": job_id, "SLURMD_NODENAME": node, "SLURM_JOB_NODELIST": nodelist,
           "SLURM_JOB_NUM_NODES": str(num_nodes), "SHARDTOOL_WARM_CONF": conf, "PYTHONPATH": REPO}
    return subprocess.run(["/bin/bash", PROLOG], env=env, capture_output=True, text=True, timeout=timeout)
