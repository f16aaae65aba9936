"""Every command the manual shows runs: README.md and the help topics (assets/help/*.md).

A command is a line of a code block, or an inline code span, that starts with `kvscope` (or `.venv/bin/kvscope`),
with one of its subcommands (`bench --long`), with `python3 app/bootstrap.py`, `.ci/run` or `python -m app.MODULE`.
Each one's `--help` is run in this process through the real entry points (app.cli.main, the module's main) and
must exit 0 and list every option the manual gives that command, so a renamed or removed option fails here;
`kvscope help TOPIC` must print the topic. One test runs `kvscope help` through the installed console script.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest

from kvscope_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "assets" / "help").glob("*.md"))]
SUBCOMMANDS = ("generate", "info", "bench", "policy-lab", "attach", "help")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
ENV = re.compile(r"^(?:[A-Z_]+=\S*\s+)+")  # CI=true bash .ci/run


def _logical_lines(block: str) -> list[str]:
    """A code block's commands: a trailing backslash or an indented next line continues a command; `# ...` ends one."""
    out: list[str] = []
    joining = False
    for raw in block.splitlines():
        line = re.split(r"(?:^|\s)#\s", raw, maxsplit=1)[0].rstrip()
        if out and (joining or (raw[:1].isspace() and line.strip())):
            out[-1] = f"{out[-1]} {line.strip()}"
        elif line.strip():
            out.append(line.strip())
        joining = line.endswith("\\")
        if joining:
            out[-1] = out[-1][:-1].rstrip()
    return out


def _command(text: str) -> tuple[str, list[str]] | None:
    """(program, words after it) for a command of ours, else None. Programs: kvscope, bootstrap, ci, and
    python -m app.MODULE as "module:app.MODULE"."""
    text = ENV.sub("", " ".join(text.split()))
    words = text.split()
    if not words:
        return None
    if words[0] in ("kvscope", ".venv/bin/kvscope"):
        return "kvscope", words[1:]
    if words[0] in SUBCOMMANDS[:-1] and OPTION.search(text):  # `bench --long [CONTEXT]`: kvscope's subcommand
        return "kvscope", words
    if words[0] in ("python3", "python") and words[1:2] == ["app/bootstrap.py"]:
        return "bootstrap", words[2:]
    if words[0] in ("python3", "python") and words[1:2] == ["-m"] and words[2].startswith("app."):
        return f"module:{words[2]}", words[3:]
    if words[0] == ".ci/run" or words[:2] == ["bash", ".ci/run"]:
        return "ci", []
    return None


def manual_commands() -> list[tuple[str, str, str, list[str]]]:
    """(file, the command as written, program, words) for every command in the manual, in order."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        candidates = [line for block in FENCE.findall(text) for line in _logical_lines(block)]
        candidates += INLINE.findall(FENCE.sub("", text))
        for c in candidates:
            cmd = _command(c)
            if cmd:
                found.append((path.relative_to(ROOT).as_posix(), " ".join(c.split()), *cmd))
    return found


COMMANDS = manual_commands()


def _help_of(capsys, cache: dict, program: str, words: list[str]) -> tuple[str, str]:
    """(the key of the --help run, its output) for a command: `kvscope SUB --help`, `kvscope --help`, or a module's."""
    if program == "kvscope":
        sub = words[0] if words and words[0] in SUBCOMMANDS else ""
        key = f"kvscope {sub}".strip()
        if key not in cache:
            rc, out, err = run_cli(capsys, *([sub] if sub else []), "--help")
            assert rc == 0 and "usage:" in out, (key, err[-500:])
            cache[key] = out
        return key, cache[key]
    module = program.split(":", 1)[1]
    if program not in cache:
        main = importlib.import_module(module).main
        buf = StringIO()
        with redirect_stdout(buf), pytest.raises(SystemExit) as done:
            main(["--help"])
        assert done.value.code in (0, None) and "usage:" in buf.getvalue(), module
        cache[program] = buf.getvalue()
    return f"python -m {module}", cache[program]


def test_the_manual_shows_commands():
    """The extraction finds what the manual is about: each kind of command, and several of each."""
    programs = {p for _, _, p, _ in COMMANDS}
    assert {"kvscope", "bootstrap", "ci"} <= programs, programs
    subs = {w[0] for _, _, p, w in COMMANDS if p == "kvscope" and w and w[0] in SUBCOMMANDS}
    assert set(SUBCOMMANDS) <= subs, subs
    assert len(COMMANDS) > 50, len(COMMANDS)


def test_every_option_the_manual_shows_is_in_its_commands_help(capsys):
    cache: dict[str, str] = {}
    missing = []
    for file, shown, program, words in COMMANDS:
        if program == "bootstrap" and words[:1] == ["launch"]:
            program, words = "kvscope", words[1:]  # launch passes its arguments to kvscope
        if program not in ("kvscope",) and not program.startswith("module:"):
            continue
        if program == "kvscope" and words[:1] == ["help"]:
            continue  # the topics: test_every_help_topic_the_manual_names_prints
        key, text = _help_of(capsys, cache, program, words)
        usage = text.split("\n\n", 1)[0]  # argparse's usage lists every option; the text below may name others
        for option in OPTION.findall(" ".join(words)):
            if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", usage):
                missing.append(f"{file}: `{shown}`: {option} is not in `{key} --help`")
    assert not missing, "\n".join(missing)
    assert {"kvscope", "kvscope generate", "kvscope bench", "kvscope policy-lab", "kvscope attach"} <= set(cache)


def test_every_help_topic_the_manual_names_prints(capsys):
    from ui.help_text import topic_text

    named = {w[1] for _, _, p, w in COMMANDS if p == "kvscope" and w[:1] == ["help"] and len(w) > 1
             and re.fullmatch(r"[a-z0-9-]+", w[1])}
    assert len(named) >= 10, named
    for topic in sorted(named):
        rc, out, err = run_cli(capsys, "help", topic)
        assert rc == 0 and out == topic_text(topic), (topic, err)


def test_help_lists_every_topic_and_each_prints_its_file(capsys):
    from ui.help_text import HELP_DIR, topics

    rc, listing, _ = run_cli(capsys, "help")
    assert rc == 0
    files = sorted(p.stem for p in HELP_DIR.glob("*.md"))
    assert [name for name, _ in topics()] == files and files
    lines = listing.splitlines()[1:]
    assert len(lines) == len(files)  # one line each
    for (name, summary), line in zip(topics(), lines):
        assert line.split(None, 1) == [name, summary], line
        assert summary and not summary.startswith("#")
        rc, out, err = run_cli(capsys, "help", name)
        assert rc == 0 and not err and out == (HELP_DIR / f"{name}.md").read_text(encoding="utf-8")


def test_readme_names_exactly_the_help_topics():
    from ui.help_text import topics

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### Help topics", 1)[1].split("\n### ", 1)[0]
    assert sorted(re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M)) == [name for name, _ in topics()]


def test_every_picture_the_manual_shows_is_in_the_checkout():
    """Each image README.md and the help topics show (markdown or <img>, a path from the checkout's root, as the
    Help window resolves it too) is a PNG in the repository."""
    texts = [ROOT / "README.md", *sorted((ROOT / "assets" / "help").glob("*.md"))]
    pictures = [(t, m) for t in texts
                for m in re.findall(r'!\[[^\]]*\]\(([^)\s]+)\)|<img src="([^"]+)"', t.read_text(encoding="utf-8"))]
    paths = [(t, a or b) for t, (a, b) in pictures]
    assert len(paths) >= 4
    for text, rel in paths:
        path = ROOT / rel
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (text.name, rel)


def test_an_unknown_topic_is_one_stderr_line_and_exit_2(capsys):
    for topic in ("no-such-topic", "../README", "KNOBS"):
        rc, out, err = run_cli(capsys, "help", topic)
        assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and "topics:" in err, (topic, err)


def test_the_set_up_commands_do_what_the_manual_says(monkeypatch):
    """`python3 app/bootstrap.py launch|test ARGS` (set-up stubbed out) start kvscope or pytest with ARGS; the
    pytest markers the manual selects on exist; `.ci/run` is the test command."""
    from app import bootstrap

    calls = []
    monkeypatch.setattr(bootstrap, "ensure_env", lambda: None)
    monkeypatch.setattr(bootstrap.subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    markers = {m.split(":")[0] for m in
               tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    shown = [(shown, words) for _, shown, p, words in COMMANDS if p == "bootstrap"]
    assert {w[0] for _, w in shown} >= {"launch", "test"}, shown
    for text, words in shown:
        args = [w.strip("\"'") for w in words[1:] if w != "..."]
        calls.clear()
        assert bootstrap.main(words[:1] + args) == 0, text
        (cmd,) = calls
        if words[0] == "launch":
            assert Path(cmd[0]).name == "kvscope" and cmd[1:] == args, (text, cmd)
        else:
            assert cmd[1:3] == ["-m", "pytest"] and cmd[3:] == args, (text, cmd)
            if "-m" in args:
                expr = " ".join(args[args.index("-m") + 1:])
                for word in re.findall(r"[a-z_]+", expr):
                    assert word in markers | {"not", "and", "or"}, (text, word)
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & 0o111 and "python3 app/bootstrap.py test" in ci.read_text()


@pytest.mark.subprocess
@pytest.mark.slow
def test_kvscope_help_through_the_console_script():
    script = Path(sys.executable).with_name("kvscope")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]
    done = subprocess.run([*cmd, "help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and "knobs" in done.stdout, done.stderr
    done = subprocess.run([*cmd, "help", "no-such-topic"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
