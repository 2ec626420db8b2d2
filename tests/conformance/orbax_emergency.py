"""Orbax's emergency (and multi-tier) manager test files, unchanged, against bubblesnap.

Usage::

    python -m tests.conformance.orbax_emergency --orbax-src ORBAX_CHECKOUT
        [--file emergency --file single_slice --file replicator] [--target orbax]
        [-k EXPR] [--daemon-flags "..."] [--json]

``ORBAX_CHECKOUT``: a google/orbax source tree (the test-only modules the wheel lacks
are taken from it). Each file named is copied, unchanged, into a work folder and run
as Orbax runs it: 4 pytest processes of 2 CPU devices joined by ``jax.distributed``,
each with its own daemon (one static ring of 4 for the run), Orbax's emergency
``CheckpointManager`` bound to bubblesnap's (``tests/conformance/orbax_plugin.py``);
``--target orbax`` runs plain Orbax the same way. It prints each failure's reason
class and the counts (``--json``: one JSON document).
"""

import argparse
import os
import shutil

from tests.conformance.orbax_manager import add_run_arguments, run_tests, work_folder

EMERGENCY = os.path.join("checkpoint", "orbax", "checkpoint", "experimental", "emergency")
#: The files --file names, under the checkout's root.
FILES = {
    "emergency": os.path.join(EMERGENCY, "checkpoint_manager_test.py"),
    "single_slice": os.path.join(EMERGENCY, "single_slice_checkpoint_manager_test.py"),
    "replicator": os.path.join(EMERGENCY, "multi_tier_checkpointing",
                               "replicator_checkpoint_manager_test.py"),
}
#: Orbax's emergency tests expect 4 processes of 2 devices.
PROCESSES = 4


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orbax-src", required=True,
                        help="a google/orbax source tree (the checkout's root)")
    parser.add_argument("--file", action="append", choices=sorted(FILES), default=None,
                        help="which test file (repeatable; default: emergency and "
                             "single_slice)")
    add_run_arguments(parser, "emergency manager")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.orbax_src)
    sources = [os.path.join(root, FILES[name])
               for name in args.file or ("emergency", "single_slice")]
    for source in sources:
        if not os.path.isfile(source):
            parser.error(f"{source} does not exist: --orbax-src names the root of a "
                         "google/orbax checkout")
    with work_folder(args, "bubblesnap-orbax-emergency-") as work:
        for source in sources:
            shutil.copy(source, os.path.join(work, os.path.basename(source)))
        return run_tests(args, [os.path.basename(s) for s in sources], work,
                         {"BUBBLESNAP_CONFORMANCE_ORBAX_SRC":
                          os.path.join(root, "checkpoint", "orbax", "checkpoint")},
                         processes=PROCESSES)


if __name__ == "__main__":
    raise SystemExit(main())
