"""The launcher and the Orbax patch: ``python -m bubblesnap.run train.py`` runs a program
unchanged with bubblesnap's managers behind Orbax's (launcher.py), the patch itself
(orbax_patch.py), and the folder whose ``sitecustomize`` applies it at Python's start-up
in the processes the program starts (bootstrap/)."""

from bubblesnap.run.launcher import main

__all__ = ["main"]
