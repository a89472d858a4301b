"""``python -m benchmarks traffic``: bytes per rank as N grows, from the engine's plan, by index mode."""

import io

import numpy as np

from benchmarks import traffic
from benchmarks.shapes import resnet50_shapes


def test_shared_index_traffic_is_flat_and_the_allgather_grows():
    out = io.StringIO()
    results = traffic.run(ranks=(2, 16, 256), counted_ranks=(8,), out=None, plot=False, stdout=out, progress=False)
    rows = {(r["mode"], r["ranks"]): r for r in results["rows"]}
    d = sum(int(np.prod(s)) for _, s in resnet50_shapes())
    k = sum(int(np.ceil(0.01 * np.prod(s) * (1 - 1e-12))) for _, s in resnet50_shapes() if np.prod(s) >= 1024)
    for n in (2, 16, 256):
        assert rows[("leader", n)]["sent"] == rows[("leader", 2)]["sent"]
        assert rows[("aggregate", n)]["sent"] == rows[("aggregate", 2)]["sent"]
        assert rows[("leader", n)]["gathered"] == rows[("aggregate", n)]["gathered"] == 0
        assert rows[("dense fp16", n)]["received"] == 2 * (n - 1) / n * 2 * d
    # the leader sends k values and k indices (plus a flag per tensor and the small tensors dense)
    assert 8 * k < rows[("leader", 2)]["sent"] < 8 * k + 4 * 0.01 * d
    always = rows[(traffic.ALWAYS_SPARSE, 256)]
    assert always["received"] == 255 * always["gathered"] + 2 * 255 / 256 * (always["sent"] - always["gathered"])
    assert results["break_even_vs_fp16"]["leader"] is None and results["break_even_vs_fp16"]["aggregate"] is None
    assert all(check["equal"] for check in results["counted"] if check["mode"] != "gather")
    assert "leader" in out.getvalue()
