"""``python -m bubblesnap.run [options] train.py [args]``: run a program unchanged, with
bubblesnap's CheckpointManager behind ``orbax.checkpoint.CheckpointManager`` (and its v1
Checkpointer and emergency manager behind Orbax's).

For training code that builds Orbax's manager itself (inside a framework): the
memory tier with no change to the code. The program runs in this process (as
``python train.py`` would: ``sys.argv``, ``__main__``); processes it starts
inherit the switch (``BUBBLESNAP_ORBAX=1`` and the bootstrap folder on
``PYTHONPATH``), so they are patched too. bubblesnap/run/orbax_patch.py says what
is patched.
"""

import argparse
import os
import runpy
import sys
import textwrap

from bubblesnap.run import orbax_patch
from bubblesnap.shared.launch_env import MEMORY_INTERVAL_ENV


class _Formatter(argparse.HelpFormatter):
    """argparse's, except that an option's name (``--durable-dir``) is never split at a
    line's end: a reader searches the help for it."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bubblesnap.run", formatter_class=_Formatter,
        description="Run a Python program with bubblesnap's CheckpointManager behind "
                    "orbax.checkpoint.CheckpointManager (every name Orbax's manager is "
                    "reached by, in the program and in the processes it starts), its v1 "
                    "Checkpointer behind Orbax v1's training.Checkpointer and its emergency "
                    "manager behind Orbax's (the local tier: the daemons' memory). The steps "
                    "its policy keeps are written by the daemon when the checkpoint "
                    "directory lies inside the daemon's --durable-dir (else by Orbax, as "
                    "plain Orbax); restores come from the daemons' memory when they hold "
                    "the step.",
        epilog="Launchers that start the processes themselves: set BUBBLESNAP_ORBAX=1 and "
               "put the folder `python -m bubblesnap.run --pythonpath` prints on PYTHONPATH "
               f"(and ${MEMORY_INTERVAL_ENV}=N for --memory-interval-steps).")
    parser.add_argument("--daemon", default=None,
                        help="the local daemon's address (default: $BUBBLESNAP_DAEMON, else "
                             "the daemon's default Unix socket)")
    parser.add_argument("--memory-interval-steps", type=_steps, default=None, metavar="N",
                        help="also snapshot every N-th step into the daemons' memory only, "
                             "between the steps the program's policy saves (listed and "
                             "restored like them, never written to disk; default "
                             f"${MEMORY_INTERVAL_ENV}, else 0: off)")
    parser.add_argument("--pythonpath", action="store_true",
                        help="print the bootstrap folder for PYTHONPATH and exit")
    parser.add_argument("-m", dest="module", default=None,
                        help="run a module (as python -m) instead of a file")
    parser.add_argument("program", nargs="?", help="the program file to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of steps (0: off)")
    return value


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this command's arguments, the program's): the program's begin after the program
    file or ``-m MODULE``, whatever they look like (as for ``python`` itself)."""
    taking_value = {"--daemon", "--memory-interval-steps", "-m"}
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in taking_value:
            index += 2
            if arg == "-m":
                return argv[:index], argv[index:]
            continue
        if arg.startswith(("--daemon=", "--memory-interval-steps=")) or (
                arg.startswith("-") and arg != "-"):
            index += 1
            continue
        return argv[:index + 1], argv[index + 1:]
    return argv, []


def main(argv=None) -> int:
    ours, theirs = _split(list(sys.argv[1:] if argv is None else argv))
    parsed = _parser().parse_args(ours)
    parsed.args = theirs
    if parsed.pythonpath:
        print(orbax_patch.bootstrap_path())
        return 0
    if parsed.module is None and parsed.program is None:
        _parser().error("give the program to run (a file, or -m module)")
    if parsed.daemon:
        os.environ["BUBBLESNAP_DAEMON"] = parsed.daemon
    if parsed.memory_interval_steps is not None:
        os.environ[MEMORY_INTERVAL_ENV] = str(parsed.memory_interval_steps)
    os.environ[orbax_patch.ENV] = "1"
    paths = [orbax_patch.bootstrap_path(), *filter(None, os.environ.get(
        "PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    orbax_patch.install()
    if parsed.module is not None:
        sys.argv = [parsed.module, *([parsed.program] if parsed.program else []), *parsed.args]
        runpy.run_module(parsed.module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [parsed.program, *parsed.args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(parsed.program)))
        runpy.run_path(parsed.program, run_name="__main__")
    return 0
