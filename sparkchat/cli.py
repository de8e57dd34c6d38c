"""The `sparkchat` command: dispatches to a subcommand, each of which owns its parser.

It sits above the wings, so it may start the server (serve/) and the probe or the export (pipeline/) alike.
Nothing heavy is imported until a subcommand runs, and each subcommand builds its parser before importing
torch, so every `--help` answers at once.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

# name -> (module whose main(argv) runs it, one line for `sparkchat --help`)
COMMANDS = {
    "chat": ("sparkchat.chat", "talk to a model directory in the terminal"),
    "serve": ("serve.__main__", "OpenAI-compatible API and a Gradio chat page over a model directory"),
    "probe": ("pipeline.probe", "which precision backends run on this machine, and what each one buys"),
    "join": ("pipeline.join", "on machine N of a multi-machine job: run its part of every training stage"),
    "link-check": ("pipeline.linkcheck", "check and time the link between the ranks of a multi-machine job"),
    "export": ("pipeline.export", "a model directory as a Hugging Face transformers directory, with a model card"),
}


def version() -> str:
    """The installed package's version; in a source tree that was never installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        return installed("sparkchat")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return m.group(1) if m else "unknown"


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {name:<{width}}{line}" for name, (_, line) in COMMANDS.items())
    ap = argparse.ArgumentParser(prog="sparkchat", usage="%(prog)s [-h] [--version] COMMAND [FLAGS ...]",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Chat with the model the pipeline trained, serve it, probe "
                                 "the precision backends, export it to Hugging Face transformers, or train "
                                 "across machines.\n\ncommands:\n" + listing,
                                 epilog="`sparkchat COMMAND --help` lists a command's flags.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    ap.add_argument("command", choices=COMMANDS, metavar="COMMAND", help="one of: %(choices)s")
    ap.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the command's own flags
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    if not argv:  # argparse would also name the hidden remainder as missing
        ap.error(f"a command is needed: {', '.join(COMMANDS)}")
    args = ap.parse_args(argv)
    module, _ = COMMANDS[args.command]
    importlib.import_module(module).main(args.args)


if __name__ == "__main__":
    main()
