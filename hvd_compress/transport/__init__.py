"""Transports: how collectives travel between ranks, beside the engine.

The :class:`~hvd_compress.transport.communicator.Communicator` protocol (asynchronous allreduce and
allgather with handles) and its implementations: Horovod (torch and TensorFlow, in
:mod:`~hvd_compress.transport.communicator`), mpi4py (:mod:`~hvd_compress.transport.mpi`),
torch.distributed (:mod:`~hvd_compress.transport.torch_dist`), thread ranks
(:mod:`~hvd_compress.transport.threads`) and the Simulator's ranks in lockstep
(:mod:`~hvd_compress.transport.lockstep`).
"""
