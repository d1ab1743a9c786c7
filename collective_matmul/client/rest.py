"""The one client of the service's REST API: the worker daemon, the command lines and `Tuned` all call it.

Every route a client of cmtune calls is one `Endpoint` of `ENDPOINTS` (its method, path template and
wire types, `collective_matmul.wire`), and `ApiClient` has one method per endpoint: bodies go in as
wire models, answers come back parsed.  The bearer token and a worker's own credential
(`collective_matmul.wire.WORKER_HEADER`) are set in one place; so are the retries of a service that
is away, restarting or overloaded (exponential backoff for ``patience_s``, the worker daemon's
policy); and an HTTP error is raised as one of this module's exceptions, so callers branch on
`NotRegistered`, `Conflict` or `Invalid`, never on a status number.  No FastAPI, no JAX.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from collective_matmul.planning.problem import Hardware, Problem, Software
from collective_matmul.wire import (
    WORKER_HEADER,
    ConfigAnswer,
    HeartbeatIn,
    HeartbeatOut,
    LeaseGranted,
    ResultIn,
    ResultOut,
    RoleOverride,
    StudyCreate,
    StudyCreated,
    StudyPage,
    SubmissionPublic,
    SubmissionSummary,
    TrialPublic,
    WorkerCreate,
    WorkerPublic,
    WorkerRegistered,
)
from collective_matmul.wire.lookup import Unmeasured

log = logging.getLogger("collective_matmul.client.rest")

TRANSIENT = (502, 503, 504)  # the service is away, restarting or overloaded: worth another try


class ApiError(Exception):
    """The service answered with an error, or could not be reached.

    Attributes:
        status: the HTTP status (None: no answer came).
        detail: what the service said is wrong (a 422's field errors joined into one line).
    """

    def __init__(self, status: int | None, detail: str):
        super().__init__(f"{status}: {detail}" if status is not None else detail)
        self.status, self.detail = status, detail


class Unreachable(ApiError):
    """No answer (a connection or a timeout failed), or a 502/503/504, after every retry."""


class NotRegistered(ApiError):
    """The service does not know this worker (a fresh database, a revoked credential): register again."""


class Conflict(ApiError):
    """409: the request clashes with the stored state (a stale lease, a final study)."""


class Invalid(ApiError):
    """422: the request does not check out; ``detail`` says what to fix."""


@dataclass(frozen=True)
class Endpoint:
    """One route the clients call: method, path template (the service's own) and wire types."""

    method: str
    path: str
    body: type[BaseModel] | None = None
    answer: type[BaseModel] | None = None  # None: no body comes back (or the caller reads none)
    many: bool = False  # the answer is a list of ``answer``
    credential: bool = False  # sends the worker's credential: a 401 means `NotRegistered`
    names_worker: bool = False  # the path is the worker's own: a 404 means `NotRegistered` too
    retry: bool = True  # False: best effort, tried once (a heartbeat comes again, a leaving worker does not wait)
    exclude_none: bool = False  # absent fields are left out of the body, not sent as null


_WORKER = dict(credential=True, names_worker=True)
ENDPOINTS: dict[str, Endpoint] = {
    "register": Endpoint("POST", "/v1/workers", WorkerCreate, WorkerRegistered),
    "heartbeat": Endpoint("POST", "/v1/workers/{worker_id}/heartbeat", HeartbeatIn, HeartbeatOut, retry=False,
                          **_WORKER),
    "lease": Endpoint("POST", "/v1/workers/{worker_id}/lease", answer=LeaseGranted, **_WORKER),
    "unregister": Endpoint("DELETE", "/v1/workers/{worker_id}", retry=False, **_WORKER),
    "result": Endpoint("POST", "/v1/trials/{trial_id}/result", ResultIn, ResultOut, credential=True),
    "workers": Endpoint("GET", "/v1/workers", answer=WorkerPublic, many=True),
    "submit": Endpoint("POST", "/v1/studies", StudyCreate, StudyCreated, exclude_none=True),
    "studies": Endpoint("GET", "/v1/studies", answer=StudyPage),
    "trials": Endpoint("GET", "/v1/studies/{study_id}/trials", answer=TrialPublic, many=True),
    "submissions": Endpoint("GET", "/v1/submissions", answer=SubmissionSummary, many=True),
    "submission": Endpoint("GET", "/v1/submissions/{submission_id}", answer=SubmissionPublic),
    "config": Endpoint("GET", "/v1/configs", answer=ConfigAnswer),
    "overrides": Endpoint("GET", "/v1/overrides", answer=RoleOverride, many=True),
}


class ApiClient:
    """A cmtune service's REST API, one method per endpoint of `ENDPOINTS`.

    Args:
        server: the service's base URL.
        token: a bearer token (its role decides what the calls may do), or None.
        worker_credential: a registered worker's own credential (`register` sets it).
        timeout: seconds per request.
        patience_s: how long a call keeps retrying while the service is unreachable (exponential
            backoff, 0.5 s doubling up to 15 s); 0: each call is tried once.
        http: the HTTP client to send through (tests: FastAPI's ``TestClient``); default: a new one.
    """

    def __init__(self, server: str, token: str | None = None, *, worker_credential: str | None = None,
                 timeout: float = 30.0, patience_s: float = 0.0, http: httpx.Client | None = None):
        self.server = server.rstrip("/")
        self.token, self.worker_credential, self.patience_s = token, worker_credential, patience_s
        self._http = http if http is not None else httpx.Client(base_url=self.server, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    # -- workers -------------------------------------------------------------------------------

    def register(self, body: WorkerCreate) -> WorkerRegistered:
        """Register a worker (again); every later worker call carries the credential the answer holds."""
        self.worker_credential = None
        registered = self._call("register", body=body)
        self.worker_credential = registered.credential
        return registered

    def heartbeat(self, worker_id: int, lease_id: str | None = None) -> HeartbeatOut:
        """Mark the worker alive and extend ``lease_id`` where given (tried once)."""
        return self._call("heartbeat", body=HeartbeatIn(lease_id=lease_id), worker_id=worker_id)

    def lease(self, worker_id: int) -> LeaseGranted | None:
        """Claim a trial for the worker; None when there is none.

        Raises:
            NotRegistered: the service does not know the worker (register again).
        """
        return self._call("lease", worker_id=worker_id)

    def result(self, trial_id: int, body: ResultIn) -> ResultOut:
        """Report a trial's result under its lease (with ``body.lease_next``, the answer's ``next`` is the next trial).

        Raises:
            Conflict: the lease is stale or another worker's: drop the result.
            Invalid: the result does not check out against its trial.
        """
        return self._call("result", body=body, trial_id=trial_id)

    def unregister(self, worker_id: int) -> None:
        """The worker leaves; its leased trials go back to the queue (tried once)."""
        self._call("unregister", worker_id=worker_id)

    def workers(self) -> list[WorkerPublic]:
        """The registered workers that have not left."""
        return self._call("workers")

    # -- studies and submissions ---------------------------------------------------------------

    def submit(self, body: StudyCreate) -> StudyCreated:
        """Submit problems, a model + mesh, or a discovered step (an admin token)."""
        return self._call("submit", body=body)

    def studies(self, *, state: str | None = None, limit: int | None = None) -> StudyPage:
        """A page of studies (``state``: only those in it; ``limit``: at most this many, default the service's)."""
        params = {name: value for name, value in (("state", state), ("limit", limit)) if value is not None}
        return self._call("studies", params=params)

    def trials(self, study_id: int) -> list[TrialPublic]:
        """The trials of a study, in order, with their measurements."""
        return self._call("trials", study_id=study_id)

    def submissions(self) -> list[SubmissionSummary]:
        """The newest submitted models."""
        return self._call("submissions")

    def submission(self, submission_id: int) -> SubmissionPublic:
        """A submitted model: each role's problem, study and tuned config, and its step measurement."""
        return self._call("submission", submission_id=submission_id)

    # -- configs -------------------------------------------------------------------------------

    def config(self, problem: Problem, hardware: Hardware, software: Software | None = None, *,
               unmeasured: Unmeasured = "baseline") -> ConfigAnswer:
        """The service's config for ``problem`` on ``hardware``, for the stack ``software`` (None: any); where nothing
        measured answers, the baseline or (``unmeasured="costmodel"``) the cost model's choice."""
        params = problem.model_dump() | _hardware_params(hardware) | {"unmeasured": unmeasured}
        if software is not None:
            params |= software.model_dump()
        return self._call("config", params=params)

    def overrides(self, model: str, hardware: Hardware,
                  on_invalid: Callable[[Any, ValueError], None] | None = None) -> list[RoleOverride]:
        """The per-role overrides of ``model`` on ``hardware``.

        Args:
            on_invalid: called with each served entry that does not check out, which is then skipped
                (None: such an entry raises).
        """
        return self._call("overrides", params={"model": model} | _hardware_params(hardware), on_invalid=on_invalid)

    # -- one request ---------------------------------------------------------------------------

    def _call(self, name: str, *, body: BaseModel | None = None, params: dict | None = None,
              on_invalid: Callable[[Any, ValueError], None] | None = None, **path):
        endpoint = ENDPOINTS[name]
        json = body.model_dump(mode="json", exclude_none=endpoint.exclude_none) if body is not None else None
        response = self._send(endpoint, endpoint.path.format(**path), json=json, params=params)
        if endpoint.answer is None or response.status_code == 204:
            return None
        if not endpoint.many:
            return endpoint.answer.model_validate_json(response.content)
        parsed = []
        for item in response.json():  # one bad entry costs only itself where the caller says so
            try:
                parsed.append(endpoint.answer.model_validate(item))
            except ValueError as exc:
                if on_invalid is None:
                    raise
                on_invalid(item, exc)
        return parsed

    def _headers(self, endpoint: Endpoint) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if endpoint.credential and self.worker_credential:
            headers[WORKER_HEADER] = self.worker_credential
        return headers

    def _send(self, endpoint: Endpoint, url: str, **kwargs) -> httpx.Response:
        def once() -> httpx.Response:
            try:
                response = self._http.request(endpoint.method, url, headers=self._headers(endpoint), **kwargs)
            except httpx.TransportError as exc:
                raise Unreachable(None, f"{type(exc).__name__}: {exc}") from exc
            except httpx.HTTPError as exc:
                raise ApiError(None, f"{type(exc).__name__}: {exc}") from exc
            if response.status_code >= 400:
                raise _error(endpoint, response)
            return response

        if not endpoint.retry or self.patience_s <= 0:
            return once()
        return retry(retry=retry_if_exception_type(Unreachable), wait=wait_exponential(multiplier=0.5, max=15),
                     stop=stop_after_delay(self.patience_s), reraise=True,
                     before_sleep=lambda state: log.warning("service unreachable (%s); retrying",
                                                            state.outcome.exception()))(once)()


def _hardware_params(hardware: Hardware) -> dict:
    params = {"platform": hardware.platform, "device_kind": hardware.device_kind,
              "device_count": hardware.device_count, "process_count": hardware.process_count}
    return params | ({"slice_devices": hardware.slice_devices} if hardware.slice_devices is not None else {})


def _error(endpoint: Endpoint, response: httpx.Response) -> ApiError:
    """The exception of an error answer (`ApiError` for a status with no meaning of its own to the clients)."""
    status = response.status_code
    if (status == 401 and endpoint.credential) or (status == 404 and endpoint.names_worker):
        kind = NotRegistered
    else:
        kind = {409: Conflict, 422: Invalid}.get(status, Unreachable if status in TRANSIENT else ApiError)
    return kind(status, _detail(response))


def _detail(response: httpx.Response) -> str:
    """What an error answer says: its ``detail``, a 422's field by field."""
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail", response.text) if isinstance(body, dict) else response.text
    if isinstance(detail, list):  # a 422: what to fix, field by field
        detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
    return str(detail)
