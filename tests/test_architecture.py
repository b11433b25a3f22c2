"""The architecture docs/architecture.md promises, checked: the trainer, checkpointing, strategies, outputs
and export name no model family; no family name or family field appears outside families/ (scripts and
data included); the Trainer holds no checkpoint code; the run folder's names are RunDir's; the config
schema imports no torch, model, objective or data code."""

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "sd_training"
GENERIC = ["loop.py", "build.py", "outputs/metrics.py", "outputs/run_outputs.py", "run/run_dir.py",
           "distributed/strategy.py", "outputs/export.py", "ema.py", "optim.py", "run/preemption.py",
           "outputs/trackers.py", "run/train_state.py", "speed/precision.py", "adapters.py", "outputs/comfy_lora.py",
           *(f"checkpoint/{p.name}" for p in sorted((PKG / "checkpoint").glob("*.py")))]
# Identifiers that belong to a family: its components, its classes, how it is chosen.
FAMILY_NAMES = {
    "sdxl", "vae", "unet", "text_encoder", "text_encoder_2", "tokenizer_2", "train_target", "StableDiffusion",
    "StableDiffusionXL", "Autoencoder", "StableDiffusionPipeline", "StableDiffusionXLPipeline", "AutoencoderKL",
    "UNet2DConditionModel", "CLIPTextModel", "CLIPTextModelWithProjection", "encode_text", "encode_images",
    "diffusion_loss", "vae_loss",
    # the transformer families (SD3, Flux) and their objective
    "sd3", "flux", "transformer", "text_encoder_3", "tokenizer_3", "t5", "guidance_embed", "StableDiffusion3",
    "Flux", "StableDiffusion3Pipeline", "FluxPipeline", "SD3Transformer2DModel", "FluxTransformer2DModel",
    "T5EncoderModel", "flow_loss", "flow_matching",
}


def names_in(path: Path) -> dict[str, list[int]]:
    """Identifiers and attribute names in code (strings and comments excluded), with their lines."""
    found: dict[str, list[int]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and tok.string in FAMILY_NAMES:
            found.setdefault(tok.string, []).append(tok.start[0])
    return found


def family_imports(path: Path) -> list[str]:
    """``from .families.sd import ...`` / ``from .families import sdxl``: a generic module reaching into one family."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and "families" in node.module.split("."):
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [p for p in parts if p in ("sd", "sdxl", "autoencoder")]
    return found


@pytest.mark.parametrize("name", GENERIC)
def test_generic_code_names_no_family(name):
    path = PKG / name
    assert not names_in(path), f"{name} names family-specific things: {names_in(path)}"
    assert not family_imports(path), f"{name} imports a family module: {family_imports(path)}"


def test_the_check_sees_a_family_name(tmp_path):
    """The scan above would catch a branch on a family (it is not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text('if cfg.model.train_target == "vae":\n    net = models.unet  # comment: sdxl\n')
    assert set(names_in(bad)) == {"train_target", "unet"}


def test_config_schema_imports_no_model_objective_or_data_code():
    """The config package, its schema and loading included (all but ``checks``), imports no torch and no
    model, objective or data code; a family's own sections come from the torch-free families.options."""
    imports = "import sys, sd_training.config, sd_training.config.schema, sd_training.config.loading; "
    code = imports + "print(sorted(m for m in sys.modules if m.startswith('sd_training')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out))
    allowed = {"sd_training", "sd_training.config", "sd_training.families", "sd_training.families.options"}
    allowed |= {f"sd_training.config.{m}" for m in ("fields", "schema", "dataset", "loading", "rules", "secrets")}
    extra = loaded - allowed
    assert not extra, f"sd_training.config imports {sorted(extra)}"
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", imports + "print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True).stdout.split()


# ---------------------------------------------------------------- families are whole plug-ins

FAMILIES_DIR = PKG / "families"
SCANNED = [p for p in [*PKG.rglob("*.py"), *(PKG.parent / "scripts").rglob("*.py"),
                       *(PKG.parent / "benchmarks").rglob("*.py"), PKG.parent / "train.py"]
           if FAMILIES_DIR not in p.parents]


# Inside a longer string (an error message, a help text): the names that cannot be ordinary words.
SUBSTRINGS = ("sdxl", "StableDiffusion", "text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3",
              "flow_matching")


def family_words() -> tuple[set[str], set[str]]:
    """(identifiers, words) that belong to one family: every registered family's name, class and pipeline
    classes, and the fields only one family has (SDXL's second encoder). Read from the registry, so a new
    family is covered the day it is registered."""
    from sd_training.families import registry

    names = set(registry.FAMILIES) | {"autoencoder"}
    classes = {cls.__name__ for cls in registry.FAMILIES.values()} | {"Autoencoder"}
    pipelines = {p for cls in registry.FAMILIES.values() for p in cls.pipeline_classes}
    fields = {"text_encoder_2", "tokenizer_2"}
    # As an identifier "sd" is the usual name of a state dict; as a string it is the family's name.
    return (names - {"sd"}) | classes | pipelines | fields, names | fields


def code_nodes(path: Path):
    """The AST nodes of a file, docstrings left out (prose, as comments are)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if id(n) not in docstrings]


def family_mentions(path: Path) -> list[str]:
    """Family identifiers in code, and string literals that are a family's name or name a family field,
    with their lines."""
    identifiers, words = family_words()
    found = []
    for node in code_nodes(path):
        if isinstance(node, ast.Name) and node.id in identifiers:
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in identifiers:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in identifiers:
            found.append(f"{node.lineno}: def {node.name}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and (node.value in words or any(f in node.value for f in SUBSTRINGS))):
            found.append(f"{node.lineno}: {node.value!r}")
    return sorted(found, key=lambda m: int(m.split(":")[0]))


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_no_family_name_or_field_outside_families(path):
    """Scripts, data code, the config and the trainer ask the family (registry.detect, its hooks) instead
    of comparing names; a family's own fields are declared under families/."""
    assert not family_mentions(path), f"{path.name} names a family: {family_mentions(path)}"


def test_the_family_scan_bites(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""Docstrings may say sdxl."""\nif name == "sdxl":\n    te = models.text_encoder_2\n'
                   'key = "model.tokenizer_2.pretrained"\n')
    assert [m.split(":")[0] for m in family_mentions(bad)] == ["2", "3", "4"]


# ---------------------------------------------------------------- a Trainer that delegates

def test_the_trainer_holds_no_checkpoint_or_resume_code():
    from sd_training.loop import Trainer

    own = [name for name in vars(Trainer) if re.search(r"checkpoint|resum|reshard|init_from|_state_dict", name)]
    assert not own, f"the Trainer has checkpoint methods {own}: they belong to sd_training.checkpoint"
    source = (PKG / "loop.py").read_text()
    for word in ("torch.save", "torch.load", "load_state_dict", "dcp."):
        assert word not in source, f"loop.py calls {word}: saving and loading belong to sd_training.checkpoint"


def test_loop_reads_on_a_few_screens():
    """loop.py holds set-up, the loop and the step: under ~350 lines, no function over ~80."""
    source = (PKG / "loop.py").read_text()
    assert len(source.splitlines()) <= 360
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, f"functions over 80 lines in loop.py: {long}"


def test_the_run_folder_names_are_spelled_in_run_dir_only():
    """Every file and folder name of a run folder belongs to RunDir (step_<N> included)."""
    names = ("config.yaml", "sources.json", "memory_plan.json", "metrics.jsonl", "current_pipeline", "tensorboard",
             "train.log", ".lock")
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "run_dir.py" or path.parent.name == "checkpoint" and path.name == "layout.py":
            continue
        strings = [n.value for n in code_nodes(path) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        offenders += [f"{path.relative_to(PKG)}: {s!r}" for s in strings
                      if s.startswith(names) or s == "step_"]  # f"step_{n:08d}"
    assert not offenders, offenders


# ---------------------------------------------------------------- layers, cycles, the package's shape

def module_name(path: Path, root: Path = PKG) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PKG) -> list[tuple[int, str]]:
    """(line, module) of every import of the package in a file, deferred ones (inside functions) included:
    ``from .x import y`` counts as x.y when that is a module, else x."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top = root.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod != top and not mod.startswith(top + "."):
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                as_path = root.parent / Path(*sub.split("."))
                is_mod = as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists()
                found.append((node.lineno, sub if is_mod else mod))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name == top or a.name.startswith(top + ".")]
    return found


def import_cycles(root: Path = PKG) -> list[list[str]]:
    """The package's import cycles (strongly connected groups of modules), deferred imports counted."""
    graph = {module_name(p, root): {m for _, m in imported_modules(p, root)} for p in root.rglob("*.py")}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v] & graph.keys():
            if w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_config_is_the_ground_floor():
    """No module of sd_training/config/ imports another part of sd_training (deferred imports included):
    owners register their fields with the schema and their checks run from sd_training.configure."""
    outside = [f"{p.relative_to(PKG)}:{line}: {mod}" for p in sorted((PKG / "config").rglob("*.py"))
               for line, mod in imported_modules(p) if not mod.startswith("sd_training.config")]
    assert not outside, f"config/ imports from above it: {outside}"


def test_no_import_cycle_deferred_imports_counted():
    assert not import_cycles(), f"import cycles: {import_cycles()}"


def test_the_layer_and_cycle_checks_bite(tmp_path):
    pkg = tmp_path / "sd_training"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "config" / "schema.py").write_text("def f():\n    from ..memory import plan\n")
    (pkg / "memory").mkdir()
    (pkg / "memory" / "__init__.py").write_text("")
    (pkg / "memory" / "plan.py").write_text("from ..config import schema\n")
    assert imported_modules(pkg / "config" / "schema.py", pkg) == [(2, "sd_training.memory.plan")]
    assert import_cycles(pkg) == [["sd_training.config.schema", "sd_training.memory.plan"]]


# The root keeps the entry points and the loop; the rest lives in subpackages named for what they hold.
ROOT_MODULES_MAX = 10


def test_the_root_keeps_about_ten_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, f"{len(root)} modules at the package root: {root}"


MODEL_CLASS = re.compile(r"^[A-Z]\w*(Model|Transformer\w*Model|ForCausalLM|WithProjection|KL|Pipeline)$")


def _reads_class_name(node) -> bool:
    """``type(x).__name__``, ``x.__class__.__name__`` or ``x.__class__``/``type(x)`` compared by name."""
    return isinstance(node, ast.Attribute) and node.attr == "__name__" and (
        isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "type"
        or isinstance(node.value, ast.Attribute) and node.value.attr == "__class__")


def _model_class_literals(node) -> list:
    """String constants naming a model class (UNet2DConditionModel, FluxTransformer2DModel, CLIPTextModel ...)
    inside ``node`` (a tuple or set of them included)."""
    return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and MODEL_CLASS.match(n.value)]


def class_name_branches(path: Path) -> list[str]:
    """Where code decides by a model's class name: a comparison (==, !=, in) of ``type(x).__name__`` /
    ``x.__class__.__name__`` or of a model class name's literal; a table keyed by model class names; an
    ``isinstance`` or ``.get`` / ``[...]`` lookup by one. Outside families/ the family is asked instead.
    (Reading a class name for a message, or a config default that names a class, is not a branch.)"""
    found = []
    for node in code_nodes(path):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_reads_class_name(o) for o in operands) or any(_model_class_literals(o) for o in operands):
                found.append(f"{node.lineno}: comparison by class name")
        elif isinstance(node, ast.Subscript) and (_reads_class_name(node.slice) or _model_class_literals(node.slice)):
            found.append(f"{node.lineno}: lookup by class name")
        elif isinstance(node, ast.Dict) and any(k is not None and _model_class_literals(k) for k in node.keys):
            found.append(f"{node.lineno}: table keyed by class names")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and (_reads_class_name(node.args[0]) or _model_class_literals(node.args[0]))):
            found.append(f"{node.lineno}: lookup by class name")
    return found


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_no_model_class_name_branches_outside_families(path):
    """Memory plans, FLOP counts, objectives and the loop ask the family for shapes and inputs; they never
    compare a model's class name."""
    assert not class_name_branches(path), f"{path.name} decides by a model class name: {class_name_branches(path)}"


def test_the_class_name_scan_bites(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('if type(net).__name__ == "x":\n    pass\nif name in ("UNet2DConditionModel", "y"):\n    pass\n'
                   'SEQ = {"FluxTransformer2DModel": 512}\nn = SEQ.get(net.__class__.__name__)\n'
                   'raise ValueError(f"{type(net).__name__} is not supported")\ntarget = "UNet2DConditionModel"\n')
    assert [m.split(":")[0] for m in class_name_branches(bad)] == ["1", "3", "5", "6"]


def test_every_registered_family_runs_the_conformance_suite():
    """tests/test_family_conformance.py is parametrized over the registry: a family registered tomorrow
    is collected there without new test code."""
    from sd_training.families import registry

    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(Path(__file__).parent / "test_family_conformance.py")],
                         capture_output=True, text=True, cwd=PKG.parent)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    missing = [name for name in registry.FAMILIES if not any(f"[{name}" in i or f"-{name}]" in i or f"-{name}-" in i
                                                            for i in ids)]
    assert ids and not missing, f"families without conformance tests: {missing}"


def test_benchmarks_and_scripts_use_the_trainers_public_step():
    """The benchmarks drive ``Trainer.micro_step`` / ``optimizer_step``; no script or benchmark reaches
    into the Trainer's private methods (which may change with the loop)."""
    from sd_training.loop import Trainer

    assert callable(Trainer.micro_step) and callable(Trainer.optimizer_step)
    private = {n for n in vars(Trainer) if n.startswith("_") and not n.startswith("__")}
    users = [p for d in ("benchmarks", "scripts") for p in sorted((PKG.parent / d).rglob("*.py"))]
    reached = [f"{p.name}:{n.lineno}: .{n.attr}" for p in users for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Attribute) and n.attr in private]
    assert not reached, f"private Trainer methods used: {reached}"
    assert any("micro_step" in p.read_text() for p in users if p.parent.name == "benchmarks")
