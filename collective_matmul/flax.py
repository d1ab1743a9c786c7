"""Moved to `collective_matmul.client.flax`: this path keeps working for one more release, with a
`DeprecationWarning`."""

import warnings

from collective_matmul.client.flax import *  # noqa: F403
from collective_matmul.client.flax import __all__  # noqa: F401

warnings.warn("collective_matmul.flax moved to collective_matmul.client.flax: import it from there (the old path "
              "goes in the next release)", DeprecationWarning, stacklevel=2)
