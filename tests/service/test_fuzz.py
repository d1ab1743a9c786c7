"""The standing checks: schemathesis fuzzes the whole OpenAPI document of a real server, on SQLite and on
PostgreSQL; hypothesis fuzzes the step result a worker reports.

Every operation gets generated requests (valid and invalid, a fixed seed, a bounded number of
examples so that it fits CI), sent with a real admin token and a real worker credential, and
every response must be: no server error, a status code the document declares, a body that fits
the declared schema.

A step result decides what a model runs, so it gets its own fuzz (`test_step_results_never_break_what_is_served`):
bodies derived from a valid one, with variants, roles, configs, ratios, samples, timing summaries and lease ids
changed, sent with the worker's credential.  Every answer is a 2xx or a 4xx of FastAPI's shape, and whatever
is accepted leaves what is served consistent: the variant chosen is one the trial asked for, the overrides are
its configs and fit their problems, and the speedups reported are the samples'.
"""

from __future__ import annotations

import copy

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import create_engine

from cmtune.launcher import running_server
from cmtune.service import migrate
from cmtune.tuner.paired import grading_rounds, ratio_quartiles
from collective_matmul.planning.decomposition import Decomposition
from collective_matmul.planning.models import PRESETS, ROLES, SLOTS, MeshSpec, role_problems
from collective_matmul.wire import Speedup, Status, StepMeasurement, Timing, TrialTask, quartiles
from tests.service.conftest import (
    HARDWARE,
    PROBLEM,
    create_tokens,
    register,
    report,
    reset_postgres,
    run_trial,
)

EXAMPLES = 12  # per operation: ~25 operations, a few hundred requests in all


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def fuzzed_server(request, tmp_path_factory):
    """A real server with some state (a study with results, a worker, a tuned config) to aim at, on each
    database: (server, tokens by role, worker)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.sqlite'}"
    else:
        url = request.getfixturevalue("pg_url")
        reset_postgres(url)
        engine = create_engine(url)
        migrate.upgrade(engine)
        engine.dispose()
    tokens = create_tokens(url, ("admin", "worker"))
    with running_server(database_url=url, extra_env={"CMTUNE_MAX_BODY_BYTES": str(1 << 20),
                                                     "CMTUNE_LEASE_SECONDS": "600"}) as server:
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30)
        admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 4}})
        admin.post("/v1/studies", json={"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}},
                                        "hardware": HARDWARE, "budget": {"trials": 4}})
        worker = register(httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['worker']}"},
                                       timeout=30), "fuzz-worker")
        while run_trial(worker) is not None:
            pass
        yield server, tokens, worker


def operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for result in schema.get_all_operations():
        yield result.ok()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_within_its_schema(fuzzed_server, mode):
    server, tokens, worker = fuzzed_server
    headers = {"Authorization": f"Bearer {tokens['admin']}", "X-Cmtune-Worker": worker.credential}
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]
    tested = []
    for operation in operations(server.url):

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(base_url=server.url, headers=headers, checks=checks)

        try:
            fuzz()
        except Unsatisfiable:  # an operation without any input has no invalid input to try
            assert mode == GenerationMode.NEGATIVE, operation.label
        tested.append(operation.label)
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert len(tested) == sum(len(methods) for methods in spec["paths"].values())  # every operation


# --- the step result --------------------------------------------------------------------------------------------

STEP_EXAMPLES = 1000  # bodies sent to one server (about ten seconds): the whole file, both databases, in under a minute
STEP_HARDWARE = HARDWARE | {"device_kind": "cpu-step-fuzz"}  # only the step fuzz's worker leases its trials
TINY = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": STEP_HARDWARE,
        "budget": {"trials": 2}, "confirm_top": 1, "step": {"search_rounds": 1}}  # one round of the menu
OVERRIDES = {"model": "tiny", **{k: v for k, v in STEP_HARDWARE.items() if k != "process_count"}}
PROBLEMS = role_problems(PRESETS["tiny"], MeshSpec(axes=TINY["mesh"]["axes"]))

NAMES = st.sampled_from(["tuned-minus-everything", "tuned-minus-lm_head", "tuned-fuse-qkv", "always-ring",
                         "tuned-ring-fill", "as-written", "baseline", "tuned", "", "t" * 300, "tuned\x00",
                         "tuned\n"]) | st.text(max_size=16)
ROLE_NAMES = st.sampled_from(["lm_head", "attn_out", "QKV", "qkv.grad_input", "", "r" * 200, "r" * 201, "qkv\x00",
                              "mlp_up\n"]) | st.text(max_size=12)
DECOMPOSITIONS = st.fixed_dictionaries({
    "method": st.sampled_from(["ring", "baseline", "bogus"]),
    "direction": st.sampled_from(["unidirectional", "bidirectional"]),
    "chunks": st.sampled_from([1, 2, 4, 8, 64, 3, 0, 128]),
    "unroll": st.sampled_from(["full", 1, 2, 3]),
    "accumulate": st.sampled_from([None, "update_slice", "concat", "input_dtype", "float32", "bogus"]),
    "fuse": st.booleans(),
})
RATIOS = st.sampled_from([0.001, 0.5, 0.7, 1.0, 1000.0, 0.0, -1.0, None]) | st.floats(1e-6, 1e6)
SAMPLES = st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=6)
LEASE_IDS = st.sampled_from(["", "x", "0" * 36, "0" * 37, "lease\x00"]) | st.text(max_size=40)
STEP_FIELDS = {"mesh": st.sampled_from([{"data": 1, "model": 4}, {}, {"model\x00": 8}, {"data": 0, "model": 8}]),
               "tensor_axis": st.sampled_from(["data", "", "model\n", "m" * 65]),
               "batch_axes": st.sampled_from([["data"], ["x"] * 9, ["\x00"]]),
               "reference": st.sampled_from(["tuned", "baseline", "nothing", "", "as-written\x00"]),
               "model": st.sampled_from(["tiny", "other", None]),
               "hardware": st.sampled_from([HARDWARE, STEP_HARDWARE | {"device_kind": "cpu\x00"},
                                            STEP_HARDWARE | {"jax_version": "0" * 200}])}


def _variant(step: dict, draw, *, timed: bool = False) -> dict | None:
    variants = [v for v in step["variants"] if v.get("timing") or not timed]
    return variants[draw(st.integers(0, len(variants) - 1))] if variants else None


def _paired(timing: dict, reference: dict) -> tuple[float, float, float] | None:
    a, b = timing["samples_s"], reference["samples_s"]
    return quartiles([x / y for x, y in zip(a, b, strict=True)]) if len(a) == len(b) else None


def _retime(variant: dict, samples: list[float], reference: dict | None) -> None:
    """``variant`` timed at ``samples``, its summary and ratio what they give (a forgery only numbers can tell)."""
    variant["timing"] = Timing.of(samples).model_dump(mode="json")
    paired = _paired(variant["timing"], reference["timing"]) if reference and reference.get("timing") else None
    if paired is not None:
        variant["ratio"], variant["ratio_iqr"] = paired[1], paired[2] - paired[0]


def rename(step, draw):
    _variant(step, draw)["name"] = draw(NAMES)


def add_role(step, draw):
    variant = _variant(step, draw)
    variant["configs"][draw(ROLE_NAMES)] = {slot: DEFAULT_CONFIG for slot in SLOTS}


def rename_role(step, draw):
    variant = _variant(step, draw)
    if variant["configs"]:
        old = draw(st.sampled_from(sorted(variant["configs"])))
        variant["configs"][draw(ROLE_NAMES)] = variant["configs"].pop(old)


def drop_role(step, draw):
    variant = _variant(step, draw)
    if variant["configs"]:
        del variant["configs"][draw(st.sampled_from(sorted(variant["configs"])))]


def reconfigure(step, draw):
    variant = _variant(step, draw)
    if variant["configs"]:
        role = draw(st.sampled_from(sorted(variant["configs"])))
        variant["configs"][role][draw(st.sampled_from(SLOTS))] = draw(DECOMPOSITIONS)


def rescale_ratio(step, draw):
    _variant(step, draw)["ratio"] = draw(RATIOS)


def resample(step, draw):
    variant = _variant(step, draw, timed=True)
    if variant is None:
        return
    samples = draw(SAMPLES)
    how = draw(st.sampled_from(["samples only", "and their summary", "and the ratio too"]))
    if how == "samples only":
        variant["timing"]["samples_s"] = samples
    elif how == "and their summary":
        variant["timing"] = Timing.of(samples).model_dump(mode="json")
    else:
        _retime(variant, samples, next((v for v in step["variants"] if v["name"] == step["reference"]), None))


def faster(step, draw):
    """A variant the trial asked for made faster than the tuned step, every number consistent."""
    variant = _variant(step, draw, timed=True)
    reference = next((v for v in step["variants"] if v["name"] == step["reference"]), None)
    if variant is None or reference is None or variant is reference or not reference.get("timing"):
        return
    factor = draw(st.floats(0.2, 0.99))
    _retime(variant, [factor * s for s in reference["timing"]["samples_s"]], reference)


def resummarise(step, draw):
    variant = _variant(step, draw, timed=True)
    if variant is not None:
        variant["timing"][draw(st.sampled_from(["median_s", "iqr_s", "min_s", "max_s"]))] = draw(st.floats(0, 10))


def restatus(step, draw):
    _variant(step, draw)["status"] = draw(st.sampled_from([*Status, "bogus"]))


def drop_variant(step, draw):
    if len(step["variants"]) > 1:
        step["variants"].remove(_variant(step, draw))


def repeat_variant(step, draw):
    step["variants"].append(copy.deepcopy(_variant(step, draw)))


def add_variant(step, draw):
    step["variants"].append(copy.deepcopy(_variant(step, draw)) | {"name": draw(NAMES)})


def confirm(step, draw):
    """Fresh rounds after the decision: some of the variants again, timed again."""
    chosen = draw(st.lists(st.sampled_from([v["name"] for v in step["variants"]]), max_size=4, unique=True))
    rounds = [copy.deepcopy(v) for v in step["variants"] if v["name"] in chosen]
    for variant in rounds:
        if variant.get("timing") and draw(st.booleans()):
            variant["timing"]["samples_s"] = [s * draw(st.floats(0.5, 1.5)) for s in variant["timing"]["samples_s"]]
            variant["timing"] = Timing.of(variant["timing"]["samples_s"]).model_dump(mode="json")
    reference = next((v for v in rounds if v["name"] == step["reference"]), None)
    for variant in rounds:
        if draw(st.booleans()) and variant.get("timing"):
            _retime(variant, variant["timing"]["samples_s"], reference)
    step["confirmation"] = rounds


def change_step(step, draw):
    field = draw(st.sampled_from(sorted(STEP_FIELDS)))
    step[field] = draw(STEP_FIELDS[field])


def change_block(step, draw):
    step["block"] = step["block"] | draw(st.sampled_from([{"name": "other"}, {"d_model": 512}, {"name": "t" * 201},
                                                          {"name": "tiny\x00"}, {"layers": 96}]))


def surprise(step, draw):
    target = draw(st.sampled_from(["step", "variant", "timing"]))
    where = {"step": step, "variant": _variant(step, draw), "timing": _variant(step, draw, timed=True)}[target]
    if where is not None:
        where["surprise"] = 1


DEFAULT_CONFIG = {"method": "baseline"}
STEP_MUTATIONS = [rename, add_role, rename_role, drop_role, reconfigure, rescale_ratio, resample, faster, resummarise,
                  restatus, drop_variant, repeat_variant, add_variant, confirm, change_step, change_block, surprise]


class StepTrial:
    """The step trial under fuzz: leased afresh (the tiny model submitted again) whenever one is accepted."""

    def __init__(self, admin: httpx.Client, worker):
        self.admin, self.worker = admin, worker
        self.lease()

    def lease(self) -> None:
        created = self.admin.post("/v1/studies", json=TINY)  # its problems: tuned the first time, then skipped
        assert created.status_code == 201, created.text
        self.submission_id = created.json()["submission_id"]
        while (grant := self.worker.post(f"/v1/workers/{self.worker}/lease").json())["trial"]["kind"] != "step":
            report(self.worker, grant)
        self.grant, self.task = grant, TrialTask.model_validate(grant["trial"])
        from cmtune.tuner.variants import variant_configs

        self.asked = variant_configs(self.task.step.configs, ablation=self.task.step.ablation)
        seconds = dict.fromkeys(self.asked, 0.85) | {"as-written": 1.0, "baseline": 0.95, "tuned": 0.8}
        seconds[next(name for name in self.asked if name.startswith("tuned-minus-"))] = 0.7  # an override
        from tests.service.conftest import step_result

        self.valid = step_result(grant["trial"], seconds) | {"hardware": STEP_HARDWARE}

    @property
    def url(self) -> str:
        return f"/v1/trials/{self.grant['trial']['id']}/result"


def _fastapi_error(response: httpx.Response) -> bool:
    """A 4xx with FastAPI's error body: a list of located errors (422), or a message."""
    detail = response.json().get("detail")
    if response.status_code == 422:
        return isinstance(detail, list) and all(isinstance(e.get("loc"), list) and isinstance(e.get("msg"), str)
                                                for e in detail)
    return isinstance(detail, str) and bool(detail)


def check_served(client: httpx.Client, trial: StepTrial, step: dict) -> list[str]:
    """What is wrong with what the server serves after ``step`` was accepted for ``trial`` (nothing: [])."""
    wrong = []
    study = client.get(f"/v1/studies/{trial.grant['trial']['study_id']}").json()
    chosen = study["decision"]["variant"] if study["state"] == "completed" and study["decision"] else None
    if chosen is not None and chosen not in trial.asked:
        wrong.append(f"chose {chosen!r}, which the trial did not ask for ({sorted(trial.asked)})")
    for override in client.get("/v1/overrides", params=OVERRIDES).json():
        role = override["role"]
        if role not in ROLES:
            wrong.append(f"an override of {role!r}, not a role of the block")
            continue
        for slot in SLOTS:
            try:
                PROBLEMS[role][slot].check(Decomposition.model_validate(override["configs"][slot]))
            except ValueError as exc:
                wrong.append(f"override of {role} {slot} does not fit its problem: {exc}")
        asked = (trial.asked.get(chosen) or {}).get(role) if chosen in trial.asked else None
        if chosen is not None and asked is not None and override["configs"] != asked.model_dump(mode="json"):
            wrong.append(f"override of {role} is not what the trial gave {chosen}")
    served = client.get(f"/v1/submissions/{trial.submission_id}").json().get("step") or {}
    if chosen is not None and served.get("vs_reference") and chosen in {v["name"] for v in step["variants"]}:
        measured = StepMeasurement.model_validate(step)
        graded = grading_rounds(measured, chosen)
        paired = ratio_quartiles(graded, chosen, graded.reference)
        expected = Speedup.of(paired)
        if expected is None or abs(served["vs_reference"]["median"] / expected.median - 1) > 1e-6:
            wrong.append(f"serves {chosen} as {served['vs_reference']['median']!r}x the step as written; its samples "
                         f"give {expected.median if expected else None!r}x")
        (stored,) = [t for t in client.get(f"/v1/studies/{study['id']}/trials").json()
                     if t["id"] == trial.grant["trial"]["id"]]
        if paired is None or stored["ratio"] is None or abs(stored["ratio"] / paired[1] - 1) > 1e-6:
            wrong.append(f"stores {chosen}'s ratio as {stored['ratio']!r}; its samples give {paired and paired[1]!r}")
    return wrong


@pytest.mark.parametrize("examples", [pytest.param(STEP_EXAMPLES // 4, id="quick"),
                                      pytest.param(STEP_EXAMPLES, id="thorough", marks=pytest.mark.slow)])
def test_step_results_never_break_what_is_served(fuzzed_server, examples):
    server, tokens, _ = fuzzed_server
    auth = {"Authorization": f"Bearer {tokens['admin']}"}
    admin = httpx.Client(base_url=server.url, headers=auth, timeout=30)
    worker = register(httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['worker']}"},
                                   timeout=30), "step-fuzz-worker", STEP_HARDWARE)
    trial = StepTrial(admin, worker)
    accepted = []

    @given(data=st.data())
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(data):
        body = {"lease_id": trial.grant["lease"]["id"], "step": copy.deepcopy(trial.valid)}
        for mutation in data.draw(st.lists(st.sampled_from(STEP_MUTATIONS), min_size=1, max_size=3), label="changes"):
            mutation(body["step"], data.draw)
        if data.draw(st.integers(0, 19), label="lease") == 0:
            body["lease_id"] = data.draw(LEASE_IDS)
        response = worker.post(trial.url, json=body)
        assert response.status_code < 500, response.text[:2000]
        if response.status_code >= 300:
            assert 400 <= response.status_code < 500 and _fastapi_error(response), response.text[:2000]
            return
        assert not response.json()["duplicate"], response.text
        accepted.append(body)
        wrong = check_served(admin, trial, body["step"])
        trial.lease()
        assert not wrong, wrong

    fuzz()
    # the valid result itself is accepted, and what it leaves is served as it should be
    response = worker.post(trial.url, json={"lease_id": trial.grant["lease"]["id"], "step": trial.valid})
    assert response.status_code == 200, response.text
    assert check_served(admin, trial, trial.valid) == []
    assert any(o["role"] in ROLES for o in admin.get("/v1/overrides", params=OVERRIDES).json())
