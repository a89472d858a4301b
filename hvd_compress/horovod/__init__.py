"""Our compressors inside stock Horovod (``hvd.DistributedOptimizer(opt, compression=...)``).

- :mod:`~hvd_compress.horovod.interface`: the public compressors (``hvd_compress.TopK`` ...), each
  an algorithm plus Horovod's ``compress``/``decompress``, and ``HorovodCompression`` for any other;
- :mod:`~hvd_compress.horovod.torch_hooks` (with :mod:`~hvd_compress.horovod.torch_buckets`):
  ``horovod.torch``'s calls, grouped into the buckets of the calling optimizer;
- :mod:`~hvd_compress.horovod.tensorflow_hooks`: ``horovod.tensorflow``'s;
- :mod:`~hvd_compress.horovod.calls`: which Horovod call is running (found on the call stack).
"""
