"""Flat '/'-joined names <-> nested dicts, as the daemon names the leaves of a state tree."""


def nested(flat: dict) -> dict:
    """``{"params/w": x}`` -> ``{"params": {"w": x}}``."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree
