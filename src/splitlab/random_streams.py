"""Named random streams: every use of randomness draws from its own, so no two uses share one.

A stream is registered by the module that uses it, under a name and a fixed number; the number
goes into the seed (with the run's seed, the round and the use's keys), so it must never change
once runs exist, and two uses may not share a name or a number.
"""

from __future__ import annotations

STREAMS: dict[str, int] = {}


def register_stream(name: str, number: int) -> int:
    """Register stream `name` as `number` and return the number; a clash is a programming error."""
    if STREAMS.get(name, number) != number or (number in STREAMS.values() and STREAMS.get(name) != number):
        raise ValueError(f"random stream {name!r} = {number} clashes with {STREAMS}")
    STREAMS[name] = number
    return number
