"""Families are whole plug-ins: no module outside ``sd_training/families/`` names a family, its classes or its
own components, in code or in a string (docstrings and comments, which explain, are not scanned); scripts,
benchmarks, the data package and the config package included. Adding a family is its module and a line in
``families/registry.py``, and every script takes its choices from the registry."""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sd_training"
FAMILIES_DIR = PKG / "families"
# Family names, their classes and pipeline classes, and components only one family has.
FAMILY_WORDS = {
    "sd", "sdxl", "autoencoder", "StableDiffusion", "StableDiffusionXL", "Autoencoder", "SDXLModels",
    "StableDiffusionPipeline", "StableDiffusionXLPipeline", "text_encoder_2", "tokenizer_2",
}
# Inside a longer string (an error message, a help text): the names that cannot be ordinary words.
FAMILY_SUBSTRINGS = ("sdxl", "StableDiffusion", "text_encoder_2", "tokenizer_2")
# As an identifier "sd" is a state dict everywhere: only its string (a family name) counts.
NOT_IDENTIFIERS = {"sd"}
# Known leaks, each with the reason it is still there (the list may only shrink).
KNOWN = {
    # Builds an SD pipeline from a checkpoint's UNet by hand; it should ask the family (a hook that builds the
    # run's pipeline from a checkpoint folder) so SDXL checkpoints work too.
    "scripts/generate_examples.py": ["84: imports the family module sd"],
}


def outside_families() -> list[Path]:
    files = [p for p in PKG.rglob("*.py") if FAMILIES_DIR not in p.parents]
    return sorted(files + list((ROOT / "scripts").glob("*.py")) + list((ROOT / "benchmarks").glob("*.py")))


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the constant nodes that are docstrings (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def family_mentions(path: Path) -> list[str]:
    """``line: what`` for each identifier or (non-doc) string literal that names a family."""
    source = path.read_text()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in FAMILY_WORDS - NOT_IDENTIFIERS:
            found.append(f"{tok.start[0]}: identifier {tok.string}")
    tree = ast.parse(source)
    docs = docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if text in FAMILY_WORDS or any(s in text for s in FAMILY_SUBSTRINGS):
                found.append(f"{node.lineno}: string {text[:60]!r}")
        elif isinstance(node, ast.ImportFrom) and node.module and "families" in node.module.split("."):
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"{node.lineno}: imports the family module {p}" for p in parts if p in FAMILY_WORDS]
    return found


@pytest.mark.parametrize("path", outside_families(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_family_is_named_outside_families(path):
    rel = str(path.relative_to(ROOT))
    found = [f for f in family_mentions(path) if f.split(": ", 1)[1] not in {k.split(": ", 1)[1] for k in KNOWN.get(rel, [])}]
    assert not found, f"{rel} names a family: {found}"


def test_the_scan_bites(tmp_path):
    """A branch on a family name, a family's component, a pipeline class in a message and an import of a family
    module are all found; the same words in a docstring or a comment are not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Docstrings may explain SDXL and sd."""\n'
        'from sd_training.families.sdxl import encode_prompts\n'
        'def f(family, models):\n'
        '    """Also here: text_encoder_2."""\n'
        '    if family == "sd":  # comment: sdxl\n'
        '        return models.text_encoder_2\n'
        '    raise ValueError("not a StableDiffusionXLPipeline")\n'
    )
    found = family_mentions(bad)
    assert sorted({int(f.split(": ", 1)[0]) for f in found}) == [2, 5, 6, 7], found  # not the docstrings (1, 4)
    assert any("identifier text_encoder_2" in f for f in found) and any("'sd'" in f for f in found)
    assert any("imports the family module sdxl" in f for f in found)


def test_scripts_take_families_from_the_registry(tmp_path):
    """--family choices are the registry's names (a new family shows up with no script edit)."""
    from sd_training.families.registry import FAMILIES

    for script in ("make_tiny_pipeline.py", "precompute_latents.py"):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True,
                             text=True, check=True, cwd=ROOT).stdout
        for name in FAMILIES:
            assert name in out, (script, name)


def test_every_family_builds_its_tiny_pipeline_and_is_detected_from_it(tmp_path):
    """Each registered family's tiny pipeline is read back as that family by the registry's detection."""
    from sd_training.families.registry import FAMILIES, detect_source
    from sd_training.families.tiny import make_tiny_pipeline

    for name in FAMILIES:
        out = make_tiny_pipeline(tmp_path / name, family=name)
        assert detect_source("auto", str(out)) == name
