"""Real SLURM: the test cluster itself, the sbatch templates, and USR1 -> requeue -> restart.

These run slurm 22.05 daemons for real (root + scripts/ci_install_slurm.sh); without them they skip,
except under CI=true, where they fail. The trainer is stood in for by scripts/requeue_probe.py,
copied as ``train.py`` into a scratch directory that the templates run in (``--chdir``), so the
templates are tested exactly as users submit them, with only sbatch command-line options and
environment variables (CONFIG, PYTHON, GPUS_PER_NODE) adapting them to the test cluster.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_cluster")  # before the import below; also a plugin here
from slurm_cluster import SlurmCluster, _pid_alive, _skip_or_fail, missing_requirements  # noqa: E402

pytest_plugins = ["slurm_cluster"]

REPO = Path(__file__).resolve().parents[1]
SRUN_TEMPLATE = REPO / "batch_files" / "multinode-template.sbatch"
TORCHRUN_TEMPLATE = REPO / "batch_files" / "multinode-torchrun.sbatch"
PROBE = REPO / "scripts" / "requeue_probe.py"
PYTHON = sys.executable  # the venv's python: the jobs need torch


def _workdir(tmp_path: Path) -> Path:
    """A scratch checkout: the probe as train.py plus a config file for the templates' CONFIG check."""
    shutil.copy(PROBE, tmp_path / "train.py")
    (tmp_path / "config.yaml").write_text("# the probe ignores its config\n")
    return tmp_path


def _markers(out: Path, event: str, restart: int) -> dict[int, dict]:
    found = {}
    for path in out.glob(f"{event}.r{restart}.rank*"):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    return found


def _wait_markers(cluster: SlurmCluster, out: Path, event: str, restart: int, n: int, job: int,
                  timeout: float = 60) -> dict[int, dict]:
    return cluster.wait_until(lambda: len(_markers(out, event, restart)) == n and _markers(out, event, restart),
                              timeout, f"{n} '{event}' markers (restart {restart})", job_id=job)


def _template_env(**extra: str) -> dict[str, str]:
    return {"CONFIG": "config.yaml", "PYTHON": PYTHON, **extra}


# ----------------------------------------------------------------------------- without daemons
def test_missing_requirements_skip_locally_but_fail_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        _skip_or_fail("no slurm")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no slurm"):
        _skip_or_fail("no slurm")


# ----------------------------------------------------------------------------- one node
@pytest.mark.slurm
def test_two_task_job_sees_both_ranks(slurm_cluster, tmp_path):
    script = tmp_path / "ranks.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "srun bash -c 'echo \"task $SLURM_PROCID of $SLURM_NTASKS local $SLURM_LOCALID on $SLURMD_NODENAME\"'\n"
    )
    job = slurm_cluster.sbatch(script, options=["--ntasks=2", f"--chdir={tmp_path}"])
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=30)
    out = slurm_cluster.job_output(job)
    assert "task 0 of 2 local 0 on localhost" in out
    assert "task 1 of 2 local 1 on localhost" in out
    assert info["ExitCode"] == "0:0"


@pytest.mark.slurm
@pytest.mark.parametrize("target", ["steps", "batch"])
def test_usr1_requeues_and_restarts_through_srun_template(slurm_cluster, tmp_path, target):
    """USR1 reaches every srun task either way: "steps" is what the template's --signal=USR1@120
    does (slurm signals the step's processes), "batch" what --signal=B:USR1@120 or
    `scancel --batch` do (only the batch shell, whose trap forwards it to srun)."""
    work = _workdir(tmp_path)
    out = work / "markers"
    job = slurm_cluster.sbatch(
        SRUN_TEMPLATE, f"out={out}", "save_seconds=1",
        options=slurm_cluster.template_options(nodes=1, ntasks_per_node=2, chdir=work),
        env=_template_env(),
    )
    first = _wait_markers(slurm_cluster, out, "start", 0, 2, job)
    assert sorted(first) == [0, 1] and {d["world"] for d in first.values()} == {2}

    slurm_cluster.send_usr1(job, target=target)
    saved = _wait_markers(slurm_cluster, out, "saved", 0, 2, job, timeout=30)
    assert all(d["parent_same"] for d in saved.values())  # the tasks were not killed mid-"save"
    slurm_cluster.speed_up_requeue(job, restarts=1)
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=60)

    assert info["Restarts"] == "1"
    assert {d["signal"] for d in _markers(out, "signal", 0).values()} == {"SIGUSR1"}
    requeue = _markers(out, "requeue", 0)
    assert list(requeue) == [0] and requeue[0]["rc"] == 0  # only rank 0 requeues
    second = _markers(out, "start", 1)
    assert sorted(second) == [0, 1] and {d["restart"] for d in second.values()} == {1}
    assert {d["reason"] for d in _markers(out, "exit", 1).values()} == {"done"}
    log = slurm_cluster.job_output(job)  # --open-mode=append: both runs in one file
    assert "(restart 0)" in log and "(restart 1)" in log
    if target == "batch":
        assert "batch shell: SIGUSR1, forwarding" in log


@pytest.mark.slurm
@pytest.mark.slow
def test_time_limit_signal_reaches_srun_tasks_without_b_prefix(slurm_cluster, tmp_path):
    """The real timer path: --signal=USR1@N (no B:) signals the tasks themselves near the limit.

    slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT) and sends the warning signal early
    ("up to 60 seconds earlier than specified", sbatch(1)). With a 2 min limit and USR1@30 it comes
    30-90 s after the start: the tasks have long installed their handlers (a signal during interpreter
    start-up kills a task, which an earlier 1 min limit with USR1@55 allowed under load), and the kill
    at 120 s is still ahead.
    """
    work = _workdir(tmp_path)
    out = work / "markers"
    options = slurm_cluster.template_options(nodes=1, ntasks_per_node=2, chdir=work, time_limit="2")
    job = slurm_cluster.sbatch(SRUN_TEMPLATE, f"out={out}", "steps=1300",
                               options=[*options, "--signal=USR1@30"], env=_template_env())
    _wait_markers(slurm_cluster, out, "start", 0, 2, job)
    signals = _wait_markers(slurm_cluster, out, "signal", 0, 2, job, timeout=110)
    assert {d["signal"] for d in signals.values()} == {"SIGUSR1"}
    slurm_cluster.speed_up_requeue(job, restarts=1)
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=60)
    assert info["Restarts"] == "1"
    assert "batch shell: SIGUSR1" not in slurm_cluster.job_output(job)  # the shell was not signalled


@pytest.mark.slurm
def test_cluster_stop_leaves_no_processes_even_after_a_failure(tmp_path):
    reason = missing_requirements(1)
    if reason:
        _skip_or_fail(reason)
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\nsrun sleep 600\n")
    with pytest.raises(RuntimeError, match="test failure"):
        with SlurmCluster(tmp_path / "cluster") as cluster:
            job = cluster.sbatch(script, options=["--ntasks=2", f"--chdir={tmp_path}"])
            cluster.wait_state(job, "RUNNING", timeout=30)
            cluster.wait_until(lambda: sum(cluster._comm(p) == "sleep" for p in cluster.processes()) == 2,
                               30, "the job's 2 sleep tasks", job_id=job)
            pids = cluster.processes()
            assert {"munged", "slurmctld", "slurmd", "slurmstepd", "sleep"} <= {cluster._comm(p) for p in pids}
            raise RuntimeError("test failure")
    assert not [p for p in pids if _pid_alive(p)]
    assert not (cluster.munge_socket.exists())


# ----------------------------------------------------------------------------- two hosts
@pytest.mark.slurm
@pytest.mark.distributed
def test_srun_template_all_reduce_across_two_hosts(slurm_cluster_2nodes, tmp_path):
    cluster = slurm_cluster_2nodes
    work = _workdir(tmp_path)
    out = work / "markers"
    job = cluster.sbatch(
        SRUN_TEMPLATE, f"out={out}", "allreduce=1", "steps=0",
        options=cluster.template_options(nodes=2, ntasks_per_node=1, chdir=work),
        env=_template_env(GLOO_SOCKET_IFNAME="eth0"),  # the namespaces' interface (netns_hosts.py)
    )
    cluster.wait_state(job, "COMPLETED", timeout=60)
    ranks = _markers(out, "start", 0)
    assert sorted(ranks) == [0, 1]
    assert {d["allreduce"] for d in ranks.values()} == {3.0}  # 1 + 2
    assert [ranks[r]["node"] for r in (0, 1)] == ["node1", "node2"]
    assert ranks[0]["netns"] != ranks[1]["netns"]  # really two network namespaces
    assert ranks[0]["master"] == f"{cluster.node_addr('node1')}:{20000 + job % 20000}"


@pytest.mark.slurm
@pytest.mark.distributed
def test_torchrun_template_two_hosts_all_reduce_usr1_requeue(slurm_cluster_2nodes, tmp_path):
    """torchrun per node, static rendezvous across namespaces; then USR1 mid-run: the workers
    "save" for 2 s while torchrun (which ignores USR1 thanks to the template) stays alive, rank 0
    requeues, and both nodes restart."""
    cluster = slurm_cluster_2nodes
    work = _workdir(tmp_path)
    out = work / "markers"
    job = cluster.sbatch(
        TORCHRUN_TEMPLATE, f"out={out}", "allreduce=1", "save_seconds=2",
        options=cluster.template_options(nodes=2, ntasks_per_node=1, cpus_per_task=2, chdir=work),
        env=_template_env(GPUS_PER_NODE="2", GLOO_SOCKET_IFNAME="eth0"),
    )
    ranks = _wait_markers(cluster, out, "start", 0, 4, job, timeout=90)
    assert {d["allreduce"] for d in ranks.values()} == {10.0}  # 1 + 2 + 3 + 4
    assert {d["world"] for d in ranks.values()} == {4}
    assert {ranks[0]["node"], ranks[3]["node"]} == {"node1", "node2"}
    assert len({d["netns"] for d in ranks.values()}) == 2

    cluster.send_usr1(job, target="steps")  # what the template's --signal=USR1@120 does
    saved = _wait_markers(cluster, out, "saved", 0, 4, job, timeout=30)
    assert all(d["parent_same"] for d in saved.values()), "torchrun died before its workers saved"
    cluster.speed_up_requeue(job, restarts=1)
    info = cluster.wait_state(job, "COMPLETED", timeout=90)
    assert info["Restarts"] == "1"
    restarted = _markers(out, "start", 1)
    assert sorted(restarted) == [0, 1, 2, 3]
    assert {d["allreduce"] for d in restarted.values()} == {10.0}
