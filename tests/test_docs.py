"""The docs cannot go stale: the configuration reference is what the schema says; every script, config
file and path, every config key and every ``sd_training`` module that README.md and docs/*.md name
exists; relative links resolve; docs/architecture.md maps every module of the package. Each check is
shown to bite on a made-up case. Fast: reads files and the schema, trains nothing."""

from __future__ import annotations

import importlib.util
import itertools
import re
import typing
from pathlib import Path

import pytest
import yaml

import sd_training  # noqa: F401  (every owner adds its fields to the schema on import)
from sd_training.config.schema import schema_entries

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sd_training"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _load_generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


# --- (a) the generated configuration reference ---------------------------------------------------------


def test_configuration_reference_is_current():
    gen = _load_generator()
    page = ROOT / "docs" / "configuration-reference.md"
    assert page.read_text(encoding="utf-8") == gen.render(), (
        "docs/configuration-reference.md is stale: run python scripts/config_reference.py")


def test_configuration_reference_check_bites(tmp_path, capsys):
    gen = _load_generator()
    entries = list(schema_entries())
    # a key the schema gained shows up, with its default, choices and help
    meta = {"help": "a made-up key", "choices": ("a", "b")}
    text = gen.render(entries + [("model.made_up_key", str, "a", meta, False)])
    assert "| `model.made_up_key` | str | `a` | `a`, `b` | a made-up key |" in text
    assert text != gen.render(entries)
    # --check: 0 for the current page, 1 for a stale or missing one
    current, stale = tmp_path / "current.md", tmp_path / "stale.md"
    current.write_text(gen.render(), encoding="utf-8")
    stale.write_text(gen.render().replace("`system.batch_size`", "`system.batch_sise`"), encoding="utf-8")
    assert gen.main(["--check", "--out", str(current)]) == 0
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert gen.main(["--check", "--out", str(tmp_path / "missing.md")]) == 1
    assert "stale" in capsys.readouterr().err


def test_configuration_reference_lists_every_key():
    text = (ROOT / "docs" / "configuration-reference.md").read_text(encoding="utf-8")
    missing = [path for path, _, _, _, is_section in schema_entries() if f"`{path}`" not in text]
    assert not missing, f"keys missing from the reference: {missing}"


# --- (b) scripts, configs and paths --------------------------------------------------------------------

# Paths are checked when they start at a folder of the repository or of the package; a path under an
# ignored folder (.gitignore: runs, generated data, benchmark results) is an output, not a file we ship.
PATH_RE = re.compile(r"(?<![\w./<>{}-])((?:[\w.-]|\{[^{}\s]*\})+(?:/(?:[\w.-]|\{[^{}\s]*\}|<\w+>)+)+/?)")
# placeholders: <panel>, step_N, NAME, OUT, a user's own my_run.yaml
PLACEHOLDER = re.compile(r"<|\*|\.\.\.|^[A-Z][A-Z0-9_]*$|_N$|_N\.|\bN\b|^my[_-]")


def _ignored_dirs() -> list[str]:
    out = []
    for line in (ROOT / ".gitignore").read_text().splitlines():
        line = line.strip()
        if line.endswith("/") and "*" not in line:
            out.append(line.strip("/") + "/")
    return out


def _roots() -> set[str]:
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} | {".ci"}
    pkg = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return top | pkg


def _expand(path: str) -> list[str]:
    """``configs/laion/{from-scratch,finetune}.yaml`` -> both files (a shard range is not a file list)."""
    parts = re.split(r"(\{[^{}]*\})", path)
    options = [p[1:-1].split(",") if p.startswith("{") and "," in p else [p] for p in parts]
    return ["".join(o).replace(" ", "") for o in itertools.product(*options)]


def missing_paths(text: str) -> list[str]:
    """Paths a page names that do not exist (at the repository root or inside the package)."""
    roots, ignored, bad = _roots(), _ignored_dirs(), []
    for match in PATH_RE.finditer(text):
        token = match.group(1).split("::")[0].rstrip(".,;:")
        first = token.split("/")[0]
        if first not in roots or any(PLACEHOLDER.search(part) for part in token.split("/")):
            continue
        output = any(token.startswith(d) or token + "/" == d for d in ignored) and not token.endswith(".py")
        for path in _expand(token):
            if "{" in path or ".." in path:
                continue  # a brace pattern of shards, not a file
            if not ((ROOT / path).exists() or (PKG / path).exists() or output):
                bad.append(path)  # data/tables.py is the package's; data/fashion a run's output
    return bad


BARE_PY_RE = re.compile(r"(?<![\w/.-])([\w-]+\.py)\b")


def _repo_file_names() -> set[str]:
    # the repository's own folders only: walking .venv would read thousands of files
    folders = [ROOT / d for d in ("scripts", "benchmarks", "batch_files", "sd_training", "tests")]
    return {p.name for p in ROOT.glob("*.py")} | {p.name for d in folders for p in d.rglob("*.py")}


def unknown_file_names(text: str, names: set[str]) -> list[str]:
    """Bare script or module names (`bench_memory.py`, `loop.py`) that no file of the repository has; a name
    said to be diffusers' own (its example scripts) is not ours to check."""
    bad = []
    for match in BARE_PY_RE.finditer(text):
        if match.group(1) not in names and "diffusers'" not in text[max(0, match.start() - 80):match.start()]:
            bad.append(match.group(1))
    return bad


LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def broken_links(text: str, page: Path) -> list[str]:
    """Relative markdown links (pages, images) that do not resolve from the page's folder."""
    bad = []
    for target in LINK_RE.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            bad.append(target)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_paths_exist(page):
    text = page.read_text(encoding="utf-8")
    assert not missing_paths(text), f"{_rel(page)} names paths that do not exist: {missing_paths(text)}"
    assert not broken_links(text, page), f"{_rel(page)} has broken links: {broken_links(text, page)}"
    bare = unknown_file_names(text, _repo_file_names())
    assert not bare, f"{_rel(page)} names files no folder of the repository has: {bare}"


def test_path_check_bites(tmp_path):
    text = ("run `python scripts/no_such_script.py` with configs/base/sd1.yaml and "
            "configs/laion/{from-scratch,nope}.yaml; `families/registry.py`; runs/NAME/report.html; "
            "`data/tables.py`, `data/no_such_module.py`, data/fashion")
    assert missing_paths(text) == ["scripts/no_such_script.py", "configs/laion/nope.yaml", "data/no_such_module.py"]
    page = tmp_path / "page.md"
    names = _repo_file_names()
    text = "`bench_memory.py`, `loop.py`, `bench_nothing.py`; diffusers' `train_text_to_image.py`"
    assert unknown_file_names(text, names) == ["bench_nothing.py"]
    page.write_text("")
    assert broken_links("[ok](page.md) [gone](nowhere.md) [web](https://example.org)", page) == ["nowhere.md"]


# --- (c) config keys -----------------------------------------------------------------------------------


def _schema():
    """Every key and section path, and the free-form dict fields whose sub-keys the schema does not list."""
    paths, free = set(), set()
    for path, tp, _default, _meta, _is_section in schema_entries():
        paths.add(path)
        if tp is dict or typing.get_origin(tp) is dict:
            free.add(path)
        if typing.get_origin(tp) is list and typing.get_origin((typing.get_args(tp) or [None])[0]) is dict:
            free.add(path)  # dataset.params.sources: a list of mappings
    return paths, free


SCHEMA_PATHS, FREE_DICTS = _schema()
SECTIONS = {p.split(".")[0] for p in SCHEMA_PATHS}
FILE_EXTENSIONS = {"pt", "py", "yaml", "yml", "json", "jsonl", "png", "md", "safetensors", "npy", "txt", "tar",
                   "log", "sh"}  # optimizer.pt is a file, not a key
# A key quoted as in an error message ('system.batch_sise'; did you mean ...) may be wrong on purpose.
KEY_RE = re.compile(r"(?<![\w./$'-])~?([a-z_][a-z0-9_]*(?:\.(?:[A-Za-z0-9_]+\*?|\*))+)(?![\w(])")


def key_exists(key: str) -> bool:
    if key in SCHEMA_PATHS:
        return True
    parts = key.split(".")
    if any(".".join(parts[:i]) in FREE_DICTS for i in range(1, len(parts))):
        return True
    if parts[-1] == "*" or parts[-1].endswith("*"):  # model.adapter.*, quickstart.shapes_*
        prefix = key.rstrip("*")
        return any(p.startswith(prefix) for p in SCHEMA_PATHS)
    return False


def _yaml_keys(block: str) -> list[str]:
    """Dotted keys of a YAML block (sections and keys), not descending into free-form dicts or lists."""
    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError:
        return []
    out = []

    def walk(node, prefix):
        for k, v in node.items():
            path = f"{prefix}{k}"
            out.append(path)
            if isinstance(v, dict) and path not in FREE_DICTS:
                walk(v, path + ".")

    if isinstance(data, dict) and set(data) & SECTIONS:
        walk(data, "")
    return out


def unknown_keys(text: str) -> list[str]:
    """Config keys a page names (``a.b=...``, ``a.b: ...``, `` `a.b` ``, YAML blocks) that the schema lacks."""
    names = []
    for match in KEY_RE.finditer(text):
        key = match.group(1)
        if key.split(".")[0] in SECTIONS and key.rsplit(".", 1)[-1] not in FILE_EXTENSIONS:
            names.append(key)
    for block in re.findall(r"```ya?ml\n(.*?)```", text, flags=re.S):
        names += _yaml_keys(block)
    return sorted({k for k in names if not key_exists(k)})


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "configuration-reference.md"], ids=_rel)
def test_named_config_keys_exist(page):
    bad = unknown_keys(page.read_text(encoding="utf-8"))
    assert not bad, f"{_rel(page)} names config keys the schema does not have: {bad}"


def test_key_check_bites():
    text = ("python train.py model.adapter.rnak=8 `system.batch_size` ~optimizer.params.lr_max "
            "model.unet.params.block_out_channels=[32] `quickstart.shapes_*` `model.nope.*` "
            "`optimizer.pt` `optimizer.eval()` sd_training.model.adapter\n"
            "```yaml\nmodel:\n  adapter:\n    rank: 8\n    rnk: 4\n  unet:\n    params: {anything: 1}\n"
            "dataset:\n  params:\n    filters: {pwatermark: '<=0.5'}\n```\n")
    assert unknown_keys(text) == ["model.adapter.rnak", "model.adapter.rnk", "model.nope.*", "optimizer.params.lr_max"]


# --- (d) modules ---------------------------------------------------------------------------------------

MODULE_RE = re.compile(r"\bsd_training(?:\.[A-Za-z_]\w*)+")


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def unknown_modules(text: str) -> list[str]:
    """``sd_training.x.y`` names whose module does not exist, or whose trailing name the module lacks
    (``sd_training.checkpoint.CheckpointManager``: the package must define or import the name)."""
    bad = []
    for name in sorted(set(MODULE_RE.findall(text))):
        parts = name.split(".")
        depth = max((i for i in range(1, len(parts) + 1) if _module_file(parts[:i])), default=0)
        rest = parts[depth:]
        if depth == 0 or len(rest) > 2:
            bad.append(name)
        elif rest and not re.search(rf"\b{re.escape(rest[0])}\b", _module_file(parts[:depth]).read_text()):
            bad.append(name)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_modules_exist(page):
    bad = unknown_modules(page.read_text(encoding="utf-8"))
    assert not bad, f"{_rel(page)} names sd_training modules or names that do not exist: {bad}"


def test_module_check_bites():
    text = ("`sd_training.memory.plan` `sd_training.configure.load` `sd_training.memory_plan` "
            "`sd_training.checkpoint.NoSuchManager` `python -m sd_training.evaluation`")
    assert unknown_modules(text) == ["sd_training.checkpoint.NoSuchManager", "sd_training.memory_plan"]


# --- (e) the architecture map --------------------------------------------------------------------------


def package_modules() -> list[str]:
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def unmapped_modules(text: str, modules: list[str]) -> list[str]:
    """Modules the map has no line for: a line that starts with the module's path in backticks."""
    mapped = set(re.findall(r"^\s*[-|]\s*`([\w/]+\.py)`", text, flags=re.M))
    return [m for m in modules if m not in mapped]


def test_architecture_maps_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert not unmapped_modules(text, package_modules()), (
        f"docs/architecture.md has no line for: {unmapped_modules(text, package_modules())}")
    mapped = re.findall(r"^\s*[-|]\s*`([\w/]+\.py)`", text, flags=re.M)
    gone = [m for m in mapped if not ((PKG / m).is_file() or (ROOT / m).is_file())]  # train.py: the root's
    assert not gone, f"docs/architecture.md maps modules that do not exist: {gone}"


def test_architecture_check_bites():
    text = "- `loop.py`: the Trainer\n- `memory/fit.py`: will it fit\nprose naming `cli.py` is not a map line\n"
    modules = ["cli.py", "loop.py", "memory/fit.py", "memory/new.py"]
    assert unmapped_modules(text, modules) == ["cli.py", "memory/new.py"]
