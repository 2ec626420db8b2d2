"""The failures of a CheckpointManager's saves, kept until ``check_for_errors`` raises them."""


class SaveErrors:
    """What went wrong with saves since the last :meth:`raise_any` (Orbax's manager raises
    an async save's failure at its next ``check_for_errors``)."""

    def __init__(self):
        self._errors: list[str] = []

    def add(self, message: str) -> None:
        self._errors.append(message)

    def failed(self, result) -> bool:
        """Whether ``result`` (a ``SnapshotResult``; None: nothing was pending) is a snapshot
        not taken; kept if so (a replica's, held through its copier, is no failure)."""
        failed = result is not None and not result.taken and result.copied_by is None
        if failed:
            self.add(f"step {result.step}: {result.reason}")
        return failed

    def raise_any(self) -> None:
        """Raises RuntimeError naming every failure kept (the first eight), and forgets them."""
        errors, self._errors = self._errors, []
        if errors:
            raise RuntimeError("bubblesnap: " + "; ".join(errors[:8]) +
                               (f" (and {len(errors) - 8} more)" if len(errors) > 8 else ""))
