"""Every script's numbers and paths are range-checked while the command line is parsed (issue 34, cases 13 and
14): one line names the argument and what it allows, exit code 2, no traceback, before anything is read or
loaded (a config that does not exist is never reached: its error would come instead) and nothing written.
Each script runs as ``__main__`` in this process (``runpy``, its ``sys.argv`` set), as ``python script.py``
would run it: a bad argument costs what parsing costs, the imports are paid once."""

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MISSING = "config=does-not-exist.yaml"  # read only after the arguments: an argument error must come first

# (script, arguments, the argument named, a word of what it allows)
CASES = [
    ("preview_data", [MISSING, "--scan-units", "abc"], "--scan-units", "'all' or an integer from 1"),
    ("preview_data", [MISSING, "--scan-units", "-1"], "--scan-units", "'all' or an integer from 1"),
    ("preview_data", [MISSING, "--out", "sheet.jpg"], "--out", "ending in .png"),
    ("preview_data", [MISSING, "--n", "100000"], "--n", "from 1 to 1024"),
    ("preview_data", [MISSING, "--tile", "60000"], "--tile", "from 32 to 1024"),
    ("preview_data", [MISSING, "--n", "1024", "--tile", "1024"], "--tile", "megapixel sheet, more than 64"),
    ("preview_data", [MISSING, "--workers", "-3"], "--workers", "from 0 to 64"),
    ("plan_memory", [MISSING, "--gpu-gb", "nan"], "--gpu-gb", "finite number > 0"),
    ("plan_memory", [MISSING, "--gpu-gb", "-5"], "--gpu-gb", "finite number > 0"),
    ("plan_memory", [MISSING, "--gpu-gb", "0"], "--gpu-gb", "finite number > 0"),
    ("plan_memory", [MISSING, "--gpu-gb", "1e9"], "--gpu-gb", "<= 4096"),
    ("make_shards", ["{tmp}", "{tmp}/out", "--samples-per-shard", "0"], "--samples-per-shard", "from 1 to 1000000"),
    ("make_shards", ["{tmp}", "{tmp}/out", "--timeout", "nan"], "--timeout", "finite number > 0"),
    ("make_shards", ["{tmp}", "{tmp}/out", "--max-side", "4"], "--max-side", "from 16 to 65535"),
    ("make_shards", ["{tmp}", "{tmp}/out", "--prefix", "a/b"], "--prefix", "without '/'"),
    ("make_shards", ["{tmp}", "{tmp}/a_file"], "out_dir", "which is a file"),
    ("precompute_latents", ["--input", "x.tar", "--pipeline", "p", "--output", "{tmp}/o", "--resolution", "30"],
     "--resolution", "a multiple of 8"),
    ("precompute_latents", ["--input", "x.tar", "--pipeline", "p", "--output", "{tmp}/o", "--max-aspect-ratio", "inf"],
     "--max-aspect-ratio", "finite number from 1 to 16"),
    ("precompute_latents", ["--input", "x.tar", "--pipeline", "p", "--output", "{tmp}/o", "--workers", "-1"],
     "--workers", "from 0 to 256"),
    ("generate_examples", ["--prompts", "{tmp}/a_file", "--out", "{tmp}/o", "--pipeline", "p", "--steps", "0"],
     "--steps", "from 1 to 1000"),
    ("generate_examples", ["--prompts", "{tmp}/a_file", "--out", "{tmp}/o", "--pipeline", "p", "--guidance", "nan"],
     "--guidance", "finite number from 0 to 100"),
    ("generate_examples", ["--prompts", "{tmp}/none.txt", "--out", "{tmp}/o", "--pipeline", "p"],
     "--prompts", "an existing file"),
    ("report", ["{tmp}", "--smooth", "0"], "--smooth", "from 1 to 100000"),
    ("report", ["{tmp}", "--max-grids", "-2"], "--max-grids", "from 1 to 1000"),
    ("plot_metrics", ["{tmp}", "-o", "{tmp}/plot.svg"], "-o/--out", "ending in .png"),
    ("sync_check", ["--steps", "0"], "--steps", "from 6 to 600"),
    ("make_fashion_mnist_shards", ["{tmp}/o", "--size", "100000"], "--size", "from 8 to 1024"),
    ("make_tiny_pipeline", ["{tmp}/o", "--seed", "-1"], "--seed", "an integer from 0"),
    ("download_diffusers", ["-o", "{tmp}/a_file", "-m", "x/y"], "-o/--out", "which is a file"),
]


@pytest.mark.faults
@pytest.mark.parametrize("script, args, name, allowed", CASES,
                         ids=[f"{c[0]}:{' '.join(a for a in c[1] if a != MISSING)}" for c in CASES])
def test_a_bad_argument_is_one_line_naming_it(tmp_path, monkeypatch, capsys, script, args, name, allowed):
    (tmp_path / "a_file").write_text("a prompt\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    path = str(ROOT / "scripts" / f"{script}.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [path, *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (some scripts put the checkout first)
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(path, run_name="__main__")
    err = capsys.readouterr().err
    assert exited.value.code == 2, (exited.value.code, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{script}.py: error: argument {name}: "), err
    assert allowed in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
