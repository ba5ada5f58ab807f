"""Screenshots of the chat page at 360 px (a phone) and 1280 px wide, for docs/serving.md.

    python scripts/page_screenshots.py BUNDLE [--out docs/img]

Serves BUNDLE on a free loopback port, asks two questions in two chats in a headless Chromium (Debian's
`chromium`, driven by playwright) that cannot resolve any host but loopback, and writes page-360.png and
page-1280.png. Fails if the page asked for anything outside loopback.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

QUESTIONS = ["What is the capital of Japan?", "Write a Python function that checks whether a number is prime."]
SYSTEM = "You are a helpful assistant. Answer briefly."


def _serve(bundle: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "edge.cli", "serve", bundle, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"edge-chat serve exited with {proc.returncode}")
            time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start within 120 s")


def _ask(page, text: str) -> None:
    n = page.locator("#chatbot [data-testid='bot'] .answer-stats").count()
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function("n => document.querySelectorAll(\"#chatbot [data-testid='bot'] .answer-stats\").length > n",
                           arg=n, timeout=180_000)
    time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, url = _serve(args.bundle)
    seen: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
            context = browser.new_context(viewport={"width": 1280, "height": 820})
            context.on("request", lambda r: seen.append(r.url))
            page = context.new_page()
            page.goto(url + "/", wait_until="load")
            page.wait_for_selector("#message textarea:not([disabled])", timeout=60_000)
            page.locator("#system textarea").fill(SYSTEM)
            _ask(page, QUESTIONS[0])
            page.locator("#new-chat").click()
            page.wait_for_function("document.querySelectorAll(\"#chatbot [data-testid='user']\").length == 0")
            _ask(page, QUESTIONS[1])
            page.screenshot(path=str(out / "page-1280.png"))
            page.set_viewport_size({"width": 360, "height": 760})
            page.reload(wait_until="load")  # the chat comes back from the browser's storage, list folded
            page.wait_for_selector("#message textarea:not([disabled])", timeout=60_000)
            page.wait_for_selector("#chatbot [data-testid='bot'] .answer-stats", timeout=10_000)
            time.sleep(1.0)
            page.screenshot(path=str(out / "page-360.png"))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    outside = [u for u in seen if urlparse(u).hostname != "127.0.0.1" and not u.startswith(("data:", "blob:"))]
    if outside:
        sys.exit(f"the page asked for hosts outside loopback: {outside}")
    for name in ("page-360.png", "page-1280.png"):
        print(out / name, f"{(out / name).stat().st_size / 1024:.0f} KB")
    print(f"{len(seen)} requests, all to 127.0.0.1")


if __name__ == "__main__":
    main()
