"""`GET /`: the web page (translate, summarize, attention heatmaps), one self-contained file.

The page is read once, when this module is imported, from the `service.api` package's
`static/index.html` (packaged as package data); it talks to the server only through `/v1/*`.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["page"])

PAGE_HTML = resources.files("service.api").joinpath("static/index.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    """The web page; browsers revalidate it (`no-cache`), so a new release shows at once."""
    return HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-cache"})
