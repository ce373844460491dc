"""The test suite's model builders (``tests/tiny_models.py``), for benchmarks run as ``python benchmarks/X.py``.

They are test fixtures, so they live under ``tests/`` and not in the installed package.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from tiny_models import make_tiny_hf_checkpoint, near_tie_routers, random_train_batch  # noqa: E402

__all__ = ["make_tiny_hf_checkpoint", "near_tie_routers", "random_train_batch"]
