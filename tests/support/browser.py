"""A real headless browser for the tests: Debian's Chromium, driven through the
DevTools protocol over a pipe (``--remote-debugging-pipe``: no port, no websocket, no
driver to install).

:class:`Browser` opens one page; :meth:`Browser.goto` loads a URL, :meth:`Browser.value`
evaluates a JavaScript expression in it, :meth:`Browser.wait_for` waits until one is
true (on a deadline, re-evaluated: never a fixed sleep), :meth:`Browser.screenshot`
saves a PNG. The browser reaches only what the page asks for (loopback in the tests).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["Browser", "chromium_binary"]

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str | None:
    """The Chromium (or Chrome) on PATH, or ``$CHROMIUM_BINARY``."""
    explicit = os.environ.get("CHROMIUM_BINARY")
    if explicit:
        return explicit
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _above_four(fd: int) -> int:
    """``fd`` moved to a descriptor number above 4."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 5)
    os.close(fd)
    return moved


class BrowserError(Exception):
    """The browser answered an error, died, or a condition did not come true."""


class Browser:
    """One headless Chromium with one page of ``width`` x ``height`` pixels."""

    def __init__(self, binary: str, width: int = 1280, height: int = 800) -> None:
        self._profile = tempfile.mkdtemp(prefix="etcd-rendezvous-chromium-")
        to_browser, self._write_fd = os.pipe()
        self._read_fd, from_browser = os.pipe()
        # Above 4, so that the shell's 3<& and 4>& below cannot overwrite one another.
        to_browser, from_browser = (_above_four(fd) for fd in (to_browser, from_browser))
        # The protocol's pipe is fds 3 (commands) and 4 (answers) of the browser.
        self._process = subprocess.Popen(
            [
                "bash",  # dash takes no fd number above 9 in a redirection
                "-c",
                f'exec "$@" 3<&{to_browser} 4>&{from_browser}',
                "bash",
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--hide-scrollbars",
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            pass_fds=(to_browser, from_browser),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=(Path(self._profile) / "stderr.log").open("wb"),
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next_id = 0
        try:
            targets = self._call("Target.getTargets")["targetInfos"]
            page = next(t["targetId"] for t in targets if t["type"] == "page")
            attached = self._call("Target.attachToTarget", targetId=page, flatten=True)
            self._session = attached["sessionId"]
            self._call("Page.enable", session=self._session)
            self._call("Runtime.enable", session=self._session)
            self._call(
                "Emulation.setDeviceMetricsOverride",
                session=self._session,
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next_id:
                    if "error" in answer:
                        raise BrowserError(f"{method}: {answer['error']}")
                    result: dict[str, Any] = answer["result"]
                    return result
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:
                log = (Path(self._profile) / "stderr.log").read_text(errors="replace")
                raise BrowserError(f"the browser closed its pipe during {method}:\n{log[-3000:]}")
            self._buffer += chunk

    def goto(self, url: str) -> None:
        """Load ``url`` and wait until its document is complete."""
        self._call("Page.navigate", session=self._session, url=url)
        self.wait_for("document.readyState === 'complete'", timeout=30)

    def value(self, expression: str) -> Any:
        """The value of JavaScript ``expression`` in the page (JSON-serialisable)."""
        answer = self._call(
            "Runtime.evaluate", session=self._session, expression=expression, returnByValue=True
        )
        if "exceptionDetails" in answer:
            raise BrowserError(f"{expression}: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0) -> bool:
        """Wait until ``expression`` is truthy in the page (as JavaScript judges it).

        Raises:
            BrowserError: it is not within ``timeout`` seconds (the message shows the
                page's text).
        """
        deadline = time.monotonic() + timeout
        while True:
            result = self.value(f"!!({expression})")
            if result:
                return result
            if time.monotonic() > deadline:
                text = self.value("document.body ? document.body.innerText : ''")
                raise BrowserError(f"not true after {timeout} s: {expression}\npage:\n{text}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """Save the page as a PNG at ``path`` (the whole page, not only the window)."""
        metrics = self._call("Page.getLayoutMetrics", session=self._session)
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        shot = self._call(
            "Page.captureScreenshot",
            session=self._session,
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def colours(self, png: Path) -> int:
        """How many different colours the PNG at ``png`` holds (drawn on a canvas in the
        page): a blank page has one or two."""
        data = base64.b64encode(png.read_bytes()).decode()
        answer = self._call(
            "Runtime.evaluate",
            session=self._session,
            awaitPromise=True,
            returnByValue=True,
            expression=(
                "(async () => { const img = new Image(); "
                f"img.src = 'data:image/png;base64,{data}'; await img.decode(); "
                "const c = document.createElement('canvas'); c.width = img.width; "
                "c.height = img.height; const g = c.getContext('2d'); g.drawImage(img, 0, 0); "
                "const px = new Uint32Array(g.getImageData(0, 0, c.width, c.height).data.buffer); "
                "return new Set(px).size; })()"
            ),
        )
        if "exceptionDetails" in answer:
            raise BrowserError(f"cannot read {png}: {answer['exceptionDetails']}")
        return int(answer["result"]["value"])

    def close(self) -> None:
        """Stop the browser and remove its profile."""
        for fd in (self._write_fd, self._read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
