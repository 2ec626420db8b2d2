"""The ``bubblesnap`` command: ``daemon`` runs one (daemon_command.py), ``status`` asks
one what it holds and ``health`` whether it serves (status_command.py), ``inspect``
lists (and verifies) a durable tier (inspect_command.py), ``plan`` prints a bubble plan
(plan_command.py)."""

import argparse
import sys

from bubblesnap.cli import daemon_command, plan_command, status_command
from bubblesnap.cli.status_command import format_status, in_flight_line

__all__ = ["format_status", "in_flight_line", "main", "parser"]


def _inspect_parser(sub) -> None:
    from bubblesnap.cli import inspect_command  # the durable tier's reader
    inspect_command.add_parser(sub)


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``bubblesnap`` command line: ``daemon``, ``status``, ``health``, ``inspect`` and
    ``plan``; ``only``: that subcommand alone."""
    top = argparse.ArgumentParser(
        prog="bubblesnap",
        description="Snapshots of JAX training state in pipeline bubbles, held in host memory.")
    sub = top.add_subparsers(dest="command", required=True)
    for name, add in (("daemon", daemon_command.add_parser),
                      ("status", status_command.add_status_parser),
                      ("inspect", _inspect_parser), ("plan", plan_command.add_parser),
                      ("health", status_command.add_health_parser)):
        if only in (None, name):
            add(sub)
    return top


def main(argv=None) -> int:
    """Runs the ``bubblesnap`` command (``argv``: default ``sys.argv[1:]``); its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # A starting daemon builds its own parser alone: the others' defaults import the
    # clients and the durable tier's tools (a second of start-up a daemon never uses).
    args = parser("daemon" if argv[:1] == ["daemon"] else None).parse_args(argv)
    return args.func(args)
