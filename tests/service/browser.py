"""A small headless Chromium driver over the DevTools protocol, for the web page tests.

It starts the system's Chromium (Debian's `chromium` package; nothing is installed at run time)
with `--remote-debugging-port=0`, reads the port Chromium picked from `DevToolsActivePort` in
the profile folder, and speaks the protocol to the page over a websocket (`websockets`, which
`uvicorn[standard]` brings). Input goes through `Input.*` events, so clicks, hovers and keys
reach the page the way a user's would.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Self

from websockets.sync.client import ClientConnection, connect

# What Chromium needs on our machines: no sandbox (containers, root), no GPU, and no traffic
# of its own to the outside world.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--no-proxy-server",
    "--hide-scrollbars",
    "--mute-audio",
)

KEYS = {  # key -> (code, windowsVirtualKeyCode)
    "ArrowLeft": ("ArrowLeft", 37), "ArrowUp": ("ArrowUp", 38), "ArrowRight": ("ArrowRight", 39),
    "ArrowDown": ("ArrowDown", 40), "Home": ("Home", 36), "End": ("End", 35),
    "PageUp": ("PageUp", 33), "PageDown": ("PageDown", 34), "Enter": ("Enter", 13),
    "Tab": ("Tab", 9), "Escape": ("Escape", 27), " ": ("Space", 32),
}


def find_chromium() -> str | None:
    """The Chromium executable: `$ATTNSERVE_CHROMIUM`, `/usr/bin/chromium`, or one on PATH."""
    candidates = [os.environ.get("ATTNSERVE_CHROMIUM"), "/usr/bin/chromium"]
    candidates += [shutil.which(name) for name in ("chromium", "chromium-browser")]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


class BrowserError(RuntimeError):
    """Chromium did not start, a protocol call failed, or the page threw."""


class Browser:
    """One headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(
        self, executable: str, profile_dir: Path, *, width: int = 1280, height: int = 900,
        timeout_s: float = 20.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.events: list[dict[str, Any]] = []  # every protocol event received, in order
        self._next_id = 0
        profile_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(profile_dir / "chromium.log", "wb")  # noqa: SIM115 (closed in close())
        self._profile = profile_dir
        self._closing = ExitStack()
        self._process = subprocess.Popen(
            [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}",
             "--remote-debugging-port=0", f"--window-size={width},{height}", "about:blank"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        try:
            self._ws = self._connect(profile_dir / "DevToolsActivePort")
            for domain in ("Page", "Runtime", "Network"):
                self.call(f"{domain}.enable")
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    # ---- plumbing ----
    def _connect(self, port_file: Path) -> ClientConnection:
        deadline = time.monotonic() + self.timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if self._process.poll() is not None or time.monotonic() > deadline:
                raise BrowserError(f"Chromium did not start; its log:\n{self._log_tail()}")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            with no_proxy.open(f"http://127.0.0.1:{port}/json/list", timeout=5) as response:
                pages = [t for t in json.load(response) if t.get("type") == "page"]
            if pages:
                break
            if time.monotonic() > deadline:
                raise BrowserError("Chromium opened no page")
            time.sleep(0.05)
        url = pages[0]["webSocketDebuggerUrl"]
        try:  # websockets >= 15 honours proxy settings: a loopback socket must not use them
            websocket = connect(url, max_size=64 * 2**20, open_timeout=self.timeout_s, proxy=None)
        except TypeError:
            websocket = connect(url, max_size=64 * 2**20, open_timeout=self.timeout_s)
        return self._closing.enter_context(websocket)

    def _log_tail(self) -> str:
        self._log.flush()
        return (self._profile / "chromium.log").read_text(errors="replace")[-2000:]

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one protocol command and return its result (events meanwhile go to `events`)."""
        self._next_id += 1
        ident = self._next_id
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"no answer to {method} within {self.timeout_s:g}s")
            message = json.loads(self._ws.recv(timeout=remaining))
            if message.get("id") == ident:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)

    def close(self) -> None:
        """Stop Chromium (politely, then not)."""
        self._closing.close()
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- page ----
    def goto(self, url: str) -> None:
        """Open `url` and wait until the document has loaded."""
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"could not open {url}: {result['errorText']}")
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression!r} threw: {text}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float | None = None) -> Any:
        """Poll a JavaScript expression until it is truthy; return its value."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"still falsy after {timeout_s or self.timeout_s:g}s: {expression} "
                           f"(last value {value!r}); page errors: {self.page_errors()}")

    def page_errors(self) -> list[str]:
        """Uncaught exceptions and console errors the page has produced so far."""
        errors = []
        for event in self.events:
            if event["method"] == "Runtime.exceptionThrown":
                details = event["params"]["exceptionDetails"]
                errors.append(details.get("exception", {}).get("description") or details["text"])
            elif (event["method"] == "Runtime.consoleAPICalled"
                  and event["params"]["type"] == "error"):
                errors.append(" ".join(str(a.get("value", a.get("description")))
                                       for a in event["params"]["args"]))
        return errors

    def requests(self) -> list[dict[str, Any]]:
        """Every request the page sent so far: `url`, `method`, `postData` when any."""
        self.call("Runtime.evaluate", expression="0")  # drain pending events
        return [e["params"]["request"] for e in self.events
                if e["method"] == "Network.requestWillBeSent"]

    # ---- input ----
    def center(self, selector: str) -> tuple[float, float]:
        """The viewport coordinates of the middle of the first element matching `selector`."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center', inline: 'center'});"
            " const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if box is None:
            raise BrowserError(f"no element matches {selector!r}")
        return box[0], box[1]

    def hover(self, selector: str) -> None:
        x, y = self.center(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        """A left click in the middle of the element, as mouse events."""
        x, y = self.center(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_text(self, selector: str, text: str) -> None:
        """Focus the element and type `text` into it (as one IME-style insertion)."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def press(self, key: str, modifiers: int = 0) -> None:
        """Press and release one key (names as in `KeyboardEvent.key`; see `KEYS`)."""
        code, vk = KEYS.get(key, (key, ord(key.upper()[0])))
        common = {"key": key, "code": code, "windowsVirtualKeyCode": vk,
                  "nativeVirtualKeyCode": vk, "modifiers": modifiers}
        self.call("Input.dispatchKeyEvent", type="rawKeyDown", **common)
        self.call("Input.dispatchKeyEvent", type="keyUp", **common)

    # ---- looks ----
    def set_color_scheme(self, scheme: str) -> None:
        """Emulate `prefers-color-scheme: light|dark`."""
        self.call("Emulation.setEmulatedMedia",
                  features=[{"name": "prefers-color-scheme", "value": scheme}])

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        """Save a PNG of the viewport, or of the whole page."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={
                "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
