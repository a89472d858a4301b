"""``Auto``: the decision (injected timings, ties, ranks that disagree), switching without losing
anything, checkpoints, pinning, and steady steps free of host reads (thread ranks, torch CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvd_compress import Auto, RegTopK, TernGrad, TopK  # noqa: E402
from benchmarks.host_reads import count_host_reads  # noqa: E402
from hvd_compress.engine.auto import BucketChoice, decide  # noqa: E402
from hvd_compress.engine.exchange import open_exchange  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402

SHAPES = {"w1": (64, 32), "w2": (48, 40), "b": (8,)}
STEPS = 9


class FakeClock:
    """Injected timings: each timed exchange marks start, launched (= dense start), dense stop, then
    before and after ``finish``; ``dense_ms`` is the dense interval, ``compressed_ms`` the other two."""

    def __init__(self, dense_ms: float, compressed_ms: float) -> None:
        self.dense_ms, self.compressed_ms, self.count = dense_ms, compressed_ms, 0

    def mark(self, like):
        self.count += 1
        return (self.count - 1) % 5

    def elapsed_ms(self, start, stop):
        return self.dense_ms if (start, stop) == (1, 2) else self.compressed_ms / 2


def gradient(rank: int, step: int, name: str) -> torch.Tensor:
    seed = 1000 * rank + 10 * step + sorted(SHAPES).index(name)
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def exchange_steps(auto: Auto, comm, steps, on_step=None, average=False):
    """``steps`` exchanges of one bucket; what they delivered (sums over ranks, or averages), summed."""
    delivered = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for step in steps:
        if on_step is not None:
            on_step(step, auto)
        exchange = open_exchange(auto, comm, "bucket")
        for name in SHAPES:
            exchange.add(name, gradient(comm.rank, step, name))
        exchange.launch()
        for name, total in exchange.finish(average=average).items():
            delivered[name] += total
    return delivered


# ------------------------------------------------------------------ decision
@pytest.mark.parametrize(
    "dense, compressed, margin, expected",
    [(10.0, 4.0, 0.0, "compressed"), (4.0, 10.0, 0.0, "dense"), (5.0, 5.0, 0.0, "dense"),
     (10.0, 9.6, 0.05, "dense"), (10.0, 9.4, 0.05, "compressed")],
)
def test_decide_both_ways_ties_go_dense(dense, compressed, margin, expected):
    assert decide(dense, compressed, margin) == expected


@pytest.mark.parametrize(
    "per_rank, expected",
    [([(1.0, 2.0), (3.0, 0.5)], ("compressed", 3.0, 2.0)),  # rank 0 alone would pick dense
     ([(2.0, 1.0), (1.0, 3.0)], ("dense", 2.0, 3.0)),  # rank 0 alone would pick compressed
     ([(2.0, 2.0), (2.0, 2.0)], ("dense", 2.0, 2.0))],
)
def test_ranks_whose_clocks_disagree_make_the_same_choice(per_rank, expected):
    def work(comm):
        auto = Auto(TopK(0.1), log=False)
        like = [("g", torch.zeros(4))]
        choice = auto.settle("bucket", like, comm, mine=per_rank[comm.rank])
        state = auto.choices["bucket"]
        return choice, state.dense_ms, state.compressed_ms

    assert run_ranks(2, work) == [expected, expected]


@pytest.mark.parametrize("dense_ms, compressed_ms, expected", [(1.0, 5.0, "dense"), (5.0, 1.0, "compressed")])
def test_measured_bucket_goes_the_cheaper_way_and_logs_once(dense_ms, compressed_ms, expected):
    lines = []

    def work(comm):
        auto = Auto(TopK(0.1, dense_below=16), warmup=2, indices=None, clock=FakeClock(dense_ms, compressed_ms),
                    log=lines.append)
        exchange_steps(auto, comm, range(STEPS))
        return auto.stats.decisions["bucket"]

    decisions = run_ranks(2, work)
    assert decisions[0] == decisions[1]
    assert decisions[0]["choice"] == expected
    assert (decisions[0]["dense_ms"], decisions[0]["compressed_ms"]) == (dense_ms, compressed_ms)
    assert len(lines) == 1 and lines[0].endswith(f"-> {expected}") and "bucket" in lines[0]


# -------------------------------------------------------------- conservation
@pytest.mark.parametrize("make", [TopK, RegTopK])
def test_switching_loses_nothing(make):
    """sent + residual == produced across compressed -> dense -> compressed (re-measured) switches;
    the first dense exchange flushes every residual."""

    def work(comm):
        auto = Auto(make(0.1, dense_below=16), warmup=2, indices=None, clock=FakeClock(1.0, 5.0), log=False)
        modes, residuals = [], []

        def watch(step, auto):
            if step == 9:  # now compressed is faster: measure again
                auto.clock = FakeClock(5.0, 1.0)
                auto.remeasure()
            modes.append(auto.mode(auto.choices.setdefault("bucket", BucketChoice())))
            residuals.append([auto.residual(n) for n in SHAPES])

        delivered = exchange_steps(auto, comm, range(16), watch)
        final = {n: auto.residual(n) for n in SHAPES}
        return delivered, final, modes, residuals

    results = run_ranks(2, work)
    modes = results[0][2]
    assert modes == results[1][2]
    assert modes[:4] == ["measure"] * 3 + ["decide"] and modes[4:9] == ["dense"] * 5
    assert modes[9:13] == ["measure"] * 3 + ["decide"] and modes[13:] == ["compressed"] * 3
    for _, _, _, residuals in results:
        assert all(r is None for step in range(5, 10) for r in residuals[step])  # flushed at step 4
    produced = {n: sum(gradient(r, s, n) for r in range(2) for s in range(16)) for n in SHAPES}
    for name in SHAPES:
        left = sum(res[1][name].reshape(SHAPES[name]) for res in results if res[1][name] is not None)
        torch.testing.assert_close(results[0][0][name] + left, produced[name], rtol=0, atol=1e-10)
        torch.testing.assert_close(results[1][0][name], results[0][0][name], rtol=0, atol=0)


class WayClock(FakeClock):
    """:class:`FakeClock` whose compressed time depends on the way the timed exchange travels (the measuring
    state of ``auto_of()`` says which): ``own_ms`` for the compressor's own index mode, ``other_ms`` for the other."""

    def __init__(self, auto_of, dense_ms: float, own_ms: float, other_ms: float) -> None:
        super().__init__(dense_ms, own_ms)
        self.auto_of, self.own_ms, self.other_ms = auto_of, own_ms, other_ms

    def mark(self, like):
        auto = self.auto_of()
        own = auto.choices["bucket"].measured <= auto.warmup + 1  # this exchange's place in the measurement
        return super().mark(like), self.own_ms if own else self.other_ms

    def elapsed_ms(self, start, stop):
        self.compressed_ms = start[1]
        return super().elapsed_ms(start[0], stop[0])


@pytest.mark.parametrize("own, other, expected", [(3.0, 1.0, "indices=leader"), (1.0, 3.0, "compressed"),
                                                   (2.0, 2.0, "compressed"), (9.0, 8.0, "dense")])
def test_three_ways_measured_the_fastest_wins_and_nothing_is_lost(own, other, expected):
    """Asked to, a gathering Top-k also measures its shared-index (leader) way; the fastest of dense, gather and
    leader is chosen on every rank (ties to the compressor's own way, then dense), and sent + residual
    == produced across the ways."""

    def work(comm):
        holder = {}
        auto = holder["auto"] = Auto(TopK(0.1, dense_below=16), warmup=2, log=False, indices="leader",
                                     clock=WayClock(lambda: holder["auto"], 5.0, own, other))
        modes = []

        def watch(step, auto):
            modes.append(auto.mode(auto.choices.setdefault("bucket", BucketChoice())))

        delivered = exchange_steps(auto, comm, range(9), watch)
        return delivered, {n: auto.residual(n) for n in SHAPES}, modes, auto.stats.decisions["bucket"]

    results = run_ranks(2, work)
    assert results[0][2] == results[1][2] == ["measure"] * 6 + ["decide"] + [expected] * 2
    decision = results[0][3]
    assert decision == results[1][3] and decision["choice"] == expected
    assert (decision["dense_ms"], decision["compressed_ms"], decision["alternative_ms"]) == (5.0, own, other)
    produced = {n: sum(gradient(r, s, n) for r in range(2) for s in range(9)) for n in SHAPES}
    for name in SHAPES:
        left = sum(res[1][name].reshape(SHAPES[name]) for res in results if res[1][name] is not None)
        torch.testing.assert_close(results[0][0][name] + left, produced[name], rtol=0, atol=1e-10)


def test_the_other_index_mode_is_the_leader_or_gather_and_can_be_turned_off():
    assert Auto(TopK(0.1)).alternative is None  # the modes train differently: trying another is asked for
    assert Auto(TopK(0.1), indices="auto").alternative.indices == "leader"
    assert Auto(TopK(0.1, indices="aggregate"), indices="auto").alternative.indices == "gather"
    assert Auto(TopK(0.1), indices="aggregate").alternative.indices == "aggregate"
    assert Auto(TernGrad(), indices="auto").alternative is None
    with pytest.raises(ValueError, match="indices must be one of"):
        Auto(TopK(0.1), indices="broadcast")
    auto = Auto(TopK(0.1), indices="auto")
    auto.ratio = 0.02  # a density schedule sets both ways
    assert auto.inner.ratio == auto.alternative.ratio == 0.02


# ----------------------------------------------------------------- checkpoints
def test_checkpoint_carries_decisions_measurements_and_residuals():
    def work(comm):
        auto = Auto(TopK(0.1, dense_below=16), warmup=2, indices=None, clock=FakeClock(5.0, 1.0), log=False)
        exchange_steps(auto, comm, range(5))
        state = auto.state_dict()
        fresh = Auto(TopK(0.1, dense_below=16), warmup=2, indices=None, log=False)
        fresh.load_state_dict(state)
        return auto, fresh

    for auto, fresh in run_ranks(2, work):
        assert fresh.choices["bucket"].public() == auto.choices["bucket"].public()
        assert fresh.stats.decisions == auto.stats.decisions
        assert fresh.mode(fresh.choices["bucket"]) == "compressed"  # no new measurement after resuming
        for name in ("w1", "w2"):
            torch.testing.assert_close(fresh.residual(name), auto.residual(name), rtol=0, atol=0)
    with pytest.raises(ValueError, match="hvd_compress: checkpoint holds TopK"):
        Auto(TopK(0.1)).load_state_dict(TopK(0.1).state_dict())


# ------------------------------------------------------------------- pinning
@pytest.mark.parametrize("make", [lambda: TopK(0.1, dense_below=16), lambda: RegTopK(0.1, dense_below=16),
                                  lambda: TernGrad(seed=3)])
def test_pinned_compressed_equals_the_simulator(make):
    def work(comm):
        auto = Auto(make(), pin="compressed", log=False)
        return exchange_steps(auto, comm, range(4), average=True), auto.choices

    results = run_ranks(2, work)
    sim = Simulator(2, make())
    expected = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for step in range(4):
        out = sim.step({n: [gradient(r, step, n) for r in range(2)] for n in SHAPES})
        for n in SHAPES:
            expected[n] += torch.as_tensor(out[n])
    for name in SHAPES:
        torch.testing.assert_close(results[0][0][name], expected[name], rtol=0, atol=1e-12)
        torch.testing.assert_close(results[1][0][name], expected[name], rtol=0, atol=1e-12)


def test_pinned_dense_by_environment_is_the_plain_sum(monkeypatch):
    monkeypatch.setenv("HVD_COMPRESS_AUTO_PIN", "dense")

    def work(comm):
        return exchange_steps(Auto(TopK(0.1), log=False), comm, range(3))

    delivered = run_ranks(2, work)[0]
    for name in SHAPES:
        expected = sum(gradient(r, s, name) for r in range(2) for s in range(3))
        torch.testing.assert_close(delivered[name], expected, rtol=0, atol=1e-12)


def test_bad_arguments_are_clear_errors(monkeypatch):
    with pytest.raises(TypeError, match="hvd_compress: Auto"):
        Auto("topk")
    with pytest.raises(ValueError, match="hvd_compress: Auto pin"):
        Auto(TopK(0.1), pin="sometimes")
    with pytest.raises(ValueError, match="hvd_compress: Auto margin"):
        Auto(TopK(0.1), margin=1.5)
    monkeypatch.setenv("HVD_COMPRESS_AUTO_DECIDE_EVERY", "7")
    assert Auto(TopK(0.1)).decide_every == 7


# -------------------------------------------------------------- host reads
@pytest.mark.parametrize("dense_ms, compressed_ms", [(1.0, 5.0), (5.0, 1.0)])
def test_steady_steps_read_nothing_back(dense_ms, compressed_ms):
    def work(comm):
        auto = Auto(TopK(0.1, dense_below=16), warmup=2, indices=None, clock=FakeClock(dense_ms, compressed_ms), log=False)
        exchange_steps(auto, comm, range(6))
        with count_host_reads() as reads:
            exchange_steps(auto, comm, range(6, 9))
        # numpy views of CPU tensors (Top-k's CPU selection) copy nothing and wait for nothing
        return {k: n for k, n in reads.by_kind.items() if k not in ("numpy", "cpu")}

    assert run_ranks(2, work) == [{}, {}]


@pytest.mark.parametrize("dtypes", [("float64",), ("float64", "float16")], ids=["one-dtype", "two-dtypes"])
def test_tensorflow_going_dense_flushes_the_residual(dtypes):
    """TensorFlow tensors (float64 computed as numpy, float16 on TensorFlow's kernels: two fused buckets,
    measured with a dense allreduce each): going dense sends the residual with the gradient, nothing lost.
    Gradients in eighths: every sum is exact in float16 too."""
    tf = pytest.importorskip("tensorflow")
    import numpy as np

    names = [f"w{i}" for i in range(len(dtypes))]

    def grad(rank, step, i):
        return np.round(np.random.default_rng(100 * i + 10 * step + rank).normal(size=(64, 32)) * 8) / 8

    def work(comm):
        auto = Auto(TopK(0.1, dense_below=16), warmup=2, indices=None, clock=FakeClock(1.0, 5.0), log=False)
        delivered = {name: np.zeros((64, 32)) for name in names}
        for step in range(7):
            exchange = open_exchange(auto, comm, "bucket")
            for i, (name, dtype) in enumerate(zip(names, dtypes)):
                exchange.add(name, tf.constant(grad(comm.rank, step, i), dtype))
            exchange.launch()
            for name, total in exchange.finish(average=False).items():
                delivered[name] += np.asarray(total, dtype=np.float64)
        return delivered, [auto.residual(name) for name in names], auto.stats.decisions["bucket"]["choice"]

    results = run_ranks(2, work)
    for delivered, residuals, choice in results:
        assert choice == "dense" and residuals == [None] * len(names)
        for i, name in enumerate(names):
            produced = sum(grad(r, s, i) for r in range(2) for s in range(7))
            np.testing.assert_array_equal(delivered[name], produced, err_msg=name)


def test_density_warmup_has_auto_measure_again_when_the_ramp_reaches_the_target(monkeypatch):
    """During the ramp the sparsifiers send most tensors dense: a choice made there is for the wrong
    density, so the schedule step that reaches the target (and only that one) calls ``remeasure``."""
    from hvd_compress import DensityWarmup

    auto = Auto(TopK(0.01), log=False)
    calls = []
    monkeypatch.setattr(auto, "remeasure", lambda: calls.append(auto.ratio))
    schedule = DensityWarmup(auto, warmup_steps=3, start=0.25)
    for _ in range(5):
        schedule.step()
    assert calls == [0.01]


# ------------------------------------------------------------------ contract
#: what routes, the Simulator, schedules, callbacks and checkpoints call on a ``compression=``
#: (:class:`~hvd_compress.algorithms.base.ExchangePolicy`), Horovod's compress/decompress included
ROUTE_MEMBERS = ("config", "config_hash", "seed", "rank", "bind", "nonfinite", "fused", "dense_only",
                 "dense_wire_dtype", "state_for", "state", "memory", "stats", "residual", "reset", "state_dict",
                 "load_state_dict", "ratio", "dense_below", "error_feedback", "momentum", "velocity", "remeasure",
                 "make_exchange", "compress", "decompress")
#: a compressor's own business (the engine calls them on the compressor an exchange runs), not a policy's
COMPRESSOR_INTERNALS = ("bucket_codec", "fused_kind", "generator", "warn_dense", "own_state", "payload_kind")


def test_auto_is_an_exchange_policy_holding_its_compressor():
    from hvd_compress.algorithms import Compressor, as_compressor
    from hvd_compress.algorithms.base import ExchangePolicy, is_compression

    inner = TopK(0.01, momentum=0.9, dense_below=16)
    auto = Auto(inner, log=False, indices="auto")
    assert not isinstance(auto, Compressor) and isinstance(auto, ExchangePolicy) and is_compression(auto)
    assert [m for m in ROUTE_MEMBERS if not hasattr(auto, m)] == []
    assert [m for m in COMPRESSOR_INTERNALS if hasattr(auto, m)] == []
    assert auto.bind(1, 2) is auto and (inner.rank, inner.size, auto.rank) == (1, 2, 1)
    assert auto.state is inner.state and auto.memory is inner.memory and auto.stats is inner.stats
    assert (auto.seed, auto.fused, auto.dense_only, auto.dense_wire_dtype, auto.dense_below, auto.error_feedback,
            auto.momentum) == (0, True, False, None, 16, True, 0.9)
    auto.nonfinite, auto.ratio = "raise", 0.05
    assert inner.nonfinite == "raise" and inner.ratio == auto.alternative.ratio == auto.ratio == 0.05
    assert as_compressor(auto) is auto
    with pytest.raises(TypeError, match="needs arguments"):
        as_compressor(Auto)
    with pytest.raises(TypeError, match="hvd_compress: Auto"):
        Auto(auto)


def test_auto_and_its_dense_view_hash_their_configuration_as_before():
    """The headers every rank compares (horovod.tensorflow's check of ``Auto``, a dense bucket's plan): the
    numbers the compressor subclasses ``Auto`` and ``DenseView`` used to send."""
    from hvd_compress.algorithms.state import CompressorState

    auto = Auto(TopK(0.01), log=False, indices="auto").bind(1, 2)
    assert (auto.config_hash(), auto.dense.config_hash(CompressorState())) == (1400225196, 2123790569)
    assert repr(auto.dense) == f"DenseView(of={repr(auto.inner)!r})"


@pytest.mark.parametrize("make", [lambda: TopK(0.1, dense_below=16), lambda: RegTopK(0.1, momentum=0.9)])
def test_the_simulator_runs_auto_pinned_as_its_compressor_or_dense(make):
    """A route (the Simulator, 3 ranks) runs ``Auto`` pinned compressed to the inner compressor's averages,
    residuals, velocities and bytes, and pinned dense to the plain average of the gradients."""
    import numpy as np

    rng = np.random.default_rng(11)
    steps = [{n: [rng.normal(size=s) for _ in range(3)] for n, s in SHAPES.items()} for _ in range(3)]
    auto, plain = Simulator(3, Auto(make(), pin="compressed", log=False)), Simulator(3, make())
    dense = Simulator(3, Auto(TopK(0.1), pin="dense", log=False))
    for grads in steps:
        got, expected, averaged = auto.step(grads), plain.step(grads), dense.step(grads)
        assert auto.bytes_sent_per_rank == plain.bytes_sent_per_rank
        for n, (g0, g1, g2) in grads.items():
            np.testing.assert_array_equal(got[n], expected[n])
            np.testing.assert_allclose(averaged[n], (g0 + g1 + g2) / 3, rtol=1e-14, atol=1e-15)
    for n in SHAPES:
        for ours, theirs in [(auto.residuals(n), plain.residuals(n)), (auto.velocities(n), plain.velocities(n))]:
            assert [x is None for x in ours] == [x is None for x in theirs]
            for a, b in zip(ours, theirs):
                if a is not None:
                    np.testing.assert_array_equal(a, b)
    assert any(r is not None for r in auto.residuals("w1"))


def test_the_simulator_seeds_auto_as_its_compressor():
    """``Simulator(n, Auto(c), seed=s)`` draws what ``Simulator(n, c, seed=s)`` draws (TernGrad's stream), in
    both index modes' copies of a sparsifier."""
    import numpy as np

    rng = np.random.default_rng(5)
    grads = {n: [rng.normal(size=s) for _ in range(2)] for n, s in SHAPES.items()}
    got = Simulator(2, Auto(TernGrad(), pin="compressed", log=False), seed=3).step(grads)
    want = Simulator(2, TernGrad(), seed=3).step(grads)
    other = Simulator(2, TernGrad(), seed=4).step(grads)
    for n in SHAPES:
        np.testing.assert_array_equal(got[n], want[n])
    assert any(not np.array_equal(want[n], other[n]) for n in SHAPES)
    auto = Auto(TopK(0.1), indices="auto", log=False)
    auto.seed = 9
    assert auto.inner.seed == auto.alternative.seed == 9


def test_a_density_ramp_keeps_the_dense_plan_and_compile_is_not_agreed_on():
    """A dense bucket sends the same whatever the density: while a warm-up ramps it, ``Auto``'s dense plan
    stays (no rebuild and no header check at every step), and it is rebuilt once, when the ramp ends.
    Ranks whose compressors differ only in ``compile=`` (a machine's setting) send the same headers."""
    from hvd_compress import DensityWarmup
    from hvd_compress.algorithms.state import CompressorState
    from hvd_compress.transport.communicator import SingleProcessCommunicator

    auto = Auto(TopK(0.01, momentum=0.9, dense_below=0), pin="dense", log=False)
    comm, run = SingleProcessCommunicator(), CompressorState()
    ramp = DensityWarmup(auto, 4, start=0.25)
    generator, plans, densities = torch.Generator().manual_seed(3), [], []
    for _ in range(6):
        exchange = open_exchange(auto, comm, "bucket", run)
        exchange.add("w", torch.randn(3000, generator=generator))
        exchange.launch()
        exchange.finish(average=True)
        plans.append([id(bucket) for bucket in run.buckets.values()])
        densities.append(auto.ratio)
        ramp.step()
    assert densities[0] == 0.25 and densities[3] > 0.01 and densities[4] == 0.01
    assert plans[0] == plans[1] == plans[2] == plans[3] != plans[4] == plans[5]
    for make in (lambda **o: Auto(TopK(0.01, **o), log=False), lambda **o: Auto(RegTopK(0.05, **o), log=False)):
        mine, theirs = make(compile=False).bind(1, 2), make().bind(1, 2)
        assert mine.config_hash() == theirs.config_hash()
        assert mine.dense.config_hash(CompressorState()) == theirs.dense.config_hash(CompressorState())
