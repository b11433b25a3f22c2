"""Run the commands of README.md and docs/*.md as a new user would: on a fresh copy of the repository, in
order, CPU only and offline. ``tests/test_docs_run.py`` runs it; by hand (from the repository root):

    .venv/bin/python tests/docs_runner.py                   # every page, a fresh copy in a temporary folder
    .venv/bin/python tests/docs_runner.py README.md --keep  # one page; the copy is kept to look at
    .venv/bin/python tests/docs_runner.py --list            # the blocks, marks and what would run

What runs: fenced blocks tagged ``bash``, ``sh``, ``shell`` or ``console`` (a ``bash -euo pipefail`` script
in the copy's root) and ``python`` (``.venv/bin/python``); ``yaml``, ``json``, ``text`` and untagged fences
are not commands. A block that cannot run on a CPU machine without network is marked on the line right
before its opening fence::

    <!-- docs-test: needs gpu -->            (or weights, slurm, token, network, apt; several: "needs gpu, slurm"
                                             or "needs gpu, needs slurm")
    <!-- docs-test: skip REASON -->          (not a command: an output listing, a config excerpt)

and one line of a block (with its backslash continuations; in Python the statement it is in) by a
``# docs-test: needs ...`` or ``# docs-test: skip ...`` comment on it. A mark that is not one of these, or
that marks nothing, is an error, never ignored.

A block that repeats one already run word for word (docs/quickstarts.md repeats the README's quickstart) is
reported as the same, not run twice.

The environment is a user's with the virtual environment activated (``.venv/bin`` first on ``PATH``, so
the docs' ``python`` is the venv's), plus: ``PYTHONPATH`` the copy (its own code, whichever checkout
``.venv``'s editable install points at), no GPU (``CUDA_VISIBLE_DEVICES=``), offline (``HF_HUB_OFFLINE=1``,
``WANDB_MODE=offline``, an empty ``HF_HOME`` outside the copy) and ``SD_TRAINING_MAX_STEPS`` (the one
shortening: ``sd_training.configure.apply_step_cap``). Each block has a time bound. The first failure
stops the run, naming the page, the line of the failing command and the command, with its output's tail.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_TAGS = {"bash", "sh", "shell", "console"}
PYTHON_TAGS = {"python"}
NEEDS = ("gpu", "weights", "slurm", "token", "network", "apt")
BLOCK_TIMEOUT_S = 900  # one block (several trainings on a busy CI machine fit; a hang does not)
TAIL_LINES = 40

FENCE_RE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
BLOCK_MARK_RE = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
LINE_MARK_RE = re.compile(r"#\s*docs-test:(?P<body>.*)$")
HTML_MARK_RE = re.compile(r"^\s*<!--.*docs-test")  # outside blocks: an HTML comment on its own line (not prose)
HASH_MARK_RE = re.compile(r"#\s*docs-test\b")  # inside command blocks: a comment


class MarkError(ValueError):
    """A ``docs-test`` mark the runner cannot read, or one that marks nothing."""


@dataclass
class Mark:
    needs: tuple[str, ...] = ()
    skip: str = ""  # the reason, for "skip REASON"

    def __str__(self) -> str:
        return f"needs {', '.join(self.needs)}" if self.needs else f"skip ({self.skip})"


def parse_mark(body: str, where: str) -> Mark:
    """``needs gpu, slurm`` or ``skip REASON`` (the text after ``docs-test:``)."""
    body = body.strip()
    if body.startswith("needs "):
        # "needs gpu, slurm" or "needs gpu, needs slurm"
        needs = tuple(re.sub(r"^needs\s+", "", n.strip()) for n in body[len("needs "):].split(","))
        unknown = [n for n in needs if n not in NEEDS]
        if unknown or not needs:
            raise MarkError(f"{where}: 'docs-test: {body}': unknown need {unknown} (one or more of {', '.join(NEEDS)})")
        return Mark(needs=needs)
    if body.startswith("skip ") and body[5:].strip():
        return Mark(skip=body[5:].strip())
    raise MarkError(f"{where}: 'docs-test: {body}' is not 'needs {'|'.join(NEEDS)}[, ...]' or 'skip REASON'")


@dataclass
class Block:
    page: str
    line: int  # the opening fence's line (1-based)
    tag: str
    lines: list[str]  # the block's lines; line i is page line self.line + 1 + i
    mark: Mark | None = None  # the whole block's mark
    line_marks: dict[int, Mark] = field(default_factory=dict)  # index in lines -> mark

    @property
    def kind(self) -> str | None:
        return "shell" if self.tag in SHELL_TAGS else "python" if self.tag in PYTHON_TAGS else None

    @property
    def runnable(self) -> bool:
        return self.kind is not None and self.mark is None and any(self.script_lines())

    def page_line(self, index: int) -> int:
        return self.line + 1 + index

    def skipped_indices(self) -> set[int]:
        """Lines left out by their marks: a shell line with its continuations, a Python statement whole."""
        out: set[int] = set()
        if self.kind == "python":
            try:
                tree = ast.parse("\n".join(self.lines))
            except SyntaxError:
                tree = None
            spans = [(n.lineno - 1, n.end_lineno - 1) for n in tree.body] if tree else []
            for i in self.line_marks:
                lo, hi = next(((a, b) for a, b in spans if a <= i <= b), (i, i))
                out.update(range(lo, hi + 1))
            return out
        for i in self.line_marks:
            start = i
            while start > 0 and self.lines[start - 1].rstrip().endswith("\\"):
                start -= 1
            end = i
            while end < len(self.lines) - 1 and self.lines[end].rstrip().endswith("\\"):
                end += 1
            out.update(range(start, end + 1))
        return out

    def script_lines(self) -> list[str]:
        """The lines that run, with the skipped ones blank (line numbers stay the page's)."""
        skipped = self.skipped_indices()
        return ["" if i in skipped else line for i, line in enumerate(self.lines)]

    def command_at(self, index: int) -> str:
        """The command that starts or continues on line ``index`` (with its continuation lines)."""
        start = index
        while start > 0 and self.lines[start - 1].rstrip().endswith("\\"):
            start -= 1
        end = index
        while end < len(self.lines) - 1 and self.lines[end].rstrip().endswith("\\"):
            end += 1
        return "\n".join(self.lines[start:end + 1])


def extract(text: str, page: str) -> list[Block]:
    """Every fenced block of a page with its marks; raises ``MarkError`` for a mark it cannot place."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, Mark] | None = None  # a block mark waiting for its fence on the next line
    i = 0
    while i < len(lines):
        line = lines[i]
        where = f"{page}:{i + 1}"
        if pending is not None and pending[0] != i - 1:
            raise MarkError(f"{page}:{pending[0] + 1}: a docs-test mark must be on the line right before a fence")
        m = BLOCK_MARK_RE.match(line)
        if m:
            pending = (i, parse_mark(m.group("body"), where))
            i += 1
            continue
        if HTML_MARK_RE.search(line):
            raise MarkError(f"{where}: a docs-test mark outside a block is '<!-- docs-test: ... -->' on its own line")
        f = FENCE_RE.match(line)
        if not f:
            i += 1
            continue
        fence, indent = f.group("fence"), len(f.group("indent"))
        body, j = [], i + 1
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        block = Block(page, i + 1, f.group("info").lower(), body, pending[1] if pending else None)
        pending = None
        for k, text_line in enumerate(body):
            lm = LINE_MARK_RE.search(text_line)
            if lm and block.kind:
                block.line_marks[k] = parse_mark(lm.group("body"), f"{page}:{block.page_line(k)}")
            elif HASH_MARK_RE.search(text_line) and block.kind:
                raise MarkError(f"{page}:{block.page_line(k)}: a line's mark is '# docs-test: needs ...' or "
                                "'# docs-test: skip ...'")
        if block.mark is not None and block.line_marks:
            raise MarkError(f"{page}:{block.line}: the block is marked as a whole and has line marks too")
        if block.mark is not None and not block.kind:
            raise MarkError(f"{page}:{block.line}: a '{block.tag or 'untagged'}' block is not run: it needs no mark")
        blocks.append(block)
        i = j + 1
    if pending is not None:
        raise MarkError(f"{page}:{pending[0] + 1}: a docs-test mark with no fence after it")
    return blocks


def manual_pages(root: Path = ROOT) -> list[str]:
    """README.md, then docs/*.md in the order of the README's manual table (pages not in it after, sorted)."""
    readme = (root / "README.md").read_text(encoding="utf-8")
    table = readme.split("## The manual", 1)[1].split("\n## ", 1)[0] if "## The manual" in readme else ""
    listed = list(dict.fromkeys(re.findall(r"\]\((docs/[\w.-]+\.md)\)", table)))
    every = sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))
    return ["README.md", *listed, *(p for p in every if p not in listed)]


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------


class DocsCommandFailed(AssertionError):
    def __init__(self, page: str, line: int, command: str, why: str, tail: str):
        self.page, self.line, self.command = page, line, command
        super().__init__(f"{page}:{line}: {why}\n  command: {command}\n"
                         f"--- output (last {TAIL_LINES} lines) ---\n{tail}")


@dataclass
class PageReport:
    page: str
    ran: list[tuple[int, float]] = field(default_factory=list)  # (line, seconds)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line, why): blocks and lines

    def summary(self) -> str:
        why: dict[str, int] = {}
        for _, reason in self.skipped:
            reason = "same as a block run before" if reason.startswith("same as ") else reason
            why[reason] = why.get(reason, 0) + 1
        left = "; ".join(f"{n} {reason}" for reason, n in sorted(why.items()))
        seconds = sum(s for _, s in self.ran)
        return (f"{self.page}: {len(self.ran)} block(s) run in {seconds:.0f}s"
                + (f", left out: {left}" if left else ""))


def make_copy(dest: Path, source: Path = ROOT) -> Path:
    """A fresh copy of ``source``'s working tree (tracked files as they are now, and untracked ones git does
    not ignore) as a new one-commit repository in ``dest``, with ``source``'s ``.venv`` linked in."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                           check=True, capture_output=True).stdout.decode().split("\0")
    dest.mkdir(parents=True, exist_ok=True)
    for name in filter(None, files):
        src = source / name
        if not os.path.lexists(src):
            continue  # deleted in the working tree
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / name, follow_symlinks=False)
    git = ["git", "-c", "user.name=docs-test", "-c", "user.email=docs-test@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "docs test copy"], cwd=dest, check=True)
    (dest / ".venv").symlink_to(venv_of(source), target_is_directory=True)
    return dest


def venv_of(source: Path) -> Path:
    """``source``'s ``.venv``, else the virtual environment running this (a git worktree without its own)."""
    if (source / ".venv" / "bin" / "python").exists():
        return (source / ".venv").resolve()
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix).resolve()
    raise FileNotFoundError(f"no .venv in {source} and not run from a virtual environment: run bash scripts/setup.sh")


def docs_env(copy: Path, max_steps: int, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SD_TRAINING_"))}
    env.pop("VIRTUAL_ENV", None)
    env.update(
        PATH=f"{copy / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(copy / ".venv"),
        PYTHONPATH=str(copy), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="offline", HF_HOME=str(home / "hf"), MPLCONFIGDIR=str(home / "mpl"),
        SD_TRAINING_MAX_STEPS=str(max_steps), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    return env


FAIL_TAG = "__docs_test_failed_line__"
# The ERR trap names the failing command's line; the header's lines come before the block's first line.
SHELL_HEADER = [f"trap 'echo {FAIL_TAG}=$LINENO >&2' ERR"]
# bash -e and the ERR trap ignore a failure left of `&&` ("setup.sh && train.py": setup fails, the block goes
# on). A plain `A && B` command line gets this after it, so a failure anywhere in the list stops the block.
AND_GUARD = f' || {{ __rc=$?; echo "{FAIL_TAG}=$LINENO" >&2; exit $__rc; }}'
COMPOUND = ("if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac", "function",
            "{", "}", "(", "!", "[[")


def shell_words(text: str) -> tuple[list[str], int]:
    """The operators ``&&``, ``||`` and ``<<`` outside quotes in ``text``, and where its comment starts
    (``len(text)`` if none), reading quotes and backslash escapes as bash does."""
    ops, quote, i = [], None, 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            return ops, i
        elif text[i:i + 2] in ("&&", "||", "<<"):
            ops.append(text[i:i + 2])
            i += 1
        i += 1
    return ops, len(text)


def guard_and_lists(lines: list[str]) -> list[str]:
    """``lines`` with ``AND_GUARD`` after each simple ``A && B [&& C]`` command (backslash continuations
    included), same line count. Left alone: lists with ``||`` (their author handles failure), heredocs, compound
    commands, pipelines and background jobs split over lines."""
    out, start = list(lines), 0
    for i, line in enumerate(lines):
        if line.rstrip().endswith("\\"):
            continue
        command = "\n".join(lines[start:i + 1])
        start = i + 1
        ops, _ = shell_words(command.replace("\\\n", " "))
        _, comment = shell_words(line)
        code = line[:comment].rstrip()
        first = command.split(None, 1)[0] if command.strip() else ""
        if (set(ops) == {"&&"} and first not in COMPOUND
                and not code.endswith(("&", "|", ";", "{", "(")) and code.strip()):
            out[i] = code + AND_GUARD + (("  " + line[comment:]) if comment < len(line) else "")
    return out


def run_block(block: Block, copy: Path, env: dict[str, str], timeout: float, scratch: Path,
              log_dir: Path | None = None) -> float:
    """Run one block in ``copy``; raises ``DocsCommandFailed`` naming the page line of the failing command.
    With ``log_dir``, its whole output is kept there (``<page>_<line>.log``)."""
    script_lines = block.script_lines()
    if block.kind == "shell":
        script = scratch / "block.sh"
        script.write_text("\n".join(SHELL_HEADER + guard_and_lists(script_lines)) + "\n")
        cmd = ["bash", "-euo", "pipefail", str(script)]
    else:
        script = scratch / "block.py"
        script.write_text("\n".join(script_lines) + "\n")
        cmd = [str(copy / ".venv" / "bin" / "python"), str(script)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout, text=True, errors="replace")
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        raise DocsCommandFailed(block.page, block.line, "\n".join(block.lines), f"the block ran past {timeout:.0f}s",
                                tail(out)) from None
    seconds = time.monotonic() - start
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{block.page.replace('/', '_')}_{block.line}.log").write_text(proc.stdout)
    if proc.returncode == 0:
        return seconds
    index = failing_index(block, proc.stdout, script.name)
    command = block.command_at(index) if index is not None else "\n".join(block.lines)
    line = block.page_line(index) if index is not None else block.line
    raise DocsCommandFailed(block.page, line, command, f"exit status {proc.returncode}",
                            tail(proc.stdout.replace(FAIL_TAG, "failed at script line")))


def failing_index(block: Block, output: str, script_name: str) -> int | None:
    """Index in ``block.lines`` of the failing command: the shell's ERR trap line, Python's last frame in the
    block's script."""
    if block.kind == "shell":
        hits = re.findall(rf"{FAIL_TAG}=(\d+)", output)
        index = int(hits[-1]) - 1 - len(SHELL_HEADER) if hits else None
    else:
        hits = re.findall(rf'File "[^"]*{re.escape(script_name)}", line (\d+)', output)
        index = int(hits[-1]) - 1 if hits else None
    if index is None or not 0 <= index < len(block.lines):
        return None
    while block.kind == "shell" and index > 0 and block.lines[index - 1].rstrip().endswith("\\"):
        index -= 1  # bash names a line inside a command continued with backslashes: its first line is the page's
    return index


def tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def run_pages(copy: Path, pages: list[str], *, max_steps: int = 2, timeout: float = BLOCK_TIMEOUT_S,
              log=print, log_dir: Path | None = None) -> list[PageReport]:
    """Run every runnable block of ``pages`` (paths relative to ``copy``) in order in ``copy``. Stops at the first
    failure (``DocsCommandFailed``); returns one report per page. ``log_dir``: every block's output kept there."""
    reports = []
    ran: dict[tuple[str, str], str] = {}  # (kind, script) -> "page:line" where that same block ran
    with tempfile.TemporaryDirectory(prefix="docs-test-") as tmp:
        scratch = Path(tmp)
        env = docs_env(copy, max_steps, scratch)
        for page in pages:
            report = PageReport(page)
            reports.append(report)
            for block in extract((copy / page).read_text(encoding="utf-8"), page):
                if block.kind is None:
                    continue
                if block.mark is not None:
                    report.skipped.append((block.line, str(block.mark)))
                    continue
                for index, mark in sorted(block.line_marks.items()):
                    report.skipped.append((block.page_line(index), str(mark)))
                if not block.runnable:
                    continue
                same = ran.get((block.kind, "\n".join(block.script_lines())))
                if same:  # a page repeating another's block word for word (docs/quickstarts.md and the README)
                    report.skipped.append((block.line, f"same as {same}"))
                    continue
                ran[(block.kind, "\n".join(block.script_lines()))] = f"{page}:{block.line}"
                count = sum(bool(x.strip()) for x in block.script_lines())
                log(f"{page}:{block.line}: {block.tag} block, {count} line(s)")
                report.ran.append((block.line, run_block(block, copy, env, timeout, scratch, log_dir)))
            log(report.summary())
    return reports


def untracked_outputs(copy: Path) -> list[str]:
    """What the commands left that git neither tracks as it was nor ignores (``git status --porcelain``)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=copy, check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


def list_blocks(pages: list[str]) -> None:
    for page in pages:
        for b in extract((ROOT / page).read_text(encoding="utf-8"), page):
            if b.kind:
                state = f"left out: {b.mark}" if b.mark else "runs" if b.runnable else "empty"
                marks = "".join(f"; line {b.page_line(i)} {m}" for i, m in sorted(b.line_marks.items()))
                print(f"{page}:{b.line}: {b.tag}: {state}{marks}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the docs' commands on a fresh copy of the repository.")
    ap.add_argument("pages", nargs="*", help="pages relative to the repository root (default: all, in order)")
    ap.add_argument("--max-steps", type=int, default=2, help="SD_TRAINING_MAX_STEPS for the commands (default 2)")
    ap.add_argument("--timeout", type=float, default=BLOCK_TIMEOUT_S, help="seconds per block")
    ap.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    ap.add_argument("--logs", type=Path, help="keep every block's output in this folder (<page>_<line>.log)")
    ap.add_argument("--list", action="store_true", help="list the blocks and their marks; run nothing")
    args = ap.parse_args(argv)
    pages = args.pages or manual_pages()
    if args.list:
        try:
            list_blocks(pages)
        except MarkError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="docs-copy-"))
    copy = make_copy(tmp / "sd-training")
    print(f"copy: {copy}")
    try:
        run_pages(copy, pages, max_steps=args.max_steps, timeout=args.timeout, log_dir=args.logs)
        left = untracked_outputs(copy)
        if left:
            print("not ignored by git after the commands:\n" + "\n".join(left), file=sys.stderr)
            return 1
        print("every runnable block ran; git status is clean")
        return 0
    except (DocsCommandFailed, MarkError) as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
