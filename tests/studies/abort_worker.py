"""Run by ``test_bench_step.py`` through ``benchmarks.cluster.run_workers``: each rank writes its result
(``mode`` "after") and then aborts, or aborts before writing one (``mode`` "before")."""

import os
import sys

from benchmarks import cluster

if __name__ == "__main__":
    config = cluster.worker_config(sys.argv[1:])
    if config["mode"] == "after":
        cluster.write_result(config, {"rank": config["rank"]})
    os.abort()
