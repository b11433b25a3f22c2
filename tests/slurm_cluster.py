"""A real SLURM cluster for tests: munged + slurmctld + 1 or 2 slurmd, state under one temp dir.

Needs root and Debian's slurm 22.05 packages (``scripts/ci_install_slurm.sh`` installs them). Nothing
system-wide is touched: munged runs with its own key and socket, the daemons use free TCP ports and
``SLURM_CONF=<workdir>/slurm.conf``, and every client call made through the helpers carries that
environment. Config, logs (``<workdir>/log``), slurmctld state and job output (``<workdir>/jobs``)
stay under ``workdir``; only the unix sockets go to a short ``/tmp/sdt-slurm-*`` dir (108-byte
path limit), removed on stop. With ``nodes=2`` each slurmd runs in its own network namespace
(``tests/netns_hosts.py``: 10.200.x addresses on a private bridge), so a 2-node job really crosses
a network: ``MASTER_ADDR`` must be an address (the templates use the node's NodeAddr) and gloo
needs ``GLOO_SOCKET_IFNAME=eth0``.

Fixtures (``slurm_cluster``: one node ``localhost`` with 2 CPUs; ``slurm_cluster_2nodes``) start
once per session, cancel each test's leftover jobs after it, and skip when root or the binaries are
missing, or fail when ``CI=true``. A test module gets them by loading this module as a plugin; the
``register_assert_rewrite`` line only avoids a PytestAssertRewriteWarning when the module also
imports names from here::

    pytest.register_assert_rewrite("slurm_cluster")
    pytest_plugins = ["slurm_cluster"]

The end-to-end test of the trainer through the template, with USR1 mid-run, is then about 30 lines
(``tiny_config`` and the override keys stand for whatever the trainer's tests use)::

    REPO = Path(__file__).resolve().parents[1]
    TEMPLATE = REPO / "batch_files" / "multinode-template.sbatch"

    @pytest.mark.slurm
    @pytest.mark.slow
    def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path, tiny_config):
        run_dir = tmp_path / "logs" / "e2e"
        job = slurm_cluster.sbatch(
            TEMPLATE,  # arguments after the script are train.py overrides
            f"experiment.log_dir={tmp_path / 'logs'}", "experiment.name=e2e", "experiment.requeue=true",
            options=slurm_cluster.template_options(nodes=1, ntasks_per_node=2, chdir=REPO),
            env={"CONFIG": str(tiny_config), "PYTHON": sys.executable},
        )
        metrics = run_dir / "metrics.jsonl"
        slurm_cluster.wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3,
                                 timeout=120, what="3 logged steps", job_id=job)
        slurm_cluster.send_usr1(job)                     # as --signal=B:USR1; target="steps" as USR1@N
        slurm_cluster.speed_up_requeue(job, restarts=1)  # skip slurm's ~120 s hold of a requeued job
        info = slurm_cluster.wait_state(job, "COMPLETED", timeout=180)
        assert info["Restarts"] == "1" and info["ExitCode"] == "0:0"
        saved = sorted((run_dir / "checkpoints").glob("step_*"))
        assert saved, slurm_cluster.job_output(job)
        log = slurm_cluster.job_output(job)              # both runs (--open-mode=append)
        assert "(restart 0)" in log and "(restart 1)" in log
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps == sorted(set(steps))              # resumed where it stopped, no step twice

Helpers: ``sbatch(script, *args, options=, env=) -> job_id``, ``template_options(...)`` (command-line
options that override a template's cluster-specific #SBATCH lines), ``wait_state(job, states)``,
``wait_until(predicate, timeout, what)``, ``job_info(job)`` (``scontrol show job -o`` as a dict of
strings: ``JobState``, ``Restarts``, ``ExitCode``, ``StdOut`` ...), ``job_output(job)``,
``send_usr1(job, target="batch"|"steps"|"full")``, ``speed_up_requeue(job)``, ``node_addr(name)``,
``run("scontrol", ...)``. Every wait fails with the job's state and output and the tails of the
daemons' logs, so a failing test explains itself.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

try:  # imported as a plugin (pytest_plugins = ["slurm_cluster"]) or as tests.slurm_cluster
    from netns_hosts import NetnsHosts, netns_available
except ImportError:  # pragma: no cover
    from tests.netns_hosts import NetnsHosts, netns_available

SBIN = Path("/usr/sbin")
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_:/]*$")  # a key in `scontrol show job -o` output
_LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT"}
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
# States after which a job never runs again (a requeued job passes through REQUEUED/PENDING instead).
TERMINAL = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT",
}
# Pending reasons that mean "will not start without a human": fail instead of waiting out a timeout.
HELD = {"launch_failed_requeued_held", "JobHeldAdmin", "JobHeldUser"}


class SlurmError(RuntimeError):
    pass


def missing_requirements(nodes: int = 1) -> str | None:
    """None if a cluster with ``nodes`` nodes can start here, else the reason (for a skip)."""
    if os.geteuid() != 0:
        return "real-SLURM tests need root (they start munged, slurmctld and slurmd)"
    missing = [d for d in DAEMONS if not (SBIN / d).exists()]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return f"slurm/munge not installed ({', '.join(missing)} missing): run scripts/ci_install_slurm.sh"
    if nodes > 1:
        if shutil.which("nsenter") is None:
            return "nsenter (util-linux) is missing"
        reason = netns_available()
        if reason:
            return f"cannot create network namespaces for a {nodes}-node cluster: {reason}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"--- {path}: (missing)"
    return f"--- {path} (last {lines} lines)\n" + "\n".join(text[-lines:])


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_and_wait(pids: Iterable[int], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``timeout`` seconds."""
    pids = [p for p in pids if _pid_alive(p)]
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p)]
            time.sleep(0.05)
        if not pids:
            return


class SlurmCluster:
    """Start a throwaway SLURM cluster under ``workdir``; stop every daemon (and job) on exit."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        nodes: int = 1,
        cpus: int = 2,
        partition: str = "debug",
        start_timeout: float = 30.0,
        task_plugin: str = "task/none",
    ):
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.workdir = Path(workdir).resolve()
        self.nodes = nodes
        self.cpus = cpus
        self.partition = partition
        self.start_timeout = start_timeout
        self.task_plugin = task_plugin
        self.conf = self.workdir / "slurm.conf"
        self.log_dir = self.workdir / "log"
        self.run_dir = self.workdir / "run"
        self.jobs_dir = self.workdir / "jobs"  # default --output/--error location
        self.node_names = ["localhost"] if nodes == 1 else [f"node{i + 1}" for i in range(nodes)]
        self.hosts: NetnsHosts | None = None
        self.sockets_dir: Path | None = None
        self.munge_socket: Path | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._started = False
        self._stopped = False

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        atexit.register(self.stop)  # last resort if the caller never reaches stop()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for d in (self.workdir, self.log_dir, self.run_dir, self.jobs_dir, self.workdir / "state"):
            d.mkdir(parents=True, exist_ok=True)
        # Unix sockets live here: munged's and slurmd's/slurmstepd's (in SlurmdSpoolDir). Socket
        # paths are limited to 108 bytes, which pytest's tmp paths overrun, and munged wants every
        # directory above its socket searchable by all, which pytest's 0700 dirs are not.
        self.sockets_dir = Path(tempfile.mkdtemp(prefix="sdt-slurm-"))
        self.sockets_dir.chmod(0o755)
        for name in self.node_names:
            (self.sockets_dir / f"spool-{name}").mkdir()
        if self.nodes > 1:
            self.hosts = NetnsHosts(self.node_names)
            self.hosts.create()
        self._start_munged()
        self.conf.write_text(self._slurm_conf())
        self._spawn("slurmctld", [str(SBIN / "slurmctld"), "-D", "-i"])
        self.wait_until(self._ctld_up, self.start_timeout, "slurmctld to answer `scontrol ping`")
        for name in self.node_names:
            cmd = [str(SBIN / "slurmd"), "-D", "-N", name]
            if self.hosts is not None:
                cmd = self.hosts.nsenter(name) + cmd  # nsenter execs slurmd: the pid is slurmd's
            self._spawn(f"slurmd-{name}", cmd)
        self.wait_until(self._nodes_idle, self.start_timeout, f"node(s) {self.node_names} idle in sinfo")

    def _start_munged(self) -> None:
        key = self.sockets_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.sockets_dir / "munge.socket"
        cmd = [
            str(SBIN / "munged"), "--foreground", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={self.run_dir / 'munged.pid'}",
            f"--log-file={self.log_dir / 'munged.log'}", f"--seed-file={self.sockets_dir / 'seed'}",
        ]
        self._spawn("munged", cmd)
        self.wait_until(self.munge_socket.exists, 10, "munged's socket")

    def _slurm_conf(self) -> str:
        w = self.workdir
        ctld_addr = "127.0.0.1" if self.hosts is None else self.hosts.gateway
        if self.hosts is None:
            node_lines = [f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"]
        else:
            node_lines = [
                f"NodeName={n} NodeAddr={self.hosts.addr(n)} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
                for n in self.node_names
            ]
        lines = [
            "ClusterName=sdtest",
            f"SlurmctldHost=localhost({ctld_addr})",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={w / 'state'}",
            f"SlurmdSpoolDir={self.sockets_dir / 'spool-%n'}",
            f"SlurmctldPidFile={self.run_dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.run_dir / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups in a container: track job processes by parentage. task/affinity binds each task
            # to its CPUs with sched_setaffinity (what a user's cluster does with task/affinity or cgroup).
            "ProctrackType=proctrack/linuxproc",
            f"TaskPlugin={self.task_plugin}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=5",  # seconds between SIGTERM and SIGKILL when a job ends or is requeued
            "MinJobAge=600",  # keep finished jobs visible to `scontrol show job` for the whole session
            "InactiveLimit=0",
            "PropagateResourceLimits=NONE",
            "MailProg=/bin/true",
            # Trust the CPU count given here, even above the hardware's (2 nodes on a 2-core machine).
            "SlurmdParameters=config_overrides",
            *node_lines,
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        return "\n".join(lines) + "\n"

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.log_dir / f"{name}.stderr", "ab")
        self._procs[name] = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
            start_new_session=True,  # ^C in the terminal must not reach the daemons before stop()
        )
        out.close()

    def _ctld_up(self) -> bool:
        self._check_daemons()
        return self.run("scontrol", "ping", check=False).stdout.find("is UP") >= 0

    def _nodes_idle(self) -> bool:
        self._check_daemons()
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        states = dict(line.split() for line in out if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.node_names)

    def _check_daemons(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited with code {proc.returncode}\n{self.diagnostics()}")

    def stop(self) -> None:
        """Cancel jobs, stop the daemons (pid files, then the pids we spawned), drop namespaces."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        try:
            if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
                self.cancel_all()
        except Exception:  # noqa: BLE001 - best effort; processes are killed below anyway
            pass
        # Whatever jobs left behind (slurmstepd daemonizes away from slurmd, so these are not its
        # descendants): every process our daemons or jobs started carries our SLURM_CONF.
        # slurmctld's helper slurmscriptd goes with slurmctld (killing it first stalls slurmctld).
        daemons = {p.pid for p in self._procs.values()}
        _kill_and_wait([p for p in self.processes() if p not in daemons and self._comm(p) != "slurmscriptd"],
                       timeout=3)
        for name in [n for n in self._procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            pids = {self._procs[name].pid} if name in self._procs else set()
            pid_file = self.run_dir / (f"{name}.pid")
            try:
                pids.add(int(pid_file.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
            expected = name.split("-")[0]
            pids = {p for p in pids if self._comm(p) == expected}
            _kill_and_wait(pids)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        _kill_and_wait(self.processes(), timeout=3)  # anything left (normally nothing)
        if self.hosts is not None:
            self.hosts.destroy()
        if self.sockets_dir is not None:
            shutil.rmtree(self.sockets_dir, ignore_errors=True)

    def processes(self) -> list[int]:
        """Pids of the processes this cluster started: daemons, slurmstepd, job scripts, tasks.

        They are the ones whose environment holds ``SLURM_CONF=<this cluster's slurm.conf>`` (the
        daemons get it from us, jobs from the submitting environment), which no other process on
        the machine has; this process itself only passes it to its children.
        """
        needle = f"SLURM_CONF={self.conf}".encode() + b"\0"
        me, pids = os.getpid(), []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if needle in environ.read_bytes() + b"\0" and int(environ.parent.name) != me:
                    pids.append(int(environ.parent.name))
            except (OSError, ValueError):
                pass
        return [p for p in pids if _pid_alive(p)]

    @staticmethod
    def _comm(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    # ---------------------------------------------------------------- clients
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ + SLURM_CONF, without an outer SLURM_* (CI may itself run under slurm) or
        torch launcher variables (sbatch exports them to the job, where they would mislead rank
        detection)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_")) and k not in _LAUNCHER_VARS}
        env["SLURM_CONF"] = str(self.conf)
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, *args: str, check: bool = True, env: Mapping[str, str] | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a slurm client command against this cluster."""
        r = subprocess.run(list(args), capture_output=True, text=True, env=self.env(env), timeout=timeout)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
        return r

    def template_options(self, nodes: int = 1, ntasks_per_node: int = 1, cpus_per_task: int = 1,
                         chdir: str | os.PathLike | None = None, time_limit: str = "10:00") -> list[str]:
        """sbatch options that fit a cluster-specific template (batch_files/*.sbatch) to this one.

        Command-line options override the template's #SBATCH lines, so the template stays untouched.
        """
        opts = [f"--partition={self.partition}", f"--nodes={nodes}",
                f"--ntasks-per-node={ntasks_per_node}", f"--cpus-per-task={cpus_per_task}",
                f"--time={time_limit}"]
        if chdir is not None:
            opts.append(f"--chdir={chdir}")
        return opts

    def sbatch(self, script: str | os.PathLike, *script_args: str, options: Iterable[str] = (),
               env: Mapping[str, str] | None = None) -> int:
        """Submit ``script`` (arguments after it go to the script); return the job id.

        Output goes to ``<workdir>/jobs/<jobid>.out|.err`` unless ``options`` set --output/--error.
        ``env`` is added to the submitting environment, which sbatch exports to the job.
        """
        cmd = ["sbatch", "--parsable", f"--output={self.jobs_dir}/%j.out",
               f"--error={self.jobs_dir}/%j.err", *options, str(script), *script_args]
        out = self.run(*cmd, env=env).stdout.strip()
        return int(out.split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o <id>`` as a dict (values are strings, e.g. info["Restarts"] == "1")."""
        line = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        info: dict[str, str] = {}
        key = None
        for token in line.split(" "):
            k, eq, v = token.partition("=")
            if eq and _KEY.match(k):
                key, info[k] = k, v
            elif key is not None:  # a value with spaces (Command=..., Reason=...) continues
                info[key] += " " + token
        return info

    def job_output(self, job_id: int) -> str:
        """The job's stdout and stderr (all runs, when the script uses --open-mode=append)."""
        info = self.job_info(job_id)
        parts = []
        for key in ("StdOut", "StdErr"):
            path = Path(info.get(key, ""))
            if path.is_file() and not (key == "StdErr" and info.get("StdErr") == info.get("StdOut")):
                parts.append(path.read_text(errors="replace"))
        return "".join(parts)

    def wait_until(self, predicate: Callable[[], object], timeout: float, what: str,
                   job_id: int | None = None, poll: float = 0.2):
        """Poll ``predicate`` until truthy (returned); on timeout raise with diagnostics."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                stacks = job_id is not None and self.dump_stacks(job_id)
                raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                 f"{self.diagnostics(job_id, 200 if stacks else 25)}")
            time.sleep(poll)

    def wait_state(self, job_id: int, states: str | Iterable[str], timeout: float = 60) -> dict[str, str]:
        """Wait until the job's JobState is one of ``states``; fail early on any other final state."""
        wanted = {states} if isinstance(states, str) else set(states)
        seen: dict[str, str] = {}

        def reached():
            seen.update(self.job_info(job_id))
            state = seen.get("JobState", "")
            if state in wanted:
                return dict(seen)
            if state in TERMINAL or seen.get("Reason") in HELD:
                raise SlurmError(f"job {job_id} is {state} ({seen.get('Reason')}, ExitCode="
                                 f"{seen.get('ExitCode')}), wanted {sorted(wanted)}\n{self.diagnostics(job_id)}")
            return None

        return self.wait_until(reached, timeout, f"job {job_id} to reach {sorted(wanted)}", job_id)

    def signal(self, job_id: int, sig: str = "USR1", target: str = "batch") -> None:
        """Send ``sig`` to a running job.

        target="batch": only the batch shell (what ``#SBATCH --signal=B:SIG@N`` does);
        target="steps": every process of every job step started by srun, not the batch shell (what
        ``#SBATCH --signal=SIG@N`` does); target="full": both.
        """
        flag = {"batch": ["--batch"], "steps": [], "full": ["--full"]}[target]
        self.run("scancel", f"--signal={sig}", *flag, str(job_id))

    def send_usr1(self, job_id: int, target: str = "batch") -> None:
        """USR1 as the time limit would send it with the template's --signal (default: batch shell)."""
        self.signal(job_id, "USR1", target)

    def speed_up_requeue(self, job_id: int, restarts: int = 1, timeout: float = 60,
                         update: Iterable[str] = ()) -> dict[str, str]:
        """After a job requeued itself, start it again now instead of in ~120 s; ``update``: more
        ``scontrol update`` fields for the pending job (``NumTasks=1``: it comes back smaller).

        slurmctld holds a requeued batch job (Reason=BeginTime) until the old launch credential
        expires; ``scontrol update StartTime=now`` lifts the hold. Waits until the job shows
        ``Restarts >= restarts`` and is pending, then updates it; returns the job info.
        """
        def requeued():
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL or info.get("Reason") in HELD:
                raise SlurmError(f"job {job_id} ended {info.get('JobState')} instead of requeueing\n"
                                 f"{self.diagnostics(job_id)}")
            if int(info.get("Restarts", "0")) >= restarts and info.get("JobState") == "PENDING":
                return info
            return None

        info = self.wait_until(requeued, timeout, f"job {job_id} to be requeued ({restarts})", job_id)
        # slurmd revokes the old launch credential when it kills the first run, at one-second
        # resolution, and refuses ("Job N already killed, do not launch batch job") a new
        # credential created in the same second; the job then fails. Wait until every node has
        # finished the kill (no COMPLETING) and let the clock move past the revocation.
        self.wait_until(self._nodes_idle, timeout, f"node(s) idle after job {job_id} requeued", job_id)
        time.sleep(2.5)
        if update:
            self.run("scontrol", "update", f"JobId={job_id}", *update)
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        return info

    def node_addr(self, name: str) -> str:
        return self.run("scontrol", "show", "node", "-o", name).stdout.split("NodeAddr=")[1].split()[0]

    def cancel_all(self, timeout: float = 20) -> None:
        """Cancel every job and wait until none is running (a test's leftovers must not block the next)."""
        ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if not ids:
            return
        self.run("scancel", *ids, check=False)

        def drained():
            states = self.run("squeue", "-h", "-o", "%T", check=False).stdout.split()
            return not states
        try:
            self.wait_until(drained, timeout, "cancelled jobs to leave the queue")
        except SlurmError:
            pass

    def dump_stacks(self, job_id: int) -> bool:
        """Every rank of a running job prints its threads' stacks to the job's output (train.py's SIGUSR2
        handler), for the diagnostics of a job that hangs; False if the job could not be signalled."""
        try:
            self.signal(job_id, "USR2", target="steps")
        except Exception:  # noqa: BLE001 (the job may have ended meanwhile)
            return False
        time.sleep(2)
        return True

    def diagnostics(self, job_id: int | None = None, output_lines: int = 25) -> str:
        parts = []
        if job_id is not None:
            try:
                info = self.job_info(job_id)
                parts.append(f"job {job_id}: " + " ".join(
                    f"{k}={info.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts", "NodeList")))
                for key in ("StdOut", "StdErr"):
                    if info.get(key) and (key == "StdOut" or info[key] != info.get("StdOut")):
                        parts.append(_tail(Path(info[key]), output_lines))
            except Exception as e:  # noqa: BLE001
                parts.append(f"job {job_id}: scontrol failed: {e}")
        parts.append(_tail(self.log_dir / "slurmctld.log"))
        for name in self.node_names:
            parts.append(_tail(self.log_dir / f"slurmd-{name}.log"))
        for name in self._procs:
            path = self.log_dir / f"{name}.stderr"
            if path.exists() and path.stat().st_size:
                parts.append(_tail(path, 10))
        return "\n".join(parts)


# ------------------------------------------------------------------------------------ fixtures
def _skip_or_fail(reason: str) -> None:
    # CI must never go green by skipping the SLURM tests: there a missing requirement is an error.
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        pytest.fail(f"CI=true and the SLURM tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def _cluster_fixture(nodes: int, tmp_path_factory):
    reason = missing_requirements(nodes)
    if reason:
        _skip_or_fail(reason)
    # One node: tasks are bound to their CPUs (task/affinity), as on a production cluster. Two nodes on one
    # 2-core machine share its cores, so binding there would pin both nodes' tasks to the same CPU ids.
    plugin = "task/affinity" if nodes == 1 else "task/none"
    with SlurmCluster(tmp_path_factory.mktemp(f"slurm{nodes}n"), nodes=nodes, cpus=2, task_plugin=plugin) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def _slurm_cluster_1(tmp_path_factory):
    yield from _cluster_fixture(1, tmp_path_factory)


@pytest.fixture(scope="session")
def _slurm_cluster_2(tmp_path_factory):
    yield from _cluster_fixture(2, tmp_path_factory)


@pytest.fixture
def slurm_cluster(_slurm_cluster_1):
    """A one-node cluster (node ``localhost``, 2 CPUs), started once per session; each test's
    leftover jobs are cancelled after it so they cannot hold the node for the next test."""
    yield _slurm_cluster_1
    _slurm_cluster_1.cancel_all()


@pytest.fixture
def slurm_cluster_2nodes(_slurm_cluster_2):
    """Two nodes ``node1``/``node2`` in separate network namespaces (2 CPUs each), per session."""
    yield _slurm_cluster_2
    _slurm_cluster_2.cancel_all()
