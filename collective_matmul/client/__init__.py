"""The tuned-config client: `Tuned` (`tuned`), its sources and look-up (`sources`), the report of the calls
(`report`), applying per-role overrides (`overrides`), an op call through a source and the ops a source runs
(`calls`), the REST client (`rest`), and the drop-ins: Flax's ``dot_general`` (`flax`) and MaxText's dense
layers (`maxtext`).

``collective_matmul.client.Tuned`` (the path before this layout) still resolves for one more release, with a
`DeprecationWarning`: write ``collective_matmul.Tuned``.
"""

from __future__ import annotations

import importlib
import warnings

_MOVED = {"Tuned": "collective_matmul.client.tuned", "ring_hardware": "collective_matmul.client.tuned"}


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'collective_matmul.client' has no attribute {name!r}")
    warnings.warn(f"collective_matmul.client.{name} moved to {module}.{name}"
                  + (" (collective_matmul.Tuned)" if name == "Tuned" else "")
                  + ": the old path goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
