"""`kvscope ARGS` run in this process, for the tests of the command line and of what it prints."""

from __future__ import annotations


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`kvscope ARGS` in this process (the model loads in well under a second): (exit code, stdout, stderr).
    argparse's exits (--help: 0, a usage error: 2) are exit codes here too."""
    from app.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return rc, out, err
