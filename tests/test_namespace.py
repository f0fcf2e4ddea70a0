"""One import namespace, one direction of dependency (docs/architecture.md §0), and installs that work.

format ← plan ← cache ← loader ← cli, with pack on format and plan (it uses the planner's pure
environment reader and lengths generator; plan never imports pack).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from helpers.s3server import free_port
from test_loader_data import write_dataset

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The layer order itself (every module, nested packages too, lazy imports included) and the
# absence of import circles: tests/test_layers.py.


def test_planner_and_cache_import_without_torch():
    code = (
        "import sys, shardtool, shardtool.plan, shardtool.cache, shardtool.pack; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr


def test_a_training_repo_with_its_own_loader_and_cache_trains_with_ours(tmp_path):
    # A training repo's own loader.py and cache/ (common next to train.py) must not shadow ours.
    root, _ = write_dataset(str(tmp_path / "ds"), [40, 40], extra=False)
    proj = tmp_path / "proj"
    (proj / "cache").mkdir(parents=True)
    (proj / "loader.py").write_text("WHOSE = 'the training repo'\n")
    (proj / "cache" / "__init__.py").write_text("WHOSE = 'the training repo'\n")
    with open(os.path.join(REPO, "examples", "train_ddp.py")) as f:
        script = f.read()
    # Right after the script imports our loader: the repo's own modules are still the repo's.
    ours = "from shardtool.loader import ShardedLoader  # changed line 1 of 2\n"
    assert ours in script
    (proj / "train.py").write_text(
        script.replace(
            ours,
            ours
            + textwrap.dedent("""
        import cache as repo_cache, loader as repo_loader
        assert repo_loader.WHOSE == repo_cache.WHOSE == 'the training repo'
        import shardtool.cache
        assert 'proj' not in shardtool.cache.__file__ and 'proj' not in ShardedLoader.__module__
        print('OURS AND THEIRS OK')
    """),
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(proj), REPO])  # a user's own repo first on the path
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            f"--master_port={free_port()}",
            "train.py",
            "--data",
            root,
            "--cache-dir",
            str(tmp_path / "c"),
            "--max-tokens",
            "512",
            "--epochs",
            "3",
            "--max-steps",
            "3",
            "--num-workers",
            "1",
            "--collective-timeout",
            "60",
        ],
        cwd=proj,
        env=dict(env, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    # stderr's head: a stalled rank's LoaderError (its shard, byte offset, stack dump) comes before
    # the peers' collective timeouts and torchrun's report.
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[:6000] + res.stderr[-3000:]
    assert res.stdout.count('"steps": 3') == 2 and res.stdout.count("OURS AND THEIRS OK") == 2, res.stdout


@pytest.mark.timeout(300)
def test_wheel_installs_one_namespace(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheel_dir), REPO],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    wheel = next(wheel_dir.glob("shardtool-*.whl"))
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    installed = sorted(os.listdir(target))
    assert "loader" not in installed and "cache" not in installed and "benchmarks" not in installed, installed
    # PEP 561: the annotations ship, so a user's type checker reads them (issue 34).
    assert (target / "shardtool" / "py.typed").is_file()
    code = textwrap.dedent("""
        import shardtool, shardtool.plan, shardtool.cache, shardtool.loader, shardtool.benchmarks.node
        from shardtool.loader import ShardedLoader
        assert shardtool.__file__.startswith(sys.argv[1]), shardtool.__file__
        for top in ("loader", "cache"):
            try:
                __import__(top)
            except ImportError:
                continue
            raise SystemExit(f"a top-level {top!r} module is installed")
        from shardtool.cli import main
        sys.exit(main(["plan", "--synthetic", "1000", "--max-tokens", "4096"]))
    """)
    res = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, str(target)],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "batches/rank" in res.stdout


def test_nothing_in_the_repository_imports_the_top_level_folders():
    # From a checkout, `import loader` would load loader/ as a second, broken copy of shardtool.loader.
    import re

    pattern = re.compile(r"^\s*(from|import) (loader|cache)(\.|\s|$)")
    bad = []
    for folder in ("tests", "tests/helpers", "tests/faults", "tests/slurm", "benchmarks", "examples", "shardtool/cli"):
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if name.endswith(".py"):
                for n, line in enumerate(open(os.path.join(REPO, folder, name)), 1):
                    if pattern.match(line) and "repo_cache" not in line:  # the shadowing test's own modules
                        bad.append(f"{folder}/{name}:{n}: {line.strip()}")
    assert not bad, bad


@pytest.mark.timeout(60)
def test_importing_shardtool_and_its_integrations_imports_no_trainer_and_no_torch():
    """Each trainer adapter imports its trainer only when that module is used."""
    trainers = ("torch", "lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan", "megatron")
    code = (
        f"import sys, shardtool, shardtool.integrations, shardtool.integrations.position; "
        f"print(sorted(m for m in {trainers!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    ).stdout
    assert out.strip() == "[]"
