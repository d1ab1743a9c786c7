"""`bench/step_variants.py`'s variant specs: a recorded variant with per-slot edits, and bad specs refused with what
the record has.  No devices are touched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cmtune.tuner.variants import FIXED_RING, ring_everywhere
from collective_matmul import Decomposition, OpConfigs
from collective_matmul.planning.decomposition import DEFAULT_GRAD_WEIGHT

_spec = importlib.util.spec_from_file_location("step_variants", Path(__file__).parents[2] / "bench/step_variants.py")
step_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_variants)

RS = Decomposition.from_id("ring-uni-c1-u2-in")
TUNED = {"qkv": OpConfigs(forward=FIXED_RING), "mlp_up": OpConfigs(grad_input=RS)}
ROUND = {"variants": [{"name": "as-written", "configs": {}},
                      {"name": "tuned", "configs": {r: c.model_dump(mode="json") for r, c in TUNED.items()}},
                      {"name": "always-ring", "configs": {r: c.model_dump(mode="json")
                                                          for r, c in ring_everywhere(["qkv", "mlp_up"]).items()}},
                      {"name": "other", "configs": {"mlp_up": OpConfigs().model_dump(mode="json")}}]}
RECORD = {"rounds": [ROUND], "grading": None, "confirmed": {"variants": [{"name": "searched", "configs": {}}]}}


def test_a_recorded_variant_with_edits_changes_only_the_slots_named():
    named = step_variants.recorded(RECORD)
    assert set(named) == {"tuned", "always-ring", "other"}  # the reference and an empty variant carry no configs
    ring = ring_everywhere(["qkv", "mlp_up"])
    assert step_variants.parse_variant("always-ring", named) == ring
    edited = step_variants.parse_variant("always-ring+mlp_up.forward=baseline+mlp_up.grad_input=tuned", named)
    assert edited["mlp_up"] == OpConfigs(forward=Decomposition.baseline(), grad_input=RS, grad_weight=FIXED_RING)
    assert edited["qkv"] == ring["qkv"]
    every = step_variants.parse_variant("always-ring+*.grad_weight=baseline", named)
    assert all(c.grad_weight == DEFAULT_GRAD_WEIGHT and c.forward == FIXED_RING for c in every.values())
    assert step_variants.parse_variant("tuned+qkv.grad_input=ring", named)["qkv"].grad_input == FIXED_RING


@pytest.mark.parametrize(("spec", "says"), [
    ("nope", "no variant 'nope' in the record; it has always-ring, other, tuned"),
    ("always-ring+attn.forward=ring", "with a role of ['mlp_up', 'qkv'] or '*'"),
    ("always-ring+qkv.backward=ring", "a slot of ('forward', 'grad_input', 'grad_weight')"),
    ("always-ring+qkv.forward", "is not <role>.<slot>=<what>"),
    ("always-ring+qkv.forward=chunky", "'chunky' is neither baseline, ring nor a recorded variant"),
    ("tuned+*.forward=other", "'other' runs no configs of 'qkv'"),
])
def test_a_bad_spec_says_what_the_record_has(spec, says):
    with pytest.raises(SystemExit) as raised:
        step_variants.parse_variant(spec, step_variants.recorded(RECORD))
    assert says in str(raised.value)
