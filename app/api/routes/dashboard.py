"""The web dashboard: static files from app/static, no build step. `/` is its page."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"

router = APIRouter(include_in_schema=False)


@router.get("/")
def dashboard() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                        headers={"Cache-Control": "no-cache"})


static_files = StaticFiles(directory=STATIC_DIR)
