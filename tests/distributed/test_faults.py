"""Fault injection over Horovod (Gloo and MPI): each case trains correctly or ends with the same
clear error on every rank, under a timeout. The cases live in ``tests/distributed/faults_torch.py``
and run several per launch to keep the suite fast."""

import json

import pytest

from tests.distributed.launch import output, require_horovod_torch, require_mpi, run_to_the_end

require_horovod_torch()

# error cases last: each ends mid-step (every rank raises at the same point)
MISMATCHED = ["terngrad", "fp16", "none"]
CASES = ["unused_parameters", "sparse_and_empty_parameters", "every_tensor_dense", "dense_switch_keeps_residual",
         "checkpoint_between_routes", "outside_an_optimizer", "grad_scaler_overflow",
         "rank0_checkpoint_on_every_rank", "transposed_parameter"]
CASES += [f"mismatched_compressor_{other}" for other in MISMATCHED] + ["mismatched_outside_an_optimizer"]


def results(kind, tmp_path):
    if kind == "mpirun":
        require_mpi()
    prefix = tmp_path / "faults"
    done, _ = run_to_the_end(kind, 2, "tests.distributed.faults_torch", "--out", str(prefix), *CASES, limit=150)
    assert done.returncode == 0, output(done)
    return [json.loads((tmp_path / f"faults.{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module", params=["horovodrun", "mpirun"])
def ranks(request, tmp_path_factory):
    return results(request.param, tmp_path_factory.mktemp(request.param))


def test_unused_parameters_are_named_by_parameter_on_stock_horovod(ranks):
    """A layer unused on one rank, two unused everywhere (different shapes, filled in by Horovod in
    a different order on each rank): stock horovod.torch, plain and grouped, trains exactly as the
    drop-in optimizer; unused parameters stay put (Top-k and TernGrad, stock and drop-in)."""
    for rank, result in enumerate(ranks):
        case = result["unused_parameters"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        ok = case["ok"]
        assert ok["difference"] == {"stock": 0.0, "stock_grouped": 0.0, "stock_small_buckets": 0.0}
        assert ok["unused_moved"] == {"topk": 0.0, "terngrad_stock": 0.0, "terngrad_dropin": 0.0}
        assert ok["b_moved"] > 0  # the layer used on rank 0 only trains with the average


def test_transposed_parameter_fails_with_the_same_error_on_every_rank(ranks):
    errors = [result["transposed_parameter"].get("error", "") for result in ranks]
    for error in errors:
        assert "hvd_compress: ranks disagree on 'hvd_compress.weight'" in error, errors
    assert len({error.split("; this rank runs")[0] for error in errors}) == 1, errors
    assert "weight[12, 8]" in errors[0] and "weight[8, 12]" in errors[1]


def test_rank0_checkpoint_loaded_on_every_rank_stops_every_rank(ranks):
    errors = [result["rank0_checkpoint_on_every_rank"].get("error", "") for result in ranks]
    for error in errors:
        assert "hvd_compress: ranks disagree on" in error and "state loaded from another rank" in error, errors
    assert len({error.split("; this rank runs")[0] for error in errors}) == 1, errors
    assert "loaded from rank 0's checkpoint" in errors[1] and "loaded from" not in errors[0].split("runs")[1]


def test_sparse_and_zero_size_parameters_train_and_conserve_mass(ranks):
    for rank, result in enumerate(ranks):
        case = result["sparse_and_empty_parameters"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        moved = case["ok"]["moved"]
        assert len(moved) == 5 and all(value > 0 for value in moved.values()), moved
        assert case["ok"]["conservation"]["dropin_TopK"] < 1e-5, case["ok"]["conservation"]


def test_stock_route_with_every_tensor_dense_keeps_no_growing_state_and_counts_every_byte(ranks):
    """A sparsifier whose every tensor travels dense: one fused bucket (its dense allreduce) and no
    per-tensor state; compressor.stats grows by the dense bytes and a 4-byte placeholder per tensor
    at every step (not only the first; the first also by the bucket's 16-byte header), at density 1."""
    for rank, result in enumerate(ranks):
        case = result["every_tensor_dense"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        ok = case["ok"]
        assert ok["index"] == 0 and ok["warnings"] == ok["distinct"], ok  # each warning once
        assert ok["names"] == [] and ok["buckets"] == 1, ok  # dense tensors keep no state
        step = ok["dense_bytes"] + 4 * ok["tensors"]
        assert ok["step_bytes"] == [step + 16] + [step] * 29, ok
        assert ok["density"] == 1.0, ok


def test_stock_route_sends_the_residual_when_a_tensor_turns_dense(ranks):
    """The dense-switch probe (``tests/distributed/switch_probe.py``): Top-k 1% for 4 steps, then
    dense: the weights moved by exactly lr x the sum of the mean gradients (float tolerance), stock
    and drop-in, with no residual read before the check."""
    for rank, result in enumerate(ranks):
        case = result["dense_switch_keeps_residual"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        assert case["ok"]["stock"] < 1e-5 and case["ok"]["dropin"] < 1e-5, case["ok"]


def test_checkpoints_move_between_stock_horovod_the_drop_in_and_the_simulator(ranks):
    """Each rank's compressor state (RegTop-k's posterior, Top-k's velocity under momentum correction)
    saved after 2 steps on one route and loaded on another resumes exactly: 2 more steps equal the
    Simulator's 4 without a break. Tensors named by position (no named_parameters=) are refused at
    load (the drop-in) or at the first step (stock), on every rank, naming the route that wrote them."""
    for rank, result in enumerate(ranks):
        case = result["checkpoint_between_routes"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        differences, refused = case["ok"]["differences"], case["ok"]["refused"]
        assert len(differences) == 8 and max(differences.values()) < 1e-6, differences
        assert ("written by horovod.torch.DistributedOptimizer and names its tensors 'allreduce.noname."
                in refused["stock->dropin"]), refused
        assert "none of which this hvd_compress.torch.DistributedOptimizer exchanges" in refused["stock->dropin"]
        assert "written by hvd_compress.torch.DistributedOptimizer" in refused["dropin->stock"], refused
        assert ("none of which this horovod.torch.DistributedOptimizer exchanges (without named_parameters= "
                "Horovod names parameters allreduce.noname.<group>.<index>)") in refused["dropin->stock"], refused


def test_compressors_outside_an_optimizer_are_buckets_of_their_own(ranks):
    """hvd.allreduce(t, name=..., compression=...) and compress(t, name=...) by hand: the same result
    either way; sent dense (N k >= d), Horovod's own average to float rounding; every byte counted
    (per call the dense or sparse payload, a 4-byte placeholder and, each call being its tensor's
    first, the 16-byte header of the check; FP16's first call goes through our exchange and, once
    the ranks agree, the next hands Horovod the float16 tensor)."""
    for rank, result in enumerate(ranks):
        case = result["outside_an_optimizer"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        ok = case["ok"]
        assert all(entry["agree"] for entry in ok.values()), ok
        assert ok["topk_dense"]["error"] < 1e-6 and ok["fp16"]["error"] < 1e-2, ok
        assert ok["topk_dense"]["bytes"] == 2 * (4000 + 4 + 16), ok
        assert ok["fp16"]["bytes"] == (2000 + 4 + 16) + 2000, ok
        # k values + indices, NaN flag + its position, placeholder, header
        assert ok["topk"]["bytes"] == 2 * (100 * 8 + 8 + 4 + 16), ok


def test_grad_scaler_skips_exactly_the_steps_dense_training_skips(ranks):
    """An overflow injected on rank 1 at step 2: stock and drop-in routes, Top-k and TernGrad with
    error feedback, skip that step on every rank as the dense route does, halve the scale as it
    does, train on afterwards, and keep every residual finite."""
    for rank, result in enumerate(ranks):
        case = result["grad_scaler_overflow"]
        assert "ok" in case, f"rank {rank}: {case.get('trace')}"
        runs = case["ok"]
        for route in ("stock", "dropin"):
            dense = runs[f"{route}_dense"]
            assert dense["stepped"] == [True, True, False, True, True], dense
            for name in ("TopK", "TernGrad"):
                run = runs[f"{route}_{name}"]
                assert run["stepped"] == dense["stepped"] and run["scales"] == dense["scales"], (route, name, run)
                assert run["residuals_finite"], (route, name)


@pytest.mark.parametrize("other, name", [("terngrad", "TernGrad"), ("fp16", "FP16"), ("none", "NoneCompressor")])
def test_stock_horovod_ranks_running_different_compressors_fail_with_our_error(ranks, other, name):
    """Rank 0 Top-k, rank 1 another compressor on stock horovod.torch: every rank raises, within
    30 s, our error naming both compressors (not Horovod's shape or dtype mismatch)."""
    cases = [result[f"mismatched_compressor_{other}"] for result in ranks]
    errors = [case.get("error", "") for case in cases]
    for rank, (case, error) in enumerate(zip(cases, errors)):
        assert error.startswith("ValueError: hvd_compress: ranks disagree on 'hvd_compress.mismatch_"), errors
        assert f"ranks run different compressors: rank 0 TopK, rank 1 {name}" in error, errors
        assert case["seconds"] < 30, (rank, case["seconds"])
    assert "this rank runs TopK(" in errors[0] and f"this rank runs {name}(" in errors[1], errors


def test_compressors_disagreeing_outside_an_optimizer_fail_with_our_error(ranks):
    """hvd.allreduce(t, compression=...) without a name, Top-k on rank 0 and FP16 on rank 1: every
    rank raises, within 30 s, our error naming both compressors (not Horovod's mismatch, nor a hang
    on allreduces that Horovod names differently on each rank)."""
    cases = [result["mismatched_outside_an_optimizer"] for result in ranks]
    errors = [case.get("error", "") for case in cases]
    for rank, (case, error) in enumerate(zip(cases, errors)):
        assert error.startswith("ValueError: hvd_compress: ranks disagree on 'hvd_compress.call.0'"), errors
        assert "ranks run different compressors: rank 0 TopK, rank 1 FP16" in error, errors
        assert case["seconds"] < 30, (rank, case["seconds"])
