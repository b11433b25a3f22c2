"""The docs run as written: every runnable command block of README.md and docs/*.md, in the README's order
then the manual table's, on one fresh copy of the repository, CPU only and offline, training commands
shortened by ``SD_TRAINING_MAX_STEPS`` (``tests/docs_runner.py`` says how blocks are found, marked and run).
After them ``git status`` in the copy is clean: every output lands in a folder git ignores.

The fast tests show the runner cannot drop a block silently: the blocks it finds on each page are the
command fences a plain count finds, less the ones a mark leaves out; a mark it cannot read, or one that marks
nothing, is an error; a failing block stops it naming the page line of the failing command. And the step
cap: ``SD_TRAINING_MAX_STEPS`` shortens the run as if ``experiment.num_examples_to_see`` were N x the global
batch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sd_training.config import ConfigError
from sd_training.configure import MAX_STEPS_ENV, apply_step_cap, load
from sd_training.data.synthetic import write_shapes_shards
from sd_training.run.train_state import Plan

from docs_runner import (AND_GUARD, ROOT, DocsCommandFailed, MarkError, extract, guard_and_lists, make_copy,
                         manual_pages, run_pages, untracked_outputs)

PAGES = manual_pages()

# --- extraction ----------------------------------------------------------------------------------------

PAGE = """# A page

```bash
echo one
```

<!-- docs-test: needs gpu, slurm -->
```sh
sbatch job.sbatch
```

```yaml
model: {}
```

- a list item with an indented block:

  ```python
  print("two")
  ```

<!-- docs-test: skip an output listing -->
```console
$ not a command
```

````bash
cat <<'TXT'
```
TXT
````

```bash
echo four \\
    --flag  # docs-test: needs weights
echo five
```

```
untagged
```
"""


def test_extract_finds_every_fence_with_its_line_tag_and_mark():
    blocks = extract(PAGE, "page.md")
    assert [(b.line, b.tag, b.kind) for b in blocks] == [
        (3, "bash", "shell"), (8, "sh", "shell"), (12, "yaml", None), (18, "python", "python"),
        (23, "console", "shell"), (27, "bash", "shell"), (33, "bash", "shell"), (39, "", None)]
    assert str(blocks[1].mark) == "needs gpu, slurm" and blocks[1].mark.needs == ("gpu", "slurm")
    assert str(blocks[4].mark) == "skip (an output listing)"
    assert blocks[3].lines == ['print("two")']  # the list item's indent removed
    assert blocks[5].lines == ["cat <<'TXT'", "```", "TXT"]  # a longer fence holds a shorter one
    assert [b.runnable for b in blocks] == [True, False, False, True, False, True, True, False]
    # a line mark leaves out its command (with the continuation before it), not the block
    assert blocks[6].line_marks.keys() == {1} and blocks[6].skipped_indices() == {0, 1}
    assert blocks[6].script_lines() == ["", "", "echo five"]
    assert blocks[6].page_line(2) == 36


def test_a_line_mark_in_python_leaves_out_its_whole_statement():
    block = extract('```python\nx = 1\nf(x,\n  y)  # docs-test: needs weights\nprint(x)\n```\n', "p.md")[0]
    assert block.script_lines() == ["x = 1", "", "", "print(x)"]


@pytest.mark.parametrize("text, message", [
    ("<!-- docs-test: needs gpus -->\n```bash\nx\n```\n", "unknown need"),
    ("<!-- docs-test: needs -->\n```bash\nx\n```\n", "is not"),
    ("<!-- docs-test: skip -->\n```bash\nx\n```\n", "is not"),
    ("<!-- docs-test: needs gpu -->\n\n```bash\nx\n```\n", "right before a fence"),
    ("text\n<!-- docs-test: needs gpu -->\n", "no fence after it"),
    ("<!-- docs-test: needs gpu -->\n```yaml\na: 1\n```\n", "is not run"),
    ("<!-- docs-test: needs gpu --> and text\n```bash\nx\n```\n", "on its own line"),
    ("prose may name `<!-- docs-test: needs gpu -->`\n```bash\nx\n```\n", None),
    ("```bash\nx  # docs-test: needs gpus\n```\n", "unknown need"),
    ("```bash\nx  # docs-test needs gpu\n```\n", "a line's mark"),
    ("<!-- docs-test: needs gpu -->\n```bash\nx  # docs-test: needs slurm\n```\n", "line marks too"),
])
def test_a_mark_that_cannot_be_read_or_marks_nothing_is_an_error(text, message):
    if message is None:
        assert extract(text, "p.md")[0].runnable
        return
    with pytest.raises(MarkError, match=message):
        extract(text, "p.md")


COMMAND_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*(bash|sh|shell|console|python)\b", re.M)
BLOCK_MARK = re.compile(r"^[ \t]*<!--[ \t]*docs-test:", re.M)


@pytest.mark.parametrize("page", PAGES)
def test_every_command_fence_of_a_page_is_run_or_marked(page):
    """A plain count of the page's command fences and marks against what the runner extracts: a fence it
    missed (a parse that swallows a block) or a mark it dropped would make the two disagree."""
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = [b for b in extract(text, page) if b.kind]
    fences = [m.start() for m in COMMAND_FENCE.finditer(text)]
    assert len(blocks) == len(fences), f"{page}: {len(fences)} command fences, the runner found {len(blocks)}"
    assert [b.line for b in blocks] == [text.count("\n", 0, s) + 1 for s in fences]
    marked = [b for b in blocks if b.mark]
    assert len(marked) == len(BLOCK_MARK.findall(text))
    runnable = [b for b in blocks if b.runnable]
    assert len(runnable) + len(marked) == len(blocks), f"{page}: an empty command block"


def test_pages_run_in_the_readme_and_manual_order():
    table = (ROOT / "README.md").read_text(encoding="utf-8").split("## The manual")[1]
    in_table = re.findall(r"\]\((docs/[\w.-]+\.md)\)", table.split("\n## ")[0])
    assert PAGES[0] == "README.md" and PAGES[1:len(in_table) + 1] == in_table
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    assert sorted(PAGES[1:]) == every, "every docs/*.md page is run"
    assert not set(every) - set(in_table), "the README's manual table lists every page"


# --- running -------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_repo(tmp_path):
    """A copy-like folder whose .venv is the interpreter running the tests."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return tmp_path


def test_a_failing_shell_command_stops_the_run_naming_its_line(tiny_repo):
    (tiny_repo / "page.md").write_text(
        "```bash\necho ran > first.txt\n```\n\n<!-- docs-test: needs gpu -->\n```bash\nfalse\n```\n\n"
        "```bash\necho ok\nls \\\n  /no/such/folder \\\n  -l\necho never > never.txt\n```\n\n"
        "```bash\necho after\n```\n")
    with pytest.raises(DocsCommandFailed) as e:
        run_pages(tiny_repo, ["page.md"], log=lambda _: None)
    assert (e.value.page, e.value.line) == ("page.md", 12)  # `ls \` starts on line 12
    assert e.value.command == "ls \\\n  /no/such/folder \\\n  -l"
    assert "page.md:12: exit status 2" in str(e.value) and "/no/such/folder" in str(e.value)
    assert (tiny_repo / "first.txt").exists() and not (tiny_repo / "never.txt").exists()


def test_a_failure_left_of_and_stops_the_block_where_bash_e_would_go_on(tiny_repo):
    (tiny_repo / "page.md").write_text(
        "```bash\ntrue && echo one > one.txt  # a comment && not code\necho 'a && b' || true\n"
        "ls /no/such/folder && \\\n  echo never > never.txt\necho never > after.txt\n```\n")
    with pytest.raises(DocsCommandFailed) as e:
        run_pages(tiny_repo, ["page.md"], log=lambda _: None)
    assert (e.value.page, e.value.line) == ("page.md", 4)  # `ls ... &&` starts on line 4
    assert "exit status 2" in str(e.value)
    assert (tiny_repo / "one.txt").exists() and not (tiny_repo / "after.txt").exists()
    assert guard_and_lists(["a && b  # c", "a || b", "if a && b; then", "x <<EOF && y"]) == [
        "a && b" + AND_GUARD + "  # c", "a || b", "if a && b; then", "x <<EOF && y"]


def test_a_failing_python_block_names_its_line_and_line_marks_leave_out_a_command(tiny_repo):
    (tiny_repo / "page.md").write_text(
        "```bash\nfalse  # docs-test: needs weights\n```\n\n```python\nimport sys\n\nx = {}\nx['missing']\n```\n")
    with pytest.raises(DocsCommandFailed) as e:
        run_pages(tiny_repo, ["page.md"], log=lambda _: None)
    assert (e.value.line, e.value.command) == (9, "x['missing']") and "KeyError" in str(e.value)


def test_the_report_counts_what_ran_and_what_was_left_out(tiny_repo):
    (tiny_repo / "page.md").write_text(
        "```bash\ntest \"$SD_TRAINING_MAX_STEPS\" = 3; test -z \"$CUDA_VISIBLE_DEVICES\"\n"
        "test \"$HF_HUB_OFFLINE\" = 1; test \"$WANDB_MODE\" = offline\n"
        "python -c 'import sys; assert sys.prefix != sys.base_prefix'  # the venv's python first on PATH\n"
        "sbatch x  # docs-test: needs slurm\n```\n\n<!-- docs-test: needs gpu -->\n```bash\nfalse\n```\n\n"
        "```yaml\na: 1\n```\n")
    twice = "```bash\necho $RANDOM >> runs.txt\n```\n\n"
    (tiny_repo / "other.md").write_text(twice + twice)
    report, other = run_pages(tiny_repo, ["page.md", "other.md"], max_steps=3, log=lambda _: None)
    assert [line for line, _ in report.ran] == [1]
    assert report.skipped == [(5, "needs slurm"), (9, "needs gpu")]
    assert "page.md: 1 block(s) run" in report.summary() and "1 needs gpu; 1 needs slurm" in report.summary()
    # a block repeating one run before, word for word, is reported, not run twice
    assert [line for line, _ in other.ran] == [1] and other.skipped == [(5, "same as other.md:1")]
    assert len((tiny_repo / "runs.txt").read_text().split()) == 1
    assert "1 same as a block run before" in other.summary()


def test_a_fresh_copy_is_clean_and_its_outputs_are_seen(tmp_path):
    copy = make_copy(tmp_path / "copy")
    assert (copy / ".venv" / "bin" / "python").exists() and (copy / "train.py").is_file()
    assert untracked_outputs(copy) == []
    (copy / "runs" / "x").mkdir(parents=True)
    (copy / "runs" / "x" / "out.png").write_bytes(b"")
    (copy / "out.png").write_bytes(b"")
    assert untracked_outputs(copy) == ["?? out.png"]  # runs/ is ignored, the root is not


# --- the step cap --------------------------------------------------------------------------------------


def quickstart(**env):
    return apply_step_cap(load(["config=configs/quickstart.yaml", "system.batch_size=8",
                                "system.gradient_accumulation=2"]), env)


def test_the_step_cap_shortens_the_run_as_if_fewer_examples():
    full = quickstart()
    assert full.experiment.num_examples_to_see == 12_800 and Plan.make(full, 1).note == ""
    capped = quickstart(**{MAX_STEPS_ENV: "3"})
    assert capped.experiment.num_examples_to_see == capped.dataset.params.num_examples_to_see == 3 * 16
    plan = Plan.make(capped, 1)
    assert plan.total_steps == 3 and f"{MAX_STEPS_ENV}=3" in plan.note and "12,800" in plan.note
    # ranks of this launch count in the global batch; a run already shorter is left alone
    ranks = quickstart(**{MAX_STEPS_ENV: "3", "RANK": "0", "WORLD_SIZE": "4"})
    assert ranks.experiment.num_examples_to_see == 3 * 16 * 4 and Plan.make(ranks, 4).total_steps == 3
    assert quickstart(**{MAX_STEPS_ENV: "100000"}).experiment.num_examples_to_see == 12_800


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_the_step_cap_refuses_what_is_not_a_step_count(value):
    with pytest.raises(ConfigError, match=MAX_STEPS_ENV):
        quickstart(**{MAX_STEPS_ENV: value})


# --- the docs, run -------------------------------------------------------------------------------------

MAX_STEPS = 2


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_documented_command_runs_on_a_fresh_copy(tmp_path):
    copy = make_copy(tmp_path / "sd-training")
    reports = run_pages(copy, PAGES, max_steps=MAX_STEPS, log_dir=tmp_path / "logs")
    print("\n".join(r.summary() for r in reports))
    assert sum(len(r.ran) for r in reports) >= 1
    left = untracked_outputs(copy)
    assert not left, f"outputs git does not ignore after the documented commands: {left}"
    log = (copy / "runs" / "quickstart" / "train.log").read_text()
    assert f"{MAX_STEPS_ENV}={MAX_STEPS}: the run stops after {MAX_STEPS}" in log  # the quickstart ran, capped


# --- outputs land in ignored folders --------------------------------------------------------------------


def test_preview_data_writes_its_default_sheet_under_the_runs_folder(tmp_path):
    """scripts/preview_data.py without --out: <experiment.log_dir>/preview_<experiment.name>.png (runs/ by
    default, which git ignores), not the folder it is started from."""
    shards = write_shapes_shards(str(tmp_path / "shapes"), 8, 1, size=64, seed=0)
    config = {"experiment": {"name": "peek", "num_examples_to_see": 8}, "model": {"pretrained": "not-loaded"},
              "system": {"batch_size": 2},
              "dataset": {"params": {"path": shards, "resolution": 64, "shuffle_buffer": 4}}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "preview_data.py"), "config=run.yaml", "--n", "2",
                          "--tile", "64"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "runs" / "preview_peek.png").is_file() and (tmp_path / "runs" / "preview_peek.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "runs", "shapes"]
