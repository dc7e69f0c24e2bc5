"""`GET /`: the web page (translate, summarize, attention heatmaps), one self-contained file.

The page is read once, when this module is imported, from the `service.api` package's
`static/index.html` (packaged as package data); it talks to the server only through `/v1/*`,
sending the bearer token its visitor gives (in its header field, or in the dialog it opens on a
401; kept in the tab's sessionStorage).

It is served with security headers: a Content-Security-Policy that runs only the page's own
inline script (by its sha256, computed here), allows inline styles (the heatmap colours its
cells with them), fetches only from this origin, and forbids framing, plugins, forms and a
`<base>`; `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff`, `Referrer-Policy:
no-referrer`.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["page"])

PAGE_HTML = resources.files("service.api").joinpath("static/index.html").read_text(encoding="utf-8")


def script_hashes(html: str) -> list[str]:
    """CSP sources (`'sha256-...'`) of the inline `<script>` elements of `html`."""
    return [
        "'sha256-" + base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode() + "'"
        for body in re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    ]


CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src " + " ".join(script_hashes(PAGE_HTML)),
    "style-src 'unsafe-inline'",
    "img-src data:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    """The web page; browsers revalidate it (`no-cache`), so a new release shows at once."""
    return HTMLResponse(PAGE_HTML, headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})
