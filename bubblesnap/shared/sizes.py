"""Byte sizes as people write and read them (flags, status lines)."""

import argparse
import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'4GiB' -> 4294967296; '500MB' -> 500000000; '1024' -> 1024."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: use a number with an optional unit, e.g. 512MiB, 4GiB, 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human_bytes(nbytes: float) -> str:
    """4294967296 -> '4.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
