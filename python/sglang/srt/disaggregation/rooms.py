"""Bootstrap rooms: the 63-bit ids that pair a request's prefill with its decode (pure Python)."""

from __future__ import annotations

import random

MAX_ROOM = (1 << 63) - 1


def new_room(rng: random.Random) -> int:
    """A fresh random room id in ``[0, 2**63)``."""
    return rng.randrange(0, MAX_ROOM)


def derive_room(room: int, sample: int) -> int:
    """Room of sample ``sample`` of an ``n`` > 1 request whose prompt has room ``room``: sample 0 keeps the
    room, sample j > 0 gets a deterministic 63-bit mix (splitmix64 finalizer), identical on the prefill and
    decode servers, so both expand ``n`` into the same rooms."""
    if sample == 0:
        return room
    x = (room + sample * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & MAX_ROOM
