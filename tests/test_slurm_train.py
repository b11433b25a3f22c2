"""The real trainer under a real SLURM: USR1 -> save -> scontrol requeue -> resume -> same final step.

Uses the cluster fixtures of tests/slurm_cluster.py (started by the test session itself) and the
unmodified batch_files/ templates.
"""

import json
import sys
from pathlib import Path

import pytest
from conftest import train_args

from sd_training.checkpoint import complete_steps

pytest.register_assert_rewrite("slurm_cluster")
pytest_plugins = ["slurm_cluster"]

REPO = Path(__file__).resolve().parents[1]
SRUN_TEMPLATE = REPO / "batch_files" / "multinode-template.sbatch"
TORCHRUN_TEMPLATE = REPO / "batch_files" / "multinode-torchrun.sbatch"


def write_config(tmp_path, pipeline, shards, name, **overrides) -> Path:
    """A YAML config of a tiny CPU run (the templates take a config file)."""
    from omegaconf import OmegaConf

    path = tmp_path / f"{name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.from_dotlist(train_args(tmp_path, pipeline, shards, name=name, **overrides))))
    return path


def metric_steps(run: Path) -> list[int]:
    return [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


@pytest.mark.slurm
@pytest.mark.slow
def test_usr1_saves_requeues_and_resumes_to_the_same_final_step(slurm_cluster, tmp_path, tiny_pipeline, shapes_shards):
    total = 60
    config = write_config(tmp_path, tiny_pipeline, shapes_shards, "slurm", **{
        "system.batch_size": 2, "experiment.num_examples_to_see": 4 * total, "experiment.checkpoint_every": 1000,
        "experiment.keep_last_checkpoints": 5, "experiment.sample_per_prompt": 0, "experiment.requeue": "true",
        "dataset.params.resampled": "false", "system.workers": 2})  # the signal reaches the loader workers too
    run = tmp_path / "runs" / "slurm"
    job = slurm_cluster.sbatch(
        SRUN_TEMPLATE, options=slurm_cluster.template_options(nodes=1, ntasks_per_node=2, chdir=REPO),
        env={"CONFIG": str(config), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"},
    )
    slurm_cluster.wait_until(lambda: (run / "metrics.jsonl").exists() and len(metric_steps(run)) >= 3,
                             timeout=240, what="3 logged steps", job_id=job)
    slurm_cluster.send_usr1(job, target="steps")  # what --signal=USR1@N does before the time limit
    slurm_cluster.speed_up_requeue(job, restarts=1)
    info = slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    log = slurm_cluster.job_output(job)
    assert info["Restarts"] == "1", log[-3000:]
    assert "requeued SLURM job" in log and "resumed from" in log, log[-3000:]
    # Each of the 2 tasks is bound to its --cpus-per-task (1 here, of the node's 2) and says so at start-up.
    for rank, path in ((0, run / "train.log"), (1, run / "logs" / "rank_1.log")):
        text = path.read_text()
        assert f"[rank {rank}] INFO sd_training.loop: launcher=srun world_size=2 device=cpu cpus=1 " in text
        assert "may run on 1 CPU(s) but starts 2 loader worker(s)" in text  # the starved loader is named
    saved = complete_steps(run / "checkpoints")
    assert saved[-1] == total and len(saved) == 2, saved  # the USR1 checkpoint was kept, the final one added
    assert saved[0] < total
    steps = metric_steps(run)
    assert steps == list(range(1, total + 1)), steps  # resumed where it stopped: no step lost or done twice


# The 2-node jobs: 2 network-namespace hosts x 2 ranks on gloo under distributed.strategy=STRATEGY (one node's
# ranks shard, the two nodes replicate), one job per template, each sent USR1 (what --signal=USR1@N does before
# the time limit), requeued by rank 0 and resumed from its checkpoint. 32 px and batch 1 per rank: each start
# is 4 fresh interpreters on the machine's 2 cores.
STRATEGY = "hsdp"
MESH_2X2 = "hsdp: 2 replica(s) x 2-rank shard groups (distributed.hsdp_shard_size)"
NODE_ENV = {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}


def two_node_config(tmp_path, pipeline, shards, name, total):
    return write_config(tmp_path, pipeline, shards, name, **{
        "system.batch_size": 1, "system.global_batch_size": 4, "experiment.num_examples_to_see": 4 * total,
        "experiment.checkpoint_every": 1000, "experiment.sample_per_prompt": 0, "experiment.requeue": "true",
        "system.workers": 1, "experiment.record_sample_keys": "true", "dataset.params.resolution": 32,
        "distributed.strategy": STRATEGY})


def preempt_and_requeue(cluster, job, run: Path, update=()) -> str:
    """USR1 to the job's steps after 3 logged steps; the requeued job is started at once (``update``: what
    changes while it waits) and must complete after one restart. Returns the job's output."""
    cluster.wait_until(lambda: (run / "metrics.jsonl").exists() and len(metric_steps(run)) >= 3,
                       timeout=300, what="3 logged steps", job_id=job)
    cluster.send_usr1(job, target="steps")
    cluster.speed_up_requeue(job, restarts=1, update=update)
    info = cluster.wait_state(job, "COMPLETED", timeout=400)
    log = cluster.job_output(job)
    assert info["Restarts"] == "1", log[-3000:]
    assert "(restart 0)" in log and "(restart 1)" in log, log[-3000:]
    return log


def samples_per_step(run: Path, total: int) -> int:
    """Checks that every step 1..total trained on the same number of samples across the requeue (steps written
    after the USR1 save and before the requeue are redone by the resumed run); returns the step it resumed at."""
    keys = [json.loads(line) for f in (run / "sample_keys").glob("rank_*.jsonl") for line in f.read_text().splitlines()]
    resumed_at = max(r["start_step"] for r in keys)
    assert 0 < resumed_at < total
    per_step = {}
    for r in keys:
        if r["step"] <= resumed_at or r["start_step"] == resumed_at:
            per_step.setdefault(r["step"], []).extend(r["keys"])
    assert sorted(per_step) == list(range(1, total + 1)) and all(len(v) == 4 for v in per_step.values()), per_step
    return resumed_at


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_srun_template_preempted_and_requeued_on_one_node(slurm_cluster_2nodes, tmp_path, tiny_pipeline,
                                                                   shapes_shards):
    """srun template, 2 nodes x 2 tasks, USR1; while pending the job is set to 1 node (it comes back smaller):
    the template starts 2 tasks, which resume the 4 ranks' checkpoint with the same global batch and samples,
    every step logged once."""
    cluster, total = slurm_cluster_2nodes, 12
    config = two_node_config(tmp_path, tiny_pipeline, shapes_shards, "srun2x2", total)
    run = tmp_path / "runs" / "srun2x2"
    job = cluster.sbatch(SRUN_TEMPLATE, options=cluster.template_options(nodes=2, ntasks_per_node=2, chdir=REPO),
                         env={"CONFIG": str(config), **NODE_ENV})
    # All three: NumNodes=1 alone lowers only the minimum, and the job's 4 CPUs would not fit one 2-CPU node.
    log = preempt_and_requeue(cluster, job, run, update=["NumNodes=1-1", "NumTasks=2", "NumCPUs=2"])
    starts = [line for line in log.splitlines() if "(restart " in line]
    assert ": 4 tasks," in starts[0] and ": 2 tasks," in starts[-1], starts  # the template counts each allocation's
    train_log = (run / "train.log").read_text()
    assert "launcher=srun world_size=4 " in train_log and "launcher=srun world_size=2 " in train_log, train_log[-3000:]
    # hsdp's default shard group is one node's tasks: 2 x 2 on 2 nodes; on 1 node a single group, which is fsdp.
    assert MESH_2X2 in train_log, train_log[-3000:]
    assert "distributed.strategy=hsdp with one shard group of all 2 rank(s) (distributed.hsdp_shard_size=0: the " \
           "ranks of one node): nothing to replicate, so it runs as fsdp" in train_log, train_log[-3000:]
    assert "resumed an fsdp checkpoint of 4 ranks under fsdp on 2 ranks: model and optimizer resharded by DCP" \
           in train_log, train_log[-3000:]
    assert all((run / "logs" / f"rank_{r}.log").exists() for r in (1, 2, 3))  # the second node's ranks too
    assert "resumed on 2 rank(s) x 1 worker(s) from a checkpoint of 4 rank(s) x 1 worker(s) (4 canonical readers); " \
           "global batch 4 = 1 x 2 accumulation x 2 ranks" in train_log, train_log[-3000:]
    assert metric_steps(run) == list(range(1, total + 1))
    saved = complete_steps(run / "checkpoints")
    assert saved[-1] == total and len(saved) == 2 and saved[0] == samples_per_step(run, total), saved


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_torchrun_template_preempted_requeued_and_resumed(slurm_cluster_2nodes, tmp_path, tiny_pipeline,
                                                                   shapes_shards):
    """torchrun template (one torchrun per node, static rendezvous, 2 workers each), USR1 to the step: the workers
    save (torchrun ignores USR1), rank 0 requeues, and the requeued job resumes on the same 2 x 2."""
    cluster, total = slurm_cluster_2nodes, 12
    config = two_node_config(tmp_path, tiny_pipeline, shapes_shards, "torchrun2x2", total)
    run = tmp_path / "runs" / "torchrun2x2"
    job = cluster.sbatch(TORCHRUN_TEMPLATE,
                         options=cluster.template_options(nodes=2, ntasks_per_node=1, cpus_per_task=2, chdir=REPO),
                         env={"CONFIG": str(config), "GPUS_PER_NODE": "2", **NODE_ENV})
    log = preempt_and_requeue(cluster, job, run)
    assert log.count("2 nodes x 2 workers") == 2, log[-3000:]
    train_log = (run / "train.log").read_text()
    assert train_log.count("launcher=torchrun world_size=4 ") == 2, train_log[-3000:]
    assert train_log.count(MESH_2X2) == 2, train_log[-3000:]  # torchrun's LOCAL_WORLD_SIZE: GPUS_PER_NODE
    assert all((run / "logs" / f"rank_{r}.log").exists() for r in (1, 2, 3))
    assert "requeued SLURM job" in log and "resumed from" in train_log, log[-3000:]
    assert "resumed on" not in train_log  # the same layout: no reassignment of readers
    assert metric_steps(run) == list(range(1, total + 1))
    saved = complete_steps(run / "checkpoints")
    assert saved[-1] == total and len(saved) == 2 and saved[0] == samples_per_step(run, total), saved
