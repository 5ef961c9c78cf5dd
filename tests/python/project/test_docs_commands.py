"""Every command the README and docs/*.md show runs as written (docs/measurements/** is a record, not checked).

Code blocks fenced as ```python must parse (ast.parse). Shell blocks (```bash, ```sh, ```shell) are read
line by line:
- `python -m hipferry SUB ...`: SUB and every --flag must be in `python -m hipferry SUB --help`; bench suites
  must be in `bench --list`;
- `python examples/X.py ...` / `python scripts/X.py ...`: the file exists and every --flag is in its --help;
- `scripts/dev.sh SUB`: SUB is in dev.sh's case list; other `scripts/...` files must exist.
Commands that only print (`--help`, `--list`) are run for real. Other commands (pip, cmake, ...) are not
checked. A block that is a fragment may be preceded by the line `<!-- not run -->`: it is then skipped.
Keep such blocks few."""
import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NOT_RUN = "<!-- not run -->"
SHELL_LANGS = {"bash", "sh", "shell"}
HELP_TIMEOUT_S = 120
_FENCE = re.compile(r"^```([A-Za-z]*)\s*$")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def doc_files():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def code_blocks(text):
    """[(lang, code, first line number, marked not run)] of the fenced blocks of a markdown text."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = [ln.strip() for ln in lines[max(0, start - 2):start] if ln.strip()]
        blocks.append((m.group(1).lower(), "\n".join(body), start + 1, bool(before) and before[-1] == NOT_RUN))
        i += 1
    return blocks


def shell_commands(code):
    """Each command of a shell block as a list of words, comments and leading VAR=value dropped."""
    commands = []
    for line in code.replace("\\\n", " ").split("\n"):
        for part in re.split(r"&&|;|\|\|", line):
            words = shlex.split(part, comments=True)
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            if words:
                commands.append(words)
    return commands


@functools.lru_cache(maxsize=None)
def _run(args):
    """(exit status, output) of `python ARGS`, once per session (each start imports torch: seconds)."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=HELP_TIMEOUT_S, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return proc.returncode, proc.stdout + proc.stderr


@functools.lru_cache(maxsize=None)
def help_of(*args):
    """(exit status, output) of `python ARGS --help`, once per session."""
    return _run((*args, "--help"))


@functools.lru_cache(maxsize=None)
def bench_suites():
    rc, out = _run(("-m", "hipferry", "bench", "--list"))
    assert rc == 0, out
    return set(out.split())


@functools.lru_cache(maxsize=None)
def hipferry_subcommands():
    rc, out = help_of("-m", "hipferry")
    assert rc == 0, out
    m = re.search(r"\{([\w,-]+)\}", out)
    assert m, out
    return set(m.group(1).split(","))


@functools.lru_cache(maxsize=None)
def dev_sh_subcommands():
    text = (ROOT / "scripts" / "dev.sh").read_text()
    case = text[text.index('case "${1:-}" in'):]
    return set(re.findall(r"^\s+([a-z][\w-]*)\)", case, re.M))


def _flag_problems(words, help_args, what):
    rc, out = help_of(*help_args)
    if rc != 0:
        return [f"{what}: --help exited {rc}: {out[-300:]}"]
    known = set(_FLAG.findall(out)) | {"--help"}
    return [f"{what}: unknown flag {w.split('=')[0]}" for w in words
            if w.startswith("--") and w.split("=")[0] not in known]


def _check_hipferry(words, what):
    if not words or words[0].startswith("-"):
        return _flag_problems(words, ("-m", "hipferry"), what)
    sub, rest = words[0], words[1:]
    if sub not in hipferry_subcommands():
        return [f"{what}: no subcommand {sub!r} (known: {sorted(hipferry_subcommands())})"]
    problems = _flag_problems(rest, ("-m", "hipferry", sub), what)
    if sub == "bench":
        takes_value = {"--out", "--max-bytes", "--repeats", "--device", "--disk-dir"}
        positional = [w for i, w in enumerate(rest)
                      if not w.startswith("-") and not (i > 0 and rest[i - 1] in takes_value)]
        problems += [f"{what}: no bench suite {s!r}" for s in positional if s not in bench_suites()]
    return problems


def check_command(words, where):
    """Problems with one shell command (an empty list: fine or not ours to check)."""
    what = f"{where}: {' '.join(words)}"
    if words[0] in ("python", "python3"):
        args = words[1:]
        if args[:2] == ["-m", "hipferry"]:
            problems = _check_hipferry(args[2:], what)
        elif args and args[0].endswith(".py") and args[0].startswith(("examples/", "scripts/")):
            if not (ROOT / args[0]).is_file():
                return [f"{what}: no file {args[0]}"]
            problems = _flag_problems(args[1:], (args[0],), what)
        else:
            return []
        if not problems and any(w in ("--help", "-h", "--list") for w in args):
            rc, out = _run(tuple(args))  # prints only: run it as written
            if rc != 0:
                problems.append(f"{what}: exited {rc}: {out[-300:]}")
        return problems
    if words[0].startswith("scripts/"):
        if not (ROOT / words[0]).is_file():
            return [f"{what}: no file {words[0]}"]
        if words[0] == "scripts/dev.sh" and (len(words) < 2 or words[1] not in dev_sh_subcommands()):
            return [f"{what}: dev.sh has no subcommand {words[1:2]} (known: {sorted(dev_sh_subcommands())})"]
    return []


def check_doc(text, name):
    """Every problem of the code blocks of one markdown text."""
    problems = []
    for lang, code, line, not_run in code_blocks(text):
        where = f"{name}:{line}"
        if not_run:
            continue
        if lang == "python":
            try:
                ast.parse(code)
            except SyntaxError as e:
                problems.append(f"{where}: python block does not parse: {e}")
        elif lang in SHELL_LANGS:
            try:
                commands = shell_commands(code)
            except ValueError as e:
                problems.append(f"{where}: shell block does not split: {e}")
                continue
            for words in commands:
                problems += check_command(words, where)
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_of_the_docs_run_as_written(path):
    assert check_doc(path.read_text(), str(path.relative_to(ROOT))) == []


def broken_links(text, folder):
    """Relative links of a markdown text whose file does not exist (web links and anchors are not checked)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"^(\w+:|#)", t) and not (folder / t.split("#")[0]).exists()]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_links_of_the_docs_point_to_files(path):
    assert broken_links(path.read_text(), path.parent) == []


@pytest.mark.older_torch  # (this module's representative there: the docs cross no ABI; their commands take 24 s)
def test_a_broken_link_is_found():
    assert broken_links("[a](docs/pool.md) [b](docs/gone.md#x) [c](https://x.org) [d](#here)", ROOT) == \
        ["docs/gone.md#x"]


def test_the_docs_have_commands_and_few_unrun_blocks():
    blocks = [b for p in doc_files() for b in code_blocks(p.read_text())]
    shell = [b for b in blocks if b[0] in SHELL_LANGS]
    assert len(shell) >= 5 and sum(b[0] == "python" for b in blocks) >= 10
    assert sum(b[3] for b in blocks) <= 3, "keep blocks marked not run few"


def test_the_readme_stays_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.split("\n")) <= 200
    assert "scripts/dev.sh example" in text and "scripts/dev.sh test" in text


BAD_DOC = """\
```python
x = (1,
```

```sh
python -m hipferry bench --no-such-flag
python -m hipferry bench pool no_such_suite
python -m hipferry frobnicate
python examples/no_such_example.py --help
python examples/finetune.py --no-such-option 3
scripts/dev.sh no-such-step
```

<!-- not run -->
```python
opt.step(   # a fragment, marked
```

```bash
python -m hipferry doctor --help
pip install --no-such-pip-flag .
```
"""


def test_a_bad_doc_fails_on_each_bad_command():
    problems = check_doc(BAD_DOC, "bad.md")
    expected = ["bad.md:1: python block does not parse", "unknown flag --no-such-flag",
                "no bench suite 'no_such_suite'", "no subcommand 'frobnicate'", "no file examples/no_such_example.py",
                "unknown flag --no-such-option", "dev.sh has no subcommand ['no-such-step']"]
    for e in expected:
        assert sum(e in p for p in problems) == 1, (e, problems)
    assert len(problems) == len(expected), problems  # the marked fragment, doctor --help and pip are fine
