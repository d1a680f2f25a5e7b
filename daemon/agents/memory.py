"""How much memory one agent may use: the values of ``agents.max_memory`` and ``[agents.NAME] max_memory``.

A bound is written in bytes (``268435456``) or as a number with a binary unit, ``K``, ``M``, ``G``
or ``T`` (``512M``, ``8G``, ``1.5G``; ``KiB``/``MiB``/... and ``KB``/``MB``/... mean the same powers
of 1024). It must lie between ``MEMORY_MIN`` (64 MiB) and this host's RAM; unset, it is half the
host's RAM (``default_bound``). The backend checks both keys at start and hands each agent's bound
to the control server with its launch, which checks it again against its own host and enforces it
with the agent's memory cgroup (``daemon.agentctl.sandbox.memory_cgroups``).
"""

from __future__ import annotations

import os
import re
from typing import Any

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
MEMORY_MIN = 64 * MiB
"""The smallest bound accepted: an agent's runtime (node, python) needs some room to start."""

_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?$", re.IGNORECASE)
_SYMBOLS = (("T", 1024 * GiB), ("G", GiB), ("M", MiB), ("K", KiB))


def parse_bytes(value: Any) -> int:
    """``"8G"`` -> 8589934592, ``1048576`` -> 1048576 (ValueError saying what is wrong)."""
    if isinstance(value, bool):
        raise ValueError("is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("is negative")
        return value
    if not isinstance(value, str):
        raise ValueError('is not a size (write bytes, or a number with K, M, G or T: "512M", "8G")')
    m = _SIZE.match(value.strip())
    if not m:
        raise ValueError('is not a size (write bytes, or a number with K, M, G or T: "512M", "8G")')
    number, unit = m.groups()
    if "." in number and not unit:
        raise ValueError("is not a whole number of bytes")
    return int(float(number) * _UNITS[unit.upper()]) if "." in number else int(number) * _UNITS[unit.upper()]


def format_bytes(value: int) -> str:
    """The shortest exact spelling of ``value`` that ``parse_bytes`` reads back (``8G``, ``1536M``)."""
    for symbol, factor in _SYMBOLS:
        if value >= factor and value % factor == 0:
            return f"{value // factor}{symbol}"
    return str(value)


def human_bytes(value: int) -> str:
    """``value`` for people, rounded: ``1.5 GiB``, ``256 MiB``."""
    for symbol, factor in _SYMBOLS:
        if value >= factor:
            amount = value / factor
            text = f"{amount:.1f}".removesuffix(".0")
            return f"{text} {symbol}iB"
    return f"{value} bytes"


def host_memory() -> int:
    """This host's RAM in bytes (``MemTotal``)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_bound(host: int | None = None) -> int:
    """The bound of an agent when neither key is set: half the host's RAM."""
    return (host_memory() if host is None else host) // 2


def accepted(host: int | None = None) -> str:
    """What a refusal quotes as accepted."""
    ram = host_memory() if host is None else host
    return (f"{format_bytes(MEMORY_MIN)}..{ram // MiB}M (bytes, or a number with K, M, G or T, e.g. \"8G\";"
            f" at least 64 MiB, at most this host's RAM, {human_bytes(ram)})")


def in_range(value: int, host: int | None = None) -> bool:
    return MEMORY_MIN <= value <= (host_memory() if host is None else host)
