"""Communication: how payloads travel (Horovod collectives; mpi4py and torch.distributed to come)."""
