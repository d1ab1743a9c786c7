"""cmtune: tune collective-matmul decompositions on real devices, and serve the best configs.

The parts install under this namespace: `cmtune.tuner` (study engine, measurement, local
tuning), `cmtune.workers` (the worker daemon), `cmtune.service` (the REST service) and
`cmtune.migrations` (its schema); the ops library is `collective_matmul`.  This root package
holds only the `cmtune` command line (`cmtune.cli`), the one place that knows every part.
"""

from importlib.metadata import version

__version__ = version("cmtune")  # pyproject.toml's, as installed: its one source
