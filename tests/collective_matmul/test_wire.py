"""The wire package: small modules, one import path for every name, no JAX, and a trial's result that travels
as the same JSON it always did."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

import collective_matmul.wire as wire
from collective_matmul import Decomposition, Hardware, Problem
from collective_matmul.wire import (
    BoundsMeasurement,
    ConfirmResult,
    Measurement,
    MeasurementProtocol,
    ResultIn,
    SearchResult,
    StepMeasurement,
    StepResult,
    StepVariant,
    Timing,
    TrialKind,
    TrialResult,
    result_of,
    what_to_send,
)

PACKAGE = Path(wire.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
RULES = ("bundle.py", "bounds.py", "lookup.py")  # the contract's rules, imported by their module path
MAX_LINES = 400
PROBLEM = Problem.parse("ag:256x64x128:float32:8")
HW = Hardware(platform="cpu", device_kind="cpu", device_count=8)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_module_of_the_wire_package_is_under_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines < MAX_LINES, f"{path.name} has {lines} lines: split it by the kind of type it holds"


def test_the_wire_package_imports_no_jax():
    code = ("import sys, collective_matmul.wire; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"


@pytest.mark.parametrize("path", [p for p in MODULES if p.name not in ("__init__.py", *RULES)], ids=lambda p: p.name)
def test_every_public_name_of_a_module_is_imported_from_the_package(path):
    defined = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    hidden = {"agrees", "check_ratio", "check_rounds"}  # the validators' own checks (wire.stats)
    public = {name for name in defined if not name.startswith("_")} - hidden
    assert public <= set(wire.__all__), f"not exported by collective_matmul.wire: {sorted(public - set(wire.__all__))}"
    assert all(hasattr(wire, name) for name in wire.__all__)


def measured(config: Decomposition, ratio: float = 0.8) -> Measurement:
    return Measurement(problem=PROBLEM, decomposition=config, hardware=HW, status="ok",
                       candidate=Timing.of([ratio * 1e-3] * 3), baseline=Timing.of([1e-3] * 3), ratio=ratio,
                       ratio_iqr=0.0)


def bounds() -> BoundsMeasurement:
    return BoundsMeasurement(problem=PROBLEM, hardware=HW, status="oom", message="no room")


def step() -> StepMeasurement:
    variants = [StepVariant(name=name, status="ok", timing=Timing.of([seconds] * 2), ratio=seconds, ratio_iqr=0.0)
                for name, seconds in (("as-written", 1.0), ("tuned", 0.9))]
    return StepMeasurement(model="mine", mesh={"model": 8}, tensor_axis="model", hardware=HW,
                           protocol=MeasurementProtocol(),
                           variants=variants)


RING = Decomposition(method="ring", direction="bidirectional", chunks=2)
RESULTS = {
    "search": (SearchResult(measurement=measured(RING)), {"measurement"}),
    "confirm": (ConfirmResult(measurements=[measured(Decomposition.baseline(), 1.0), measured(RING)], bounds=bounds()),
                {"measurements", "bounds"}),
    "step": (StepResult(step=step()), {"step"}),
}


@pytest.mark.parametrize("kind", RESULTS)
def test_a_trial_result_travels_as_the_body_of_its_kind_and_back(kind):
    result, fields = RESULTS[kind]
    body = ResultIn.of("lease", result, lease_next=True)
    sent = body.model_dump(mode="json", exclude_none=True)
    assert set(sent) == {"lease_id", "lease_next"} | fields  # the JSON workers have always sent: no 'kind'
    received = ResultIn.model_validate_json(body.model_dump_json())
    assert received.result == result and received.result.kind == TrialKind(kind)
    # the union picks its member by kind
    assert TypeAdapter(TrialResult).validate_python(result.model_dump()) == result


def test_a_result_is_of_its_trials_kind():
    assert result_of(TrialKind.SEARCH, [measured(RING)]) == RESULTS["search"][0]
    confirm = result_of(TrialKind.CONFIRM, [measured(RING)], bounds())
    assert confirm.kind == TrialKind.CONFIRM and confirm.bounds == bounds()
    assert SearchResult(measurement=measured(RING)).measurements == [measured(RING)]
    for kind, measurements, extra in ((TrialKind.SEARCH, [measured(RING)] * 2, None),
                                      (TrialKind.SEARCH, [measured(RING)], bounds()),
                                      (TrialKind.STEP, [measured(RING)], None)):
        with pytest.raises(ValueError, match=f"a {kind} trial's result"):
            result_of(kind, measurements, extra)
    with pytest.raises(ValidationError):
        SearchResult(kind="confirm", measurement=measured(RING))


def test_a_result_of_another_kind_is_told_the_field_to_send():
    assert what_to_send(TrialKind.STEP, RESULTS["search"][0]) == "send 'step'"
    assert what_to_send(TrialKind.SEARCH, ConfirmResult(measurements=[measured(RING)])) == "send 'measurement'"
    assert what_to_send(TrialKind.SEARCH, RESULTS["confirm"][0]) == ("send 'measurement' (bounds come with a "
                                                                      "confirmation only)")


def test_a_step_travels_with_maxtexts_twelve_mesh_axes_and_a_mesh_of_too_many_is_refused():
    axes = ["diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
            "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive"]
    mesh = {name: 8 if name == "tensor_sequence" else 1 for name in axes}
    measured = step().model_copy(update={"mesh": mesh, "tensor_axis": "tensor_sequence"})
    assert StepMeasurement.model_validate_json(measured.model_dump_json()).mesh == mesh
    with pytest.raises(ValidationError, match="at most 16 items"):
        StepMeasurement.model_validate({**measured.model_dump(), "mesh": {f"a{i}": 1 for i in range(17)}})
