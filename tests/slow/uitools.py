"""Helpers of the slow UI suite: servers in subprocesses, and headless Debian Chromium driven by
Selenium (no browser is downloaded).

Uses ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (Debian packages ``chromium`` and
``chromium-driver``, installed by ``.ci/run``); ``APPRENTICE_CHROMIUM`` / ``APPRENTICE_CHROMEDRIVER``
point elsewhere. Passing the driver path explicitly keeps Selenium Manager from fetching one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("APPRENTICE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = os.environ.get("APPRENTICE_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
         "--disable-extensions", "--hide-scrollbars", "--window-size=1400,1000"]


def require_chromium() -> None:
    missing = [p for p in (CHROMIUM, DRIVER) if not Path(p).exists()]
    if missing:
        pytest.skip(f"{missing} not installed: `apt-get install chromium chromium-driver` (.ci/run does)")


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium WebDriver; quit on exit."""
    require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, predicate: Callable[[str], bool], what: str, timeout: float = 90) -> str:
    """Wait until ``predicate(visible page text)`` holds; returns the text or fails with the page's text."""
    t0, text = time.time(), ""
    while time.time() - t0 < timeout:
        with contextlib.suppress(Exception):
            text = driver.find_element("tag name", "body").text
            if predicate(text):
                return text
        time.sleep(0.5)
    raise AssertionError(f"page {driver.current_url} never showed {what}; it shows:\n{text[:3000]}")


def wait_for_all(driver, needles: Iterable[str], what: str, timeout: float = 90) -> str:
    """Wait until the page shows every one of ``needles``. The pages render asynchronously (MLflow
    fills a run's parent name, datasets and params in separate requests), so a test waits for all it
    will assert on instead of asserting on the text of a half-rendered page; a failure names what
    never appeared."""
    needles = list(needles)
    try:
        return wait_for(driver, lambda t: all(n in t for n in needles), what, timeout)
    except AssertionError as e:
        text = ""
        with contextlib.suppress(Exception):  # a dead page still reports the original failure
            text = driver.find_element("tag name", "body").text
        missing = [n for n in needles if n not in text]
        raise AssertionError(f"{what}: still missing {missing}\n{e}") from None


def screenshot(driver, name: str, full_page: bool = False) -> Path:
    """Save a PNG under ``$APPRENTICE_SCREENSHOTS`` (default: pytest's basetemp's screenshots/)."""
    out = Path(os.environ.get("APPRENTICE_SCREENSHOTS") or Path(os.environ.get("TMPDIR", "/tmp")) / "apprentice-screens")
    out.mkdir(parents=True, exist_ok=True)
    if full_page:
        h = driver.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
        driver.set_window_size(1400, min(int(h) + 40, 12000))
    path = out / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def slow_only() -> list[pytest.MarkDecorator]:
    # the timeout covers the session fixture (a deployed run of two iterations), which the first test pays for
    return [pytest.mark.slow, pytest.mark.timeout(3600), pytest.mark.skipif(not os.environ.get("APPRENTICE_RUN_SLOW"),
                                                 reason="UI suite: set APPRENTICE_RUN_SLOW=1 (minutes; .ci/run does)")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 1500) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code < 500:
                return
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


def start(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
