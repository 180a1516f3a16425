"""Parsers for the values users type: durations, lists of batch sizes, input shapes."""

from __future__ import annotations

import re

from infermux.errors import UsageError

__all__ = ["parse_batches", "parse_bytes", "parse_delay_ms", "parse_duration_s",
           "parse_latency_ms", "parse_shape"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h|d)?\s*$")
_SCALE_S = {"ms": 1e-3, "s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
            "d": 86400.0}


def parse_duration_s(text: str | float, *, name: str = "duration") -> float:
    """`"10s"`, `"500ms"`, `"2m"`, `"30d"`, `"1.5"` (seconds) → seconds; rejects negatives and junk."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _DURATION.match(text)
        if match is None:
            raise UsageError(
                f"{name} {text!r} is not a duration: write a number with ms, s, m, h or d, e.g. 10s"
            )
        value = float(match.group(1)) * _SCALE_S[match.group(2)]
    if value < 0:
        raise UsageError(f"{name} {text!r} is negative: a duration is 0 or more, e.g. 10s")
    return value


def _ms(text: str | float, name: str) -> float:
    """Milliseconds from a bare number (already ms) or a duration with its unit."""
    if isinstance(text, (int, float)) or _BARE_NUMBER.match(text):
        return float(text)
    return parse_duration_s(text, name=name) * 1e3


def parse_latency_ms(text: str | float, *, name: str = "--p99") -> float:
    """A latency bound in ms: `"15ms"`, `"0.015s"`, or a bare number of milliseconds (`15`).

    `run`, `tune` and `study` read `--p99` with it, so `--p99 15` and `--p99 15ms` mean the same
    everywhere.
    """
    value = _ms(text, name)
    if not value > 0:
        raise UsageError(f"{name} {text!r} must be above 0: a latency bound, e.g. 15ms")
    return value


def parse_delay_ms(text: str | float, *, name: str = "delay") -> float:
    """A delay in ms, 0 allowed: `"0.3ms"`, `"0"`, or a bare number of milliseconds (`0.3`)."""
    return _ms(text, name)


_BARE_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*$")
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SCALE_B = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
            "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, *, name: str = "size") -> int:
    """`"8GiB"`, `"512MB"`, `"1024"` (bytes) → bytes; rejects zero, negatives and junk."""
    if isinstance(text, int):
        value = text
    else:
        match = _BYTES.match(text)
        if match is None:
            raise UsageError(f"{name} {text!r} is not a size: write a number with B, MB, GB, "
                             "MiB or GiB, e.g. 8GiB")
        value = int(float(match.group(1)) * _SCALE_B[(match.group(2) or "b").lower()])
    if value <= 0:
        raise UsageError(f"{name} {text!r} must be positive, e.g. 8GiB")
    return value


def parse_batches(text: str | list[int]) -> list[int]:
    """`"1,8,64"` → `[1, 8, 64]`; every batch size must be a positive integer."""
    items = text if isinstance(text, list) else [p for p in str(text).split(",") if p.strip()]
    batches: list[int] = []
    for item in items:
        try:
            value = int(str(item).strip())
        except ValueError:
            raise UsageError(
                f"batch size {item!r} is not an integer: pass positive integers, e.g. --batch 1,8,64"
            ) from None
        if value <= 0:
            raise UsageError(
                f"batch size {value} must be at least 1: pass positive integers, e.g. --batch 1,8"
            )
        batches.append(value)
    if not batches:
        raise UsageError("no batch size given: pass at least one, e.g. --batch 1,8,64")
    return batches


def parse_shape(text: str) -> tuple[int, ...]:
    """`"3x224x224"` → `(3, 224, 224)`: the shape of one item, without the batch axis."""
    parts = [p for p in re.split(r"[x×,]", text.strip()) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise UsageError(
            f"input shape {text!r} is not a list of sizes: write them joined by x, e.g. 3x224x224"
        ) from None
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"input shape {text!r} needs positive sizes, e.g. --input-shape 3x224x224")
    return shape
