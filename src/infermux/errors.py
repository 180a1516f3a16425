"""The project's one shallow exception tree.

Vendor and library errors are translated once, at the boundary where they happen, into one of
these. The CLI prints the message as one line; the exit code tells a usage error (2) from a
failure (1).
"""

from __future__ import annotations

__all__ = ["DeviceOutOfMemoryError", "InfermuxError", "RunError", "UsageError", "first_line"]


class InfermuxError(Exception):
    """Base of every error infermux raises on purpose."""

    exit_code = 1


class UsageError(InfermuxError):
    """The user asked for something that cannot be: a bad value, an unknown name, a missing unit."""

    exit_code = 2


class RunError(InfermuxError):
    """Something went wrong while doing what was asked (a broken file, an engine failure)."""

    exit_code = 1


class DeviceOutOfMemoryError(RunError):
    """A device ran out of memory at one configuration (recorded as that point's result)."""


def first_line(exc: BaseException, *, typed: bool = True, limit: int = 300) -> str:
    """An exception as one line for a table, a record or a log: `Type: first line of message`.

    `typed=False` leaves the type out where the message says enough (the type alone stands in
    for an empty message); lines longer than `limit` are cut.
    """
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    name = type(exc).__name__
    if not line:
        return name
    return (f"{name}: {line}" if typed else line)[:limit]
