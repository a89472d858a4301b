"""benchmarks.powersgd: the Simulator-side PowerSGD baseline against torch's own DDP hook, and its traffic.

The hook check: a small MLP (a 24x32 and a 6x24 matrix, two biases: at rank 4 the 6x24 matrix fails
torch's ``min_compression_rate`` rule and goes dense) trains with DDP and
``powerSGD_hook`` on 2 and 4 gloo processes, each rank on its own random batches, 2 dense steps then
4 compressed ones, SGD with momentum; after every step the parameters must equal
:class:`~benchmarks.powersgd.PowerSGDSimulator` fed the same per-rank gradients, within
``RTOL`` of the tensor's largest entry. DDP's rebuilt bucket layout, as recorded inside the hook,
must be the baseline's default (one bucket, the model's tensors in reverse order).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from benchmarks.powersgd import PowerSGD, PowerSGDSimulator, orthogonalize, traffic_vs_dense  # noqa: E402
from benchmarks.wire import allreduce_traffic, collective_traffic  # noqa: E402

RANKS_TRIED = (1, 2, 4)  # matrix approximation ranks, each a fresh model
START, STEPS, LR, MOMENTUM, SEED = 2, 6, 0.1, 0.9, 3
#: parameters after every step: |DDP - baseline| <= RTOL * max |baseline| per tensor
RTOL = 1e-5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 6))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return torch.randn(8, 32, generator=generator), torch.randint(0, 6, (8,), generator=generator)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def _ddp_rank(rank: int, port: int, world: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from tests.distributed.launch import gloo_group

    torch.set_num_threads(1)
    record = {}
    with gloo_group(rank, world, port):
        for approx in RANKS_TRIED:
            model = make_model()
            names = {id(p): name for name, p in model.named_parameters()}
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            state = PowerSGDState(None, matrix_approximation_rank=approx, start_powerSGD_iter=START,
                                  random_seed=SEED)
            layouts = []

            def hook(state, bucket):
                if state.iter == START:
                    layouts.append([names[id(p)] for p in bucket.parameters()])
                return powerSGD_hook(state, bucket)

            ddp.register_comm_hook(state, hook)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
            params = []
            for step in range(STEPS):
                optimizer.zero_grad()
                loss_of(ddp, rank, step).backward()
                optimizer.step()
                params.append({name: p.detach().clone().numpy() for name, p in model.named_parameters()})
            record[approx] = {"params": params, "layout": layouts}
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(record, f)


def baseline(world: int, config: PowerSGD):
    """Every step's parameters of the same training with :class:`PowerSGDSimulator` averaging, and its buckets."""
    model = make_model()
    sim = PowerSGDSimulator(world, config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = []
    for step in range(STEPS):
        grads = {name: [] for name, _ in model.named_parameters()}
        for rank in range(world):
            model.zero_grad()
            loss_of(model, rank, step).backward()
            for name, p in model.named_parameters():
                grads[name].append(p.grad.clone())
        averaged = sim.step(grads)
        for name, p in model.named_parameters():
            p.grad = averaged[name]
        optimizer.step()
        params.append({name: p.detach().clone().numpy() for name, p in model.named_parameters()})
    return params, sim.buckets


@pytest.mark.parametrize("world", [2, 4])
def test_equals_torch_powersgd_hook(world, tmp_path):
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    from tests.distributed.launch import spawn_gloo

    out = str(tmp_path / "ddp")
    spawn_gloo(_ddp_rank, world, world, out, timeout=120)
    ranks = []
    for rank in range(world):
        with open(f"{out}.{rank}", "rb") as f:
            ranks.append(pickle.load(f))
    worst = 0.0
    for approx in RANKS_TRIED:
        expected, buckets = baseline(world, PowerSGD(approx, start_iter=START, random_seed=SEED))
        assert ranks[0][approx]["layout"] == buckets  # one bucket, the model's tensors reversed
        for rank in range(world):
            for step in range(STEPS):
                for name, want in expected[step].items():
                    got = ranks[rank][approx]["params"][step][name]
                    diff = float(np.abs(got - want).max() / np.abs(want).max())
                    worst = max(worst, diff)
                    assert diff <= RTOL, f"rank {rank}, approx rank {approx}, step {step}, {name}: {diff:.2e}"
        # the compressed steps changed the parameters away from a dense run's
        dense, _ = baseline(world, PowerSGD(approx, start_iter=STEPS + 1))  # never compressed
        assert np.abs(expected[-1]["0.weight"] - dense[-1]["0.weight"]).max() > 1e-4
    print(f"world {world}: largest relative difference {worst:.2e}")



def test_traffic_count_and_low_rank():
    """Bytes per step: the whole gradient before ``start_iter``, then P, Q and the dense part; the
    average is rank k; the dense part's errors cancel over ranks."""
    shapes = {"w": (24, 32), "v": (6, 24), "b": (24,), "c": (6,)}
    world, config = 4, PowerSGD(4, start_iter=3, random_seed=1)
    assert config.matrix((24, 32)) == (24, 32, 4) and config.matrix((6, 24)) is None  # 30 * 4 * 2 >= 144
    assert config.matrix((24,)) is None and PowerSGD(2).matrix((6, 24)) == (6, 24, 2)  # 30 * 2 * 2 < 144
    generator = torch.Generator().manual_seed(7)
    sim = PowerSGDSimulator(world, config)
    numel = 24 * 32 + 6 * 24 + 24 + 6
    for step in range(5):
        grads = {name: [torch.randn(shape, generator=generator) for _ in range(world)]
                 for name, shape in shapes.items()}
        out = sim.step(grads)
        table = {row["name"]: row for row in sim.layer_table(shapes)}  # this step's
        posted = sim.collectives_per_rank[0]
        assert all(p == posted for p in sim.collectives_per_rank)
        if step < 3:
            assert posted == [("powersgd.bucket0.dense", "allreduce", 4 * numel)]
            assert table["w"]["sent"] == "dense"
            torch.testing.assert_close(out["w"], torch.stack(grads["w"]).mean(0))
            continue
        assert dict((n.rsplit(".", 1)[1], b) for n, _, b in posted) == {
            "dense": 4 * (6 * 24 + 24 + 6), "p": 4 * 24 * 4, "q": 4 * 32 * 4}
        assert table["w"]["sent"] == "low-rank" and table["w"]["values"] == (24 + 32) * 4
        assert table["v"]["sent"] == "dense"
        assert int(torch.linalg.matrix_rank(out["w"])) == 4
        assert float(sim.errors["b"].sum(0).abs().max()) < 1e-5  # x_r - mean_r x_r
        assert sim.bytes_sent_per_rank == [sum(b for _, _, b in posted)] * world
        assert collective_traffic(posted, world) == pytest.approx(allreduce_traffic(sim.bytes_sent_per_rank[0], world))
    compressed = 6 * 24 + 24 + 6 + (24 + 32) * 4
    assert traffic_vs_dense(config, shapes, 5) == pytest.approx((3 * numel + 2 * compressed) / (5 * numel))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_orthogonalize(k):
    generator = torch.Generator().manual_seed(k)
    m = torch.randn(2, 9, k, generator=generator)
    q = orthogonalize(m.clone())
    for b in range(2):
        torch.testing.assert_close(q[b].T @ q[b], torch.eye(k), atol=1e-5, rtol=0)
        # the same column space: projecting m onto q's columns returns m
        torch.testing.assert_close(q[b] @ (q[b].T @ m[b]), m[b], atol=1e-5, rtol=1e-5)
