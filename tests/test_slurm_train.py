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


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.distributed
def test_requeued_on_fewer_nodes_continues_the_same_samples(slurm_cluster_2nodes, tmp_path, tiny_pipeline,
                                                            shapes_shards):
    """2 nodes x 1 task, USR1, requeued and set to 1 node while pending (a job that comes back smaller): the
    template starts 1 task, which resumes with the same global batch and samples, every step logged once."""
    slurm_cluster = slurm_cluster_2nodes
    total = 30
    config = write_config(tmp_path, tiny_pipeline, shapes_shards, "shrink", **{
        "system.batch_size": 2, "system.global_batch_size": 4, "experiment.num_examples_to_see": 4 * total,
        "experiment.checkpoint_every": 1000, "experiment.sample_per_prompt": 0, "experiment.requeue": "true",
        "system.workers": 1, "experiment.record_sample_keys": "true"})
    run = tmp_path / "runs" / "shrink"
    job = slurm_cluster.sbatch(
        SRUN_TEMPLATE, options=slurm_cluster.template_options(nodes=2, ntasks_per_node=1, chdir=REPO),
        env={"CONFIG": str(config), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"},
    )
    slurm_cluster.wait_until(lambda: (run / "metrics.jsonl").exists() and len(metric_steps(run)) >= 3,
                             timeout=240, what="3 logged steps", job_id=job)
    slurm_cluster.send_usr1(job, target="steps")
    slurm_cluster.speed_up_requeue(job, restarts=1, update=["NumNodes=1", "NumTasks=1"])
    slurm_cluster.wait_state(job, "COMPLETED", timeout=300)
    log = (run / "train.log").read_text()
    assert "resumed on 1 rank(s) x 1 worker(s) from a checkpoint of 2 rank(s) x 1 worker(s) (2 canonical readers); " \
           "global batch 4 = 2 x 2 accumulation x 1 ranks" in log, log[-3000:]
    assert metric_steps(run) == list(range(1, total + 1))
    keys = [json.loads(line) for f in (run / "sample_keys").glob("rank_*.jsonl") for line in f.read_text().splitlines()]
    resumed_at = max(r["start_step"] for r in keys)
    assert 0 < resumed_at < total
    per_step = {}
    for r in keys:  # steps written after the save and before the requeue are redone by the resumed run
        if r["step"] <= resumed_at or r["start_step"] == resumed_at:
            per_step.setdefault(r["step"], []).extend(r["keys"])
    assert sorted(per_step) == list(range(1, total + 1)) and all(len(v) == 4 for v in per_step.values())


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.distributed
def test_two_namespace_hosts_train_with_torchrun_template(slurm_cluster_2nodes, tmp_path, tiny_pipeline, shapes_shards):
    """2 nodes (network namespaces) x 1 process each, torchrun static rendezvous, gloo across hosts."""
    config = write_config(tmp_path, tiny_pipeline, shapes_shards, "twonode", **{
        "system.batch_size": 2, "experiment.num_examples_to_see": 4 * 6, "experiment.sample_per_prompt": 0})
    run = tmp_path / "runs" / "twonode"
    cluster = slurm_cluster_2nodes
    job = cluster.sbatch(
        TORCHRUN_TEMPLATE, options=cluster.template_options(nodes=2, ntasks_per_node=1, chdir=REPO),
        env={"CONFIG": str(config), "PYTHON": sys.executable, "GPUS_PER_NODE": "1", "GLOO_SOCKET_IFNAME": "eth0",
             "OMP_NUM_THREADS": "1"},
    )
    cluster.wait_state(job, "COMPLETED", timeout=300)
    log = cluster.job_output(job)
    assert "world_size=2" in (run / "train.log").read_text()
    assert (run / "logs" / "rank_1.log").exists()  # the second node's rank wrote its log
    assert complete_steps(run / "checkpoints")[-1] == 6, log[-3000:]
    assert metric_steps(run) == list(range(1, 7))
