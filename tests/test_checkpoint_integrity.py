"""Checkpoints are verified before they are trusted.

One tiny fp32 run (resolution 32, 6 steps, checkpoints at steps 2, 4 and 6) is trained once per module;
each case copies its run folder (large files hard-linked, a file is copied before it is damaged), damages
the newest checkpoint in one way and resumes it with a CheckpointManager over the parts of a Trainer set up
once (the set-up's own resume path, without rebuilding the model each time): the resume must use the older
intact checkpoint, say in one log line which file is wrong and how, and leave the damaged folder in place
(with its ``DAMAGED`` note). Damage that the marker's checksums would catch first is also re-recorded in
the marker for the cases that test the value checks behind them (train_state.json's values, the names it
lists, the shapes). Then: every checkpoint damaged (a clear refusal, exit 2, nothing deleted), retention
around damaged folders, the ``sizes`` mode, an earlier-format marker, ``model.init_from`` and
``model.ema.path`` pipelines (no fallback: one ConfigError line), and a 2-rank FSDP run where only rank 1
reads the damaged shard file (both ranks take the older step).

    python tests/test_checkpoint_integrity.py OUT_PREFIX key=value ...   (the 2-rank worker, under torchrun)
"""

import json
import os
import shutil
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import args_with, ready_trainer

from sd_training import distributed
from sd_training.checkpoint import CheckpointDamaged, Checkpointer, CheckpointManager, complete_steps, verify
from sd_training.checkpoint.integrity import file_record
from sd_training.checkpoint.layout import DAMAGED, MARKER
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.loop import Trainer
from sd_training.loop import main as train
from sd_training.run.run_dir import RunDir
from sd_training.run.train_state import TrainState

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6  # checkpoints at 2, 4, 6
NEWEST, OLDER = "step_00000006", "step_00000004"


run_args = args_with({"dataset.params.resolution": 32, "experiment.num_examples_to_see": 4 * STEPS,
                      "experiment.checkpoint_every": 2, "experiment.keep_last_checkpoints": 5,
                      "experiment.sample_per_prompt": 0})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_pipeline, shapes_shards):
    tmp = tmp_path_factory.mktemp("integrity")
    args = run_args(tmp, tiny_pipeline, shapes_shards)
    train(load(args))
    run = tmp / "runs" / "run"
    (run / "args.json").write_text(json.dumps(args))
    assert complete_steps(run / "checkpoints") == [2, 4, 6]
    return run


def _link_or_copy(src, dst):
    return os.link(src, dst) if os.path.getsize(src) > 2**20 else shutil.copy2(src, dst)


@pytest.fixture
def case(tmp_path, base, tiny_pipeline, shapes_shards):
    """A copy of the base run (big files hard-linked: damage goes through :func:`own` first)."""
    shutil.copytree(base, tmp_path / "runs" / "run", copy_function=_link_or_copy)
    return tmp_path, run_args(tmp_path, tiny_pipeline, shapes_shards)


def own(path: Path) -> Path:
    """This copy's own bytes (not the base run's hard link), so it can be damaged."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def rerecord(folder: Path, name: str) -> None:
    """The marker records the file as it is now (damage written consistently: only the value checks see it)."""
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][name] = file_record(folder / name)
    (folder / MARKER).write_text(json.dumps(marker))


def truncate(folder, name="unet.pt"):
    p = own(folder / name)
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size // 2)


def flip_byte(folder, name="unet.pt"):
    p = own(folder / name)
    with open(p, "r+b") as fh:
        fh.seek(p.stat().st_size // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))


def edit_train_state(folder, change):
    p = own(folder / "train_state.json")
    text = p.read_text()
    p.write_text(change(text) if callable(change) else change)
    rerecord(folder, "train_state.json")


def edit_json(folder, **kw):
    def change(text):
        return json.dumps({**json.loads(text), **kw})
    edit_train_state(folder, change)


def another_model_size(folder):
    p = own(folder / "unet.pt")
    sd = torch.load(p, weights_only=True)
    sd["conv_in.weight"] = torch.zeros(64, 8, 3, 3)  # 8 input channels instead of 4
    torch.save(sd, p)
    rerecord(folder, "unet.pt")


def earlier_marker(folder):
    (folder / MARKER).write_text("1795646608.5581403\n")  # the format before the file records


def marker_lists(folder, name):
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][name] = {"size": 1}
    (folder / MARKER).write_text(json.dumps(marker))


# name -> (damage of the newest checkpoint folder, the file the line names, the problem it states)
DAMAGE = {
    "truncated .pt": (truncate, "unet.pt", "the COMPLETE marker records"),
    "deleted rank file": (lambda f: (f / "rank_0.pt").unlink(), "rank_0.pt", "is missing"),
    "flipped byte in a .pt": (flip_byte, "unet.pt", "fails its checksum"),
    "train_state.json unparsable": (lambda f: edit_train_state(f, '{"step": 6, "images'), "train_state.json",
                                    "does not parse as JSON"),
    "step 'abc'": (lambda f: edit_json(f, step="abc"), "train_state.json", "holds step 'abc', not a whole number"),
    "step -5": (lambda f: edit_json(f, step=-5), "train_state.json", "holds step -5, not a whole number"),
    "step of another folder": (lambda f: edit_json(f, step=8), "train_state.json", "but its folder is step 6"),
    "images_seen -1": (lambda f: edit_json(f, images_seen=-1), "train_state.json", "holds images_seen -1"),
    "file list names ../x": (lambda f: edit_json(f, checkpoint_files=["../x", "unet"]), "train_state.json",
                             "lists '../x' in checkpoint_files, a path outside the step folder"),
    "file list names an absolute path": (lambda f: edit_json(f, checkpoint_files=["/etc/passwd"]), "train_state.json",
                                         "lists '/etc/passwd' in checkpoint_files, a path outside"),
    "marker names ../x": (lambda f: marker_lists(f, "../x"), "COMPLETE", "lists '../x', a path outside the step folder"),
    "model of another size": (another_model_size, "unet.pt",
                              "holds parameter 'conv_in.weight' of shape (64, 8, 3, 3), this run's model has (64, 4, 3, 3)"),
    "earlier-format marker, truncated .pt": (lambda f: (earlier_marker(f), truncate(f)), "unet.pt",
                                             "cannot be read (torch.load:"),
    "earlier-format marker, deleted rank file": (lambda f: (earlier_marker(f), (f / "rank_0.pt").unlink()),
                                                 "rank_0.pt", "is missing"),
}


def worker(prefix: str, argv: list[str]) -> None:
    """Under torchrun: the Trainer's set-up (which resumes); each rank writes the step it resumed."""
    cfg = load(argv)
    info = distributed.setup(cfg.system.device, cfg.distributed.dist_backend, cfg.distributed.dist_url)
    try:
        t = Trainer(cfg, info)
        t.setup()
        Path(f"{prefix}{info.rank}.json").write_text(json.dumps({"step": t.state.step}))
        distributed.barrier()
    finally:
        distributed.teardown()


def resumed(args) -> Trainer:
    t = ready_trainer(load(args))
    t._lock.close()  # the run folder is free again for the next run in it
    return t


@pytest.fixture(scope="module")
def trainer(base):
    """A Trainer set up once (it resumes the base run); each case resumes its copy with a CheckpointManager
    over this Trainer's model, optimizer, schedules and loader (the set-up's own path, without rebuilding)."""
    return resumed(json.loads((base / "args.json").read_text()))


def resume_in(t: Trainer, run: Path) -> CheckpointManager:
    m = t.checkpoints
    manager = CheckpointManager(t.cfg, RunDir(str(run.parent), run.name), t.info, t.plan,
                                TrainState(global_batch=t.plan.global_batch), m.model, m.stateful, t.lr_scheduler,
                                t.loader)
    manager.resume()
    return manager


def rejection_lines(run: Path, caplog=None) -> list[str]:
    if caplog is not None:
        return [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
    return [line for line in (run / "train.log").read_text().splitlines() if "cannot be used" in line]


@pytest.mark.faults
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_kept_and_the_older_one_resumes(case, trainer, damage, caplog):
    tmp, _ = case
    run = tmp / "runs" / "run"
    newest, older = run / "checkpoints" / NEWEST, run / "checkpoints" / OLDER
    hurt, file, problem = DAMAGE[damage]
    hurt(newest)
    before = sorted(p.name for p in newest.iterdir())
    manager = resume_in(trainer, run)
    assert manager.state.step == 4 and manager.state.images_seen == 16
    saved = torch.load(older / "unet.pt", weights_only=True)
    assert all(torch.equal(v, saved[k]) for k, v in trainer.net.state_dict().items())  # the older one's weights
    lines = rejection_lines(run, caplog)
    assert len(lines) == 1, lines
    assert f"{NEWEST}/{file} " in lines[0] and problem in lines[0] and "left in place" in lines[0], lines[0]
    assert sorted(p.name for p in newest.iterdir()) == sorted(before + [DAMAGED])  # nothing removed
    assert problem in (newest / DAMAGED).read_text()


# A pickle planted in the newest checkpoint (tests/test_checkpoint_payloads.py has every kind of file, on one
# and two ranks, with no older checkpoint): it never runs, and the older one resumes.
PAYLOADS = {
    "DCP index added to a full-tensor folder": ("sharded/.metadata", False, "is not recorded by the COMPLETE marker"),
    "a file COMPLETE does not list": ("notes.pt", False, "is not recorded by the COMPLETE marker"),
    "optimizer state, recorded": ("optimizer.pt", True, "holds objects other than tensors"),
    "a FIFO COMPLETE does not list": ("queue", False, "is a FIFO, not a regular file"),
}


@pytest.mark.faults
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_a_payload_in_the_newest_checkpoint_never_runs_and_the_older_one_resumes(case, trainer, payload, caplog):
    from test_checkpoint_payloads import plant

    tmp, _ = case
    run = tmp / "runs" / "run"
    newest = run / "checkpoints" / NEWEST
    name, rerecord, problem = PAYLOADS[payload]
    if name == "queue":
        os.mkfifo(newest / name)  # read, it would block the resume
    else:
        plant(newest, name, tmp / "RAN", rerecord)
    assert resume_in(trainer, run).state.step == 4 and not (tmp / "RAN").exists()
    lines = rejection_lines(run, caplog)
    assert len(lines) == 1 and f"{newest / name} {problem}" in lines[0], lines
    assert os.path.lexists(newest / name) and (newest / DAMAGED).exists()


@pytest.mark.faults
def test_an_intact_checkpoint_with_an_earlier_format_marker_resumes(case, trainer, caplog):
    tmp, args = case
    run = tmp / "runs" / "run"
    earlier_marker(run / "checkpoints" / NEWEST)
    assert resume_in(trainer, run).state.step == 6 and not rejection_lines(run, caplog)


@pytest.mark.faults
def test_every_checkpoint_damaged_is_a_clear_refusal_that_deletes_nothing(case, capsys):
    from sd_training.cli import main as cli

    tmp, args = case
    ckpts = tmp / "runs" / "run" / "checkpoints"
    truncate(ckpts / "step_00000006")
    flip_byte(ckpts / "step_00000004", "optimizer.pt")
    (ckpts / "step_00000002" / "rank_0.pt").unlink()
    before = {p: sorted(q.name for q in p.iterdir()) for p in ckpts.iterdir()}
    assert cli(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "no checkpoint in" in line]
    assert "Traceback" not in err and len(lines) == 1, err
    assert "can be resumed from" in lines[0] and "start_fresh" in lines[0]
    for step, file in (("step_00000006", "unet.pt holds"), ("step_00000004", "optimizer.pt fails its checksum"),
                       ("step_00000002", "rank_0.pt is missing")):
        assert f"{step}: {ckpts / step / file}" in err, err
    assert sorted(ckpts.iterdir()) == sorted(before)  # nothing moved or deleted; each has its note
    for p, names in before.items():
        assert sorted(q.name for q in p.iterdir()) == sorted(names + [DAMAGED])
    assert complete_steps(ckpts) == [2, 4, 6]


@pytest.mark.faults
def test_retention_keeps_damaged_checkpoints_and_does_not_count_them(case):
    """Step 2 cut short, step 6 with a flipped byte: the run resumes at 4 and trains to 8 keeping one
    checkpoint; the damaged step 2 stays, the damaged step 6 is moved aside when step 6 is saved again."""
    tmp, args = case
    ckpts = tmp / "runs" / "run" / "checkpoints"
    truncate(ckpts / "step_00000002")
    flip_byte(ckpts / "step_00000006")
    done = train(load(args + ["experiment.num_examples_to_see=32", "experiment.keep_last_checkpoints=1"]))
    assert done["step"] == 8
    assert complete_steps(ckpts) == [2, 8]  # 4 and 6 (new) retired; the damaged 2 neither deleted nor counted
    aside = list(ckpts.glob("step_00000006.damaged-*"))
    assert len(aside) == 1 and (aside[0] / DAMAGED).exists() and (aside[0] / "unet.pt").exists()
    assert (ckpts / "step_00000002" / "unet.pt").exists()


def test_sizes_mode_records_sizes_only_and_still_finds_a_cut_file(tmp_path):
    ck = Checkpointer(tmp_path, checksum=False)
    folder = ck.save(3, {"unet": {"w": torch.ones(1000)}}, {"rng": 1, "data": 1}, {"step": 3}, "a: 1\n", rank=0)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["checksum"] is None and all(set(r) == {"size"} for r in marker["files"].values())
    assert set(marker["files"]) == {"unet.pt", "rank_0.pt", "train_state.json", "config.yaml"}
    verify(folder)  # nothing to compare but sizes: passes
    truncate(folder)
    with pytest.raises(CheckpointDamaged, match=r"unet\.pt holds .* bytes, the COMPLETE marker records"):
        verify(folder)


def test_the_marker_records_every_file_with_size_and_crc32_of_an_async_save(tmp_path):
    import zlib

    ck = Checkpointer(tmp_path, asynchronous=True)
    folder = ck.save(5, {"unet": {"w": torch.randn(300)}, "optimizer": {"s": 1}}, {"rng": 1, "data": 1}, {"step": 5},
                     "a: 1\n", rank=0)
    ck.wait()
    marker = json.loads((folder / MARKER).read_text())
    on_disk = {p.name for p in folder.iterdir()} - {MARKER}
    assert set(marker["files"]) == on_disk and marker["ranks"] == 1 and marker["checksum"] == "crc32"
    for name, rec in marker["files"].items():
        data = (folder / name).read_bytes()
        assert rec == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


# -- model.init_from and model.ema.path: no fallback, one ConfigError line ------------------------------

@pytest.fixture(scope="module")
def net(tiny_pipeline):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(Path(tiny_pipeline) / "unet")


def _pipeline_copy(base, tmp_path) -> Path:
    out = tmp_path / "pipe"
    shutil.copytree(base / "current_pipeline", out, copy_function=_link_or_copy)
    return out


def _garble_header(p):
    own(p)
    with open(p, "r+b") as fh:
        fh.seek(12)
        fh.write(b"\xff\xfe")


def _cut(p):
    own(p)
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size - 1000)


PIPELINE_DAMAGE = {
    "truncated safetensors": (_cut, "is cut short: its header describes"),
    "garbled header": (_garble_header, "has a garbled header"),
    "missing weights file": (lambda p: p.unlink(), "holds no weights file"),
}


@pytest.mark.faults
@pytest.mark.parametrize("damage", list(PIPELINE_DAMAGE))
def test_init_from_a_damaged_pipeline_names_the_file(base, tmp_path, net, damage):
    from sd_training.checkpoint import init_weights_from

    pipe = _pipeline_copy(base, tmp_path)
    weights = pipe / "unet" / "diffusion_pytorch_model.safetensors"
    hurt, problem = PIPELINE_DAMAGE[damage]
    hurt(weights)
    with pytest.raises(ConfigError) as e:
        init_weights_from(str(pipe), net, "unet", want_ema=False)
    msg = str(e.value)
    assert msg.startswith("'model.init_from': ") and problem in msg and "\n" not in msg, msg
    assert str(weights if damage != "missing weights file" else weights.parent) in msg


@pytest.mark.faults
def test_init_from_a_pipeline_of_another_model_size_names_the_parameter(base, tmp_path, net):
    from diffusers import UNet2DConditionModel

    from sd_training.checkpoint import init_weights_from

    other = UNet2DConditionModel.from_config({**dict(net.config), "in_channels": 8})
    with pytest.raises(ConfigError, match=r"unet holds parameter 'conv_in.weight' of shape \(64, 4, 3, 3\), this run's "
                                          r"model has \(64, 8, 3, 3\)"):
        init_weights_from(str(base / "current_pipeline"), other, "unet", want_ema=False)


@pytest.mark.faults
def test_init_from_a_damaged_checkpoint_names_the_file_without_fallback(case, net):
    from sd_training.checkpoint import init_weights_from

    tmp, _ = case
    run = tmp / "runs" / "run"
    flip_byte(run / "checkpoints" / NEWEST)
    with pytest.raises(ConfigError, match=rf"'model.init_from': .*{NEWEST}/unet\.pt fails its checksum.*older checkpoint"):
        init_weights_from(str(run), net, "unet", want_ema=False)  # the run folder: its newest checkpoint
    init_weights_from(str(run / "checkpoints" / OLDER), net, "unet", want_ema=False)  # the older one, named: loads


@pytest.mark.faults
def test_a_damaged_ema_path_stops_the_run_with_one_line(case, capsys):
    from sd_training.cli import main as cli

    tmp, args = case
    pipe = _pipeline_copy(tmp / "runs" / "run", tmp)
    weights = pipe / "unet" / "diffusion_pytorch_model.safetensors"
    _cut(weights)
    assert cli(args + ["experiment.name=ema", "model.use_ema=true", f"model.ema.path={pipe}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"'model.ema.path': {weights} is cut short" in err, err


# -- FSDP on 2 ranks: the ranks decide together -------------------------------------------------------------

def _torchrun(args, cwd):
    from test_distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *args]
    res = forked.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=cwd,
                     timeout=600)  # forked: no imports
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.faults
def test_fsdp_shard_damaged_where_only_rank_1_reads_it_both_ranks_take_the_older_step(tmp_path, tiny_pipeline,
                                                                                        shapes_shards):
    args = run_args(tmp_path, tiny_pipeline, shapes_shards, **{
        "distributed.strategy": "fsdp", "system.batch_size": 2, "experiment.num_examples_to_see": 8,
        "experiment.checkpoint_every": 1})
    _torchrun([str(ROOT / "train.py"), *args], tmp_path)  # 2 steps: checkpoints 1 and 2, asynchronous DCP
    run = tmp_path / "runs" / "run"
    newest = run / "checkpoints" / "step_00000002"
    marker = json.loads((newest / MARKER).read_text())
    shards = [n for n in marker["files"] if n.startswith("sharded/__")]
    assert len(shards) == 2 and all("crc32" in marker["files"][n] for n in shards)
    assert {"rank_0.pt", "rank_1.pt", "sharded/.metadata"} <= set(marker["files"]) and marker["ranks"] == 2
    # verify() gives rank r every 2nd file of the sorted list from r: damage a shard only rank 1 hashes.
    hashed = sorted(n for n, r in marker["files"].items() if "crc32" in r)
    target = next(n for n in hashed[1::2] if n.startswith("sharded/__"))
    flip_byte(newest, target)
    _torchrun([str(Path(__file__).resolve()), str(tmp_path / "resumed_"), *args], tmp_path)
    steps = [json.loads((tmp_path / f"resumed_{r}.json").read_text())["step"] for r in (0, 1)]
    assert steps == [1, 1]
    lines = rejection_lines(run)
    assert len(lines) == 1 and f"{target} fails its checksum" in lines[0], lines
    assert (newest / DAMAGED).exists() and (newest / target).exists()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
