"""Python API over tests/slurm/cluster.sh: a private single-machine SLURM cluster for tests.

    from tests.slurm.harness import LocalSlurm          # or: from .harness import LocalSlurm
    with LocalSlurm() as c:                             # up(2) on enter, down() on exit
        r = c.sbatch("job.sh", "-N2", wait=True, timeout=60)
        assert r.state == "COMPLETED" and r.exit_code == 0
        subprocess.run(["squeue"], env=c.env, timeout=10)

Every subprocess call has a timeout. Client commands get ``self.env``: the caller's environment minus any
inherited SLURM_*/SBATCH_*/SRUN_*/SALLOC_* variables (running pytest inside a real allocation would otherwise
make srun join *that* job), plus SLURM_CONF, SLURM_TEST_DIR and the marker SHARDTOOL_SLURM_TEST_DIR that lets
``down()`` find and kill leftover job processes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

CLUSTER_SH = Path(__file__).resolve().parent / "cluster.sh"

TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
_STRIP_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCONTROL_")
_REQUIRED_BINARIES = (
    "/usr/sbin/slurmctld",
    "/usr/sbin/slurmd",
    "/usr/sbin/munged",
    "/usr/bin/srun",
    "/usr/bin/sbatch",
    "/usr/bin/scontrol",
    "/usr/bin/sinfo",
)


class SlurmError(RuntimeError):
    """A cluster or client command failed; the message carries output and log tails."""


@dataclasses.dataclass
class JobResult:
    jobid: int
    state: str | None  # e.g. COMPLETED/FAILED/PENDING; None if the record is already purged
    exit_code: int | None  # from ExitCode=code:signal
    signal: int | None
    output: Path | None  # the job's stdout file (the harness sets -o unless the caller did)
    info: dict  # last `scontrol show job -o` fields

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == 0

    def read_output(self) -> str:
        return self.output.read_text() if self.output and self.output.exists() else ""


def available() -> tuple[bool, str]:
    """Can a local cluster be started here? (True, how) or (False, why not). Cheap, starts nothing."""
    if os.name != "posix" or not Path("/proc/self").exists():
        return False, "needs Linux (/proc)"
    if os.geteuid() != 0:
        return False, "needs root (SlurmUser=root, munged started via runuser)"
    if not shutil.which("bash") or not Path("/usr/sbin/runuser").exists() and not shutil.which("runuser"):
        return False, "needs bash and runuser"
    missing = [b for b in _REQUIRED_BINARIES if not os.access(b, os.X_OK)]
    if not missing:
        return True, "slurm-wlm installed"
    if shutil.which("apt-get"):
        return True, "slurm-wlm missing; cluster.sh will apt-get install it"
    return False, f"slurm-wlm not installed ({', '.join(missing)}) and no apt-get to install it"


def _pid_alive(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1] != "Z"
    except OSError:
        return False
    return False


def _parse_kv(line: str) -> dict:
    """Parse `scontrol show ... -o` one-line output (Key=Value separated by spaces; values may contain '=')."""
    out: dict[str, str] = {}
    key = None
    for tok in line.split():
        if "=" in tok and tok.split("=", 1)[0].replace("/", "").replace(":", "").isalnum():
            key, val = tok.split("=", 1)
            out[key] = val
        elif key is not None:  # value with spaces (e.g. Reason=Prolog error ...)
            out[key] += " " + tok
    return out


class LocalSlurm:
    def __init__(
        self,
        state_dir: str | os.PathLike | None = None,
        *,
        script: Path = CLUSTER_SH,
        up_timeout: float = 300.0,
        cmd_timeout: float = 30.0,
    ):
        self._given_dir = Path(state_dir) if state_dir else None
        self.dir: Path | None = None
        self.script = Path(script)
        self.up_timeout = up_timeout
        self.cmd_timeout = cmd_timeout
        self.nodes: list[str] = []
        self.prolog: Path | None = None
        self.config: dict[str, str] = {}
        self.last_up_seconds: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def up(self, nodes: int = 2, prolog: str | os.PathLike | None = None) -> LocalSlurm:
        """Start munged, slurmctld and `nodes` slurmd (node1..nodeN); blocks until all are idle.

        prolog: executable script run by slurmd as root before each job on each node (no PATH, no job env;
        it gets SLURM_CONF and can `. "${SLURM_CONF%/*}/cluster.env"`). None = the default logging prolog.
        """
        if self.dir is None:
            self.dir = self._given_dir or Path(tempfile.mkdtemp(prefix="shardtool-slurm-"))
        # who owns this cluster: reap_orphans() stops clusters whose owning process died without down()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "owner.pid").write_text(f"{os.getpid()}\n")
        env = self._script_env()
        if prolog is not None:
            p = Path(prolog).resolve()
            if not os.access(p, os.X_OK):
                raise SlurmError(f"prolog {p} is not executable")
            env["SLURM_TEST_PROLOG"] = str(p)
        t0 = time.monotonic()
        self._script(["up", str(nodes)], env=env, timeout=self.up_timeout)
        self.last_up_seconds = time.monotonic() - t0
        self.config = self._read_cluster_env()
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.prolog = Path(self.config.get("SLURM_TEST_PROLOG", "")) or None
        return self

    def down(self) -> None:
        """Cancel jobs, stop every daemon of this cluster, remove its state dir. Idempotent."""
        if self.dir is None:
            return
        self._script(["down"], env=self._script_env(), timeout=120)
        self.nodes = []
        self.dir = None

    def restart(self, nodes: int | None = None, prolog: str | os.PathLike | None = None) -> LocalSlurm:
        """down + up in the same state dir path (job ids restart at 1; drained nodes come back idle)."""
        n = nodes or len(self.nodes) or 2
        given = self._given_dir
        if self.dir is not None:
            self._given_dir = self.dir
            self.down()
        try:
            return self.up(n, prolog=prolog)
        finally:
            self._given_dir = given

    def status(self) -> str:
        return self._script(["status"], env=self._script_env(), timeout=30, check=False).stdout

    def __enter__(self) -> LocalSlurm:
        if not self.nodes:
            self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    @classmethod
    def reap_orphans(cls, pattern: str = "shardtool-slurm-*") -> list[Path]:
        """Stop clusters under the temp dir left by a test process that died without down() (e.g. killed by
        a hard timeout). Only dirs with an owner.pid whose process is gone; manual cluster.sh dirs are kept."""
        reaped = []
        for d in Path(tempfile.gettempdir()).glob(pattern):
            try:
                pid = int((d / "owner.pid").read_text().strip())
            except (OSError, ValueError):
                continue
            if pid == os.getpid() or _pid_alive(pid):
                continue
            c = cls(d)
            c.dir = d
            try:
                c.down()
                reaped.append(d)
            except SlurmError:
                pass
        return reaped

    # ------------------------------------------------------------------ paths and env
    @property
    def conf(self) -> Path:
        self._need_up()
        return self.dir / "slurm.conf"

    def node_dir(self, node: str) -> Path:
        """The emulated node-local disk of `node` (`$SLURM_TEST_NODE_ROOT/<node>/local`)."""
        self._need_up()
        return self.dir / "nodes" / node / "local"

    @property
    def env(self) -> dict:
        """Environment for client commands (srun, sbatch, squeue, ...) and anything that calls them."""
        self._need_up()
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_PREFIXES)}
        env.update(
            SLURM_CONF=str(self.dir / "slurm.conf"),
            SLURM_TEST_DIR=str(self.dir),
            SHARDTOOL_SLURM_TEST_DIR=str(self.dir),
        )
        return env

    # ------------------------------------------------------------------ clients
    def run(
        self, argv: Sequence[str], *, timeout: float | None = None, check: bool = True, **kw
    ) -> subprocess.CompletedProcess:
        """Run any command against this cluster (env set), killing its whole process group on timeout."""
        return self._run(
            list(argv), env=kw.pop("env", self.env), timeout=timeout or self.cmd_timeout, check=check, **kw
        )

    def srun(self, *args: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """`srun ARGS...`; e.g. c.srun("-N2", "--ntasks-per-node=1", "hostname"). Returns CompletedProcess."""
        return self.run(["srun", *args], timeout=timeout, check=check, **kw)

    def sbatch(
        self,
        script: str | os.PathLike,
        *options: str,
        script_args: Iterable[str] = (),
        wait: bool = True,
        timeout: float = 120,
        poll: float = 0.2,
        **kw,
    ) -> JobResult:
        """Submit `sbatch OPTIONS... SCRIPT SCRIPT_ARGS...`. With wait=True block until a terminal state
        (raises TimeoutError with job info and log tails after `timeout`). Unless an -o/--output option is
        given, stdout goes to $SLURM_TEST_DIR/jobs/slurm-<jobid>.out."""
        self._need_up()
        opts = list(options)
        output = None
        if not any(o == "-o" or o.startswith(("--output", "-o")) for o in opts):
            (self.dir / "jobs").mkdir(exist_ok=True)
            opts.append(f"--output={self.dir}/jobs/slurm-%j.out")
        cp = self.run(["sbatch", "--parsable", *opts, str(script), *script_args], timeout=30, **kw)
        jobid = int(cp.stdout.strip().split(";")[0])
        if output is None and any(o.startswith("--output=" + str(self.dir)) for o in opts):
            output = self.dir / "jobs" / f"slurm-{jobid}.out"
        if wait:
            self.wait_state(jobid, TERMINAL_STATES, timeout=timeout, poll=poll)
        return self.job_result(jobid, output=output)

    def job_info(self, jobid: int) -> dict:
        """`scontrol show job -o` as a dict, {} once the record is purged (MinJobAge after the end)."""
        cp = self.run(["scontrol", "show", "job", "-o", str(jobid)], check=False, timeout=15)
        if cp.returncode != 0 or not cp.stdout.strip():
            if "Invalid job id" in cp.stderr:
                return {}
            raise SlurmError(f"scontrol show job {jobid} failed: {cp.stderr.strip()}")
        return _parse_kv(cp.stdout.splitlines()[0])

    def job_state(self, jobid: int) -> str | None:
        """JobState (RUNNING, PENDING, COMPLETED, ...) or None if unknown/purged."""
        return self.job_info(jobid).get("JobState")

    def job_result(self, jobid: int, output: Path | None = None) -> JobResult:
        info = self.job_info(jobid)
        code = sig = None
        if "ExitCode" in info:
            c, _, s = info["ExitCode"].partition(":")
            code, sig = int(c), int(s or 0)
        if output is None and info.get("StdOut"):
            output = Path(info["StdOut"])
        return JobResult(jobid, info.get("JobState"), code, sig, output, info)

    def wait_state(self, jobid: int, states: str | Iterable[str], timeout: float = 60, poll: float = 0.2) -> str:
        """Poll until JobState is one of `states`; returns it. TimeoutError (with diagnostics) otherwise."""
        return self._poll_state(
            f"job {jobid}", lambda: self.job_state(jobid), states, timeout, poll, lambda: self.job_info(jobid)
        )

    def scancel(self, jobid: int, *options: str) -> None:
        self.run(["scancel", *options, str(jobid)], timeout=15)

    def requeue(self, jobid: int, hold: bool = False, start_now: bool = True, timeout: float = 30) -> None:
        """`scontrol requeue` (or requeuehold): the job goes back to PENDING and runs again with
        SLURM_RESTART_COUNT incremented.

        slurmctld gives a requeued job BeginTime = now + 120 s (hard-coded). With start_now (default) we wait
        for it to be PENDING (it passes through COMPLETING) and its old steps to be gone, then set
        StartTime=now+2. Not `now`: killing the first run makes slurmd revoke the job id's credential with
        one-second resolution, and a relaunch whose credential is from the same second is refused
        ("Job N already killed, do not launch batch job") and the job ends FAILED, ExitCode 1.
        """
        self.run(["scontrol", "requeuehold" if hold else "requeue", str(jobid)], timeout=15)
        if start_now and not hold:
            self.wait_state(jobid, {"PENDING"}, timeout=timeout)
            self._wait_steps_gone(jobid, timeout=timeout)
            self.run(["scontrol", "update", f"jobid={jobid}", "StartTime=now+2"], timeout=15)

    def _wait_steps_gone(self, jobid: int, timeout: float) -> None:
        """Until every slurmstepd of the job's previous run is gone: each holds a socket
        <spool>/<node>_<jobid>.<step> (relaunching while one lingers could race with the old run)."""
        deadline = time.monotonic() + timeout
        while any((self.dir / "spool").glob(f"*/*_{jobid}.*")):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {jobid}: old steps still present after {timeout}s\n{self.logs_tail()}")
            time.sleep(0.1)

    def release(self, jobid: int) -> None:
        self.run(["scontrol", "release", str(jobid)], timeout=15)

    # ------------------------------------------------------------------ nodes
    def node_info(self, node: str) -> dict:
        cp = self.run(["scontrol", "show", "node", "-o", node], timeout=15)
        return _parse_kv(cp.stdout.splitlines()[0])

    def node_states(self) -> dict[str, str]:
        """{'node1': 'idle', 'node2': 'drained', ...} (sinfo's long state names, lower case)."""
        cp = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
        return dict(line.split(None, 1) for line in cp.stdout.splitlines() if line.strip())

    def wait_node_state(self, node: str, states: str | Iterable[str], timeout: float = 60, poll: float = 0.2) -> str:
        return self._poll_state(
            node, lambda: self.node_states().get(node), states, timeout, poll, lambda: self.node_info(node)
        )

    def _poll_state(self, what: str, get, states: str | Iterable[str], timeout: float, poll: float, info):
        """Poll `get()` until it returns one of `states`; TimeoutError with `info()` and log tails."""
        want = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            state = get()
            if state in want:
                return state
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{what} not in {sorted(want)} after {timeout}s (now {state})\n{info()}\n{self.logs_tail()}"
                )
            time.sleep(poll)

    def resume_node(self, node: str, timeout: float = 30) -> None:
        """Undrain `node` (scontrol update state=resume) and wait until it is idle again."""
        self.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=15)
        self.wait_node_state(node, {"idle", "mixed", "allocated"}, timeout=timeout)

    # ------------------------------------------------------------------ diagnostics
    def logs_tail(self, lines: int = 15) -> str:
        if self.dir is None:
            return ""
        chunks = []
        for f in [self.dir / "log" / "slurmctld.log", *sorted((self.dir / "log").glob("slurmd.*.log"))]:
            if f.exists():
                tail = f.read_text(errors="replace").splitlines()[-lines:]
                chunks.append(f"----- {f}\n" + "\n".join(tail))
        return "\n".join(chunks)

    # ------------------------------------------------------------------ internals
    def _need_up(self) -> None:
        if self.dir is None:
            raise SlurmError("cluster is not up")

    def _script_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STRIP_PREFIXES)}
        env.pop("SLURM_TEST_PROLOG", None)
        env["SLURM_TEST_DIR"] = str(self.dir)
        return env

    def _script(self, args: list[str], *, env: dict, timeout: float, check: bool = True):
        try:
            return self._run(["bash", str(self.script), *args], env=env, timeout=timeout, check=check)
        except SlurmError as e:
            raise SlurmError(f"{e}\n{self.logs_tail()}") from None

    def _read_cluster_env(self) -> dict:
        out = {}
        for line in (self.dir / "cluster.env").read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                out[k] = v
        return out

    @staticmethod
    def _run(argv: list[str], *, env: dict, timeout: float, check: bool, **kw) -> subprocess.CompletedProcess:
        # own process group so a timeout kills srun/sbatch and everything they spawned, not just the leader
        p = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw
        )
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate(timeout=10)
            raise SlurmError(
                f"timeout after {timeout}s: {argv}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
            ) from None
        cp = subprocess.CompletedProcess(argv, p.returncode, out, err)
        if check and p.returncode != 0:
            raise SlurmError(f"exit {p.returncode}: {argv}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}")
        return cp
