"""What a run writes for people, against hostile input (issue 34): model card templates in a sandbox, text
from configs and data escaped in cards and the report, bounded readers of run-folder YAML/JSON, exports
readable by the group, and no ``user:password`` in any script's output."""

import ast
import copy
import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import args_with, run_trainer
from huggingface_hub import ModelCard

from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.outputs import model_card, readers
from sd_training.report import write_report
from sd_training.report.series import read_metrics

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]
ROOT = Path(__file__).resolve().parent.parent

run_args = args_with({"dataset.params.resolution": 32, "experiment.num_examples_to_see": 4,
                      "experiment.save_every": 1, "experiment.save_only_most_recent": "false"})


@pytest.fixture(scope="module")
def run_info(tiny_pipeline, shapes_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("cards")
    cfg = load(run_args(root, tiny_pipeline, shapes_shards, "t"))
    return model_card.RunInfo(cfg, "sd", ("stable-diffusion",), "unet", str(tiny_pipeline), "samples", 4, 1, 1e-3,
                              root / "metrics.jsonl")


def _with(run_info, **cfg_changes):
    cfg = copy.deepcopy(run_info.cfg)
    for dotted, value in cfg_changes.items():
        *path, last = dotted.split("__")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return model_card.RunInfo(**{**vars(run_info), "cfg": cfg})


# -- case 2: templates in a sandbox ---------------------------------------------------------------------
@pytest.mark.parametrize("expression, words", [
    ("{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}", ["__init__", "unsafe"]),
    ("{{ title.__class__.__mro__[1].__subclasses__() }}", ["__class__", "unsafe"]),
    ("{{ facts.data.sources.append(1) }}", ["append", "unsafe"]),
    ("{{ 'x' * 10 ** 7 }}", ["over the template's bound"]),  # 10 MB: 10 GB today would be a kill
    ("{% include '/etc/passwd' %}", ["cannot include"]),
])
def test_a_template_is_rendered_in_a_sandbox_and_refused_at_start_up(run_info, tmp_path, monkeypatch,
                                                                     expression, words):
    """Today's unsandboxed environment runs the payload (the marker appears) and renders the rest."""
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "card.md"
    bad.write_text("---\n{{ card_data }}\n---\n\n# {{ title }}\n" + expression + "\n")
    with pytest.raises(ConfigError) as e:
        model_card.check_template(_with(run_info, experiment__model_card_template=str(bad)), tmp_path)
    message = str(e.value)
    assert "'experiment.model_card_template'" in message and str(bad) in message
    assert f"line 6: {expression}" in message  # the line and the expression
    for w in words:
        assert w in message
    assert not (tmp_path / "MARKER").exists()


# -- case 12: hostile text in the card ------------------------------------------------------------------
PROMPT = "<script>alert(1)</script> ![x](http://evil.example/p.png)\n# injected | a | b"
SOURCE = "evil|name\n## heading <img src=x onerror=alert(1)> ![y](http://evil.example/q.png)"
PATH = "/data/`x`|<b>y</b>\n# z"
RULE = "in [a|`b`]\n# z"


def _hostile_card(run_info, tmp_path) -> str:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 0.5, f"data/source/{SOURCE}/share": 1.0,
                                   "data/filter/shape/pass_rate": 0.5, "data/skipped/bad|reason\n# x": 2}) + "\n")
    info = _with(run_info, experiment__sample_prompts=[PROMPT, "a plain prompt"], experiment__name="run|<i>x</i>")
    info.cfg.dataset.params.sources = [{"path": PATH, "name": SOURCE, "weight": 1.0, "filters": {"shape": RULE}}]
    info.metrics = metrics
    export = model_card.ExportInfo(tmp_path, False, "raw", 1, 4, grid=tmp_path / "grid.png")
    return str(model_card.render(info.template, model_card.template_vars(info, export)))


def test_prompts_source_names_and_paths_stay_text_in_the_card(run_info, tmp_path):
    """Today: a <script> tag, two images from elsewhere, injected headings and a table torn by '|'."""
    markdown_it = pytest.importorskip("markdown_it")
    card = _hostile_card(run_info, tmp_path)
    body = card.split("\n---\n", 1)[1]
    page = markdown_it.MarkdownIt("commonmark").enable("table").render(body)
    assert "<script" not in page and "<img src=\"x\"" not in page and "<i>" not in page and "<b>" not in page
    assert re.findall(r"<img src=\"([^\"]*)\"", page) == ["samples.png"]  # no image loads from elsewhere
    assert [h.split(">")[0] for h in page.split("<h")[1:] if h[0] in "123456"] == ["1", "2", "2", "2", "2"]
    data_table = page.split("<h2>Data</h2>")[1].split("</table>")[0]
    rows = data_table.split("<tr>")[2:]  # the header's and the source's
    assert len(rows) == 1 and rows[0].count("<td") == 5  # '|' in the name and path did not add cells
    assert "evil|name ## heading &lt;img src=x onerror=alert(1)&gt;" in rows[0]  # shown as written, on one line
    assert "<code>/data/'x'|&lt;b&gt;y&lt;/b&gt; # z</code>" in rows[0]
    assert "<code>in [a|'b'] # z</code>" in page
    # The snippet's prompt cannot close the code fence, and it stays the prompt once run.
    snippet = card.split("```python\n", 1)[1].split("\n```", 1)[0]
    assert "```" not in snippet
    calls = [n for n in ast.walk(ast.parse(snippet)) if isinstance(n, ast.Call)]
    call = next(n for n in calls if getattr(n.func, "id", "") == "pipe")
    assert call.args[0].value == PROMPT
    # The metadata is YAML that says what the run said (a hostile name cannot add keys).
    assert set(ModelCard(card).data.to_dict()) <= {"base_model", "library_name", "pipeline_tag", "tags",
                                                              "license"}


# -- case 12: a mixture source named '$...$' in the report -------------------------------------------------
def test_a_source_named_with_dollars_does_not_stop_the_report(tmp_path, caplog):
    """Today matplotlib parses '$\\undefined{x}$' as math and raises: report.html is never written."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run$\\frac{1}{$"
    run.mkdir()
    rows = [{"step": s, "loss": 1.0 / s, "data/source/$\\undefined{x}$/share": 0.5,
             "data/source/<script>x</script>/share": 0.5} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text("experiment: {name: '<script>alert(1)</script>', "
                                     "sample_prompts: ['</pre><script>x</script>']}\n")
    page = write_report(run).read_text()
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert (run / "report" / "sources.png").is_file()
    plot_metrics = _script("plot_metrics")
    assert plot_metrics.main([str(run), "-o", str(tmp_path / "m.png")]).is_file()  # its title is the folder's name


# -- case 5 and 14: bounded readers -----------------------------------------------------------------------
LAUGHS = "a: &a ['lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol', 'lol']\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(3))


@pytest.mark.parametrize("config, words", [
    (LAUGHS, ["line 1", "anchor or alias", "never does"]),  # 4 levels only: the real one had 9
    ("experiment: " + "[" * 5000 + "]" * 5000 + "\n", ["line 1", "nests lists/mappings over 64 deep"]),
], ids=["aliases", "deep"])
def test_the_report_refuses_yaml_aliases_and_deep_nesting_in_config_yaml(tmp_path, caplog, config, words):
    """Today the aliases are expanded (a 9-level file grew the report to 22.8 GB) and the deep list raises
    RecursionError out of write_report."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with caplog.at_level(logging.WARNING):
        page = write_report(run).read_text()
    assert "loss" in page and "'lol'" not in page
    for w in words:
        assert w in caplog.text
    assert str(run / "config.yaml") in caplog.text


def test_metrics_lines_nested_too_deep_or_unparsable_are_skipped_counted_and_named(tmp_path, caplog):
    """Today a deeply nested line raises RecursionError out of the report, the model card's reader and
    plot_metrics.py; a 5000-digit number raises ValueError past the 'not JSON' handler."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": 1, "loss": 1.0}), "[" * 100_000 + "]" * 100_000,
             json.dumps({"step": 2, "loss": 0.5}), '{"step": 3, "loss": ' + "1" * 5000 + "}",
             '{"step": 4, "x": ' + "[" * 100 + "]" * 100 + "}", json.dumps({"step": 5, "loss": 0.25})]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        metrics = read_metrics(path)
    assert metrics["loss"] == [(1, 1.0), (2, 0.5), (5, 0.25)]
    assert f"{path}:2,5 nests arrays/objects over 64 deep: skipped (2 lines)" in caplog.text
    assert f"{path}:4 is not JSON" in caplog.text
    assert model_card.last_metrics(path, 4)["step"] == 2
    with pytest.raises(readers.UnsafeFile, match="over 64 deep"):
        readers.loads("[" * 100_000)


# -- case 15: exports readable by the group ---------------------------------------------------------------
def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def test_every_file_a_run_writes_follows_the_umask(tiny_pipeline, shapes_shards, tmp_path):
    """A full export and a LoRA export (with its kohya file and merged pipeline), checkpoints, the card.
    Today every .safetensors is 0600 (safetensors writes through a private temporary file)."""
    old = os.umask(0o022)
    try:
        full = run_trainer(load(run_args(tmp_path, tiny_pipeline, shapes_shards, "full"))).run_dir.root
        lora = run_trainer(load(run_args(tmp_path, tiny_pipeline, shapes_shards, "lora", **{
            "model.adapter.type": "lora", "model.adapter.rank": 2, "model.adapter.export_merged": "true",
            "model.adapter.export_kohya": "true"}))).run_dir.root
    finally:
        os.umask(old)
    for root in (full, lora):
        modes = _modes(root)
        assert any(name.endswith(".safetensors") for name in modes)
        assert {name: m for name, m in modes.items() if m != "0o644"} == {}
        dirs = [p for p in root.rglob("*") if p.is_dir()]
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o755 for p in dirs)
    names = set(_modes(lora))
    assert {"current_pipeline/pytorch_lora_weights_kohya.safetensors",
            "current_pipeline/merged/unet/diffusion_pytorch_model.safetensors"} <= names


# -- case 14: secrets in scripts' output --------------------------------------------------------------------
def test_push_to_hub_never_prints_the_endpoints_password(tiny_pipeline, tmp_path):
    """Today: 'cannot reach the Hub at http://someone:s3cret-pass@127.0.0.1:9' on stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(HF_HOME=str(tmp_path), HF_TOKEN="hf_not_a_token", HF_HUB_OFFLINE="0",
               HF_ENDPOINT="http://someone:s3cret-pass@127.0.0.1:9")  # a port that refuses: no network used
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "push_to_hub.py"), tiny_pipeline, "--repo", "me/m"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 3, out.stderr
    assert "cannot reach the Hub at http://<redacted>@127.0.0.1:9" in out.stderr
    assert "s3cret-pass" not in out.stdout + out.stderr


def test_make_shards_never_prints_an_image_urls_password(tmp_path):
    """Today: 'make_shards: skipping http://someone:s3cret-pass@127.0.0.1:9/a.png: ...' on stderr."""
    table = tmp_path / "images.csv"
    table.write_text("image,caption\nhttp://someone:s3cret-pass@127.0.0.1:9/a.png,a cat\n")  # refused at once
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shards.py"), str(table), str(tmp_path / "out"),
                          "--quiet", "--timeout", "5"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "make_shards: skipping http://<redacted>@127.0.0.1:9/a.png" in out.stderr, out.stderr[-2000:]
    assert "s3cret-pass" not in out.stdout + out.stderr


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
