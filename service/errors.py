"""Errors and their HTTP statuses, mapped in one place (`register`).

The domain errors of the study lifecycle live in `cmtune.tuner.errors`; the service adds the
ones only a server has (authentication, an unreachable database).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

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


def status_of(exc: CmtuneError) -> int:
    return next((code for kind, code in STATUS.items() if isinstance(exc, kind)), 500)


def register(app: FastAPI) -> None:
    @app.exception_handler(CmtuneError)
    async def _domain_error(request: Request, exc: CmtuneError) -> JSONResponse:
        status = status_of(exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"detail": exc.message}, status_code=status, headers=headers)
