"""The one bucket engine every route runs.

- :mod:`~hvd_compress.engine.exchange`: a bucket's front (``open_exchange``, ``BucketExchange``:
  add the gradients, launch, finish);
- :mod:`~hvd_compress.engine.fused`: its plan per layout and its steps (the dense part in one
  allreduce, the compressed part in the rounds of the compressor's codec, error feedback, the
  non-finite rule), on every framework's kernels;
- :mod:`~hvd_compress.engine.rounds`: the round runner and the cross-rank header check;
- :mod:`~hvd_compress.engine.nonfinite`: the error a NaN/Inf gradient raises on every rank;
- :mod:`~hvd_compress.engine.auto`: ``Auto``, per bucket the compressed exchange or a dense
  allreduce, whichever the link makes faster.

The engine moves payloads over a :class:`~hvd_compress.transport.communicator.Communicator`
(:mod:`hvd_compress.transport`); formats on the wire are defined in :mod:`hvd_compress.wire`.
"""
