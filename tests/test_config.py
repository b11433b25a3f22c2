"""Config: precedence, required keys, unknown-key suggestions, type errors, seed-001 compatibility, --help."""

import sys
from pathlib import Path

import forked
import pytest

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.config.loading import help_text, to_yaml

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = """
experiment: {name: t, num_examples_to_see: 64}
model: {pretrained: /some/pipeline}
dataset: {params: {path: "/data/{00000..00003}.tar"}}
"""


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_precedence_defaults_yaml_cli(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load([f"config={path}", "system.batch_size=16"], yaml_text="system: {batch_size: 4, workers: 3}")
    assert cfg.system.batch_size == 16  # command line beats YAML
    assert cfg.system.workers == 3  # YAML beats the default (6)
    assert cfg.system.gradient_accumulation == 1  # schema default
    # Interpolations follow the final value.
    assert cfg.dataset.params.batch_size == 16
    assert cfg.dataset.params.workers == 3
    assert cfg.lr_scheduler.params.learning_rate == cfg.optimizer.params.learning_rate


def test_required_key_names_full_path(tmp_path):
    path = write(tmp_path, "model: {pretrained: /p}\ndataset: {params: {path: x.tar}}\nexperiment: {name: t}\n")
    with pytest.raises(ConfigError, match=r"experiment\.num_examples_to_see"):
        load([f"config={path}"])


def test_explicit_question_marks_are_required(tmp_path):
    path = write(tmp_path, MINIMAL.replace("pretrained: /some/pipeline", "pretrained: '???'"))
    with pytest.raises(ConfigError, match=r"required config keys are not set.*model\.pretrained"):
        load([f"config={path}"])


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("system.batch_sise=4", "system.batch_size"),
        ("experiment.batch_size=4", "system.batch_size"),
        ("optimizer.params.learning_rat=1e-4", "optimizer.params.learning_rate"),
        ("model.use_emma=true", "model.use_ema"),
    ],
)
def test_unknown_key_suggests_closest(tmp_path, override, suggestion):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match="unknown config key") as e:
        load([f"config={path}", override])
    assert f"did you mean '{suggestion}'" in str(e.value)


def test_unknown_key_in_yaml(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"experiment\.save_evry.*experiment\.save_every"):
        load([f"config={path}"], yaml_text="experiment: {save_evry: 10}")


def test_unknown_unet_param_is_rejected(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"model\.unet\.params\.block_out_channel.*block_out_channels"):
        load([f"config={path}"], yaml_text="model: {unet: {params: {block_out_channel: [32, 64]}}}")


def test_wrong_type_names_key(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"wrong type for 'system\.batch_size'"):
        load([f"config={path}", "system.batch_size=big"])


def test_bad_choice_suggests(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match="did you mean 'bf16'"):
        load([f"config={path}", "model.mixed_precision=bf61"])


def test_alias_must_agree(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"lr_scheduler\.params\.learning_rate"):
        load([f"config={path}", "lr_scheduler.params.learning_rate=0.5", "optimizer.params.learning_rate=0.25"])
    assert load([f"config={path}", "lr_scheduler.params.learning_rate=0.5"]).optimizer.params.learning_rate == 0.5


def test_argument_without_equals(tmp_path):
    with pytest.raises(ConfigError, match="not key=value"):
        load(["--batch_size", "4"])


def test_seed_001_finetune_config_loads(tmp_path):
    """The seed's fine-tuning example, ??? filled with local paths, loads unchanged."""
    text = (ROOT / "configs" / "examples" / "finetuning.yaml").read_text()
    path = write(tmp_path, text)
    cfg = load([f"config={path}", "model.pretrained=/models/sd2", "experiment.num_examples_to_see=1000",
                "experiment.eval_caption_file=" + write(tmp_path, "a cat\n", "prompts.txt"), "dataset.params.path=/d/{0..9}.tar"])
    assert cfg.system.batch_size == 2
    assert cfg.dataset.params.batch_size == 2
    assert cfg.model.gradient_checkpointing and cfg.model.xformers
    assert cfg.optimizer.params.beta2 == 0.98


def test_resolved_config_round_trips(tmp_path):
    cfg = load([f"config={write(tmp_path, MINIMAL)}", "system.batch_size=5"])
    again = load([f"config={write(tmp_path, to_yaml(cfg), 'resolved.yaml')}"])
    assert again == cfg


def test_help_lists_every_key_with_default_and_comment():
    text = help_text()
    assert "batch_size: 32  # images per device per micro-batch" in text
    assert "num_examples_to_see: ???" in text
    for key in ("gradient_accumulation", "mixed_precision", "warmup_length", "filters", "save_every"):
        assert f"{key}:" in text


def test_cli_help_and_config_error_exit_codes(tmp_path):
    out = forked.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "system:" in out.stdout
    out = forked.run([sys.executable, str(ROOT / "train.py"), f"config={write(tmp_path, MINIMAL)}", "system.bach_size=3"],
                     capture_output=True, text=True)
    assert out.returncode == 2
    assert "did you mean 'system.batch_size'" in out.stderr


def test_seed_config_with_api_key_placeholder_says_what_to_do(tmp_path):
    path = write(tmp_path, MINIMAL + "wandb:\n  api_key: ???\n")
    with pytest.raises(ConfigError, match="delete the line and export WANDB_API_KEY"):
        load([f"config={path}"])


def test_bare_no_is_a_string_where_the_schema_wants_one(tmp_path):
    """YAML reads `no` as False; mixed_precision takes the word, booleans keep their meaning."""
    cfg = load([f"config={write(tmp_path, MINIMAL)}", "model.mixed_precision=no", "model.use_ema=no"])
    assert cfg.model.mixed_precision == "no" and cfg.model.use_ema is False
    cfg = load([f"config={write(tmp_path, MINIMAL)}"], yaml_text="model:\n  mixed_precision: no\n")
    assert cfg.model.mixed_precision == "no"
    # On the command line a string field keeps the word as typed (not yes/no for on/off).
    cfg = load([f"config={write(tmp_path, MINIMAL)}", "experiment.name=off", "wandb.mode=offline"])
    assert cfg.experiment.name == "off" and cfg.wandb.mode == "offline"


@pytest.mark.faults
def test_wandb_api_key_is_redacted_from_everything_written(tmp_path):
    from sd_training.configure import load
    from sd_training.config.loading import public_dict, to_yaml

    cfg = load(["experiment.name=x", "model.pretrained=p", "dataset.params.path=d", "experiment.num_examples_to_see=8",
                "wandb.api_key=sk-secret-123"])
    assert cfg.wandb.api_key == "sk-secret-123"  # the run itself still has it
    assert "sk-secret-123" not in to_yaml(cfg) and "<redacted>" in to_yaml(cfg)
    assert public_dict(cfg)["wandb"]["api_key"] == "<redacted>"


@pytest.mark.parametrize("override, words", [
    ("experiment.sample_resolution=60", "multiple of 8"),
    ("experiment.sample_steps=0", "'experiment.sample_steps' must be >= 1"),
    ("lr_scheduler.params.decay_length=0", "'lr_scheduler.params.decay_length' must be >= 1"),
    ("optimizer.params.max_grad_norm=-1", "'optimizer.params.max_grad_norm' must be >= 0"),
    ("optimizer.params.learning_rate=-1e-4", "'optimizer.params.learning_rate' must be >= 0"),
    ("optimizer.params.learning_rate=nan", "'optimizer.params.learning_rate' is NaN"),
    ("optimizer.params.weight_decay=-0.1", "'optimizer.params.weight_decay' must be >= 0"),
    ("model.ema.decay=1.5", r"'model.ema.decay' must be within \[0, 1\]"),
    ("distributed.timeout_minutes=0", "'distributed.timeout_minutes' must be > 0"),
    ("system.workers=-2", "'system.workers' must be >= 0"),
    ("experiment.name=../../elsewhere", "leaves experiment.log_dir"),
    ("dataset.params.caption_dropout=2", "'dataset.params.caption_dropout' must be within"),
])
@pytest.mark.faults
def test_numeric_keys_are_range_checked_at_start_up(override, words):
    from sd_training.config import ConfigError
    from sd_training.configure import load

    base = ["experiment.name=x", "model.pretrained=p", "dataset.params.path=d", "experiment.num_examples_to_see=8"]
    load(base)  # the base is fine
    with pytest.raises(ConfigError, match=words):
        load(base + [override])


def test_an_open_diffusion_alias_set_alone_is_the_users_value():
    from sd_training.config import ConfigError
    from sd_training.configure import load

    base = ["experiment.name=x", "model.pretrained=p", "dataset.params.path=d", "experiment.num_examples_to_see=8"]
    cfg = load(base + ["system.dist_backend=gloo"])
    assert cfg.distributed.dist_backend == "gloo"
    with pytest.raises(ConfigError, match="differs from 'distributed.dist_backend'"):
        load(base + ["system.dist_backend=gloo", "distributed.dist_backend=nccl"])


def test_asset_interpolation_finds_packaged_files_from_any_folder(tmp_path, monkeypatch):
    import os

    from sd_training.config.loading import ASSETS

    monkeypatch.chdir(tmp_path)
    base = [f"config={write(tmp_path, MINIMAL)}"]
    cfg = load(base + ["model.vae.pretrained=${asset:quickstart_vae}"])
    assert cfg.model.vae.pretrained == os.path.join(ASSETS, "quickstart_vae")
    assert os.path.isfile(os.path.join(cfg.model.vae.pretrained, "config.json"))
    with pytest.raises(ConfigError, match=r"model.vae.pretrained.*asset:nope.*shipped: .*quickstart_vae"):
        load(base + ["model.vae.pretrained=${asset:nope}"])


REQUIRED = ["dataset.params.path=/data/{0..1}.tar", "experiment.name=plan", "model.pretrained=/models/sd",
            "experiment.num_examples_to_see=120"]


@pytest.mark.parametrize("world, accumulation", [(1, 6), (2, 3), (3, 2), (6, 1)])
def test_global_batch_size_derives_the_accumulation_on_every_rank_count(world, accumulation):
    from sd_training.run.train_state import Plan

    cfg = load(["system.batch_size=2", "system.global_batch_size=12", *REQUIRED])
    plan = Plan.make(cfg, world)
    assert (plan.accumulation, plan.global_batch, plan.total_steps) == (accumulation, 12, 10)


def test_a_global_batch_size_a_layout_cannot_reach_is_refused_with_the_numbers():
    from sd_training.run.train_state import Plan

    cfg = load(["system.batch_size=2", "system.global_batch_size=12", *REQUIRED])
    with pytest.raises(ConfigError, match=r"cannot be reached on 4 rank\(s\).* multiple of 2 x 4 = 8 \(closest: 8 or 16\)"):
        Plan.make(cfg, 4)
    both = load(["system.batch_size=2", "system.global_batch_size=12", "system.gradient_accumulation=3", *REQUIRED])
    with pytest.raises(ConfigError, match="leave 'system.gradient_accumulation' at 1"):
        Plan.make(both, 1)
    assert Plan.make(load(["system.batch_size=2", "system.gradient_accumulation=3", *REQUIRED]), 2).global_batch == 12


def test_removing_a_key_on_the_command_line_restores_the_schema_default():
    """``~key`` drops a key the YAML layers set: the quickstart's cosine settings do not block another schedule."""
    quickstart = f"config={ROOT / 'configs' / 'quickstart.yaml'}"
    with pytest.raises(ConfigError, match="only apply to CosineWithWarmup.*~lr_scheduler.params.min_lr_ratio"):
        load([quickstart, "lr_scheduler.scheduler=ConstantWithWarmup"])
    cfg = load([quickstart, "lr_scheduler.scheduler=ConstantWithWarmup", "~lr_scheduler.params.decay_length",
                "~lr_scheduler.params.min_lr_ratio"])
    assert cfg.lr_scheduler.scheduler == "ConstantWithWarmup"
    assert (cfg.lr_scheduler.params.decay_length, cfg.lr_scheduler.params.min_lr_ratio) == (None, 0.0)
    assert cfg.lr_scheduler.params.warmup_length == 30  # the rest of the file still applies


def test_a_command_line_key_sets_an_entry_of_a_list_the_files_hold():
    """``dataset.params.sources.1.weight=2`` sets the second source's weight (a dotlist alone reads "1" as a
    mapping key, and the merge with the file's list failed with OmegaConf's TypeError); a bad index is named."""
    lora = f"config={ROOT / 'configs' / 'quickstart_lora.yaml'}"
    sources = load([lora, "dataset.params.sources.1.weight=2", "dataset.params.sources.0.name=word",
                    "experiment.name=x"]).dataset.params.sources
    assert [(s.get("name"), s["weight"]) for s in sources] == [("word", 1), (None, 2)]
    assert sources[1]["path"].startswith("data/quickstart/shapes")  # the rest of the entry stays
    with pytest.raises(ConfigError, match=r"'dataset.params.sources' has 2 entries \(indices 0 to 1\)"):
        load([lora, "dataset.params.sources.2.weight=2"])
    with pytest.raises(ConfigError, match=r"'dataset.params.sources' is a list; name an entry by its index"):
        load([lora, "dataset.params.sources.first.weight=2"])


def test_removal_of_sections_keys_and_mapping_entries(tmp_path):
    path = write(tmp_path, MINIMAL + "system: {batch_size: 4, workers: 3}\n")
    cfg = load([f"config={path}", "~system.batch_size"])
    assert (cfg.system.batch_size, cfg.system.workers) == (32, 3)
    assert load([f"config={path}", "~system"]).system.workers == 6  # a whole section
    # A removed section can be set again key by key after the files.
    assert load([f"config={path}", "~system", "system.batch_size=5"]).system.batch_size == 5
    # Inside a free-form mapping (parse: the schema's rules, without the UNet's constructor check).
    from sd_training.config.loading import parse

    cfg = parse([f"config={path}", "~model.unet.params.b"], yaml_text="model: {unet: {params: {a: 1, b: 2}}}")
    assert cfg.model.unet.params == {"a": 1} and cfg.model.pretrained == "/some/pipeline"
    # A key of the schema that no file sets already has its default: nothing to remove.
    assert load([f"config={path}", "~optimizer.params.beta1"]).optimizer.params.beta1 == 0.9
    # Removing a required key makes it missing again.
    with pytest.raises(ConfigError, match=r"required config keys are not set.*experiment\.name"):
        load([f"config={path}", "~experiment.name"])


@pytest.mark.parametrize("args, words", [
    (["~system.bach_size"], r"cannot remove '~system.bach_size': unknown config key.*did you mean 'system.batch_size'"),
    (["~systm"], "unknown config key 'systm'"),
    (["~system.batch_size.x"], "'system.batch_size' is a value, not a section"),
    (["~system.batch_size=4"], "takes no value"),
    (["~"], "takes no value"),
    (["~system.batch_size", "system.batch_size=4"], "both removed .* and set"),
])
def test_bad_removals_are_refused_naming_the_key(tmp_path, args, words):
    with pytest.raises(ConfigError, match=words):
        load([f"config={write(tmp_path, MINIMAL)}", *args])


def test_removal_is_in_the_usage_line():
    assert help_text().splitlines()[0].endswith("[~key.sub ...]")


def test_choices_are_declared_in_the_field_shown_by_help_and_checked_once(tmp_path):
    """--help lists a key's choices from its field; the one check names the key and the closest choice."""
    from dataclasses import fields, is_dataclass

    from sd_training.config.schema import TrainConfig, schema_entries

    text = help_text()
    assert "mixed_precision: 'no'  # (no | bf16 | fp16) " in text
    assert "strategy: 'ddp'  # (ddp | fsdp | hsdp) " in text
    declared = [(path, meta, default) for path, _tp, default, meta, section in schema_entries()
                if not section and "choices" in meta]
    assert len(declared) >= 19  # the former hand-written _choice(...) calls, and more
    for path, meta, default in declared:
        assert default is None or default in meta["choices"], path  # every default is one of its choices
        assert " | ".join(meta["choices"][:2]) not in meta["help"], f"{path}'s help repeats its choices"
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"distributed.strategy='fsdq': expected one of ddp, fsdp or hsdp; did you mean 'fsdp'\?"):
        load([f"config={path}", "distributed.strategy=fsdq"])
    with pytest.raises(ConfigError, match=r"model.vae.dtype='fp8': expected one of auto, fp32, bf16 or fp16"):
        load([f"config={path}", "model.vae.dtype=fp8"])
    # yes/no words of the progress bar still mean on/off.
    assert load([f"config={path}", "experiment.progress_bar=yes"]).experiment.progress_bar == "on"
    assert is_dataclass(TrainConfig) and all(fl.metadata.get("help") for fl in fields(TrainConfig))


def test_family_sections_come_from_the_families_options_with_the_same_keys(tmp_path):
    cfg = load([f"config={write(tmp_path, MINIMAL)}", "model.text_encoder_2.pretrained=/te2", "model.tokenizer_2.pretrained=/tok2"])
    assert (cfg.model.text_encoder_2.pretrained, cfg.model.tokenizer_2.pretrained) == ("/te2", "/tok2")
    with pytest.raises(ConfigError, match="'vae_training' section applies to model.train_target=vae only"):
        load([f"config={write(tmp_path, MINIMAL)}", "vae_training.kl_weight=0.1"])
    config_dir = ROOT / "sd_training" / "config"
    for name in ("text_encoder_2", "tokenizer_2", "sdxl", "VAEObjectiveConfig", "vae_training"):
        for path in config_dir.glob("*.py"):
            assert name not in path.read_text(), f"{path.name} spells the family-specific {name}"
