"""The one progress callback every long library call takes: `progress(label, fraction_done)`.

`label` says what is happening now (a line for a progress bar); `fraction_done` runs from 0 to 1.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ProgressFn"]

ProgressFn = Callable[[str, float], None]
