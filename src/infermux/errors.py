"""The project's one shallow exception tree.

Vendor and library errors are translated once, at the boundary where they happen, into one of
these. The CLI prints the message as one line; the exit code tells a usage error (2) from a
failure (1).
"""

from __future__ import annotations

__all__ = ["DeviceOutOfMemoryError", "InfermuxError", "RunError", "UsageError"]


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
