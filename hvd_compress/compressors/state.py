"""What a compressor learns while it runs, kept apart from its configuration.

A compressor's configuration (``ratio``, ``seed``, options: :meth:`Compressor.config`) says
what it sends; its :class:`CompressorState` (``compressor.state``) holds everything a run
accumulates: per-tensor arrays (residuals, velocities, posteriors, in
:class:`~hvd_compress.compressors.residual.TensorMemory`), the random streams, the fused
buckets' plans and the state they hold, and what a route keeps per compressor
(:meth:`route_data`: stock Horovod's plans and calls for torch, the
layouts checked and eager call counts for TensorFlow). It follows PyTorch's ``PowerSGDState`` (torch.distributed's
``powerSGD_hook``) and GRACE's ``Memory`` (Xu et al., "GRACE: A Compressed Communication
Framework for Distributed Machine Learning", ICDCS 2021): the exchanges read and write
state only through this object. ``Compressor.state_dict()`` saves the memory and the random
streams (the checkpoint format); bucket plans and route data are rebuilt.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from hvd_compress.compressors.residual import TensorMemory


class CompressorState:
    """One compressor's run state (module docstring)."""

    def __init__(self) -> None:
        #: per-tensor arrays by name (residual, velocity, posterior, ...)
        self.memory = TensorMemory()
        #: bucket key -> fused bucket (``hvd_compress.comm.fused.FusedBucket``): its plan and the
        #: bucket-shaped state it holds until :meth:`flush_buckets`
        self.buckets: Dict[str, Any] = {}
        #: kernel module name -> this rank's random stream; streams loaded before their framework ran
        self.generators: Dict[str, Any] = {}
        self.saved_generators: Dict[str, Any] = {}
        #: (rank, world) that saved the loaded state, ``None`` when it is this rank's own or none was loaded
        self.origin: Optional[Tuple[int, int]] = None
        #: the route that wrote the state last loaded
        self.loaded_route = ""
        #: loaded arrays may be another framework's (moved on the first gradient)
        self.loaded_elsewhere = False
        self._route_data: Dict[str, Any] = {}

    def route_data(self, key: str, make: Callable[[], Any]) -> Any:
        """What the route ``key`` keeps for this compressor (made by ``make()`` on first use)."""
        if key not in self._route_data:
            self._route_data[key] = make()
        return self._route_data[key]

    def flush_buckets(self) -> None:
        """Write the fused buckets' state into the per-name memory (checkpoints, inspection)."""
        for bucket in self.buckets.values():
            bucket.flush(self.memory)

    def drop_bucket(self, key: str) -> None:
        """Forget the fused bucket of ``key`` (its plan; a route whose layout changed rebuilds it)."""
        self.buckets.pop(key, None)

    def drop_buckets(self, name: Optional[str] = None) -> None:
        """Forget every fused bucket, or those holding tensor ``name``."""
        for key, bucket in list(self.buckets.items()):
            if name is None or name in bucket.names:
                del self.buckets[key]
