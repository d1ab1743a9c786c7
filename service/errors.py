"""Errors and their HTTP statuses, mapped in one place (`register`).

The domain errors of the study lifecycle live in `cmtune.tuner.errors`; the service adds the
ones only a server has (authentication, an unreachable database).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from cmtune.tuner.errors import CmtuneError, ConflictError, InvalidError, NotFoundError

__all__ = ["ConflictError", "ForbiddenError", "InvalidError", "NotFoundError", "UnauthorizedError",
           "UnavailableError", "register"]


class UnauthorizedError(CmtuneError):
    """No token, or an unknown or revoked one."""


class ForbiddenError(CmtuneError):
    """A token whose role may not do this."""


class UnavailableError(CmtuneError):
    """The database cannot be reached (the request may be retried)."""


STATUS = {NotFoundError: 404, ConflictError: 409, InvalidError: 422, UnauthorizedError: 401, ForbiddenError: 403,
          UnavailableError: 503}
log = logging.getLogger("cmtune.service")


class ErrorOut(BaseModel):
    """Every error but 422: what went wrong and what to do."""

    detail: str


DESCRIPTIONS = {
    401: "no bearer token, an unknown or revoked one, or (worker calls) no valid worker credential",
    403: "the token's role, or the worker credential, may not do this",
    404: "no such study, trial, worker or submission",
    409: "the request clashes with the stored state (a stale lease, a final study, a duplicate)",
    413: "the request body is over CMTUNE_MAX_BODY_BYTES",
    503: "the database is unreachable: retry",
}


def responses(*codes: int) -> dict:
    """OpenAPI entries for the error statuses a route can answer (422 is FastAPI's own schema)."""
    return {code: {"model": ErrorOut, "description": DESCRIPTIONS[code]} for code in codes}


def status_of(exc: CmtuneError) -> int:
    return next((code for kind, code in STATUS.items() if isinstance(exc, kind)), 500)


def register(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, without echoing the input back (it may be huge, or NaN, which JSON cannot carry)."""
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's 400 for a body it cannot decode is a bad body like any other: 422."""
        if exc.status_code == 400:
            return JSONResponse({"detail": [{"loc": ["body"], "msg": f"{exc.detail}: send UTF-8 JSON",
                                             "type": "json_invalid"}]}, status_code=422)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(CmtuneError)
    async def _domain_error(request: Request, exc: CmtuneError) -> JSONResponse:
        status = status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status == 422:  # the shape of FastAPI's own validation errors, so every 422 matches one schema
            body = {"detail": [{"loc": ["body"], "msg": exc.message, "type": "value_error"}]}
        else:
            body = {"detail": exc.message}
        return JSONResponse(body, status_code=status, headers=headers)
