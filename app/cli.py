"""The ``chatgate`` command line.

Each area registers its own subcommands (``register(subparsers)`` in
``app/cli_*.py``), so this file only assembles them. Modules are imported lazily
inside the command handlers, so ``chatgate generate`` never imports the gateway.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands; each exposes ``register(subparsers)``.
_COMMAND_MODULES = ("app.cli_engine", "app.cli_tenancy", "app.cli_serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatgate", description="Multi-tenant LLM chat serving.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that area is not part of this checkout yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
