"""Headless Chromium driven from Python with the standard library alone: what the results page's test
(test_all.py) and `python -m bench results` open results.html in.

Chromium speaks the DevTools protocol over a pipe when started with --remote-debugging-pipe: commands go in on its
file descriptor 3, replies and events come out of 4, each a JSON message ended by a zero byte. That is enough to
load a page at a window size, run JavaScript in it, collect its console errors and take screenshots, without
Selenium, Playwright or a WebSocket library. The browser is Debian's package (apt-get install chromium), which
.ci/run installs.
"""
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")  # None: not installed


class BrowserError(RuntimeError):
    """Chromium refused a command, threw in the page, or stopped answering."""


class Chromium:
    """One headless Chromium with one page, its profile in a folder of the caller's (a temporary one)."""

    def __init__(self, profile: Path, timeout: float = 60):
        to_chromium, self.writer = os.pipe()
        self.reader, from_chromium = os.pipe()
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chromium, from_chromium)]  # clear of 3 and 4
        options = ["--headless", "--remote-debugging-pipe", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                   f"--user-data-dir={profile}"] + (["--no-sandbox"] if os.geteuid() == 0 else [])  # root: no sandbox
        self.process = subprocess.Popen([CHROMIUM, *options, "about:blank"], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False,
                                        preexec_fn=lambda: (os.dup2(ends[0], 3), os.dup2(ends[1], 4)))
        for fd in (to_chromium, from_chromium, *ends):
            os.close(fd)
        self.timeout, self.buffer, self.calls, self.events = timeout, b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", page=True)

    def call(self, method: str, page: bool = False, **params) -> dict:
        """Send one command (to the page's session with page) and wait for its reply, keeping the events."""
        self.calls += 1
        message = {"id": self.calls, "method": method, "params": params}
        if page:
            message["sessionId"] = self.session
        os.write(self.writer, json.dumps(message).encode() + b"\0")
        while (reply := self.receive()).get("id") != self.calls:
            self.events.append(reply)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply["result"]

    def receive(self) -> dict:
        while b"\0" not in self.buffer:
            if not select.select([self.reader], [], [], self.timeout)[0]:
                raise BrowserError(f"chromium did not answer within {self.timeout:.0f} s")
            chunk = os.read(self.reader, 1 << 20)
            if not chunk:
                raise BrowserError("chromium closed its pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def open(self, path: Path, width: int, height: int, phone: bool = False) -> None:
        """Load a file at this window size (a phone's: the mobile viewport), until its load event."""
        self.call("Emulation.setDeviceMetricsOverride", page=True, width=width, height=height, deviceScaleFactor=1,
                  mobile=phone)
        self.call("Page.navigate", page=True, url=Path(path).resolve().as_uri())
        while not any(event.get("method") == "Page.loadEventFired" for event in self.events):
            self.events.append(self.receive())
        self.events = [event for event in self.events if event.get("method") != "Page.loadEventFired"]

    def run(self, script: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = self.call("Runtime.evaluate", page=True, expression=script, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{script[:80]}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console errors and warnings, and the browser's own (an image it could not load)."""
        said = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                said.append(params["exceptionDetails"].get("exception", {}).get("description", "exception"))
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning", "assert"):
                said.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
                said.append(params["entry"]["text"])
        return said

    def screenshot(self, path: Path, whole_page: bool) -> Path:
        """A PNG of the window, or of the whole page's height (whole_page)."""
        shot = self.call("Page.captureScreenshot", page=True, format="png", captureBeyondViewport=whole_page)
        Path(path).write_bytes(base64.b64decode(shot["data"]))
        return Path(path)

    def close(self) -> None:
        try:
            self.call("Browser.close")
            self.process.wait(timeout=30)
        except (BrowserError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            os.close(self.writer)
            os.close(self.reader)
