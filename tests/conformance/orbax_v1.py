"""Orbax v1's own Checkpointer tests, unchanged, against bubblesnap's v1 Checkpointer.

Usage::

    python -m tests.conformance.orbax_v1 [--target orbax] [-k EXPR] [--json]

Orbax ships the bodies of its v1 ``training.Checkpointer`` tests in the wheel
(``orbax.checkpoint.experimental.v1._src.training.checkpointer_test_base``); Orbax's
own test file only subclasses them. This writes that file (the two test classes,
nothing else) into a work folder and runs it as ``tests.conformance.orbax_manager`` runs
the manager's: one process, 8 forced CPU devices, ``training.Checkpointer`` bound to
bubblesnap's and a daemon per test (``tests/conformance/orbax_plugin.py``);
``--target orbax`` runs plain Orbax the same way.
"""

import argparse
import os

from tests.conformance.orbax_manager import add_run_arguments, run_tests, work_folder

TEST_FILE = "checkpointer_test.py"
#: Orbax's test file: its test classes are those of the base, run as they are.
TEST_TEXT = '''from absl.testing import absltest
from orbax.checkpoint.experimental.v1._src.training import checkpointer_test_base


class CheckpointerTest(checkpointer_test_base.CheckpointerTestBase.Test):
  pass


class DeprecationsTest(checkpointer_test_base.CheckpointerTestBase.DeprecationsTest):
  pass


if __name__ == '__main__':
  absltest.main()
'''


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\\n\\n")[0])
    add_run_arguments(parser, "Checkpointer")
    args = parser.parse_args(argv)
    with work_folder(args, "bubblesnap-orbax-v1-conformance-") as work:
        with open(os.path.join(work, TEST_FILE), "w") as f:
            f.write(TEST_TEXT)
        return run_tests(args, TEST_FILE, work, {})


if __name__ == "__main__":
    raise SystemExit(main())
