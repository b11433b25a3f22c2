"""No secret leaves the process (issue 26): a token read through ``${oc.env:...}`` in a shard command and
a literal ``Bearer`` token never reach a file the run writes (config.yaml, checkpoints, the exported
pipeline, wandb's and tensorboard's files, logs), and a resume of that run is accepted."""

import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import train_args

from sd_training.checkpoint.resume_config import config_changes
from sd_training.configure import load
from sd_training.config.loading import parse, public_dict, to_yaml
from sd_training.config.secrets import redact_text
from sd_training.loop import main as train

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]

ENV_NAME = "SD_TEST_HUB_TOKEN"


def files_holding(root: Path, needles: list[bytes], since: float = 0.0, skip: tuple = ()) -> list[str]:
    """Every file under ``root`` (recursively, binary too; modified at or after ``since``) that holds one of
    ``needles``."""
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            try:
                if path.is_symlink() or path in skip or path.stat().st_mtime < since:
                    continue
                data = path.read_bytes()
            except OSError:  # another test's file, gone meanwhile
                continue
            found += [f"{path} holds {n[:6]!r}..." for n in needles if n in data]
    return found


def test_a_planted_token_reaches_no_file_the_run_writes_and_the_run_resumes(tmp_path, tiny_pipeline, shapes_shards,
                                                                             monkeypatch):
    env_token, literal = "hf_" + secrets.token_hex(16), "lit_" + secrets.token_hex(16)
    monkeypatch.setenv(ENV_NAME, env_token)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # The usual way to stream a private hub dataset: curl with an Authorization header (file:// here).
    def curl(token: str) -> str:
        # Each shard's command fails after its data ("exited with status 3"): the reader logs the shard
        # (its command, token included) as skipped, so train.log is tested too.
        return f'pipe:curl -s -f -H "Authorization: Bearer {token}" file://{shapes_shards}; exit 3'

    config = tmp_path / "secret.yaml"
    config.write_text(
        "dataset:\n  params:\n"
        f"    path: '{curl('${oc.env:' + ENV_NAME + '}')}'\n"
        "validation:\n"
        f"    path: '{curl(literal)}'\n"
        "    num_batches: 1\n"
    )
    args = [a for a in train_args(tmp_path, tiny_pipeline, shapes_shards, name="sec", **{
        "dataset.params.resolution": 32, "experiment.num_examples_to_see": 4 * 2, "experiment.checkpoint_every": 2,
        "experiment.save_every": 2, "experiment.sample_per_prompt": 1, "experiment.sample_steps": 1,
        "wandb.mode": "offline", "experiment.tensorboard": "true",
    }) if not a.startswith("dataset.params.path=")]
    started = time.time() - 1
    cfg = load([f"config={config}", *args])
    assert env_token in cfg.dataset.params.path and literal in cfg.validation.path  # the run reads with them
    # wandb records the command line: one argument there holds a literal token too.
    monkeypatch.setattr(sys, "argv", ["train.py", f"config={config}", f"wandb.api_key={literal}",
                                      f"validation.path=https://user:{literal}@host/x.tar"])
    train(cfg)
    run = tmp_path / "runs" / "sec"
    assert (run / "checkpoints" / "step_00000002").is_dir() and (run / "current_pipeline").is_dir()
    assert any((run / "wandb").rglob("*.wandb")) and any((run / "tensorboard").iterdir())
    needles = [env_token.encode(), literal.encode()]
    assert files_holding(run, needles) == []
    # Nor anywhere else the run may write: the temporary folder, wandb's folders in the home directory.
    for place in (Path(tempfile.gettempdir()), Path.home() / ".cache" / "wandb", Path.home() / ".config" / "wandb"):
        assert files_holding(place, needles, since=started, skip=(config,)) == []
    dumped = (run / "config.yaml").read_text()
    # Kept as written: re-running the file reads the variable again.
    assert 'Authorization: Bearer ${oc.env:' + ENV_NAME + '}"' in dumped
    assert 'Authorization: Bearer <redacted>"' in dumped  # the literal one is redacted
    # wandb got the run config (with the interpolation, not the token).
    assert files_holding(run / "wandb", [("oc.env:" + ENV_NAME).encode()])
    assert "exited with status 3" in (run / "train.log").read_text()  # the shard was logged, without its token
    # Resume, nothing changed but the token (rotated): accepted, trains on to step 4.
    monkeypatch.setenv(ENV_NAME, "hf_" + secrets.token_hex(16))
    more = ["experiment.num_examples_to_see=16", "dataset.params.num_examples_to_see=16"]
    out = train(load([f"config={config}", *args, *more]))
    assert out["step"] == 4 and "resumed from" in (run / "train.log").read_text()
    assert files_holding(run, needles) == []


def test_dumps_keep_env_interpolations_and_redact_literal_secrets(tmp_path, monkeypatch):
    token = "tok_" + secrets.token_hex(12)
    monkeypatch.setenv(ENV_NAME, token)
    cfg = parse([
        "experiment.name=x", "experiment.num_examples_to_see=8", "model.pretrained=/p",
        "dataset.params.path='pipe:curl -H \"X-Api-Key: k3y_abcdef123\" https://me:pa55word@host/{0..3}.tar'",
        f"validation.path=https://host/v.tar?token=t0ken_abc&x=1&sig=${{oc.env:{ENV_NAME}}}",
        f"experiment.project=${{oc.env:{ENV_NAME}}}",  # wandb.project follows it: ${experiment.project}
        "wandb.api_key=abcdef0123456789", "model.unet.params={hf_token: plain_secret_1}",
    ])
    text, public = to_yaml(cfg), public_dict(cfg)
    for secret in (token, "k3y_abcdef123", "pa55word", "t0ken_abc", "abcdef0123456789", "plain_secret_1"):
        assert secret not in text, secret
    assert public["experiment"]["project"] == "${oc.env:" + ENV_NAME + "}"
    assert public["wandb"]["project"] == "${oc.env:" + ENV_NAME + "}"
    assert public["validation"]["path"].endswith("&x=1&sig=${oc.env:" + ENV_NAME + "}")
    assert "https://<redacted>@host/{0..3}.tar" in public["dataset"]["params"]["path"]
    assert redact_text('curl -H "Authorization: Bearer abc.def"') == 'curl -H "Authorization: Bearer <redacted>"'
    assert redact_text("a photo of a cat") == "a photo of a cat"
    kept = 'curl -H "Authorization: Bearer ${oc.env:HF_TOKEN}" -u me:${oc.env:PW} https://u:${oc.env:P}@h/?sig=${oc.env:S}'
    assert redact_text(kept) == kept  # interpolations are not secrets: kept as written
    # The dump is loadable: the interpolation reads the variable again.
    monkeypatch.setenv(ENV_NAME, "tok_other")
    (tmp_path / "dump.yaml").write_text(text)
    again = parse([f"config={tmp_path / 'dump.yaml'}"])
    assert again.experiment.project == again.wandb.project == "tok_other"
    assert to_yaml(again) == text  # and dumps to the same text


def test_resume_comparison_sees_through_redaction_and_env_interpolations():
    env = "pipe:curl -H 'Authorization: Bearer ${oc.env:HF_TOKEN}' https://h/{0..9}.tar"
    old_resolved = "pipe:curl -H 'Authorization: Bearer hf_old_secret' https://h/{0..9}.tar"  # a dump before issue 26
    cur = {"dataset": {"params": {"path": env}}, "wandb": {"api_key": "<redacted>"}}
    for saved in (env, redact_text(old_resolved), old_resolved):
        text = f"dataset:\n  params:\n    path: \"{saved}\"\nwandb:\n  api_key: null\n"
        assert config_changes(text, cur) == ([], [], []), saved
    other = "dataset:\n  params:\n    path: \"pipe:curl -H 'Authorization: Bearer ${oc.env:HF_TOKEN}' https://h/{0..5}.tar\"\n"
    assert config_changes(other, cur)[2] == [f"dataset.params.path: {other.split(chr(34))[1]} -> {env}"]


def test_a_config_error_prints_no_password_of_the_value_it_names(capsys):
    # The config error echoes the refused value; before, a URL's password reached the terminal with it.
    from sd_training.cli import main

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    assert main([f"config={quickstart}", "experiment.name=https://alice:hunter2@host/x"]) == 2
    err = capsys.readouterr().err
    assert "experiment.name" in err and "<redacted>" in err and "hunter2" not in err, err
