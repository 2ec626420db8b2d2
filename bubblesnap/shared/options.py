"""Validating option dataclasses: one message shape that names the option and its flag.

Options are frozen, keyword-only dataclasses that check themselves when made,
so a wrong value fails where it is written, naming the option, instead of
deep inside a training step or a daemon's start.
"""

import numbers


def require(options, field: str, ok: bool, what: str, flag: str = "") -> None:
    """Raises ValueError unless ``ok``: "Class.field: --flag must be <what>, got <value>".

    Called from an options dataclass's ``__post_init__``; ``flag`` is the
    command-line flag that sets the field, if one does.
    """
    if not ok:
        name = f"{type(options).__name__}.{field}" + (f": {flag}" if flag else "")
        raise ValueError(f"{name} must be {what}, got {getattr(options, field)!r}")


def is_number(value) -> bool:
    """A real number that is not a bool (True is an int to Python, never a duration here)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
