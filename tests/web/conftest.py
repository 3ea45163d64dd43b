"""Fixtures: the real gateway (stories260k) and Debian's Chromium driven by Playwright."""

from __future__ import annotations

import shutil

import pytest

from tests.app.harness import GatewayServer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="session")
def web_gateway(tmp_path_factory: pytest.TempPathFactory, stories_path) -> GatewayServer:
    server = GatewayServer(tmp_path_factory.mktemp("web-gateway"), "stories260k", 512)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser():
    if not shutil.which(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (make system-deps)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    try:
        yield page
    finally:
        context.close()
