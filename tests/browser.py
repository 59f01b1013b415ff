"""A headless Chromium driven through its DevTools protocol, for tests of a page: no driver to install, no
client library. The protocol runs over a pair of pipes (`--remote-debugging-pipe`: the browser reads commands
on its fd 3 and writes answers and events on its fd 4, each a JSON message ended by a NUL byte), as
Playwright and Puppeteer drive it.

    with Browser() as browser:            # pytest.skip when no chromium is installed
        tab = browser.open("http://127.0.0.1:8000/")
        tab.type_into("#ingredients", ["2 eggs", "1 cup flour"])
        tab.click("#go")
        tab.wait_for("document.querySelector('#status').textContent === 'done'")
        png = tab.screenshot()
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
import threading
import time
from typing import Any

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    for name in CANDIDATES:
        if found := shutil.which(name):
            return found
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    """A headless Chromium process and its DevTools connection."""

    def __init__(self, width: int = 1000, height: int = 1100):
        executable = find_chromium()
        if executable is None:
            pytest.skip(f"no Chromium found ({', '.join(CANDIDATES)}); Debian: apt-get install chromium")
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        commands_r, self._commands_w = os.pipe()
        self._answers_r, answers_w = os.pipe()
        # Numbers above 4 for the browser's ends, so that moving them onto 3 and 4 closes neither.
        commands_r, answers_w = (self._above_4(fd) for fd in (commands_r, answers_w))
        args = [
            "--headless",
            "--no-sandbox",  # tests run as root in CI, where Chromium's sandbox refuses to start
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--remote-debugging-pipe",
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        # bash (dash takes one-digit fds only) puts the pipes on fds 3 and 4, then becomes the browser.
        script = f'exec "$0" "$@" 3<&{commands_r} 4>&{answers_w} {commands_r}<&- {answers_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, executable, *args],
            pass_fds=(commands_r, answers_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(commands_r)
        os.close(answers_w)
        self._next_id = 0
        self._answers: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _above_4(fd: int) -> int:
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
        os.close(fd)
        return moved

    def _read(self) -> None:
        buffer = b""
        with os.fdopen(self._answers_r, "rb", buffering=0) as answers:
            while chunk := answers.read(65536):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                with self._cond:
                    for raw in messages:
                        message = json.loads(raw)
                        if "id" in message:
                            self._answers[message["id"]] = message
                    self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def send(self, method: str, session: str | None = None, timeout: float = 60.0, **params: Any) -> dict:
        """One protocol command; its result, or BrowserError."""
        with self._cond:
            self._next_id += 1
            call = self._next_id
        message: dict[str, Any] = {"id": call, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._commands_w, json.dumps(message).encode() + b"\0")
        end = time.monotonic() + timeout
        with self._cond:
            while call not in self._answers:
                left = end - time.monotonic()
                if self._closed or left <= 0:
                    raise BrowserError(
                        f"{method}: no answer ({'browser exited' if self._closed else 'timeout'})"
                    )
                self._cond.wait(left)
            answer = self._answers.pop(call)
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return answer["result"]

    def open(self, url: str) -> Tab:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        tab = Tab(self, session)
        tab.send(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        tab.send("Page.navigate", url=url)
        tab.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")
        return tab

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrowserError, OSError):
                self.send("Browser.close", timeout=10)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.close(self._commands_w)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Tab:
    """A page in the browser: evaluate script, type, click, wait, take a screenshot."""

    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method: str, **params: Any) -> dict:
        return self.browser.send(method, session=self.session, **params)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while not self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > end:
                raise BrowserError(f"timed out waiting for {condition}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A real mouse click at the middle of the element."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def type_into(self, selector: str, lines: list[str]) -> None:
        """Focus the element and type the lines, Enter between them, as keyboard input."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        for i, line in enumerate(lines):
            if i:
                for kind in ("keyDown", "keyUp"):
                    self.send(
                        "Input.dispatchKeyEvent",
                        type=kind,
                        key="Enter",
                        code="Enter",
                        windowsVirtualKeyCode=13,
                        text="\r" if kind == "keyDown" else "",
                    )
            self.send("Input.insertText", text=line)

    def screenshot(self) -> bytes:
        """The whole page as PNG."""
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        return base64.b64decode(data)
