"""The launcher and the Orbax patch: ``python -m bubblesnap.run train.py`` runs a program
unchanged with bubblesnap's managers behind Orbax's (launcher.py), the patch itself
(orbax_patch.py), and the folder whose ``sitecustomize`` applies it at Python's start-up
in the processes the program starts (bootstrap/). Importing the patch (every patched
process does, and the daemon) loads nothing of the launcher."""


def main(argv=None) -> int:
    """Runs ``python -m bubblesnap.run`` with ``argv`` (default ``sys.argv[1:]``)."""
    from bubblesnap.run import launcher

    return launcher.main(argv)
