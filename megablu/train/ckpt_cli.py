"""Subcommands of this area (placeholder until the area's work lands)."""


def register(sub) -> None:
    return None
