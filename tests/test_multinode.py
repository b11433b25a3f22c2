"""Two "nodes" on one machine: ``torchrun --nnodes 2 --nproc-per-node 2`` started twice with c10d rendezvous
(what a user runs on each node without SLURM), 4 trainers on gloo, killed after a checkpoint and started again.

What is checked: what torchrun's c10d rendezvous tells each worker (``GROUP_RANK`` = the node, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` = one node's ranks) and that the trainer's one environment probe reads from it the
layout of 2 nodes x 2 ranks, and hsdp's default shard group of one node's ranks from it; that the run trains,
checkpoints, and after both nodes are SIGKILLed resumes from its checkpoint on a new rendezvous, each step
once, on the samples of an uninterrupted one-process run with the same global batch, and ends with the same
weights as that run (fp32: up to the order in which the ranks' gradients are summed).

The real SLURM path (both sbatch templates, 2 network-namespace nodes, USR1 and requeue) is
tests/test_slurm_train.py's.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_tree, train_args
from elastic_runs import drop_checkpoints_after, full_checkpoint, steps_keys
from helpers import alive, max_diff
from test_distributed import free_port
from test_resume import finish, launch
from test_restarts import ranks_of

from sd_training.checkpoint import complete_steps
from sd_training.distributed import DistInfo, hsdp_shard_size, probe_env

try:
    from netns_hosts import NetnsHosts, netns_available
except ImportError:  # pragma: no cover
    from tests.netns_hosts import NetnsHosts, netns_available

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[1]
NODES, PER_NODE = 2, 2
STEPS, GLOBAL_BATCH = 4, 4
STRATEGY = "hsdp"  # one node's 2 ranks shard, the 2 nodes replicate
# fp32 weights after 4 AdamW steps of the same samples, noise and timesteps: only the summation order of the
# gradients differs (4 ranks' reduce-scatter against one process's 4 micro-batches); test_distributed's
# tolerance, with its larger Adam epsilon (near-zero gradients, whose rounding depends on that order, must not
# become full-size updates of different sign).
TOL = 1e-5


def run_args(tmp_path, pipeline, shards, name, strategy=STRATEGY):
    return train_args(tmp_path, pipeline, shards, name=name, **{
        "experiment.num_examples_to_see": STEPS * GLOBAL_BATCH, "experiment.checkpoint_every": 2,
        "experiment.keep_last_checkpoints": 10, "experiment.sample_per_prompt": 0,
        "experiment.record_sample_keys": "true", "experiment.checkpoint_async": "false",
        "system.batch_size": 1, "system.global_batch_size": GLOBAL_BATCH,
        "dataset.params.canonical_readers": GLOBAL_BATCH, "dataset.params.resolution": 32,
        "model.mixed_precision": "no", "optimizer.params.epsilon": 1e-4, "lr_scheduler.params.warmup_length": 0,
        "distributed.strategy": strategy})


@pytest.fixture
def hosts():
    """Two hosts in network namespaces (tests/netns_hosts.py) where they can be made (root, iproute2): each
    node's torchrun runs behind its own address, and the rendezvous, the agents' store and gloo cross a network
    as between machines. Elsewhere (None) both run on 127.0.0.1."""
    if netns_available() is not None:
        yield None
        return
    with NetnsHosts(["node1", "node2"]) as made:
        yield made


def start_nodes(tmp_path, args, tag: str, hosts) -> list[subprocess.Popen]:
    """One torchrun per node, both pointed at the same c10d rendezvous on node1 (a fresh port and id per start).
    ``--local-addr``: the address the workers are given as MASTER_ADDR when this node's agent is the
    rendezvous's rank 0 (else its host name, which names 127.0.0.1 on every fake host here). ``is_host``: node1
    serves the rendezvous store; torch guesses that from the host name's addresses, and an address of another
    interface (10.200.x here, a second NIC on a cluster) is not among them: no agent would serve it."""
    port, procs = free_port(), []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if hosts is not None:
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # the interface with the host's address, in every namespace
    for node in range(NODES):
        name = f"node{node + 1}"
        where = [] if hosts is None else hosts.nsenter(name)
        local = [] if hosts is None else [f"--local-addr={hosts.addr(name)}"]
        endpoint = "127.0.0.1" if hosts is None else hosts.addr("node1")
        cmd = [*where, sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}",
               f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}:{port}",
               f"--rdzv-id=multinode-{tag}", f"--rdzv-conf=is_host={int(node == 0)}", *local, "--max-restarts=0", str(ROOT / "train.py"), *args]
        out = open(tmp_path / f"torchrun-{tag}-{node}.log", "w")
        # nsenter execs torchrun: the pid is torchrun's (its workers are its children).
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        out.close()
    return procs


def output(tmp_path, tag: str) -> str:
    return "\n".join((tmp_path / f"torchrun-{tag}-{n}.log").read_text()[-3000:] for n in range(NODES))


def worker_envs(procs, tmp_path, tag, timeout=300) -> list[tuple[int, dict[str, str]]]:
    """(node, environment) that torchrun gave each of its workers (read from /proc while they run)."""
    deadline, found = time.monotonic() + timeout, []
    while True:
        found = [ranks_of(p.pid) for p in procs]
        if all(len(r) == PER_NODE for r in found):
            break
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, output(tmp_path, tag)
        time.sleep(0.1)
    envs = []
    for node, ranks in enumerate(found):
        for pid in ranks.values():
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            envs.append((node, dict(v.split("=", 1) for v in raw if "=" in v)))
    return envs


def kill_after_checkpoint(procs, run: Path, step: int, tmp_path, tag, timeout=600) -> None:
    """SIGKILL both nodes (torchrun and its trainers) once checkpoint ``step`` is complete; later ones are
    dropped, so the next start resumes from ``step``."""
    deadline = time.monotonic() + timeout
    while step not in complete_steps(run / "checkpoints"):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, output(tmp_path, tag)
        time.sleep(0.05)
    trees = [pid for p in procs for pid in ranks_of(p.pid).values()]
    for p in procs:
        kill_tree(p.pid)
        p.wait()
    gone_by = time.monotonic() + 60  # rank 0 must have let go of the run folder's lock
    while any(alive(pid) for pid in trees):
        assert time.monotonic() < gone_by
        time.sleep(0.05)
    drop_checkpoints_after(run, step)


def saved_state(run: Path, step: int = STEPS) -> tuple[dict, dict]:
    """Checkpoint ``step``'s state as full tensors: plain files (one process) or DCP shards (FSDP2)."""
    return full_checkpoint(run, step)


def finish_nodes(procs, tmp_path, tag, timeout=600) -> None:
    for p in procs:
        try:
            p.wait(timeout=timeout)
        finally:
            for q in procs:
                if q.poll() is None and p.returncode not in (None, 0):
                    kill_tree(q.pid)
        assert p.returncode == 0, output(tmp_path, tag)


def test_torchrun_c10d_two_nodes_train_checkpoint_and_resume(tmp_path, tiny_pipeline, shapes_shards, hosts):
    ref = tmp_path / "runs" / "ref"
    finish(launch(tmp_path, run_args(tmp_path, tiny_pipeline, shapes_shards, "ref", "ddp")))

    run = tmp_path / "runs" / "c10d"
    args = run_args(tmp_path, tiny_pipeline, shapes_shards, "c10d")
    first = start_nodes(tmp_path, args, "first", hosts)
    try:
        envs = worker_envs(first, tmp_path, "first")
        kill_after_checkpoint(first, run, 2, tmp_path, "first")
    finally:
        for p in first:
            kill_tree(p.pid)

    # What c10d's rendezvous tells the workers: their node (GROUP_RANK, in the order the agents joined, not the
    # order of the hosts), the rank in the node and one node's rank count; global ranks are node-major; the store
    # of the workers is the agent's of node GROUP_RANK 0, at its --local-addr.
    group = {node: int(e["GROUP_RANK"]) for node, e in envs}
    assert sorted(group.values()) == list(range(NODES)), envs
    layout = sorted((int(e["GROUP_RANK"]), int(e["LOCAL_RANK"]), int(e["RANK"])) for _, e in envs)
    assert layout == [(g, l, g * PER_NODE + l) for g in range(NODES) for l in range(PER_NODE)], layout
    first_node = next(node for node, g in group.items() if g == 0)
    for node, e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) == ("4", "2", "2"), e
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True" and e["TORCHELASTIC_RESTART_COUNT"] == "0"
        if hosts is not None:
            assert e["MASTER_ADDR"] == hosts.addr(f"node{first_node + 1}"), e
        probed = probe_env(e)  # the trainer's one probe, on that environment
        assert (probed["launcher"], probed["world_size"], probed["local_world_size"]) == ("torchrun", 4, 2), probed
        assert probed["rank"] == int(e["RANK"]) and probed["local_rank"] == int(e["LOCAL_RANK"])
        info = DistInfo(rank=probed["rank"], world_size=probed["world_size"], local_world_size=probed["local_world_size"])
        assert info.nodes == NODES and hsdp_shard_size(0, info.world_size, info.local_world_size) == PER_NODE
    log = (run / "train.log").read_text()
    assert "launcher=torchrun world_size=4 " in log, log[-3000:]
    assert "hsdp: 2 replica(s) x 2-rank shard groups (distributed.hsdp_shard_size)" in log, log[-3000:]

    second = start_nodes(tmp_path, args, "second", hosts)
    try:
        finish_nodes(second, tmp_path, "second")
    finally:
        for p in second:
            kill_tree(p.pid)
    log = (run / "train.log").read_text()
    assert " at step 2" in log.split("resumed from", 1)[-1].splitlines()[0], output(tmp_path, "second")
    assert log.count("hsdp: 2 replica(s) x 2-rank shard groups") == 2 and "resumed an" not in log  # the same mesh
    assert complete_steps(run / "checkpoints")[-1] == STEPS
    losses = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses == list(range(1, STEPS + 1)), losses  # every step once, none lost or done twice
    # The same samples as one process with the whole global batch, step by step, across the kill.
    assert steps_keys(run, GLOBAL_BATCH) == steps_keys(ref, GLOBAL_BATCH)
    a, _ = saved_state(ref)
    b, ts = saved_state(run)
    assert ts["step"] == STEPS
    assert max_diff(a["unet"], saved_state(ref, 2)[0]["unet"]) > 1e-4  # steps 3-4 moved the weights: the
    diff = max_diff(a["unet"], b["unet"], strict=True)  # comparison below means something
    print(f"unet: max abs difference {diff:.3g} from the one-process run")
    assert diff <= TOL, diff
