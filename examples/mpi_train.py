"""Train the small CNN of ``pytorch_train.py`` over plain MPI (mpi4py, no Horovod).

    mpirun -np 4 python examples/mpi_train.py --compression regtopk
    mpirun -np 2 python examples/mpi_train.py --compression terngrad --epochs 1

The same as ``pytorch_train.py --path mpi``: ``hvd_compress.mpi.DistributedOptimizer``.
"""

import os
import sys

if __package__ in (None, ""):  # run as a script: make `examples` and `hvd_compress` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.pytorch_train import main  # noqa: E402

if __name__ == "__main__":
    main(default_path="mpi")
