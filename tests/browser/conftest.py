"""The widget in real Chromium (Debian's package, driven by Playwright through its
``executable_path``) against a real one-node cluster with the tiny demo model. Without
chromium these tests fail; ``make test`` installs it, or where it cannot (not root, no
apt) leaves them out with one loud line saying how to install it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, start_cluster

ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# (flags a closed network needs: no background connections, no sandbox as root)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(tmp_path_factory.mktemp("browser"), tiny_model) as c:
        yield c


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    if CHROMIUM is None:
        pytest.fail("no chromium: install Debian's package (apt-get install chromium; "
                    "make test does this when it runs as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()
