"""Limits checked at load (issue 26): sizes against the machine, every folder the run writes, interpolation
errors, plain run names, damaged pipeline files, weights of the wrong shape, and the batch layout on
resume. Each case is a bad value or file fed to ``sd_training.configure.load`` (no training run but
the last): one ``ConfigError`` naming the key or the file and saying what to do."""

import json
import os
import shutil
import tempfile

import pytest
import torch
from conftest import train_args

from sd_training.checkpoint.resume_config import check_resume_config
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.config.loading import public_dict, to_yaml
from sd_training.distributed import usable_cpus
from sd_training.families.tiny import TINY_UNET, TINY_VAE
from sd_training.memory.activations import activation_bytes

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]

BASE = ["experiment.name=x", "experiment.num_examples_to_see=64", "model.pretrained=/models/sd",
        "dataset.params.path=/data/{0..3}.tar"]


def tiny(tmp_path, pipeline, *extra):
    return [f"experiment.log_dir={tmp_path / 'runs'}", "experiment.name=x", "experiment.num_examples_to_see=64",
            f"model.pretrained={pipeline}", "dataset.params.path=/data/{0..3}.tar", "system.device=cpu", *extra]


# ---------------------------------------------------------------- sizes against the machine

def test_absurd_worker_counts_are_refused_against_the_cpus():
    with pytest.raises(ConfigError, match=r"'system\.workers'=100,000 .* may use \d+ CPU\(s\).*set system\.workers="):
        load([*BASE, "system.workers=100000"])
    with pytest.raises(ConfigError, match=r"'dataset\.params\.workers'=5,000"):
        load([*BASE, "dataset.params.workers=5000"])
    load([*BASE, f"system.workers={max(usable_cpus(), 6)}"])  # the default (6) on a small machine is fine


@pytest.mark.parametrize("value, message", [
    ("1000000000", r"'dataset\.params\.resolution' must be within \[8, 8192\], got 1000000000"),
    ("1004", r"dataset\.params\.resolution=1004: must be a multiple of 8"),
])
def test_resolution_is_bounded(value, message):
    with pytest.raises(ConfigError, match=message):
        load([*BASE, f"dataset.params.resolution={value}"])
    with pytest.raises(ConfigError, match=r"'experiment\.sample_resolution' must be within \[8, 8192\]"):
        load([*BASE, "experiment.sample_resolution=1000000000"])


def test_a_batch_beyond_the_memory_plan_is_refused_at_load(tiny_pipeline, tmp_path):
    """system.batch_size=100000000 used to fill the memory for minutes: now one line, with the numbers."""
    with pytest.raises(ConfigError) as err:
        load(tiny(tmp_path, tiny_pipeline, "system.batch_size=100000000"))
    text = str(err.value)
    assert "system.batch_size=100,000,000" in text and "does not fit" in text and "MiB per sample" in text
    assert "RAM" in text and "Settings that would fit in 90% of it" in text and "system.gradient_accumulation" in text
    # The advised batch loads; from-scratch UNets (model.unet.params) are planned too.
    fits = int(text.split("system.batch_size=")[-1].split(" ")[0].replace(",", ""))
    assert 1 < fits < 100_000_000
    load(tiny(tmp_path, tiny_pipeline, f"system.batch_size={fits}"))
    with pytest.raises(ConfigError, match="does not fit"):
        load(tiny(tmp_path, tiny_pipeline, "system.batch_size=100000000", "model.unet.pretrained=null",
                  "model.unet.params={block_out_channels: [32, 64], layers_per_block: 1, cross_attention_dim: 64, "
                  "down_block_types: [CrossAttnDownBlock2D, DownBlock2D], up_block_types: [UpBlock2D, CrossAttnUpBlock2D]}"))
    wide = ["system.batch_size=1", "dataset.params.resolution=2048", "model.unet.pretrained=null",
            "model.unet.params={block_out_channels: [4096, 4096], cross_attention_dim: 64, norm_num_groups: 32}"]
    with pytest.raises(ConfigError, match=r"resolution=2048 does not fit.*would fit.*model.gradient_checkpointing=true"):
        load(tiny(tmp_path, tiny_pipeline, *wide))
    load(tiny(tmp_path, tiny_pipeline, *wide, "model.gradient_checkpointing=true"))  # as advised


def test_the_start_up_plan_counts_activations_and_refuses_a_batch_that_cannot_fit():
    """Modules that cannot be read at load (a hub id, the quickstart's pipeline) are planned once built."""
    from diffusers import UNet2DConditionModel

    from sd_training.memory.fit import check_plan, micro_batch_activations
    from sd_training.memory.plan import format_plan, memory_plan

    net = UNet2DConditionModel(**TINY_UNET)
    cfg = load([*BASE, "system.device=cpu", "dataset.params.resolution=64"])  # /models/sd: nothing to read at load

    def rows(batch):
        cfg.system.batch_size = batch
        return memory_plan(net, [], "adamw", 1, False, False, 4, None, "layer",
                           activations=micro_batch_activations(cfg, net))

    small = rows(4)
    assert small[0].activations > 0 and "acts" in format_plan(small, "ddp", 1)
    check_plan(small, "ddp", "cpu", cfg)
    with pytest.raises(ConfigError, match=r"system\.batch_size=100,000,000 at dataset\.params\.resolution=64 does not fit"):
        check_plan(rows(100_000_000), "ddp", "cpu", cfg)


def test_the_activation_estimate_is_monotonic_and_close_to_what_autograd_saves():
    """Rough, stated as such: fitted to the tensors autograd saves, within 10% for the tiny UNet and VAE."""
    base = activation_bytes(TINY_UNET, "unet", 256, 4, False)
    assert activation_bytes(TINY_UNET, "unet", 512, 4, False) > base  # resolution
    assert activation_bytes({**TINY_UNET, "block_out_channels": (128, 256, 512)}, "unet", 256, 4, False) > base  # width
    assert activation_bytes(TINY_UNET, "unet", 256, 2, False) < base  # bf16
    assert activation_bytes(TINY_UNET, "unet", 256, 4, True) < base / 4  # gradient checkpointing
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    def saved(module, *inputs) -> int:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(*inputs)
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_UNET)
    unet.set_attn_processor(AttnProcessor2_0())
    measured = saved(unet, torch.randn(1, 4, 16, 16), torch.tensor([10]), torch.randn(1, 77, 64))
    assert 0.9 < activation_bytes(TINY_UNET, "unet", 128, 4, False) / measured < 1.1
    vae = AutoencoderKL(**TINY_VAE)
    measured = saved(vae, torch.randn(1, 3, 64, 64))
    assert 0.9 < activation_bytes(TINY_VAE, "vae", 64, 4, False) / measured < 1.1


# ---------------------------------------------------------------- interpolations

@pytest.mark.parametrize("args, message", [
    (["experiment.project=${oc.env:SD_TRAINING_UNSET_VAR}"],
     r"'experiment\.project' cannot be resolved: \$\{oc\.env:SD_TRAINING_UNSET_VAR\}: the environment variable "
     r"SD_TRAINING_UNSET_VAR is not set: export it, or give a default"),
    (["experiment.project=${nope:1}"], r"'experiment\.project' cannot be resolved: \$\{nope:1\}: there is no resolver 'nope'"),
    (["experiment.log_dir=${experiment.log_dir}"], r"'experiment\.log_dir' cannot be resolved: .*interpolation loop"),
    (["experiment.project=${experiment.name}_${wandb.project}"], r"cannot be resolved: .*interpolation loop"),
    (["experiment.project=${experiment.nme}"], r"there is no key 'experiment\.nme'; did you mean 'experiment\.name'"),
    (["system.workers=${oc.env:SD_TRAINING_UNSET_VAR}"], r"'system\.workers' cannot be resolved"),
    (["experiment.project=${"], r"cannot parse the command-line argument 'experiment\.project=\$\{'"),
])
def test_interpolation_errors_name_the_key_and_the_interpolation(args, message, monkeypatch):
    monkeypatch.delenv("SD_TRAINING_UNSET_VAR", raising=False)
    with pytest.raises(ConfigError, match=message):
        load([*BASE, *args])


def test_interpolation_errors_in_a_yaml_file_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dataset:\n  params:\n    path: ${oc.env:SD_TRAINING_UNSET_VAR}/{0..3}.tar\n")
    with pytest.raises(ConfigError, match=r"'dataset\.params\.path' cannot be resolved: \$\{oc\.env:SD_TRAINING_UNSET_VAR\}"):
        load([f"config={path}", *BASE[:3]])


# ---------------------------------------------------------------- run names and the folders the run writes

@pytest.mark.parametrize("name", [".", "..", "a/b", "../elsewhere", "/abs", ".hidden", "bell\x07", " ", "x" * 201])
def test_run_names_must_be_plain_names(name):
    with pytest.raises(ConfigError, match=r"'experiment\.name'=.* is not a plain name"):
        load(BASE[1:], yaml_text=f"experiment:\n  name: {json.dumps(name)}\n")


def test_start_fresh_with_name_dot_is_refused_before_any_folder_is_moved(tmp_path):
    (tmp_path / "runs" / "other_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="not a plain name"):
        load([*BASE[1:], "experiment.name=.", "experiment.start_fresh=true", f"experiment.log_dir={tmp_path / 'runs'}"])
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other_run"]


def test_folders_that_cannot_be_made_are_refused_at_load(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"'experiment\.log_dir': {blocker}/runs/x cannot be made: {blocker} is a file"):
        load([*BASE, f"experiment.log_dir={blocker / 'runs'}"])
    with pytest.raises(ConfigError, match=rf"'quickstart\.tiny_pipeline': {blocker}/pipe cannot be made"):
        load([*BASE, f"experiment.log_dir={tmp_path}", f"quickstart.tiny_pipeline={blocker / 'pipe'}"])
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(ConfigError, match="broken symbolic link"):
        load([*BASE, f"experiment.log_dir={tmp_path / 'dangling' / 'runs'}"])
    try:  # a place no folder can be made in, whoever runs the test (root included)
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
        writable_sys = True
    except OSError:
        writable_sys = False
    if not writable_sys:
        with pytest.raises(ConfigError, match=r"'experiment\.log_dir': cannot write /sys/sd_training_runs/x \(/sys is "
                                              r"the nearest folder that exists\)"):
            load([*BASE, "experiment.log_dir=/sys/sd_training_runs"])
    load([*BASE, f"experiment.log_dir={tmp_path / 'new' / 'runs'}"])
    assert not (tmp_path / "new").exists()  # checked, not made (the run makes it)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".sd-training")]  # the probe is gone


# ---------------------------------------------------------------- damaged pipeline files

@pytest.fixture
def pipeline_copy(tiny_pipeline, tmp_path):
    return shutil.copytree(tiny_pipeline, tmp_path / "pipeline")


@pytest.mark.parametrize("content, message", [
    ("{not json", r"model_index\.json \(the model_index\.json of model\.pretrained\) cannot be read as JSON"),
    ("[1, 2]", r"model_index\.json \(the model_index\.json of model\.pretrained\) holds a JSON list"),
    ('{"unet": ["diffusers", "UNet2DConditionModel"]}', r"model_index\.json has no '_class_name'"),
    (b"\xff\xfe\x00garbage", r"cannot be read as JSON"),
])
def test_a_malformed_model_index_names_the_file(pipeline_copy, tmp_path, content, message):
    index = pipeline_copy / "model_index.json"
    index.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=message) as err:
        load(tiny(tmp_path, pipeline_copy))
    assert str(index) in str(err.value) and "restore" in str(err.value).lower()


def test_weights_of_another_model_size_name_the_component_and_the_parameter(pipeline_copy, tmp_path):
    from sd_training.families.components.unet import build_unet

    config = pipeline_copy / "unet" / "config.json"
    conf = json.loads(config.read_text())
    conf["block_out_channels"] = [2 * c for c in conf["block_out_channels"]]
    config.write_text(json.dumps(conf))
    cfg = load(tiny(tmp_path, pipeline_copy))
    with pytest.raises(ConfigError, match=rf"'model\.unet\.pretrained': the unet weights in {pipeline_copy}/unet do not "
                                          r"fit the model its config\.json describes \(the first that differs is "
                                          r"conv_in\.bias: \[64\] in the weights, \[128\] in the model\)"):
        build_unet(cfg.model)


# ---------------------------------------------------------------- the batch layout on resume

def _checkpoint(tmp_path, saved_args, global_batch):
    folder = tmp_path / "step_00000002"
    folder.mkdir()
    (folder / "train_state.json").write_text(json.dumps({"step": 2, "global_batch": global_batch}))
    return folder, to_yaml(load(saved_args))


@pytest.mark.parametrize("now, global_batch, accepted", [
    (["system.batch_size=8", "system.gradient_accumulation=1"], None, True),  # 4 x 2 -> 8 x 1, one rank
    (["system.batch_size=2", "system.gradient_accumulation=4"], None, True),  # 4 x 2 -> 2 x 4
    (["system.batch_size=4", "system.gradient_accumulation=1"], 8, True),  # 4 x 2 on 1 rank -> 4 x 1 on 2 ranks
    (["system.batch_size=2", "system.global_batch_size=8"], None, True),  # the same, derived
    (["system.batch_size=8", "system.gradient_accumulation=2"], None, False),  # 16 images per step: refused
    (["system.batch_size=4", "system.gradient_accumulation=1"], None, False),  # 4 per step on 1 rank: refused
])
def test_a_batch_layout_change_that_keeps_the_global_batch_resumes(tmp_path, now, global_batch, accepted):
    folder, saved = _checkpoint(tmp_path, [*BASE, "system.batch_size=4", "system.gradient_accumulation=2"], 8)
    current = public_dict(load([*BASE, *now]))
    if accepted:
        assert check_resume_config(saved, current, False, folder, global_batch=global_batch) == []
    else:
        with pytest.raises(ConfigError, match=r"system\.(batch_size|gradient_accumulation)"):
            check_resume_config(saved, current, False, folder, global_batch=global_batch)


def test_a_real_resume_with_the_accumulation_changed_by_hand(tmp_path, tiny_pipeline, shapes_shards):
    from sd_training.loop import main as train

    def args(batch, accumulation, steps):
        return load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="acc", **{
            "dataset.params.resolution": 32, "experiment.num_examples_to_see": 8 * steps,
            "experiment.checkpoint_every": 1, "experiment.sample_per_prompt": 0, "system.batch_size": batch,
            "system.gradient_accumulation": accumulation}))

    train(args(4, 2, 1))
    out = train(args(8, 1, 2))  # refused before issue 26 ("system.batch_size: 4 -> 8")
    assert out["step"] == 2
    log = (tmp_path / "runs" / "acc" / "train.log").read_text()
    assert "resumed from" in log and "global batch 8 kept" in log
    plan = json.loads((tmp_path / "runs" / "acc" / "memory_plan.json").read_text())
    assert plan["rows"][0]["activations"] > 0  # the start-up plan counts them


def test_a_key_newer_than_the_checkpoint_at_its_default_is_not_a_change():
    """A checkpoint written before a key existed (system.stop_timeout_s, experiment.checkpoint_verify ...)
    resumes when the key is at its default; set to something else, it is a change like any other."""
    from sd_training.checkpoint.resume_config import config_changes

    saved = "system:\n  batch_size: 4\nmodel:\n  use_ema: false\n"
    free, _, refused = config_changes(saved, {"system": {"batch_size": 4, "stop_timeout_s": 120.0},
                                              "model": {"use_ema": False, "gradient_checkpointing": False}})
    assert refused == [] and any("newer than the checkpoint" in line for line in free)
    assert config_changes(saved, {"system": {"batch_size": 4}, "model": {"use_ema": False, "gradient_checkpointing": True}})[2] == [
        "model.gradient_checkpointing: <absent> -> True"]
