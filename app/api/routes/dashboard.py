"""The web dashboard: static files from app/static, no build step. `/` is its page.

The page needs no API key to load (it holds no data); it asks for one when the API answers 401.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
"""Only this origin's files run or load: a CDN or an injected script is refused by the browser."""

REVALIDATE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
"""Browsers revalidate (a 304 by ETag) instead of running an old module against a newer API."""

router = APIRouter(include_in_schema=False)


@router.get("/")
def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                        headers={**REVALIDATE, "Content-Security-Policy": CONTENT_SECURITY_POLICY})


class _RevalidatedStaticFiles(StaticFiles):
    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(REVALIDATE)
        if path.endswith(".LICENSE") and response.status_code == 200:
            response.headers["Content-Type"] = "text/plain; charset=utf-8"  # read in the browser, not downloaded
        return response


static_files = _RevalidatedStaticFiles(directory=STATIC_DIR)
