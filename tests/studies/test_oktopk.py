"""benchmarks.oktopk: the sum-selected global top-k baseline against a hand-computed exchange, an independent
loop-by-loop oracle (with momentum correction and the budget's warm-up), its conservation of every entry,
its traffic, and its rows in ``python -m benchmarks convergence``."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import convergence  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from benchmarks.oktopk import OkTopk, OkTopkSimulator, traffic_vs_dense  # noqa: E402
from benchmarks.wire import allreduce_traffic, collective_traffic  # noqa: E402
from hvd_compress.algorithms.schedule import warmup_density  # noqa: E402


def oracle_step(acc, s):
    """One exchange written rank by rank and owner by owner (float64): ``acc`` is ``[a_r]`` (1-D, length d);
    returns the average and, per rank, the indices its residual clears."""
    ranks, d = len(acc), len(acc[0])
    sent = []  # per rank: {owner: [indices]}
    for a in acc:
        by_owner = {}
        for owner in range(ranks):
            region = [i for i in range(d) if i % ranks == owner]
            by_owner[owner] = sorted(region, key=lambda i: -abs(a[i]))[:s]
        sent.append(by_owner)
    average, kept = np.zeros(d), set()
    for owner in range(ranks):
        sums = {}
        for rank in range(ranks):
            for i in sent[rank][owner]:
                sums[i] = sums.get(i, 0.0) + float(acc[rank][i])
        for i in sorted(sums, key=lambda i: -abs(sums[i]))[:s]:
            kept.add(i)
            average[i] = sums[i] / ranks
    cleared = [sorted(i for owner in range(ranks) for i in sent[rank][owner] if i in kept) for rank in range(ranks)]
    return average, cleared


def test_a_hand_computed_exchange():
    # 2 ranks, 6 entries: owner 0 holds entries 0, 2, 4 and owner 1 entries 1, 3, 5; one slot per region
    a = torch.tensor([[5.3, -1.7, 0.6, 3.1, -2.2, 0.15],
                      [-4.1, 2.3, 1.2, 0.25, 0.35, -6.4]])
    average, cleared = OkTopkSimulator.exchange(a, 1)
    # owner 0 gets entry 0 from both ranks (5.3 and -4.1), the only entry it receives: kept, though its sum is small;
    # owner 1 gets entry 3 (3.1) from rank 0 and entry 5 (-6.4) from rank 1 and keeps the larger |sum|, entry 5
    want = torch.tensor([(5.3 - 4.1) / 2, 0, 0, 0, 0, -6.4 / 2])
    torch.testing.assert_close(average, want)
    # rank 0 sent entries 0 and 3: only 0 was kept, so 3.1 stays in its residual; rank 1 sent 0 and 5, both kept
    assert cleared.tolist() == [[True, False, False, False, False, False], [True, False, False, False, False, True]]


@pytest.mark.parametrize("ranks,numel,momentum,warmup", [(2, 37, 0.0, 0), (4, 103, 0.9, 3), (5, 64, 0.0, 4)])
def test_steps_match_the_oracle_and_lose_nothing(ranks, numel, momentum, warmup):
    config = OkTopk(0.2, momentum=momentum, warmup_steps=warmup, warmup_start=0.6)
    sim = OkTopkSimulator(ranks, config)
    rng = np.random.default_rng(ranks * numel)
    errors, velocities = np.zeros((ranks, numel)), np.zeros((ranks, numel))
    produced, applied = np.zeros(numel), np.zeros(numel)
    split = numel // 3  # two tensors, to check the bucket's order
    for step in range(6):
        g = rng.standard_normal((ranks, numel)).astype(np.float32)
        out = sim.step({"w": [torch.from_numpy(x[:split].copy()).reshape(split, 1) for x in g],
                        "b": [torch.from_numpy(x[split:].copy()) for x in g]})
        assert out["w"].shape == (split, 1) and out["b"].shape == (numel - split,)
        got = torch.cat([out["w"].reshape(-1), out["b"]]).double().numpy()
        s = max(1, round(warmup_density(step, warmup, 0.6, 0.2) * numel / (2 * ranks)))
        assert sim.last_slots == s
        velocities = momentum * velocities + g if momentum else g
        acc = errors + velocities
        average, cleared = oracle_step(acc, s)
        np.testing.assert_allclose(got, average, rtol=1e-5, atol=1e-6)
        assert np.count_nonzero(got) == ranks * s
        for rank in range(ranks):
            acc[rank, cleared[rank]] = 0
            if momentum:
                velocities[rank, cleared[rank]] = 0
        errors = acc
        np.testing.assert_allclose(sim.errors[:, :numel].numpy(), errors, rtol=1e-5, atol=1e-5)
        produced += g.sum(0)
        applied += ranks * got
    if not momentum:  # what was produced is applied or still in a residual
        np.testing.assert_allclose(applied + sim.errors[:, :numel].double().numpy().sum(0), produced, atol=1e-4)


@pytest.mark.parametrize("ranks", [2, 4, 16, 64])
def test_traffic_is_twice_the_kept_share_and_flat_in_n(ranks):
    numel = 206_922
    sim = OkTopkSimulator(ranks, OkTopk(0.04))
    sim.step({"w": [torch.zeros(numel)] * ranks})
    s = sim.last_slots
    assert s == round(0.04 * numel / (2 * ranks))
    traffic = collective_traffic(sim.collectives_per_rank[0], ranks) / allreduce_traffic(4 * numel, ranks)
    # s rounds t d / 2N to an integer: within N / (t d) of the budget
    assert traffic == pytest.approx(traffic_vs_dense(s, numel, ranks)) == pytest.approx(0.04, rel=ranks / (0.04 * numel))
    table = sim.layer_table({"w": (numel,)})
    assert table[0]["sent"] == "sparse" and table[0]["values"] == pytest.approx(ranks * s)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="traffic"):
        OkTopk(0.0)
    with pytest.raises(ValueError, match="momentum"):
        OkTopk(0.04, momentum=1.0)
    with pytest.raises(ValueError, match="2 ranks"):
        OkTopkSimulator(1, OkTopk())
    assert OkTopk.slots(1.0, 10, 4) == 1 and OkTopk.slots(1e-6, 10, 4) == 1  # at least one slot
    assert OkTopk.slots(1.0, 12, 2) == 3
    with pytest.raises(ValueError, match="traffic budget"):
        convergence.plan(["mlp"], ["oktopk"], [0.01])


def test_convergence_rows(tmp_path):
    argv = ["convergence", "--data", "digits", "--train-size", "128", "--test-size", "64", "--epochs", "2",
            "--warmup-epochs", "0.5", "--models", "mlp", "--ranks", "4", "--global-batch", "16", "--no-progress",
            "--compressors", "none,oktopk", "--traffic", "0.05", "--variants", "plain,mc+warmup", "--seeds", "0",
            "--out", str(tmp_path), "--name", "ok"]
    assert main(argv) == 0
    results = json.loads((tmp_path / "ok.json").read_text())
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == ["dense", "ok-topk traffic 0.05", "ok-topk traffic 0.05 +mc +warm-up"]
    plain, dgc = rows["ok-topk traffic 0.05"], rows["ok-topk traffic 0.05 +mc +warm-up"]
    assert plain["traffic_vs_dense"] == pytest.approx(0.05, rel=0.02)
    assert dgc["traffic_vs_dense"] > plain["traffic_vs_dense"]  # the warm-up's denser steps
    assert dgc["seeds"][0]["compressor_momentum"] == 0.9 and dgc["seeds"][0]["optimizer_momentum"] == 0.0
    assert plain["seeds"][0]["compressor_momentum"] == 0.0 and plain["seeds"][0]["optimizer_momentum"] == 0.9
    assert results["settings"]["oktopk"]["traffic"] == [0.05]
