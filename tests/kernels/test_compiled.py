"""The CPU's fused passes (:mod:`hvd_compress.kernels.torch_compiled`) compiled with ``torch.compile``.

The suite runs them eagerly (``HVD_COMPRESS_COMPILE=0``, tests/conftest.py); here they compile, in this
process only. Compiled equals eager bit for bit where the arithmetic is the same (marks, counts, maxima,
TernGrad's codes) and within float rounding where a compiled reduction reorders sums (moments, std); the
engine gives the same averages, residuals and bytes either way; a steady step compiles nothing; where
the compiler fails, one warning and eager results. Also the CPU's sampled-limit Top-k on rows long
enough to be sampled, against the reference.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import DensityWarmup, GaussianK, RegTopK, TernGrad, TopK  # noqa: E402
from hvd_compress.kernels import torch_compiled as C  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402

SPECIALS = (np.nan, np.inf, -np.inf, 0.0)


@pytest.fixture
def compiling(monkeypatch):
    monkeypatch.setenv(C.COMPILE_ENV, "1")


def rows_with_specials(rows, n, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, n)).astype(dtype)
    a[0, rng.integers(0, n, 3)] = SPECIALS[:3]
    a[-1, : n // 4] = a[-1, n // 4 : n // 2]  # ties
    return torch.from_numpy(a)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows", [1, 3])
def test_compiled_passes_equal_eager_bit_for_bit(compiling, rows, dtype):
    a = rows_with_specials(rows, 1000, rows, dtype)
    limit = torch.from_numpy(np.linspace(-0.5, 1.5, rows, dtype=dtype)[:, None])
    limits = torch.from_numpy(np.tile(np.asarray([0.1, 0.7, 1.3, 2.1], dtype), (rows, 1)))
    uniform = torch.from_numpy(np.random.default_rng(9).random((rows, 1000)).astype(dtype))
    bound = torch.from_numpy(np.full((rows, 1), 1.7, dtype))
    scale = torch.from_numpy(np.full((rows, 1), 2.3, dtype))
    rate = torch.from_numpy(np.abs(rows_with_specials(rows, 1000, 7, dtype).numpy()) * 0.37)
    age = torch.from_numpy(np.random.default_rng(5).integers(0, 40, (rows, 1000)).astype(dtype))
    aged = [torch.full_like(age, -1.0) for _ in range(3)]
    for p, args in [(C.marks_and_largest, (a, limit)), (C.marks_above, (a, limit)), (C.counts_above, (a, limits)),
                    (C.magnitude_marks_above, (a, limit)), (C.magnitude_counts_above, (a, limits)),
                    (C.largest_magnitudes, (a,)),
                    (C.aged_marks, (a, rate, age, aged, limit * 10))]:
        calls = [args[:3] + (aged[i],) + args[4:] if p is C.aged_marks else args for i in range(3)]
        got, source, eager = (p(*calls[0]), p.fn(*calls[1]), p.eager(*calls[2]))  # compiled; its source, eager
        if p is C.aged_marks:  # and the ages it wrote
            got, source, eager = (x + (y,) for x, y in zip((got, source, eager), aged))
            np.testing.assert_array_equal(aged[0].numpy(), age.numpy() + 1)
        for g, s, e in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, source, eager))):
            assert g.dtype == s.dtype == e.dtype
            np.testing.assert_array_equal(g.numpy(), s.numpy())
            np.testing.assert_array_equal(g.numpy(), e.numpy())
    for of_magnitude, plain, args in [(C.magnitude_marks_above, C.marks_above, (limit,)),
                                      (C.magnitude_counts_above, C.counts_above, (limits,))]:
        np.testing.assert_array_equal(of_magnitude(a, *args).numpy(), plain(a.abs(), *args).numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_compiled_ternary_codes_equal_eager_from_uniforms_and_from_stream_keys(compiling, dtype):
    """The codes written into ``out`` from drawn uniforms, and from each row's counter-stream keys (the pass
    makes the uniforms), compiled and eagerly, equal ``sign(g) [u < min(|g|, b) / S]`` with the uniforms of
    the spec's counter stream; the torch kernels' eager draws of the same calls are those uniforms."""
    from hvd_compress.kernels import torch_ops as T
    from spec.ranks import counter_draws

    rows, n = 3, 1001
    a = rows_with_specials(rows, n, 5, np.float32 if dtype == np.float16 else dtype)
    stream, spec_stream = T.generator(7, 2, a), counter_draws(7, 2)
    stream.take(12345)
    spec_stream(12345)
    keys = torch.tensor([stream.take(n) for _ in range(rows)], dtype=torch.int32)  # (rows, 2)
    drawn = np.stack([spec_stream(n) for _ in range(rows)])
    uniform = torch.from_numpy(drawn).to(getattr(torch, np.dtype(dtype).name))
    eager_draws = T.generator(7, 2, a)
    eager_draws.take(12345)
    np.testing.assert_array_equal(np.stack([T.uniform_into(eager_draws, torch.empty(n)).numpy() for _ in range(rows)]),
                                  drawn)
    bound = torch.full((rows, 1), 1.7, dtype=a.dtype)
    scale = torch.from_numpy(np.array([[2.3], [0.0], [np.inf]], a.numpy().dtype))
    outs = [torch.full((rows, n), 7, dtype=torch.int8) for _ in range(4)]
    C.ternary_codes(a, uniform, bound, scale, outs[0])
    C.ternary_codes.eager(a, uniform, bound, scale, outs[1])
    if dtype != np.float16:  # from keys: the uniforms of a's own dtype
        C.keyed_ternary_codes(a, keys[:, :1], keys[:, 1:], bound, scale, outs[2])
        C.keyed_ternary_codes.eager(a, keys[:, :1], keys[:, 1:], bound, scale, outs[3])
    else:
        outs[2:] = outs[:2]
    keep = uniform < torch.minimum(a.abs(), bound) / scale  # NaN entries: never kept
    expected = torch.where(keep, torch.sign(a), 0).to(torch.int8)
    for out in outs:
        np.testing.assert_array_equal(out.numpy(), expected.numpy())


@pytest.mark.parametrize("world_size", [1, 3, 16])
@pytest.mark.parametrize("numel", [1, 32, 45, 1003])
def test_compiled_packing_equals_eager_and_the_reference(compiling, world_size, numel):
    """TernGrad's lanes and 2-bit bytes packed in one compiled pass, a last partial word included, equal the
    eager kernels' and the reference's (and unpack to the codes); the code sums times each row's scale too."""
    from hvd_compress.kernels import reference as R
    from hvd_compress.kernels import torch_ops as T
    from hvd_compress.kernels.groups import Group

    codes = np.random.default_rng(numel).integers(-1, 2, numel).astype(np.int8)
    t = torch.from_numpy(codes)
    for compile in (True, False):
        lanes = T.pack_ternary(t, world_size, compile)
        two_bit = T.pack_two_bit(t, compile)
        np.testing.assert_array_equal(lanes.numpy(), R.pack_ternary(codes, world_size))
        np.testing.assert_array_equal(two_bit.numpy(), R.pack_two_bit(codes))
        summed = T.unpack_ternary_sum(lanes, numel, world_size)
        assert summed.dtype == torch.int32
        np.testing.assert_array_equal(summed.numpy(), R.unpack_ternary_sum(lanes.numpy(), numel, world_size))
        unpacked = T.unpack_two_bit(two_bit, numel)
        assert unpacked.dtype == torch.int8
        np.testing.assert_array_equal(unpacked.numpy(), codes)
        quarter = numel // 4  # two rows of a quarter, then one of the rest
        groups = ([Group(0, 0, [0], numel)] if not quarter
                  else [Group(0, 0, [0, 1], quarter), Group(2 * quarter, 2, [2], numel - 2 * quarter)])
        scale = torch.tensor([0.37, -1.9, 3.3][: 1 if not quarter else 3], dtype=torch.float32)
        got = T.scale_rows(groups, summed, scale, torch.float32, numel, compile)
        want = R.scale_rows(groups, summed.numpy(), scale.numpy(), np.float32, numel)
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("dtype, g_dtype", [(np.float32, np.float32), (np.float64, np.float64),
                                            (np.float32, np.float16)])
def test_compiled_momentum_update_equals_eager_and_the_reference(compiling, dtype, g_dtype):
    from hvd_compress.kernels import reference as R

    rng = np.random.default_rng(4)
    u = rows_with_specials(1, 5001, 2, dtype)[0]
    g = torch.from_numpy((rng.standard_normal(5001) * 3.1).astype(g_dtype))
    compiled, eager = torch.full_like(u, -7.0), torch.full_like(u, -7.0)
    C.momentum_update(u, g, 0.9, compiled)
    C.momentum_update.eager(u, g, 0.9, eager)
    want = R.momentum_update(u.numpy(), g.numpy(), 0.9)
    assert compiled.dtype == eager.dtype == u.dtype
    np.testing.assert_array_equal(compiled.numpy(), eager.numpy())
    np.testing.assert_array_equal(compiled.numpy(), want)


def test_compiled_reductions_equal_eager_within_rounding(compiling):
    a = torch.from_numpy(np.random.default_rng(3).standard_normal((3, 5000)).astype(np.float32) * 1.7 + 0.3)
    for got, want in [(C.moments(a), C.moments.eager(a)), (C.ternary_scales(a, 2.5), C.ternary_scales.eager(a, 2.5))]:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-6)
    np.testing.assert_array_equal(C.ternary_scales(a, -1.0)[1].numpy(), np.full(3, np.inf, np.float32))
    np.testing.assert_array_equal(C.largest_magnitudes(a).numpy(), C.ternary_scales.eager(a, -1.0)[0].numpy())


def simulate(make, compiled, monkeypatch, steps=4, ranks=3, warmup_steps=None):
    """A Simulator run of ``make()`` on float32 torch tensors: averages, residuals and bytes per step; with
    ``warmup_steps``, under a :class:`DensityWarmup` from 30% stepped after every step."""
    monkeypatch.setenv(C.COMPILE_ENV, "1" if compiled else "0")
    rng = np.random.default_rng(11)
    compressor = make()
    warmup = None if warmup_steps is None else DensityWarmup(compressor, warmup_steps=warmup_steps, start=0.3)
    sim = Simulator(ranks, compressor)
    shapes = {"w": (40, 300), "v": (300, 40), "u": (7001,), "b": (50,)}
    out = []
    for step in range(steps):
        grads = {name: [torch.from_numpy((rng.standard_normal(shape) * (1 + step)).astype(np.float32))
                        for _ in range(ranks)] for name, shape in shapes.items()}
        averages = sim.step(grads)
        residuals = {name: [None if r is None else np.asarray(r) for r in sim.residuals(name)] for name in shapes}
        out.append(({k: v.numpy() for k, v in averages.items()}, residuals, sim.bytes_sent_per_rank))
        if warmup is not None:
            warmup.step()
    return out


ENGINE_CASES = {
    "topk": lambda: TopK(0.02, dense_below=100),
    "regtopk": lambda: RegTopK(0.02, dense_below=100),
    "topk-reuse": lambda: TopK(0.02, dense_below=100, exact_every=2),
    "topk-aggregate": lambda: TopK(0.05, dense_below=100, indices="aggregate"),
    "topk-leader": lambda: TopK(0.05, dense_below=100, indices="leader"),
    "topk-momentum": lambda: TopK(0.02, dense_below=100, momentum=0.9),
    "gaussiank": lambda: GaussianK(0.02, dense_below=100),
    "terngrad": lambda: TernGrad(clip=None, dense_below=100, error_feedback=True),
    "terngrad-clipped": lambda: TernGrad(dense_below=100, error_feedback=True),
}
#: cases whose compiled reductions may round differently: TernGrad's clipping bound (a std) is its scale
WITHIN_ROUNDING = {"terngrad-clipped"}


def assert_same(kind, got, want, message):
    if kind in WITHIN_ROUNDING:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=message)
    else:
        np.testing.assert_array_equal(got, want, err_msg=message)


@pytest.mark.parametrize("kind", sorted(ENGINE_CASES))
def test_engine_compiled_equals_engine_eager(kind, monkeypatch):
    """Bit for bit, but where a scale is a compiled std (clipped TernGrad): within float rounding. Gaussian-k's
    compiled moments may round differently too: on this data no threshold lands between them."""
    eager = simulate(ENGINE_CASES[kind], False, monkeypatch)
    compiled = simulate(ENGINE_CASES[kind], True, monkeypatch)
    for (avg_e, res_e, bytes_e), (avg_c, res_c, bytes_c) in zip(eager, compiled):
        assert bytes_e == bytes_c
        for name in avg_e:
            assert_same(kind, avg_c[name], avg_e[name], f"{kind} {name}")
            for r_c, r_e in zip(res_c[name], res_e[name]):
                assert (r_c is None) == (r_e is None)
                if r_e is not None:
                    assert_same(kind, r_c, r_e, f"{kind} {name} residual")


def test_steady_steps_compile_nothing(compiling, monkeypatch):
    """After a layout's first steps (every pass compiled once, with single- and multi-row groups), later
    steps of that layout, of a new one of other sizes, and of a density warm-up (a new ``k`` and plan every step)
    add no graph: shapes are dynamic."""
    from torch._dynamo.utils import counters

    steady = [ENGINE_CASES[kind] for kind in ("topk", "gaussiank", "terngrad", "topk-reuse", "topk-aggregate",
                                              "topk-momentum")]
    for make in steady:
        simulate(make, True, monkeypatch, steps=2, ranks=2)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for make in steady:
        simulate(make, True, monkeypatch, steps=3, ranks=2)
    assert counters["stats"]["unique_graphs"] == graphs
    sim = Simulator(2, TopK(0.03, dense_below=10))  # other sizes, two size groups of two rows each
    rng = np.random.default_rng(0)
    for _ in range(2):
        sim.step({name: [torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for _ in range(2)]
                  for name, n in (("p", 3000), ("q", 3000), ("s", 777), ("t", 777))})
    assert counters["stats"]["unique_graphs"] == graphs
    for kind in ("topk-momentum", "topk-aggregate"):
        simulate(ENGINE_CASES[kind], True, monkeypatch, steps=4, ranks=2, warmup_steps=3)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_failing_compiler_warns_once_and_runs_eagerly(compiling, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(C, "_broken", False)
    fresh = C.Pass(C.marks_above.fn, C.marks_above.eager)
    monkeypatch.setattr(torch, "compile", broken)
    a, limit = rows_with_specials(2, 100, 1), torch.zeros((2, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = fresh(a, limit)
        second = C.Pass(C.counts_above.fn, C.counts_above.eager)(a, torch.zeros((2, 3)))
    assert len([w for w in caught if "torch.compile failed" in str(w.message)]) == 1
    np.testing.assert_array_equal(first.numpy(), C.marks_above.fn(a, limit).numpy())
    assert second.shape == (2, 3) and not C.enabled(torch.device("cpu"))


def test_ternary_codes_failing_to_compile_after_their_keys_give_the_eager_results(compiling, monkeypatch):
    """TernGrad's keys are taken for the compiled codes pass; where that pass's compilation then fails, the
    same pass runs eagerly from the keys (and later steps draw their uniforms first): the eager run's results."""
    compile_now = torch.compile

    def failing_for_the_codes(fn, **options):
        if fn.__name__ == "keyed_ternary_codes":
            raise RuntimeError("no C++ compiler")
        return compile_now(fn, **options)

    want = simulate(ENGINE_CASES["terngrad"], False, monkeypatch)
    monkeypatch.setattr(C, "_broken", False)
    monkeypatch.setattr(C.keyed_ternary_codes, "compiled", None)
    monkeypatch.setattr(torch, "compile", failing_for_the_codes)
    with pytest.warns(RuntimeWarning, match="torch.compile failed"):
        got = simulate(ENGINE_CASES["terngrad"], True, monkeypatch)
    assert C._broken
    for step, ((g_avg, g_res, g_bytes), (w_avg, w_res, w_bytes)) in enumerate(zip(got, want)):
        assert g_bytes == w_bytes
        for name in w_avg:
            np.testing.assert_array_equal(g_avg[name], w_avg[name], err_msg=f"step {step} {name}")
            for g, w in zip(g_res[name], w_res[name]):
                np.testing.assert_array_equal(g, w, err_msg=f"step {step} {name} residual")


@pytest.mark.parametrize("value, cpu, cuda", [("", True, False), ("auto", True, False), ("1", True, True),
                                               ("on", True, True), ("0", False, False), ("off", False, False)])
def test_the_switch(monkeypatch, value, cpu, cuda):
    monkeypatch.setenv(C.COMPILE_ENV, value)
    assert (C.enabled(torch.device("cpu")), C.enabled(torch.device("cuda"))) == (cpu, cuda)


@pytest.mark.parametrize("switch, option", [("1", False), ("0", True)])
def test_the_compressor_option_overrides_the_switch(monkeypatch, switch, option):
    """``compile=False`` runs every pass eagerly where ``HVD_COMPRESS_COMPILE=1``, ``compile=True`` compiled
    where it is 0: the same averages and residuals, bit for bit (Top-k's, the aggregate rule's and unclipped
    TernGrad's passes: no reordered sums)."""
    compiled_calls, compile_now = [], torch.compile

    def recorded(fn, **options):
        run = compile_now(fn, **options)
        return lambda *args: compiled_calls.append(fn.__name__) or run(*args)

    monkeypatch.setattr(torch, "compile", recorded)
    for p in (C.marks_and_largest, C.aged_marks, C.counts_above, C.marks_above, C.moments, C.ternary_scales,
              C.ternary_codes, C.keyed_ternary_codes, C.largest_magnitudes):
        monkeypatch.setattr(p, "compiled", None)  # compiled again, through ``recorded``
    for kind in ("topk", "topk-aggregate", "terngrad", "topk-reuse"):
        with_option = ENGINE_CASES[kind]

        def make(with_option=with_option):
            compressor = with_option()
            compressor.compile = option
            return compressor

        compiled_calls.clear()
        got = simulate(make, switch == "1", monkeypatch, steps=3, ranks=2)
        assert bool(compiled_calls) == option, kind
        want = simulate(with_option, option, monkeypatch, steps=3, ranks=2)
        for (avg_g, res_g, bytes_g), (avg_w, res_w, bytes_w) in zip(got, want):
            assert bytes_g == bytes_w
            for name in avg_w:
                np.testing.assert_array_equal(avg_g[name], avg_w[name], err_msg=f"{kind} {name}")


def test_the_compressor_option_is_checked_and_not_agreed_on():
    assert TopK(0.1, compile=False).compile is False and TernGrad().compile is None
    assert "compile=True" in repr(RegTopK(0.1, compile=True))
    assert TopK(0.1, compile=True).config() == TopK(0.1).config()  # a machine's setting, not the ranks' header
    with pytest.raises(TypeError, match="compile"):
        GaussianK(0.1, compile="yes")
    compressor = TopK(0.1)
    with pytest.raises(TypeError, match="compile"):
        compressor.compile = 1


def test_a_bad_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv(C.COMPILE_ENV, "sometimes")
    with pytest.raises(ValueError, match="HVD_COMPRESS_COMPILE"):
        C.enabled(torch.device("cpu"))


def test_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HVD_COMPRESS_CACHE", str(tmp_path))
    assert C.cache_dir() == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert C.cache_dir() == tmp_path / "elsewhere"
