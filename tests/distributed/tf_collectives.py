"""Run by ``test_horovod_tf.py`` under ``horovodrun`` (:func:`check`, first in the job of
``tf_horovod.py --collectives``): the collectives of
:class:`~hvd_compress.horovod.tensorflow_hooks.HorovodTensorFlowCommunicator`, queued together and run at the
first ``wait`` (allgathers as one grouped allgather; with two ranks the allreduces gathered and
reduced on each rank), against Horovod's own eager allgather and allreduce of the same tensors,
called one by one; then the same collectives of numpy arrays (an exchange computing on the host), whose
results come back as numpy arrays. Each rank writes ``--out.<rank>``: the Horovod calls the queue made, then one line per
collective, ``same`` when the results have the same dtype, shape and bytes, else what differs.
"""

from __future__ import annotations

import argparse

import numpy as np
import tensorflow as tf


def collectives(rank: int) -> list:
    """``(op, tensor)``: op ``sum``/``max`` (allreduce) or None (allgather), every dtype the exchanges send."""
    rng = np.random.default_rng(rank)
    return [
        (None, tf.constant([[7, rank, 3]], tf.int64)),  # a header
        ("sum", tf.constant(rng.standard_normal(1000).astype(np.float32))),
        (None, tf.constant(rng.integers(0, 1000, 10 + rank).astype(np.int32))),  # sizes differ by rank
        (None, tf.constant(rng.standard_normal(10 + rank).astype(np.float32))),
        ("sum", tf.constant(rng.standard_normal((3, 7)))),
        ("sum", tf.constant(rng.integers(-2**31, 2**31, 500, dtype=np.int64).astype(np.int32))),  # wraps
        ("sum", tf.constant(rng.integers(-2**62, 2**62, 50, dtype=np.int64))),
        ("max", tf.constant(np.abs(rng.standard_normal(5)).astype(np.float32))),
        ("max", tf.constant([np.inf if rank else 0.0, 0.0, 1.0], tf.float32)),  # a flagged tensor's scale
        ("sum", tf.constant(rng.standard_normal(30).astype(np.float16))),  # not gathered: Horovod's own sum
        (None, tf.constant(rng.standard_normal((2 + rank, 3)).astype(np.float16))),
        (None, tf.constant(rng.integers(-9, 9, (4, 2)).astype(np.int8))),
        (None, tf.constant(np.zeros(0, np.float32))),
    ]


def run_queued(comm, cases: list, prefix: str) -> list:
    """Queue every case on ``comm``, then wait for each: the results in order."""
    handles = [comm.allgather_async(t, f"{prefix}.{i}") if op is None else comm.allreduce_async(t, op, f"{prefix}.{i}")
               for i, (op, t) in enumerate(cases)]
    return [comm.wait(handle) for handle in handles]


def check(out: str) -> None:
    """The comparison (module docstring) on this rank, Horovod initialized; writes ``out.<rank>``."""
    import horovod.tensorflow as hvd

    from hvd_compress.horovod.tensorflow_hooks import HorovodTensorFlowCommunicator

    comm = HorovodTensorFlowCommunicator()
    cases = collectives(hvd.rank())
    calls, own = [], {name: getattr(hvd, name) for name in ("allgather", "allreduce", "grouped_allgather")}
    for name, function in own.items():
        def counted(*args, _run=function, _name=name, **kwargs):
            calls.append(_name)
            return _run(*args, **kwargs)

        setattr(hvd, name, counted)
    queued = [got.numpy() for got in run_queued(comm, cases, "case")]
    host = run_queued(comm, [(op, t.numpy()) for op, t in cases], "host")  # numpy in, numpy out
    for name, function in own.items():
        setattr(hvd, name, function)
    lines = [f"calls {' '.join(calls)}"]
    for i, ((op, tensor), got, got_host) in enumerate(zip(cases, queued, host)):
        want = (hvd.allgather(tensor, name=f"own.{i}") if op is None
                else hvd.allreduce(tensor, op=hvd.Sum if op == "sum" else hvd.Max, name=f"own.{i}")).numpy()
        same = all(isinstance(x, np.ndarray) and x.dtype == want.dtype and x.shape == want.shape
                   and x.tobytes() == want.tobytes() for x in (got, got_host))
        lines.append(f"{i} {op} {tensor.dtype.name} " + ("same" if same else f"differs: {got!r}, {got_host!r} vs {want!r}"))
    with open(f"{out}.{hvd.rank()}", "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    import horovod.tensorflow as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    check(args.out)


if __name__ == "__main__":
    main()
