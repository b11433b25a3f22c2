"""No pickle from a checkpoint folder ever runs (issue 34, case 1); a run never starts over on its own
(case 3); an optimizer switched on resume is refused, or its state dropped with a warning (case 10).

The checkpoints are b27a8d6's fixtures (``fixtures/checkpoints_b27a8d6``, see test_old_checkpoints: step 4
of a one-process run and of a 2-rank FSDP run, both with EMA): nothing is trained to build them. A payload
case copies one, plants a pickle whose unpickling would create a marker file in place of one kind of file
(its record in ``COMPLETE`` rewritten too where that reaches the reader behind the checksums) or as a file
``COMPLETE`` does not list, resumes, and checks that the marker file never appears, that the refusal names
the file, and that the run stops (exit 2: the fixture holds one step) with the folder left in place. The
fallback to an older intact checkpoint is test_checkpoint_integrity's (its payload cases). The 2-rank cases
run in one torchrun launch, a CheckpointManager per case over one Trainer's parts: this file is the worker.

    python tests/test_checkpoint_payloads.py OUT_PREFIX CASES.json key=value ...   (under torchrun)
"""

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import forked
import pytest
import torch

from sd_training.checkpoint.integrity import file_record
from sd_training.checkpoint.layout import MARKER

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "checkpoints_b27a8d6"
STEP = "step_00000004"
ARGS = [
    f"config={FIXTURE / 'run.yaml'}", "experiment.log_dir=runs", "experiment.num_examples_to_see=32",
    "experiment.save_every=1000", "experiment.checkpoint_every=2", "experiment.keep_last_checkpoints=10",
    "experiment.log_every=1", "experiment.sample_steps=2", "experiment.sample_per_prompt=0",
    "experiment.sample_prompts=[a]", "system.workers=0", "system.device=cpu", "model.pretrained=pipeline",
    "dataset.params.path=shapes/shapes-{000000..000003}.tar", "dataset.params.resolution=64", "wandb.mode=disabled",
    "optimizer.params.learning_rate=1e-3", "lr_scheduler.params.warmup_length=2", "model.use_ema=true",
    "model.mixed_precision=bf16",
]
ONE = ["experiment.name=one_process", "system.batch_size=4"]
FSDP = ["experiment.name=fsdp2", "system.batch_size=2", "distributed.strategy=fsdp"]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]


class OpenPayload:
    """Unpickled, creates ``marker`` (``open(marker, "w")``)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class SystemPayload(OpenPayload):
    """Unpickled, runs ``touch marker`` (the red team's ``os.system``)."""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(ckpt: Path, name: str, marker: Path, rerecord: bool = False, link: bool = False) -> None:
    """A payload as ``ckpt/name`` (a torch.save of it for ``.pt`` files, a bare pickle otherwise, padded to the
    size of the file it replaces, as the red team's was: only the CRC32 of the rank that hashes it differs);
    ``rerecord``: ``COMPLETE`` records its size and CRC32 (the checksums pass: the reader behind them must
    refuse it); ``link``: the file is a symbolic link to the payload, outside the folder."""
    path = ckpt / name
    target = ckpt.parent.parent / f"payload-{path.name}" if link else path
    size = path.stat().st_size if path.exists() else 0
    path.unlink(missing_ok=True)
    path.parent.mkdir(exist_ok=True)
    payload = (SystemPayload if name.endswith(".metadata") else OpenPayload)(marker)
    if name.endswith(".pt"):
        torch.save(payload, target)
    else:  # pickle.load stops at the pickle's end: the padding is never read
        data = pickle.dumps(payload)
        target.write_bytes(data + b"\0" * max(0, size - len(data)))
    if link:
        path.symlink_to(target)
    if rerecord:
        m = json.loads((ckpt / MARKER).read_text())
        m["files"][name] = file_record(path)
        (ckpt / MARKER).write_text(json.dumps(m))


def scratch_at(tmp: Path, tiny_pipeline, shapes_shards, *runs: str) -> Path:
    """A folder holding the fixture runs under runs/ and the pipeline and shards at the paths their configs name."""
    (tmp / "pipeline").symlink_to(tiny_pipeline)
    (tmp / "shapes").symlink_to(Path(shapes_shards.split("{")[0]).parent)
    for run in runs:
        shutil.copytree(FIXTURE / run, tmp / "runs" / run)
    return tmp


def copy_case(scratch: Path, run: str, case: str) -> Path:
    """The fixture run ``run`` copied as runs/<case>; returns its step folder."""
    shutil.copytree(scratch / "runs" / run, scratch / "runs" / case)
    return scratch / "runs" / case / "checkpoints" / STEP


# -- one process: every kind of file of a full-tensor checkpoint ------------------------------------------

# case -> (file planted, rerecorded in COMPLETE, a link, the phrase that names the problem)
ONE_PROCESS = {
    "rank file": ("rank_0.pt", False, False, "the COMPLETE marker records"),
    "net weights, recorded": ("unet.pt", True, False, "holds objects other than tensors"),
    "optimizer": ("optimizer.pt", False, False, "the COMPLETE marker records"),
    "EMA, recorded": ("ema.pt", True, False, "holds objects other than tensors"),
    "LR schedule": ("lr_scheduler.pt", False, False, "the COMPLETE marker records"),
    "train state": ("train_state.json", False, False, "the COMPLETE marker records"),
    "config": ("config.yaml", False, False, "the COMPLETE marker records"),
    "DCP index added, unlisted": ("sharded/.metadata", False, False, "is not recorded by the COMPLETE marker"),
    "unlisted file": ("extra.pt", False, False, "is not recorded by the COMPLETE marker"),
    "net weights as a link, recorded": ("unet.pt", True, True, "is a symbolic link, not a regular file"),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_pipeline, shapes_shards):
    """(scratch folder, a Trainer set up on the intact fixture: its resume passes the new checks)."""
    from helpers import ready_trainer

    from sd_training.configure import load

    scratch = scratch_at(tmp_path_factory.mktemp("payloads"), tiny_pipeline, shapes_shards, "one_process", "fsdp2")
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        t = ready_trainer(load(ARGS + ONE))
        t._lock.close()
        assert t.state.step == 4
        yield scratch, t
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("case", list(ONE_PROCESS))
def test_a_payload_in_a_one_process_checkpoint_never_runs(one_process, case):
    from test_checkpoint_integrity import resume_in

    from sd_training.checkpoint.manager import NoUsableCheckpoint

    scratch, trainer = one_process
    name, rerecord, link, problem = ONE_PROCESS[case]
    slug = case.replace(" ", "_").replace(",", "")
    ckpt = copy_case(scratch, "one_process", slug)
    marker = scratch / f"RAN-{slug}"
    plant(ckpt, name, marker, rerecord, link)
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    with pytest.raises(NoUsableCheckpoint) as e:
        resume_in(trainer, ckpt.parent.parent)
    assert not marker.exists()
    line = str(e.value).split(f"{STEP}: {ckpt / name} ", 1)  # the file named, then its problem
    assert len(line) == 2 and problem in line[1].split(". They are left")[0], str(e.value)
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*") if p.name != "DAMAGED") == before


# DCP's index of the 2-rank FSDP fixture, resumed in one process (the same global batch: 4 x 1 = 2 x 2).
FSDP_IN_ONE_PROCESS = {
    "DCP index": ("sharded/.metadata", False, "fails its checksum"),
    "DCP index, recorded": ("sharded/.metadata", True, "is refused: it names posix.system"),
}


@pytest.mark.parametrize("case", list(FSDP_IN_ONE_PROCESS))
def test_a_payload_as_the_dcp_index_never_runs_in_one_process(one_process, case):
    from test_checkpoint_integrity import resume_in

    from sd_training.checkpoint.manager import NoUsableCheckpoint

    scratch, trainer = one_process
    name, rerecord, problem = FSDP_IN_ONE_PROCESS[case]
    slug = "one_" + case.replace(" ", "_").replace(",", "")
    ckpt = copy_case(scratch, "fsdp2", slug)
    config = ckpt / "config.yaml"  # the run's name as the one-process Trainer's, recorded: the config check passes
    config.write_text(config.read_text().replace("name: fsdp2\n", "name: one_process\n"))
    m = json.loads((ckpt / MARKER).read_text())
    m["files"]["config.yaml"] = file_record(config)
    (ckpt / MARKER).write_text(json.dumps(m))
    plant(ckpt, name, scratch / f"RAN-{slug}", rerecord)
    with pytest.raises(NoUsableCheckpoint, match=re.escape(f"{STEP}: {ckpt / name} {problem}")):
        resume_in(trainer, ckpt.parent.parent)
    assert not (scratch / f"RAN-{slug}").exists()


def test_the_restricted_reader_reads_dcp_index_and_refuses_anything_else(tmp_path):
    from sd_training.checkpoint import CheckpointDamaged
    from sd_training.checkpoint.dcp_metadata import read_metadata

    md = read_metadata(FIXTURE / "fsdp2" / "checkpoints" / STEP / "sharded" / ".metadata")
    assert "unet.conv_in.weight" in md.state_dict_metadata and md.storage_data
    for payload in (OpenPayload(tmp_path / "RAN"), SystemPayload(tmp_path / "RAN"), {"x": eval}, [b"x"] * 3):
        (tmp_path / ".metadata").write_bytes(pickle.dumps(payload))
        with pytest.raises(CheckpointDamaged, match=r"\.metadata (is refused|holds a)"):
            read_metadata(tmp_path / ".metadata")
        assert not (tmp_path / "RAN").exists()


def test_init_from_a_checkpoint_with_a_file_complete_does_not_list_names_it(one_process):
    from sd_training.checkpoint import init_weights_from
    from sd_training.config import ConfigError

    scratch, trainer = one_process
    ckpt = copy_case(scratch, "one_process", "init_from")
    plant(ckpt, "notes.pt", scratch / "RAN-init_from")
    refusal = f"'model.init_from': {ckpt / 'notes.pt'} is not recorded by the COMPLETE"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        init_weights_from(str(ckpt), trainer.net, "unet", want_ema=False)
    assert not (scratch / "RAN-init_from").exists()


# -- 2 FSDP ranks: DCP's index and shards, each rank's file -------------------------------------------------

# case -> (file planted, rerecorded in COMPLETE, the phrase that names the problem)
FSDP_CASES = {
    "DCP index": ("sharded/.metadata", False, "the COMPLETE marker records"),
    "DCP index, recorded": ("sharded/.metadata", True, "is refused: it names posix.system"),
    "DCP shard of rank 0": ("sharded/__0_0.distcp", False, "the COMPLETE marker records"),
    "rank 1's file": ("rank_1.pt", False, "the COMPLETE marker records"),
    "EMA scalars, recorded": ("ema_meta.pt", True, "holds objects other than tensors"),
    "unlisted shard": ("sharded/__2_0.distcp", False, "is not recorded by the COMPLETE marker"),
}


def fsdp_worker(prefix: str, cases: dict, argv: list[str]) -> None:
    """Under torchrun: a Trainer set up on the intact fixture (it resumes it), then each case's run folder
    resumed with a CheckpointManager over its parts; each rank writes what each resume did."""
    from test_checkpoint_integrity import resume_in

    from sd_training import distributed
    from sd_training.checkpoint.manager import NoUsableCheckpoint
    from sd_training.configure import load
    from sd_training.loop import Trainer

    cfg = load(argv)
    info = distributed.setup(cfg.system.device, cfg.distributed.dist_backend, cfg.distributed.dist_url)
    try:
        t = Trainer(cfg, info)
        t.setup()
        out = {"intact": t.state.step}
        for case, run in cases.items():
            try:
                out[case] = f"resumed at step {resume_in(t, Path(run)).state.step}"
            except NoUsableCheckpoint as e:
                out[case] = str(e)
        Path(f"{prefix}{info.rank}.json").write_text(json.dumps(out))
        distributed.barrier()
    finally:
        distributed.teardown()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_payload_in_an_fsdp_checkpoint_never_runs_on_either_rank(tmp_path, tiny_pipeline, shapes_shards):
    from test_distributed import free_port

    scratch = scratch_at(tmp_path, tiny_pipeline, shapes_shards, "fsdp2")
    cases, planted = {}, {}
    for case, (name, rerecord, _) in FSDP_CASES.items():
        slug = case.replace(" ", "_").replace(",", "").replace("'", "")
        ckpt = copy_case(scratch, "fsdp2", slug)
        plant(ckpt, name, scratch / f"RAN-{slug}", rerecord)
        cases[case], planted[case] = str(ckpt.parent.parent), (ckpt, scratch / f"RAN-{slug}")
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(Path(__file__).resolve()), str(tmp_path / "out_"),
           str(tmp_path / "cases.json"), *ARGS, *FSDP]
    res = forked.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=scratch,
                     timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    outs = [json.loads((tmp_path / f"out_{r}.json").read_text()) for r in (0, 1)]
    assert outs[0]["intact"] == outs[1]["intact"] == 4  # the real index passes the restricted reader
    for case, (name, _, problem) in FSDP_CASES.items():
        ckpt, marker = planted[case]
        assert not marker.exists(), case
        for out in outs:  # both ranks stop, with the same line naming the file, then its problem
            line = out[case].split(f"{STEP}: {ckpt / name} ", 1)
            assert len(line) == 2 and problem in line[1].split(". They are left")[0], (case, out[case])
        assert (ckpt / name).exists() and (ckpt / "DAMAGED").exists()


# -- case 3: step folders without their marker stop the run; nothing of it is touched ------------------------

def produced(run: Path) -> dict:
    """What a run has made that a start from step 1 would erase or overwrite: metrics, exports, grids, checkpoints."""
    keep = ("metrics.jsonl", "current_pipeline", "samples", "checkpoints")
    return {str(p.relative_to(run)): p.read_bytes() if p.is_file() else None
            for p in sorted(run.rglob("*")) if p.relative_to(run).parts[0] in keep}


def test_checkpoints_without_their_marker_stop_the_run_and_nothing_is_touched(tmp_path, tiny_pipeline, shapes_shards,
                                                                               monkeypatch, capsys):
    from sd_training.cli import main as cli

    scratch = scratch_at(tmp_path, tiny_pipeline, shapes_shards, "one_process")
    monkeypatch.chdir(scratch)
    run = scratch / "runs" / "one_process"
    (run / "checkpoints" / STEP / MARKER).unlink()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 5)))
    (run / "current_pipeline").mkdir()
    (run / "current_pipeline" / "model_index.json").write_text("{}")
    (run / "samples").mkdir()
    (run / "samples" / "step_00000004.png").write_bytes(b"a grid")
    before = produced(run)
    assert cli(ARGS + ONE) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{STEP}: has no {MARKER} marker" in err and "start_fresh" in err, err
    assert produced(run) == before  # no row cut, no export, no grid, no folder moved aside


def test_a_new_run_over_step_folders_without_their_marker_is_refused_or_moved_aside(tmp_path):
    from sd_training.config import ConfigError
    from sd_training.run.run_dir import RunDir

    run = RunDir.at(tmp_path / "run")
    (run.checkpoints / STEP).mkdir(parents=True)
    (run.metrics).write_text('{"step": 4}\n')
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run"):
        run.refuse_or_move_aside([], resume=False, start_fresh=False)
    aside = run.refuse_or_move_aside([], resume=True, start_fresh=True)
    assert (aside / "checkpoints" / STEP).is_dir() and (aside / "metrics.jsonl").exists()
    assert not run.checkpoints.exists()


# -- case 10: another optimizer on resume --------------------------------------------------------------------

@pytest.mark.parametrize("name, extra", [("lion", []), ("prodigy", ["optimizer.params.learning_rate=1.0"])])
def test_another_optimizer_on_resume_is_refused_or_its_state_dropped_with_a_warning(
        tmp_path, tiny_pipeline, shapes_shards, monkeypatch, capsys, name, extra):
    from sd_training.cli import main as cli

    scratch = scratch_at(tmp_path, tiny_pipeline, shapes_shards, "one_process")
    monkeypatch.chdir(scratch)
    run = scratch / "runs" / "one_process"
    switch = ARGS + ONE + [f"optimizer.name={name}", *extra]
    assert cli(switch) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"optimizer.name: adamw -> {name}" in err, err
    allowed = switch + ["experiment.allow_config_change=true", "experiment.num_examples_to_see=24",
                        "experiment.report=false"]
    assert cli(allowed) == 0, capsys.readouterr().err[-3000:]
    log = (run / "train.log").read_text()
    assert "resumed from" in log and "at step 4" in log
    dropped = [line for line in log.splitlines() if "optimizer state of step_00000004 is dropped" in line]
    assert len(dropped) == 1 and f"optimizer.name={name}" in dropped[0] and "moments restart" in dropped[0], log[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [5, 6] and all(0 < v < 10 for v in losses.values()), losses


if __name__ == "__main__":
    fsdp_worker(sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), sys.argv[3:])
