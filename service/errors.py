"""Domain errors; `register` turns each into its HTTP status in one place."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


class ServiceError(Exception):
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotFoundError(ServiceError):
    status = 404


class ConflictError(ServiceError):
    """The request clashes with the stored state (a stale lease, a duplicate)."""

    status = 409


class InvalidError(ServiceError):
    """Well-formed but unusable input: the message says what to fix."""

    status = 422


class UnauthorizedError(ServiceError):
    status = 401


class ForbiddenError(ServiceError):
    status = 403


class UnavailableError(ServiceError):
    status = 503


def register(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=headers)
