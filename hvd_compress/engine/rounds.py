"""A codec's rounds of collectives started and waited for, and the header check of every bucket.

A codec (:mod:`hvd_compress.algorithms.rounds`) says what travels; :func:`start_round`
starts it on a :class:`~hvd_compress.transport.communicator.Communicator` and :func:`wait_round`
collects the results. Every bucket's first collective is an allgather of a header
``[config hash, layout hash, ...]``; :func:`check_header` stops every rank with the same
error when the ranks' first two entries differ (compressor, its configuration, the
tensors' names, shapes and order, or state loaded from another rank).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from hvd_compress.wire import different_algorithms


def start_round(comm: Any, key: str, sends: Sequence[Any], handles: Dict[str, Any]) -> List[str]:
    """Start every :class:`~hvd_compress.algorithms.rounds.Send` of a round, in order, as
    collective ``<key>.<name>``; their handles go into ``handles``. Returns the round's names."""
    for send in sends:
        label = f"{key}.{send.name}"
        if send.op == "gather":
            handles[send.name] = comm.allgather_async(send.tensor, label, send.rows)
        else:
            handles[send.name] = comm.allreduce_async(send.tensor, comm.SUM if send.op == "sum" else comm.MAX, label)
    return [send.name for send in sends]


def wait_round(comm: Any, names: Sequence[str], handles: Dict[str, Any]) -> Dict[str, Any]:
    """The results of a round started by :func:`start_round`, waited for in order."""
    return {name: comm.wait(handles[name]) for name in names}


def decode_rounds(comm: Any, key: str, steps: Any, names: Sequence[str], handles: Dict[str, Any]) -> Any:
    """Hand the codec's generator ``steps`` the results of its last round (``names``); its decode."""
    try:
        steps.send(wait_round(comm, names, handles))
    except StopIteration as done:
        return done.value
    raise RuntimeError(f"hvd_compress: the codec of '{key}' has more rounds than it declares")


class Rounds:
    """A codec's rounds of collectives for one bucket and one step.

    ``handles`` is the exchange's dict of collective handles (its header and dense sum go
    there too, so ``in_flight`` lists everything). :meth:`begin` starts the first of the
    codec's ``count`` rounds (its generator ``steps``), :meth:`advance` starts each later one
    with the results of the one before (waiting for them), :meth:`decode` hands the codec
    the last round's results and returns its decode, and :meth:`release` lets the handles
    go (their work objects hold the transport's connections).
    """

    def __init__(self, comm: Any, key: str, handles: Dict[str, Any]) -> None:
        self.comm, self.key, self.handles = comm, key, handles
        self.steps: Any = None  # the codec's generator, once begun
        self.names: List[str] = []  # the names of the round in flight
        self.left = 0  # rounds still to start

    def begin(self, steps: Any, count: int) -> None:
        """Start the first of ``count`` rounds of ``steps`` (nothing when ``count`` is 0)."""
        self.left = count
        if count:
            self.steps = steps
            self._start(next(steps))

    def advance(self) -> None:
        """Start every round still to start, each with the results of the one before."""
        while self.left > 0:
            self._start(self.steps.send(wait_round(self.comm, self.names, self.handles)))

    def decode(self) -> Any:
        return decode_rounds(self.comm, self.key, self.steps, self.names, self.handles)

    def release(self) -> None:
        self.handles.clear()
        self.steps = None

    def _start(self, sends: Sequence[Any]) -> None:
        self.names = start_round(self.comm, self.key, sends, self.handles)
        self.left -= 1


def check_header(comm: Any, rows: List[List[int]], key: str, compressor: Any, detail: str = "",
                 note: str = "") -> None:
    """Raise the same ``ValueError`` on every rank when the ranks' ``[config hash, layout hash]`` differ,
    or, in a world of one rank (nobody to differ from), when that rank holds another rank's state
    (``note``: why, :meth:`~hvd_compress.algorithms.state.CompressorState.note`)."""
    if all(row[:2] == rows[0][:2] for row in rows) and (len(rows) > 1 or not note):
        return
    comm.fail_together()
    raise ValueError(
        f"hvd_compress: ranks disagree on '{key}' (compressor or its configuration, the names, shapes and "
        f"order of the gradients, or compressor state loaded from another rank): [config hash, layout hash] "
        f"per rank = {[row[:2] for row in rows]}{different_algorithms(row[0] for row in rows)}; "
        f"this rank runs {compressor!r}{detail}{note}"
    )
