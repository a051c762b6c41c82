"""A headless chromium driven through the DevTools protocol (websocket-client): what the chat
page's test does with it (evaluate JS, type, press Enter, move the mouse, take a screenshot)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import websocket


class Browser:
    def __init__(self, chromium: str) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="lens-evals-chromium-"))
        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port_file, deadline = self.profile / "DevToolsActivePort", time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert self.process.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        page = next(t for t in requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=120)
        self._id = 0

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self._id:
                assert "error" not in message, f"{method}: {message['error']}"
                result: dict[str, Any] = message["result"]
                return result

    def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in result, f"{expression}: {result['exceptionDetails']}"
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)
        return value

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && !!window.chatState && window.chatState.ready === true")

    def type(self, selector: str, text: str) -> None:
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send(
                "Input.dispatchKeyEvent",
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
                text="\r" if kind == "keyDown" else "",
            )

    def hover(self, selector: str) -> None:
        box = self.js(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
        )
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)


def dump_dom(chromium: str, page: Path) -> str:
    """The DOM chromium renders from a file, offline (no network: --dump-dom of a file URL)."""
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    return result.stdout
