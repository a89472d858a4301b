"""What a codec asks the transport to move: rounds of collectives.

A compressor's codec (a fused bucket's, :meth:`Compressor.bucket_codec`) encodes and decodes; the engine in
:mod:`hvd_compress.engine` only starts collectives and hands their results back. A codec's
``exchange`` is a generator: each ``yield`` is one round, a list of :class:`Send`; the
engine starts them, waits for their results when the next round (or the decode) needs
them, and sends the codec ``{name: result}``; the generator's return value is the decode.

A round whose results a later round needs (TernGrad's allreduce-Max of the scales,
before codes drawn with the shared scale) is waited for in the exchange's ``complete``;
the last round in ``finish``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

#: the operations a :class:`Send` may ask for
OPS = ("sum", "max", "gather")


@dataclass
class Send:
    """One collective: ``name`` (its handle, and ``<bucket key>.<name>`` on the wire), ``op``
    (``"sum"``/``"max"``: allreduce; ``"gather"``: allgather along the first dimension),
    ``tensor``, and for a gather each rank's rows where known (``None``: the transport finds out)."""

    name: str
    op: str
    tensor: Any
    rows: Optional[List[int]] = None
