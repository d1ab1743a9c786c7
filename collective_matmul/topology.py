"""Moved to `collective_matmul.programs.topology`: this path keeps working for one more release, with a
`DeprecationWarning`."""

import warnings

from collective_matmul.programs.topology import *  # noqa: F403
from collective_matmul.programs.topology import __all__  # noqa: F401

warnings.warn("collective_matmul.topology moved to collective_matmul.programs.topology: import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
