"""Every new key checked at load (issue 34): user patterns matched with a time bound, the learning rate of
every parameter group against the optimizer's needs, text lengths and resolutions against the family's
limits, ``model.adapter.init_from`` read before any model loads, Flux's ``guidance_embed`` only where the
transformer has a guidance embedding, and config files whose YAML aliases would expand without bound.
Each case is a bad value or file fed to ``sd_training.configure.load`` (or the script that reads it): one
``ConfigError`` naming the key or the file, where the code before issue 34 hung, trained wrongly or
failed at step 1 with a traceback."""

import sys
import time

import pytest
from conftest import train_args

import forked
from sd_training.config import ConfigError
from sd_training.config.loading import parse
from sd_training.configure import load

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]

LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4}
NESTED = "([a-z_0-9.]+)+Z"  # the red team's pattern: exponential in Python's re on every layer name
# Exponential in the bounded engine too (the `regex` package cuts the red team's pattern short itself)
EXPONENTIAL = "(.|..)*[A-Z]"


def args(tmp_path, pipeline, **overrides):
    return train_args(tmp_path, pipeline, "/data/{0..3}.tar", **{"dataset.params.resolution": 32, **overrides})


# ---------------------------------------------------------------- case 4: bounded regular expressions

_LOAD = ("import sys, time\nfrom sd_training.config import ConfigError\nfrom sd_training.configure import load\n"
         "t = time.monotonic()\ntry:\n    load(sys.argv[1:])\nexcept ConfigError as e:\n"
         "    print(f'{time.monotonic() - t:.1f}', e)\nelse:\n    print(f'{time.monotonic() - t:.1f}')\n")


def _load_forked(argv: list[str]):
    """(seconds, ConfigError text or '') of ``load(argv)`` in a forked child: Python's re held the main
    thread in C code where no signal handler (or pytest's timeout) runs."""
    res = forked.run([sys.executable, "-c", _LOAD, *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    seconds, _, message = res.stdout.strip().rpartition("\n")[2].partition(" ")
    return float(seconds), message


def test_a_nested_quantifier_in_target_regex_is_bounded_at_load(tiny_pipeline, tmp_path):
    """``([a-z_0-9.]+)+Z`` spun at 100% CPU in the memory plan (SIGTERM ignored: the main thread was in the C
    regex engine). The bounded engine answers it at once (it matches no layer: the build says so); a
    pattern that would still backtrack without end is a ConfigError naming the key and the pattern within
    the matching budget."""
    seconds, message = _load_forked(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.target_regex": NESTED}))
    assert seconds < 30 and message == "", message
    seconds, message = _load_forked(args(tmp_path, tiny_pipeline, **LORA,
                                         **{"model.adapter.target_regex": EXPONENTIAL}))
    assert message.startswith("'model.adapter.target_regex' '(.|..)*[A-Z]' took more than 2 s"), message
    assert seconds < 30  # the budget (2 s) plus the load itself on a busy machine


def test_plan_memory_refuses_the_pattern_with_one_line(tiny_pipeline, tmp_path):
    argv = args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.target_regex": EXPONENTIAL})
    res = forked.run([sys.executable, "scripts/plan_memory.py", "--gpu-gb", "24", *argv], capture_output=True,
                     text=True, timeout=120, cwd=forked.ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "plan_memory: 'model.adapter.target_regex' '(.|..)*[A-Z]' took more than" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_sensible_pattern_still_matches_and_a_broken_one_names_the_key(tiny_pipeline, tmp_path):
    from sd_training.config.patterns import PatternTimeout, full_matches

    names = [f"down_blocks.{i}.attentions.0.transformer_blocks.0.attn1.to_{p}" for i in range(2) for p in "qkvx"]
    assert full_matches(r".*attn1\.to_(q|k|v)", names, "k") == [n for n in names if not n.endswith("x")]
    start = time.monotonic()
    with pytest.raises(PatternTimeout, match=r"'k' '\(a\|aa\)\+Z' took more than 0.2 s"):
        full_matches("(a|aa)+Z", ["a" * 80], "k", budget_s=0.2)
    assert time.monotonic() - start < 5
    with pytest.raises(ConfigError, match=r"'model\.adapter\.target_regex' '\(' is not a regular expression"):
        load(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.target_regex": "("}))


# ---------------------------------------------------------------- bounded YAML in the training config

def _laughs(levels: int) -> str:
    """A "billion laughs" config: each line nine aliases of the line before (9^levels strings)."""
    lols = ", ".join(['"lol"'] * 9)
    lines = ["experiment:", "  name: x", "dataset:", "  params:", "    sources:",
             f'      - {{path: "/d/{{0..3}}.tar", note: &l0 [{lols}]}}']
    for i in range(1, levels):
        lines.append(f"      - {{path: /d/{i}.tar, note: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]}}")
    return "\n".join(lines) + "\n"


def test_a_config_whose_aliases_multiply_is_refused_naming_the_file(tmp_path, monkeypatch):
    """Nine levels of nine aliases (387 million nodes) would fill the memory; OmegaConf's own limit (2.4,
    not 2.3) can be lifted by an environment variable and tells the user to lift it. The file is refused
    by our bound whatever the environment, before a node is built."""
    monkeypatch.setenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", "none")
    for levels in (5, 9):  # 5: 59,000 nodes, which the code before issue 34 built
        path = tmp_path / f"laughs{levels}.yaml"
        path.write_text(_laughs(levels))
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"config file '{path}': its YAML aliases \(\*name\) expand \d+ "
                                              r"written nodes to [\d,]+; at most 10,000 may come from aliases"):
            parse([f"config={path}"])
        assert time.monotonic() - start < 5


def test_aliases_users_write_by_hand_load_and_deep_or_recursive_yaml_is_refused(tmp_path):
    shared = tmp_path / "shared.yaml"
    shared.write_text("experiment: {name: x, num_examples_to_see: 64}\n"
                      "dataset: {params: {path: \"/data/{0..3}.tar\"}}\n"
                      "model:\n  pretrained: &sd /models/sd\n  vae: {pretrained: *sd}\n  unet: {pretrained: *sd}\n")
    cfg = parse([f"config={shared}"])
    assert cfg.model.vae.pretrained == cfg.model.unet.pretrained == "/models/sd"
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 70 + "]" * 70 + "\n")
    with pytest.raises(ConfigError, match=rf"config file '{deep}' nests mappings or lists 7\d levels deep"):
        parse([f"config={deep}"])
    deeper = tmp_path / "deeper.yaml"
    deeper.write_text("a: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(ConfigError, match=rf"config file '{deeper}' nests mappings or lists deeper than"):
        parse([f"config={deeper}"])
    big = tmp_path / "big.yaml"
    big.write_text("experiment: {name: x}\n" + "# padding\n" * 120_000)
    with pytest.raises(ConfigError, match=rf"config file '{big}' is 1,200,022 bytes \(at most 1,048,576\)"):
        parse([f"config={big}"])
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &x [1, *x]\n")
    with pytest.raises(ConfigError, match=rf"config file '{loop}': an alias refers to a node that contains it"):
        parse([f"config={loop}"])


# ---------------------------------------------------------------- case 6: every group's learning rate

PRODIGY = ["experiment.name=x", "experiment.num_examples_to_see=64", "model.pretrained=/models/sd",
           "dataset.params.path=/data/{0..3}.tar", "optimizer.name=prodigy", "optimizer.params.learning_rate=1.0"]


@pytest.mark.parametrize("over, key", [
    (["model.adapter.type=lora", "model.adapter.learning_rate=1e-4"], "model.adapter.learning_rate"),
    (["model.adapter.type=lora", "model.adapter.text_encoders.train=true",
      "model.adapter.text_encoders.learning_rate=5e-5"], "model.adapter.text_encoders.learning_rate"),
    (["model.text_encoder.train=true", "model.text_encoder.learning_rate=1e-5"], "model.text_encoder.learning_rate"),
])
def test_prodigy_refuses_an_adamw_rate_in_any_parameter_group(over, key):
    """Prodigy's guard read optimizer.params.learning_rate only: model.adapter.learning_rate=1e-4 beside
    optimizer.params.learning_rate=1.0 trained about 10,000x too slowly, silently."""
    with pytest.raises(ConfigError, match=rf"optimizer\.name=prodigy .* '{key}' multiplies it .* would train about "
                                          rf"[\d,]+x slower\. Set {key}=1\.0"):
        parse([*PRODIGY, *over])


def test_prodigy_refuses_unequal_group_rates_at_load_and_takes_equal_ones():
    with pytest.raises(ConfigError, match=r"prodigy steps every parameter group with one learning rate, but this run's "
                                          r"groups have 2 \(model\.adapter\.learning_rate=1, "
                                          r"model\.adapter\.text_encoders\.learning_rate=0\.5\)"):
        parse([*PRODIGY, "model.adapter.type=lora", "model.adapter.learning_rate=1.0",
              "model.adapter.text_encoders.train=true", "model.adapter.text_encoders.learning_rate=0.5"])
    parse([*PRODIGY, "model.adapter.type=lora", "model.adapter.learning_rate=1.0"])
    parse([*PRODIGY, "model.text_encoder.train=true"])  # the text encoder takes the optimizer's 1.0


# ---------------------------------------------------------------- case 7: text lengths per family

@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_t5_lengths_beyond_the_pipelines_limit_are_refused_for_every_transformer_family(family, family_pipeline,
                                                                                      tmp_path):
    """SD3 took model.t5.max_length=100000 and asked for 80 GB at step 1; Flux capped it at 512 alone."""
    with pytest.raises(ConfigError, match=r"'model\.t5\.max_length'=100,000 is more than the (SD3|Flux) family "
                                          r"takes: at most 512 tokens \((StableDiffusion3|Flux)Pipeline's "
                                          r"max_sequence_length"):
        load(args(tmp_path, family_pipeline(family), **{"model.t5.max_length": 100000}))
    load(args(tmp_path, family_pipeline(family), **{"model.t5.max_length": 512}))


def test_clip_lengths_beyond_the_encoders_positions_are_refused_at_load(sdxl_pipeline, tmp_path):
    """The UNet families found model.text_encoder.max_length=100000 only once the text encoder was loaded."""
    with pytest.raises(ConfigError, match=r"'model\.text_encoder\.max_length'=100,000 is more than the sdxl family "
                                          r"takes: at most 77 tokens \(the text encoder's position embeddings"):
        load(args(tmp_path, sdxl_pipeline, **{"model.text_encoder.max_length": 100000}))
    load(args(tmp_path, sdxl_pipeline, **{"model.text_encoder.max_length": 77}))


# ---------------------------------------------------------------- case 8: resolutions per family

@pytest.mark.parametrize("over, message", [
    ({"dataset.params.resolution": 40}, r"'dataset\.params\.resolution'=40 px, but every image side SD3 trains on "
                                        r"must be a multiple of 16 px, at most 256 px \(the VAE's 8 px per latent x "
                                        r"the transformer's patch_size 2; at most pos_embed_max_size 16 patches per "
                                        r"side\): nearest valid: 32 or 48"),
    ({"dataset.params.resolution": 512}, r"'dataset\.params\.resolution'=512 px.*nearest valid: 256$"),
    ({"experiment.sample_resolution": 72}, r"'experiment\.sample_resolution'=72 px.*nearest valid: 64 or 80"),
    ({"dataset.params.aspect_buckets": "true", "dataset.params.bucket_step": 8},
     r"an aspect bucket of dataset\.params\.resolution=32, bucket_step=8 and max_aspect_ratio=2 has a side of 24 px.*"
     r"set dataset\.params\.bucket_step=16$"),
    ({"dataset.params.resolution": 256, "dataset.params.aspect_buckets": "true", "dataset.params.bucket_step": 16},
     r"has a side of 272 px, but .* at most 256 px .*: lower dataset\.params\.max_aspect_ratio or"),
])
def test_sd3_image_sides_are_checked_against_patch_size_and_position_embeddings(over, message, sd3_pipeline,
                                                                                 tmp_path):
    """40 px was a RuntimeError at step 1 (latents of 5 patches of 2); beyond pos_embed_max_size x patch_size a
    ValueError after every model had loaded."""
    with pytest.raises(ConfigError, match=message):
        load(args(tmp_path, sd3_pipeline, **over))


def test_flux_buckets_and_samples_are_checked_like_its_resolution(flux_pipeline, tmp_path):
    with pytest.raises(ConfigError, match=r"'experiment\.sample_resolution'=40 px, but every image side Flux trains "
                                          r"on must be a multiple of 16 px \(2x2 patches of the VAE's 8 px"):
        load(args(tmp_path, flux_pipeline, **{"experiment.sample_resolution": 40}))
    load(args(tmp_path, flux_pipeline, **{"experiment.sample_resolution": 48, "dataset.params.aspect_buckets": "true",
                                          "dataset.params.bucket_step": 16}))


# ---------------------------------------------------------------- case 14: guidance_embed where it is read

def test_guidance_embed_is_refused_where_the_transformer_has_no_guidance_embedding(flux_pipeline, sd3_pipeline,
                                                                                    tmp_path):
    import json
    import shutil

    schnell = tmp_path / "schnell"
    shutil.copytree(flux_pipeline, schnell)
    conf = json.loads((schnell / "transformer" / "config.json").read_text())
    (schnell / "transformer" / "config.json").write_text(json.dumps({**conf, "guidance_embeds": False}))
    with pytest.raises(ConfigError, match=r"'model\.guidance_embed'=4 would be unused: the Flux's transformer config "
                                          r"\(no guidance_embeds\) has no guidance embedding"):
        load(args(tmp_path, schnell, **{"model.guidance_embed": 4.0}))
    with pytest.raises(ConfigError, match=r"'model\.guidance_embed'=4 would be unused: the SD3's transformer"):
        load(args(tmp_path, sd3_pipeline, **{"model.guidance_embed": 4.0}))
    load(args(tmp_path, schnell))  # the default is no setting
    load(args(tmp_path, flux_pipeline, **{"model.guidance_embed": 4.0}))  # a guidance-distilled transformer


# ---------------------------------------------------------------- case 9: init_from read at load

def test_init_from_of_a_cut_or_foreign_file_is_a_config_error_at_load(tiny_pipeline, tmp_path):
    import torch
    from safetensors.torch import save_file

    whole = tmp_path / "pytorch_lora_weights.safetensors"
    save_file({"unet.a.lora_A.weight": torch.zeros(64, 64)}, str(whole))
    data = whole.read_bytes()
    cut, foreign = tmp_path / "cut.safetensors", tmp_path / "foreign.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    torch.save({"w": torch.zeros(2)}, foreign)  # a pickle (zip) under the LoRA's name
    with pytest.raises(ConfigError, match=rf"'model\.adapter\.init_from': {cut} is cut short: {len(data) // 2:,} of "
                                          rf"{len(data):,} bytes"):
        load(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.init_from": str(cut)}))
    with pytest.raises(ConfigError, match=rf"'model\.adapter\.init_from': {foreign} is not a safetensors file"):
        load(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.init_from": str(foreign)}))
    load(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.init_from": str(tmp_path)}))  # the folder's whole file
