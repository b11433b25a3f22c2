"""Model cards (sd_training.outputs.model_card) and scripts/push_to_hub.py.

Two tiny real runs under bf16 autocast on the CPU with a loader worker, an export at every step: a LoRA on
two ranks (torchrun, gloo) from a weighted mixture of two sources, one of them filtered, and a full fine-tune
with an EMA from one filtered source. Their cards parse with ``ModelCard.load``, carry the Hub's metadata,
say the numbers the run logged, embed the run's sample grid, and their how-to-load snippets run (offline)
and load what was exported. ``push_to_hub.py`` lists what it would send and fails clearly without a token,
offline, with the Hub unreachable and on a folder that is not an export."""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import args_with, run_trainer
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from sd_training import adapters
from sd_training.outputs.run_outputs import model_card
from sd_training.config import ConfigError
from sd_training.configure import load

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
PUSH = ROOT / "scripts" / "push_to_hub.py"
FILTER = "in [circle, square]"


run_args = args_with({"dataset.params.resolution": 32, "experiment.num_examples_to_see": 8,
                      "model.mixed_precision": "bf16", "system.workers": 1, "experiment.save_every": 1,
                      "experiment.save_only_most_recent": "false"})


def lora_on_two_ranks(root: Path, pipeline, shards) -> Path:
    """LoRA rank 4 / alpha 8, 2 ranks x batch 2, sources a (weight 3, filtered) and b (weight 1)."""
    from test_distributed import free_port

    sources = (f"[{{path: '{shards}', name: a, weight: 3, filters: {{shape: '{FILTER}'}}}}, "
               f"{{path: '{shards}', name: b, weight: 1}}]")
    args = run_args(root, pipeline, shards, "lora", **{
        "model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8, "system.batch_size": 2,
        "dataset.params.sources": sources, "experiment.model_card_license": "apache-2.0"})
    args = [a for a in args if not a.startswith("dataset.params.path=")]  # a mixture's paths are its sources'
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train.py"), *args]
    # Forked from one process that imported torch and diffusers once (tests/forked.py): a fresh torchrun spends
    # ~27 CPU-s importing them in its agent and both ranks.
    out = forked.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return root / "runs" / "lora"


def full_run(root: Path, pipeline, shards) -> Path:
    """A full fine-tune with an EMA (exports raw + EMA pipelines; samples from the EMA), one filtered source."""
    cfg = load(run_args(root, pipeline, shards, "full", **{
        "model.use_ema": "true", "model.ema.decay": 0.9, "dataset.params.filters": f"{{shape: '{FILTER}'}}"}))
    return run_trainer(cfg).run_dir.root


@pytest.fixture(scope="module")
def runs(tiny_pipeline, shapes_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("cards")
    return {"lora": lora_on_two_ranks(root, tiny_pipeline, shapes_shards),
            "full": full_run(root, tiny_pipeline, shapes_shards)}


def log_row(run: Path, step: int) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] == step and "loss" in r][-1]


def table(card: ModelCard) -> dict:
    """The card's two-column Training table."""
    return dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", card.text, flags=re.M))


def snippet(card: ModelCard) -> str:
    return re.search(r"```python\n(.*?)```", card.text, flags=re.S).group(1)


def check_numbers(card: ModelCard, run: Path, step: int, global_batch: str) -> None:
    """Steps, images seen, global batch and learning rate as the run logged them (metrics.jsonl, config.yaml)."""
    row, t = log_row(run, step), table(card)
    cfg_lr = float(re.search(r"^  params:\n    learning_rate: (\S+)", (run / "config.yaml").read_text(), re.M).group(1))
    assert t["optimizer steps"] == f"{step} of 2"
    assert t["images seen"] == str(row["images_seen"]) == str(4 * step)
    assert t["global batch"] == global_batch
    assert t["learning rate"].startswith(f"{cfg_lr:.3g} peak (adamw), ConstantWithWarmup, 2 warmup steps")
    assert t["learning rate"].endswith(f"; {row['lr']:.3g} at step {step}")
    assert t["precision"].startswith("bf16 mixed precision")


@pytest.mark.slow  # the module's two runs (2 ranks + 1) are shared by 4 tests: 90 CPU-s for the 4 with start-up
def test_pipeline_cards_parse_carry_the_hub_metadata_and_match_the_run(runs, tiny_pipeline):
    run = runs["full"]
    for folder, weights, step in [(run / "current_pipeline", "raw", 2), (run / "current_pipeline_ema", "ema", 2),
                                  (run / "pipelines" / "step_00000001", "raw", 1)]:
        card = ModelCard.load(folder / "README.md")
        d = card.data.to_dict()
        assert d["library_name"] == "diffusers" and d["pipeline_tag"] == "text-to-image"
        assert d["tags"] == ["text-to-image", "diffusers", "stable-diffusion", "stable-diffusion-diffusers",
                             "sd-training"]
        assert d["base_model"] == Path(tiny_pipeline).name and "license" not in d  # the tiny base has no card
        check_numbers(card, run, step, "4 (4 per device x 1 device(s) x 1 accumulation)")
        assert table(card)["trained"] == "unet: all weights"
        assert table(card)["weights"] == ("EMA of the weights (decay 0.9)" if weights == "ema" else
                                          "the trained weights (no EMA)")
        # The grid beside the card is the run's (the EMA's: experiment.sample_from=auto), embedded.
        grid = run / "samples" / f"step_{step:08d}.png"
        assert (folder / "samples.png").read_bytes() == grid.read_bytes()
        assert "](samples.png)" in card.text and f"Samples at step {step} (ema weights)" in card.text
        assert f'DiffusionPipeline.from_pretrained("{folder.resolve()}")' in snippet(card)  # each folder its own
        # The one source: what passed its filter, as rank 0's loader logged it.
        rate = log_row(run, step)["data/filter/shape/pass_rate"]
        assert 0 < rate < 1
        assert f"| shape | `{FILTER}` | {100 * rate:.1f}% |" in card.text


@pytest.mark.slow
def test_lora_card_on_two_ranks_says_the_adapter_the_mixture_and_the_license(runs, tiny_pipeline):
    run = runs["lora"]
    card = ModelCard.load(run / "current_pipeline" / "README.md")
    d = card.data.to_dict()
    assert d["tags"] == ["text-to-image", "diffusers", "lora", "stable-diffusion", "stable-diffusion-diffusers",
                         "sd-training"]
    assert d["license"] == "apache-2.0" and d["base_model"] == Path(tiny_pipeline).name
    check_numbers(card, run, 2, "4 (2 per device x 2 device(s) x 1 accumulation)")
    assert table(card)["trained"] == "unet: LoRA rank 4, alpha 8 on the attention preset"
    row = log_row(run, 2)
    for name, weight in (("a", 3), ("b", 1)):
        share = row[f"data/source/{name}/share"]
        passed = row[f"data/source/{name}/accepted"] / row[f"data/source/{name}/samples_read"]
        line = next(x for x in card.text.splitlines() if x.startswith(f"| {name} |"))
        assert line.endswith(f"| {weight} | {100 * share:.1f}% | {100 * passed:.1f}% |"), line
    assert 0 < row["data/source/a/accepted"] < row["data/source/a/samples_read"]  # the filter rejected some
    grid = run / "samples" / "step_00000002.png"
    assert (run / "current_pipeline" / "samples.png").read_bytes() == grid.read_bytes()


@pytest.mark.slow
def test_the_how_to_load_snippets_run_offline_and_load_the_exports(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipe_folder = runs["full"] / "current_pipeline"
    ns = {}
    exec(snippet(ModelCard.load(pipe_folder / "README.md")), ns)
    exported = load_file(str(pipe_folder / "unet" / "diffusion_pytorch_model.safetensors"))
    loaded = ns["pipe"].unet.state_dict()
    assert all(torch.equal(loaded[k].float(), v.float()) for k, v in exported.items())
    assert (tmp_path / "sample.png").is_file() and ns["image"].size == (32, 32)

    (tmp_path / "sample.png").unlink()
    lora_folder = runs["lora"] / "current_pipeline"
    ns = {}
    exec(snippet(ModelCard.load(lora_folder / "README.md")), ns)
    assert ns["pipe"].get_list_adapters() == {"unet": ["default_0"]}
    saved = load_file(str(lora_folder / adapters.LORA_FILE))
    key = next(k for k in saved if k.endswith("lora_B.weight"))  # e.g. unet.down_blocks...to_q.lora_B.weight
    layer = dict(ns["pipe"].unet.named_parameters())[key.removeprefix("unet.").replace(".weight", ".default_0.weight")]
    assert torch.equal(layer.detach().float(), saved[key].float())
    assert (tmp_path / "sample.png").is_file()


# ---------------------------------------------------------------------------------- template errors

@pytest.fixture(scope="module")
def run_info(tiny_pipeline, shapes_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("template")
    cfg = load(run_args(root, tiny_pipeline, shapes_shards, "t"))
    return model_card.RunInfo(cfg, "sd", ("stable-diffusion",), "unet", str(tiny_pipeline), "samples", 4, 1, 1e-3,
                              root / "metrics.jsonl")


@pytest.mark.parametrize("text, words", [
    ("---\n{{ card_data }}\n---\n# {{ title }\n", ["line 4", "unexpected '}'"]),
    ("---\n{{ card_data }}\n---\n\n{{ title }}\n{{ no_such_name }}\n", ["line 6", "'no_such_name' is undefined"]),
    ("# {{ title }}\n", ["without library_name, pipeline_tag, tags", "{{ card_data }}"]),
])
def test_a_broken_template_is_an_error_naming_its_file_and_line(run_info, tmp_path, text, words):
    bad = tmp_path / "card.md"
    bad.write_text(text)
    with pytest.raises(ConfigError) as e:
        model_card.check_template(run_info.__class__(**{**vars(run_info), "cfg": _with_template(run_info.cfg, bad)}),
                                  tmp_path)
    assert "'experiment.model_card_template'" in str(e.value) and str(bad) in str(e.value)
    for w in words:
        assert w in str(e.value)


def _with_template(cfg, path):
    cfg = copy.deepcopy(cfg)
    cfg.experiment.model_card_template = str(path)
    return cfg


def test_a_broken_template_stops_the_run_before_it_trains(tiny_pipeline, shapes_shards, tmp_path):
    missing = tmp_path / "nowhere.md"
    cfg = load(run_args(tmp_path, tiny_pipeline, shapes_shards, "t",
                        **{"experiment.model_card_template": str(missing)}))
    with pytest.raises(ConfigError, match=f"the model card template {missing} does not exist"):
        run_trainer(cfg)
    assert not list((tmp_path / "runs" / "t" / "checkpoints").glob("step_*"))


def test_the_base_license_comes_from_its_card_and_a_cached_snapshot_names_its_hub_id(run_info, tmp_path):
    snap = tmp_path / "hub" / "models--someone--base-model" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (snap / "README.md").write_text("---\nlicense: other\nlicense_name: base-license\nlicense_link: LICENSE.md\n---\n"
                                    "# base\n")
    cfg = _with_template(run_info.cfg, model_card.TEMPLATE)
    cfg.model.pretrained = str(snap)
    base = model_card.base_model(cfg, str(snap))
    assert base["name"] == "someone/base-model" and base["load"] == str(snap.resolve())
    assert (base["license"], base["license_name"], base["license_link"]) == ("other", "base-license", "LICENSE.md")
    data = model_card.card_data(run_info, model_card.ExportInfo(tmp_path, False, "raw", 0, 0), base).to_dict()
    assert data["license"] == "other" and data["license_name"] == "base-license"
    assert model_card.base_model(cfg, "model.unet.params (from scratch)") == {}  # no base_model from scratch
    # The card's names of the LoRA files are the adapters module's.
    assert (model_card.LORA_WEIGHTS, model_card.KOHYA_WEIGHTS, model_card.COMFY_WEIGHTS) == (
        adapters.LORA_FILE, adapters.KOHYA_FILE, adapters.COMFY_FILE)


def test_the_data_figures_come_from_the_last_log_line_read_from_the_end_of_the_file(tmp_path, monkeypatch):
    """A long run's metrics.jsonl is read from its end, a growing tail at a time (64 bytes here): validation
    rows and a line cut by a kill are passed over."""
    monkeypatch.setattr(model_card, "METRICS_TAIL", 64)
    rows = [{"step": i, "loss": 1.0 / i, "data/samples_read": 10 * i} for i in range(1, 60)]
    rows.append({"step": 59, "val/loss": 2})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 60, "lo')
    assert [model_card.last_metrics(path, s).get("step") for s in (59, 100, 10, 1, 0)] == [59, 59, 10, 1, None]
    assert model_card.last_metrics(path, 7)["data/samples_read"] == 70
    assert model_card.last_metrics(tmp_path / "absent.jsonl", 5) == {}


# ---------------------------------------------------------------------------------- push_to_hub

def push(*args, **env_over):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(env_over)
    return subprocess.run([sys.executable, str(PUSH), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow
def test_push_dry_run_lists_the_files_their_sizes_and_the_repo_without_token_or_network(runs, tmp_path):
    folder = runs["lora"] / "current_pipeline"
    out = push(folder, "--repo", "someone/my-lora", "--private", "--dry-run", HF_HOME=tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 0, out.stderr
    assert f"repo: someone/my-lora (model, private if created), branch main; a lora folder: {folder}" in out.stdout
    listed = re.findall(r"^ +(\S+ [KMG]?B)  (\S+)$", out.stdout, flags=re.M)
    assert [name for _, name in listed] == ["README.md", adapters.LORA_FILE, "samples.png"]
    assert f"{(folder / adapters.LORA_FILE).stat().st_size / 1024:.1f} KB" == listed[1][0]
    assert "README.md: its loading snippet names someone/my-lora instead of this folder (1 place(s))" in out.stdout
    text, n = model_card.for_repo((folder / "README.md").read_text(), folder, "someone/my-lora")
    assert n == 1 and 'pipe.load_lora_weights("someone/my-lora")' in text
    pipeline = push(runs["full"] / "current_pipeline", "--repo", "me/p", "--dry-run", HF_HOME=tmp_path)
    names = re.findall(r"^ +\S+ [KMG]?B  (\S+)$", pipeline.stdout, flags=re.M)
    assert {"README.md", "samples.png", "model_index.json", "unet/diffusion_pytorch_model.safetensors"} <= set(names)


def test_push_errors_are_clear_without_token_offline_unreachable_and_for_a_non_export(tiny_pipeline, tmp_path):
    folder = Path(tiny_pipeline)  # a real pipeline folder, as an export is
    out = push(folder, "--repo", "me/m", HF_HOME=tmp_path)  # no HF_TOKEN, no stored login
    assert out.returncode == 2 and "no Hugging Face token found: set HF_TOKEN" in out.stderr
    assert "hf auth login" in out.stderr and "Traceback" not in out.stderr
    out = push(folder, "--repo", "me/m", HF_HOME=tmp_path, HF_TOKEN="hf_not_a_token", HF_HUB_OFFLINE="1")
    assert out.returncode == 3 and "offline: HF_HUB_OFFLINE is set" in out.stderr and "Traceback" not in out.stderr
    out = push(folder, "--repo", "me/m", HF_HOME=tmp_path, HF_TOKEN="hf_not_a_token", HF_HUB_OFFLINE="0",
               HF_ENDPOINT="http://127.0.0.1:9")
    assert out.returncode == 3 and "cannot reach the Hub at http://127.0.0.1:9" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    out = push(tmp_path, "--repo", "me/m", "--dry-run")
    assert out.returncode == 2 and f"{tmp_path} is not an exported pipeline or LoRA folder" in out.stderr
    out = push(folder, "--repo", "not a repo//name", "--dry-run")
    assert out.returncode == 2 and "is not a Hub repository name" in out.stderr
