"""A compressor with a wire format of its own, added in this one file: signSGD with majority vote.

Bernstein, Zhao, Azizzadenesheli and Anandkumar, "signSGD with Majority Vote is Communication
Efficient and Fault Tolerant" (ICLR 2019), Algorithm 1: every rank sends the signs of its
gradient and the aggregate is the sign of their sum::

    s_r = sign(g_r) in {-1, 0, 1};   vote = sign(sum over ranks of s_r)

The sum an exchange returns (``finish(average=False)``) is ``N vote``, so the average is the
vote. On the wire the ranks' signs are summed exactly: ``t + 1`` packed into int32 lanes of
``ceil(log2(2N + 1))``-bit fields (``ops.pack_ternary``), one allreduce-Sum for the bucket
(a tensor with NaN/Inf on some rank, flagged in the exchange's header, is NaN on every
rank, as a dense allreduce would give). No format the library knows: the compressor
brings its codec (``tensor_codec``), and the exchange runs its round without a line of
``hvd_compress`` changed. ``Compression.register`` gives it a name: ``Compression.by_name``
builds it, and a rank running another compressor is told which one each rank runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np
import pytest

from hvd_compress import FP16, Compression
from hvd_compress.comm.exchange import BucketExchange
from hvd_compress.comm.threads import run_ranks
from hvd_compress.compressors.base import Compressor, dense_sum
from hvd_compress.compressors.rounds import Send
from hvd_compress.compressors.tensor_codec import TensorCodec, nan_result
from hvd_compress.compressors.validation import check_count, checked
from hvd_compress.simulator import Simulator
from hvd_compress.wire import FIRST_FREE_NUMBER, DensePayload, header_config, register_algorithm, ternary_lanes
from tests import conformance


@dataclass(frozen=True)
class SignPayload:
    """One rank's signs (int8 in {-1, 0, 1}); ``nbytes``: 2 bits per sign, what the lanes cost at most."""

    values: Any
    dtype: Any

    @property
    def nbytes(self) -> int:
        return math.ceil(int(self.values.shape[0]) / 4)


def signs(flat: Any, ops: Any) -> Any:
    """``sign(x)`` as int8: TernGrad's codes of ``x`` with scale 1 and zero draws (``[0 < |x|]``)."""
    return ops.terngrad_codes(flat, 1.0, ops.zeros_like(flat))


class MajorityVote(Compressor):
    """signSGD with majority vote (module docstring); tensors under ``dense_below`` elements go dense."""

    payload_kind = "sign"
    dense_below = checked("dense_below", check_count, "Tensors below this many elements go dense (an int >= 0).")

    def __init__(self, dense_below: int = 0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.dense_below = dense_below

    def config(self) -> Dict[str, Any]:
        return {**super().config(), "dense_below": self.dense_below}

    def _encode(self, flat: Any, name: str, shape: tuple, ops: Any) -> Any:
        if flat.shape[0] < self.dense_below:
            return DensePayload(values=flat, dtype=flat.dtype)
        return SignPayload(values=signs(flat, ops), dtype=flat.dtype)

    def _sum(self, payloads: List[Any], numel: int, ops: Any):
        if all(isinstance(p, DensePayload) for p in payloads):
            return dense_sum(payloads, numel, ops)
        return majority(ops.sum_codes([p.values for p in payloads]), len(payloads), payloads[0].dtype, ops), \
            payloads[0].dtype

    def tensor_codec(self, exchange: Any) -> "MajorityVoteCodec":
        return MajorityVoteCodec(self, exchange)


def majority(sign_sum: Any, world: int, dtype: Any, ops: Any) -> Any:
    """``N sign(sum of signs)`` in ``dtype``'s accumulation dtype (the average is the vote)."""
    acc = ops.accumulation_dtype(dtype)
    vote = signs(ops.cast(sign_sum, acc), ops)
    return ops.cast(vote, acc) * world


class MajorityVoteCodec(TensorCodec):
    """The exchange's side: one round, an allreduce-Sum of packed signs."""

    kind = "sign"

    def add(self, name: str, tensor: Any) -> Any:
        payload = self.compressor.encode(tensor, name)
        if isinstance(payload, DensePayload):
            return payload
        self.names.append(name)
        self.payloads.append(payload)
        return None

    def add_nonfinite(self, name: str, tensor: Any) -> Any:
        flat = self.ops.reshape(tensor, (-1,))
        if flat.shape[0] < self.compressor.dense_below:
            return super().add_nonfinite(name, tensor)
        self.names.append(name)  # zero signs; its flag tells every rank
        self.payloads.append(SignPayload(values=signs(self.ops.zeros_like(flat), self.ops), dtype=flat.dtype))
        return None

    def header(self) -> List[int]:
        return []

    def exchange(self, rows: Any):
        ops, world = self.ops, self.bucket.world
        lanes = ops.concat([ops.pack_ternary(p.values, world) for p in self.payloads])
        received = yield [Send("signs", "sum", lanes)]
        results, start = {}, 0
        for name, payload in zip(self.names, self.payloads):
            numel = int(payload.values.shape[0])
            size = ternary_lanes(numel, world)
            if name in self.bucket.flagged:  # NaN/Inf on some rank (the header's flags)
                results[name] = nan_result(self.bucket, name, numel, dict(self.bucket.added)[name])
            else:
                total = majority(ops.unpack_ternary_sum(received["signs"][start : start + size], numel, world), world,
                                 payload.dtype, ops)
                results[name] = self.bucket.result(name, total, payload.dtype)
            start += size
        return results


def make() -> MajorityVote:
    return MajorityVote()


# --------------------------------------------------------------------------- the algorithm itself
def test_the_vote_of_three_ranks():
    grads = {"w": [np.array([1.0, -2.0, 0.5, 0.0, -1.0], np.float32),
                   np.array([3.0, -1.0, -0.5, 0.0, 2.0], np.float32),
                   np.array([-1.0, 4.0, -0.25, 0.0, 0.0], np.float32)]}
    out = Simulator(3, make()).step(grads)["w"]
    np.testing.assert_array_equal(out, [1.0, -1.0, -1.0, 0.0, 0.0])
    assert out.dtype == np.float32


def test_sends_two_bits_per_sign_and_small_tensors_dense():
    compressor = MajorityVote(dense_below=10)
    compressor.encode(np.ones(40, np.float32), "w")
    compressor.encode(np.ones(5, np.float32), "b")
    assert compressor.stats.bytes_sent == 10 + 5 * 4
    assert compressor.config() == {"type": "MajorityVote", "dense_below": 10}
    with pytest.raises(ValueError, match="hvd_compress: MajorityVote dense_below"):
        compressor.dense_below = -1


def test_rejects_bad_gradients():
    conformance.check_rejects_bad_gradients(make)


# --------------------------------------------------------------------------- through the real exchange
@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
def test_thread_ranks_through_the_real_exchange_equal_the_simulator(framework):
    conformance.check_thread_ranks_equal_simulator(make, ranks=3, framework=framework, rtol=0)


def test_drop_in_torch_optimizer_on_thread_ranks_equals_the_simulator():
    conformance.check_drop_in_optimizer_equals_simulator(make)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_state_dict_round_trip_continues_exactly(framework):
    conformance.check_state_dict_round_trip(make, framework=framework)


def test_ranks_configured_differently_fail_clearly():
    conformance.check_ranks_disagreeing_fail_clearly(make, lambda: MajorityVote(dense_below=100))
    conformance.check_ranks_disagreeing_fail_clearly(make, FP16)


def vote_against_fp16(fuse: bool = False) -> None:
    """Rank 0 votes, rank 1 runs FP16: the header check's error (thread ranks). FP16's bucket on the
    per-tensor path, whose header has the vote's width; on the fused path (``fuse``), whose header
    holds the two hashes only, the ranks' headers differ in width and the transport stops them."""
    compressors = [make(), FP16()]
    run_ranks(2, lambda comm: conformance.exchange_steps(comm, compressors[comm.rank], 1, "numpy", fuse),
              timeout=20)


@pytest.fixture
def registered():
    """``majorityvote`` in the name table for one test."""
    Compression.register("majority-vote", MajorityVote)
    yield
    Compression.unregister("majority_vote")


def test_registered_by_name_and_named_in_the_disagreement_error(registered):
    assert Compression.names[-1] == "majorityvote" and Compression.majorityvote is MajorityVote
    built = Compression.by_name("Majority-Vote", 0.5, dense_below=3)  # no ratio parameter: ignored
    assert isinstance(built, MajorityVote) and built.dense_below == 3
    number = header_config("MajorityVote", 0) >> 32
    assert number >= FIRST_FREE_NUMBER and header_config("TopK", 0) >> 32 == 3  # built-ins keep theirs
    with pytest.raises(ValueError, match="ranks run different compressors: rank 0 MajorityVote, rank 1 FP16"):
        vote_against_fp16()
    with pytest.raises(ValueError, match="ranks disagree on the trailing shape of allgather 'bucket0.header'"):
        vote_against_fp16(fuse=True)
    with pytest.raises(ValueError, match="is taken by MajorityVote"):
        Compression.register("majorityvote", FP16)
    with pytest.raises(ValueError, match="cannot number Other 3: TopK already has 3"):
        register_algorithm("Other", 3)


def test_unregistered_it_is_another_compressor():
    assert "majorityvote" not in Compression.names and header_config("MajorityVote", 0) >> 32 == 0
    with pytest.raises(ValueError, match="unknown compression 'majorityvote'"):
        Compression.by_name("majorityvote")
    with pytest.raises(ValueError, match="rank 0 another compressor, rank 1 FP16"):
        vote_against_fp16()


def test_a_nan_on_one_rank_is_nan_on_every_rank_and_the_rest_votes():
    def run(comm: Any) -> Dict[str, np.ndarray]:
        exchange = BucketExchange(make(), comm, "bucket0")
        for name, per_rank in conformance.gradients(0, comm.size).items():
            grad = per_rank[comm.rank].copy()
            if name == "layer.bias" and comm.rank == 1:
                grad[3] = np.nan
            exchange.add(name, grad)
        exchange.launch()
        return exchange.finish(average=True)

    results = run_ranks(3, run, timeout=30)
    want = Simulator(3, make()).step({"layer.weight": conformance.gradients(0, 3)["layer.weight"]})["layer.weight"]
    for result in results:
        assert np.isnan(result["layer.bias"]).all()
        np.testing.assert_array_equal(result["layer.weight"], want)
