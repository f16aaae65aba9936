"""`kvscope help [TOPIC]`: the manual's reference topics (assets/help/*.md, read by ui.help_text) on the terminal.
Without a topic it lists them, one line each; an unknown topic is one stderr line and exit 2."""

from __future__ import annotations

import argparse
import sys

from ui.help_text import topic_text, topics


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvscope help", description="Print a reference topic of the manual, or list them.")
    ap.add_argument("topic", nargs="?", metavar="TOPIC", help="a topic name from the list `kvscope help` prints")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.topic is None:
        listed = topics()
        width = max((len(name) for name, _ in listed), default=0)
        print("kvscope help TOPIC prints one of these:")
        for name, summary in listed:
            print(f"  {name:<{width}}  {summary}")
        return 0
    try:
        text = topic_text(args.topic)
    except KeyError as e:
        print(f"kvscope help: error: {e.args[0]}", file=sys.stderr)
        return 2
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0
