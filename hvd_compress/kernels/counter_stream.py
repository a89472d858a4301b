"""A counter-based random stream: torch's TernGrad draws on the host, made where they are used.

A stream is a 64-bit seed ``s`` and a position ``p``, the draws taken so far. A call for ``n`` draws
takes the keys ``(k0, k1)``, the low and high 32-bit words of ``splitmix64(s + p mod 2^64)``, and
advances ``p`` by ``n``. Its draw ``j`` (``0 <= j < n``) and that draw's uniform on [0, 1) are::

    d_j = h(h(j * 0x9E3779B9 + k0) xor k1)   (mod 2^32)
    u_j = (d_j mod 2^24) 2^-24                (float32, exact)

with ``h`` the 32-bit mixer ``lowbias32`` (``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15;
x *= 0x846CA68B; x ^= x >> 16``, shifts logical). ``h`` is a bijection of 32-bit words, so a call's draws
are distinct; the second key breaks the shift that would relate two calls' first rounds. Draw ``j``
depends on nothing but the keys and ``j`` (a counter-based generator: Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011), so TernGrad's compiled codes pass makes each entry's
uniform as it reads the entry (:func:`~hvd_compress.kernels.torch_compiled.counter_draws`) instead
of drawing them into memory first. The torch functions are in
:mod:`~hvd_compress.kernels.torch_compiled`; this module is the stream's host side.
"""

from __future__ import annotations

import hashlib
from typing import Tuple

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """Steele, Lea and Flood's SplitMix64 output function of ``x`` (one step of its sequence)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def as_int32(word: int) -> int:
    """A 32-bit word as the signed int32 of the same bits."""
    return word - (1 << 32) if word >= 1 << 31 else word


class CounterStream:
    """A rank's stream: its 64-bit ``seed`` and ``position`` (module docstring)."""

    #: a saved state: ``seed`` and ``position`` as two little-endian 64-bit words
    STATE_BYTES = 16
    #: the state torch's own CPU generator (a Mersenne Twister) saves
    MT19937_STATE_BYTES = 5056

    def __init__(self, seed: int) -> None:
        self.seed, self.position = seed & _MASK64, 0

    def take(self, n: int) -> Tuple[int, int]:
        """The keys ``(k0, k1)`` of the next ``n`` draws, as signed int32; the position advances by ``n``."""
        word = splitmix64((self.seed + self.position) & _MASK64)
        self.position += n
        return as_int32(word & 0xFFFFFFFF), as_int32(word >> 32)

    def state(self) -> bytes:
        return self.seed.to_bytes(8, "little") + (self.position & _MASK64).to_bytes(8, "little")

    def set_state(self, state: bytes) -> None:
        """Continue from a saved :meth:`state`. A Mersenne Twister's state (torch's own CPU generator's)
        seeds the stream from its BLAKE2b digest, at position 0: it resumes on a stream of its own, not
        where that generator stood. ``ValueError`` for a state of any other length."""
        if len(state) == self.STATE_BYTES:
            self.seed = int.from_bytes(state[:8], "little")
            self.position = int.from_bytes(state[8:], "little")
        elif len(state) == self.MT19937_STATE_BYTES:
            self.seed = int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little")
            self.position = 0
        else:
            raise ValueError(f"a counter stream's state is {self.STATE_BYTES} bytes (or a Mersenne Twister's "
                             f"{self.MT19937_STATE_BYTES}), not {len(state)}")
