"""The standing check: schemathesis fuzzes the whole OpenAPI document of a real server.

Every operation gets generated requests (valid and invalid, a fixed seed, a bounded number of
examples so that it fits CI), sent with a real admin token and a real worker credential, and
every response must be: no server error, a status code the document declares, a body that fits
the declared schema.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from cmtune.service.launcher import running_server
from tests.service.conftest import HARDWARE, PROBLEM, create_tokens, register, run_trial

EXAMPLES = 12  # per operation: ~25 operations, a few hundred requests in all


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    """A real server with some state (a study with results, a worker, a tuned config) to aim at."""
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.sqlite'}"
    tokens = create_tokens(url, ("admin", "worker"))
    with running_server(database_url=url, extra_env={"CMTUNE_MAX_BODY_BYTES": str(1 << 20)}) as server:
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['admin']}"}, timeout=30)
        admin.post("/v1/studies", json={"problem": PROBLEM, "hardware": HARDWARE, "budget": {"trials": 4}})
        admin.post("/v1/studies", json={"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}},
                                        "hardware": HARDWARE, "budget": {"trials": 4}})
        worker = register(httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['worker']}"},
                                       timeout=30), "fuzz-worker")
        while run_trial(worker) is not None:
            pass
        yield server, tokens["admin"], worker


def operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    for result in schema.get_all_operations():
        yield result.ok()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_answers_within_its_schema(fuzzed_server, mode):
    server, admin, worker = fuzzed_server
    headers = {"Authorization": f"Bearer {admin}", "X-Cmtune-Worker": worker.credential}
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
