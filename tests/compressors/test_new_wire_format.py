"""A compressor with a wire format of its own, added in this one file: signSGD with majority vote.

Bernstein, Zhao, Azizzadenesheli and Anandkumar, "signSGD with Majority Vote is Communication
Efficient and Fault Tolerant" (ICLR 2019), Algorithm 1: every rank sends the signs of its
gradient and the aggregate is the sign of their sum::

    s_r = sign(g_r) in {-1, 0, 1};   vote = sign(sum over ranks of s_r)

The sum an exchange returns (``finish(average=False)``) is ``N vote``, so the average is the
vote. On the wire the ranks' signs are summed exactly: ``t + 1`` packed into int32 lanes of
``ceil(log2(2N + 1))``-bit fields (``ops.pack_ternary``), one allreduce-Sum for the bucket's
compressed part, and beside it one allreduce-Sum of a flag per tensor (``0 * max|g|``: 0, or
NaN where the tensor holds NaN/Inf on this rank), so a tensor with NaN/Inf on some rank is
NaN on every rank, as a dense allreduce would give. No format the library knows: the
compressor brings its fused bucket's codec (``bucket_codec``, written with the bucket's
kernel functions only, ``layout.ops``), and the exchange runs its round without a line of
``hvd_compress`` changed. :class:`VoteSpec` is the algorithm's definition in numpy, tensor by
tensor, that the tests hold the engine to. ``Compression.register`` gives it a name:
``Compression.by_name`` builds it, and a rank running another compressor is told which one
each rank runs.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Tuple

import numpy as np
import pytest

from hvd_compress import FP16, Compression
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.transport.threads import run_ranks
from hvd_compress.algorithms.base import Compressor
from hvd_compress.algorithms.rounds import Send
from hvd_compress.algorithms.validation import check_count, checked
from hvd_compress.simulator import Simulator
from hvd_compress.wire import FIRST_FREE_NUMBER, header_config, register_algorithm, ternary_lanes
from tests import conformance


def signs(flat: Any, ops: Any) -> Any:
    """``sign(x)`` as int8: TernGrad's codes of ``x`` with scale 1 and zero draws (``[0 < |x|]``)."""
    return ops.terngrad_codes(flat, 1.0, ops.zeros_like(flat))


class MajorityVote(Compressor):
    """signSGD with majority vote (module docstring); tensors under ``dense_below`` elements go dense."""

    payload_kind = "sign"
    fused = True
    dense_below = checked("dense_below", check_count, "Tensors below this many elements go dense (an int >= 0).")

    def __init__(self, dense_below: int = 0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.dense_below = dense_below

    def config(self) -> Dict[str, Any]:
        return {**super().config(), "dense_below": self.dense_below}

    def fused_kind(self, numel: int) -> str:
        return "dense" if numel == 0 or numel < self.dense_below else self.payload_kind

    def bucket_codec(self, layout: Any) -> "MajorityVoteBucketCodec":
        return MajorityVoteBucketCodec(layout)


def majority(sign_sum: Any, world: int, dtype: Any, ops: Any) -> Any:
    """``N sign(sum of signs)`` in ``dtype``'s accumulation dtype (the average is the vote)."""
    acc = ops.accumulation_dtype(dtype)
    vote = signs(ops.cast(sign_sum, acc), ops)
    return ops.cast(vote, acc) * world


class MajorityVoteBucketCodec:
    """The fused bucket's side: one round, the packed signs and a flag per tensor, both allreduce-Sum.

    Written with the bucket's kernel functions (``layout.ops``), slicing and arithmetic only,
    each result a new array: the same code runs numpy arrays, torch tensors and TensorFlow's tensors.
    """

    rounds = 1
    spare = 0  # no work entry beyond the compressed part

    def __init__(self, layout: Any) -> None:
        ops = layout.ops
        #: each work entry's tensor (its row), to spread a tensor's flag over its entries
        self.row_of = ops.concat([ops.full(grp.n, row, layout.like, ops.int64)
                                  for grp in layout.groups for row in range(grp.first, grp.last)])

    def wire(self, layout: Any, itemsize: int) -> Tuple[int, int]:
        """``(bytes sent, values sent)`` of a step: the int32 lanes, and a flag per tensor."""
        ops = layout.ops
        flag_size = ops.itemsize(ops.empty(0, layout.acc, layout.like))
        return 4 * ternary_lanes(layout.n_compressed, layout.world) + len(layout.compressed) * flag_size, \
            layout.n_compressed

    def exchange(self, layout: Any, g: Any, step: Any) -> Generator[List[Send], Dict[str, Any], Any]:
        """Signs and flags in one round; the decode: ``(N vote, NaN for a flagged tensor; the flags)``."""
        ops, world = layout.ops, layout.world
        largest, _ = ops.terngrad_bucket_scales(g, layout.groups, None)  # max|g| of every tensor
        flags = ops.cast(largest, layout.acc) * 0  # 0, or NaN where the tensor holds NaN/Inf
        received = yield [Send("signs", "sum", ops.pack_ternary(signs(g, ops), world)),
                          Send("flags", "sum", flags)]
        sign_sum = ops.unpack_ternary_sum(received["signs"], layout.n_compressed, world)
        flagged = received["flags"]  # NaN where some rank's tensor held NaN/Inf
        total = majority(sign_sum, world, layout.dtype, ops) + ops.take(flagged, self.row_of)
        return total, ops.isnan(flagged)


def make() -> MajorityVote:
    return MajorityVote()


class VoteSpec:
    """The per-tensor spec of N ranks voting (``step`` as :class:`tests.oracle.PerTensorRanks` has it):
    ``sign(sum of sign(g_r))``, or under ``dense_below`` the dense average (summed in rank order in
    float32, rounded to the gradients' dtype, divided by N)."""

    def __init__(self, n_ranks: int, compressor: MajorityVote) -> None:
        self.n_ranks, self.dense_below = n_ranks, compressor.dense_below

    def step(self, grads: Dict[str, List[Any]]) -> Dict[str, np.ndarray]:
        out = {}
        for name, per_rank in grads.items():
            values = [conformance.as_numpy(g) for g in per_rank]
            if values[0].size < self.dense_below:
                total = values[0].astype(np.float32)
                for v in values[1:]:
                    total = total + v.astype(np.float32)
                out[name] = (total.astype(values[0].dtype).astype(np.float32) / np.float32(self.n_ranks)).astype(
                    values[0].dtype)
            else:
                out[name] = np.sign(np.sum([np.sign(v) for v in values], axis=0)).astype(values[0].dtype)
        return out


# --------------------------------------------------------------------------- the algorithm itself
def test_the_vote_of_three_ranks():
    grads = {"w": [np.array([1.0, -2.0, 0.5, 0.0, -1.0], np.float32),
                   np.array([3.0, -1.0, -0.5, 0.0, 2.0], np.float32),
                   np.array([-1.0, 4.0, -0.25, 0.0, 0.0], np.float32)]}
    out = Simulator(3, make()).step(grads)["w"]
    np.testing.assert_array_equal(out, [1.0, -1.0, -1.0, 0.0, 0.0])
    assert out.dtype == np.float32


def test_sends_packed_signs_and_small_tensors_dense():
    sim = Simulator(2, MajorityVote(dense_below=10))
    sim.step({"w": [np.ones(40, np.float32)] * 2, "b": [np.ones(5, np.float32)] * 2})
    header, flag = 16, 4  # [config hash, layout hash] at a layout's first step; a float32 flag per tensor
    assert sim.bytes_sent_per_rank == [header + 4 * ternary_lanes(40, 2) + flag + 5 * 4] * 2
    compressor = MajorityVote(dense_below=10)
    assert compressor.config() == {"type": "MajorityVote", "dense_below": 10}
    with pytest.raises(ValueError, match="hvd_compress: MajorityVote dense_below"):
        compressor.dense_below = -1


def test_rejects_bad_gradients():
    conformance.check_rejects_bad_gradients(make)


# --------------------------------------------------------------------------- through the real exchange
@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow", "tensorflow-kernels"])
def test_thread_ranks_through_the_real_exchange_equal_the_per_tensor_spec(framework):
    conformance.check_thread_ranks_equal_per_tensor_spec(make, ranks=3, framework=framework, rtol=0, spec=VoteSpec)


def test_drop_in_torch_optimizer_on_thread_ranks_equals_the_simulator():
    conformance.check_drop_in_optimizer_equals_simulator(make)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_state_dict_round_trip_continues_exactly(framework):
    conformance.check_state_dict_round_trip(make, framework=framework)


def test_ranks_configured_differently_fail_clearly():
    conformance.check_ranks_disagreeing_fail_clearly(make, lambda: MajorityVote(dense_below=100))
    conformance.check_ranks_disagreeing_fail_clearly(make, FP16)


def vote_against_fp16() -> None:
    """Rank 0 votes, rank 1 runs FP16: the header check's error (thread ranks)."""
    compressors = [make(), FP16()]
    run_ranks(2, lambda comm: conformance.exchange_steps(comm, compressors[comm.rank], 1, "numpy"), timeout=20)


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


def exchange_step(comm: Any, compressor: MajorityVote, poisoned: str = "") -> Dict[str, np.ndarray]:
    """One step of this rank through one bucket; rank 1's ``poisoned`` holds a NaN."""
    exchange = BucketExchange(compressor, comm, "bucket0")
    for name, per_rank in conformance.gradients(0, comm.size).items():
        grad = per_rank[comm.rank].copy()
        if name == poisoned and comm.rank == 1:
            grad[3] = np.nan
        exchange.add(name, grad)
    exchange.launch()
    return exchange.finish(average=True)


def test_a_nan_on_one_rank_is_nan_on_every_rank_and_the_rest_votes():
    results = run_ranks(3, lambda comm: exchange_step(comm, make(), "layer.bias"), timeout=30)
    want = VoteSpec(3, make()).step({"layer.weight": conformance.gradients(0, 3)["layer.weight"]})["layer.weight"]
    for result in results:
        assert np.isnan(result["layer.bias"]).all()
        np.testing.assert_array_equal(result["layer.weight"], want)


def test_a_fused_step_sends_the_packed_signs_and_a_flag_per_tensor():
    compressors = [MajorityVote(dense_below=100) for _ in range(3)]  # the bias (40) dense, the weight (320) voted
    results = run_ranks(3, lambda comm: exchange_step(comm, compressors[comm.rank]), timeout=30)
    want = VoteSpec(3, MajorityVote(dense_below=100)).step(conformance.gradients(0, 3))
    header, dense, flag = 16, 40 * 4, 4  # [config hash, layout hash] once; float32 bias and flag
    for compressor, result in zip(compressors, results):
        assert compressor.stats.bytes_sent == header + dense + 4 * ternary_lanes(320, 3) + flag
        for name in want:
            np.testing.assert_array_equal(result[name], want[name], err_msg=name)
