"""Communication: how payloads travel between ranks.

- :mod:`~hvd_compress.comm.exchange` (a bucket's front) and :mod:`~hvd_compress.comm.fused`
  (its plan and steps, on every framework's kernels) move one bucket of gradients over a
  :class:`~hvd_compress.comm.communicator.Communicator`;
- communicators: Horovod (torch and TensorFlow), mpi4py (:mod:`~hvd_compress.comm.mpi`),
  torch.distributed (:mod:`~hvd_compress.comm.torch_dist`) and thread ranks
  (:mod:`~hvd_compress.comm.threads`);
- :mod:`~hvd_compress.comm.horovod` and :mod:`~hvd_compress.comm.horovod_tf`: our
  compressors as Horovod ``Compressor`` objects (``compression=`` in stock Horovod);
- :mod:`~hvd_compress.comm.auto`: ``Auto``, per bucket the compressed exchange or a dense
  allreduce, whichever the link makes faster.

Formats on the wire are defined in :mod:`hvd_compress.wire`.
"""
