"""The web dashboard: one page shell for every /ui URL, plus its static files (no external assets).

Every answer says ``Referrer-Policy: no-referrer`` (`cmtune.service.guard`; the shell's
``<meta name="referrer">`` too): no dashboard URL travels on in a Referer.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

STATIC = Path(__file__).resolve().parents[1] / "dashboard"
router = APIRouter(include_in_schema=False)


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/ui")


@router.get("/ui")
@router.get("/ui/studies/{study_id}")
@router.get("/ui/workers")
@router.get("/ui/configs")
@router.get("/ui/submissions/{submission_id}")
def page(study_id: int | None = None, submission_id: int | None = None) -> FileResponse:
    """The page shell; its script reads the URL, asks the API (with the reader's token) and renders."""
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
