"""A headless system Chromium driven by Selenium, for the dashboard tests.

Debian's chromium and chromium-driver (scripts/setup installs them) are named explicitly, and
SE_OFFLINE keeps selenium-manager from downloading a browser or a driver. The browser gets a
fresh profile and every background feature that would talk to the internet off; its console is
logged so a test can assert the page wrote no errors.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(os.path.basename(path))):
            return f"{path} is not installed (scripts/setup installs chromium and chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


def require_browser() -> None:
    missing = browser_missing()
    if missing:
        pytest.skip(missing)


@contextlib.contextmanager
def chromium(profile_dir: str, *, width: int = 1400, height: int = 1100) -> Iterator:
    """A headless Chromium session; quit (and its driver stopped) however the test ends."""
    os.environ["SE_OFFLINE"] = "true"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-quic", "--disable-extensions", "--disable-default-apps", "--no-default-browser-check",
                 f"--user-data-dir={profile_dir}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(60)
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


def console_errors(driver) -> list[dict]:
    """The browser console's SEVERE entries since the last call (reading the log empties it)."""
    return [entry for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def navigations(driver) -> tuple[float, int]:
    """This document's time origin and navigation entries: both stay the same while a page updates
    itself, and change when it is reloaded."""
    return (driver.execute_script("return performance.timeOrigin"),
            driver.execute_script("return performance.getEntriesByType('navigation').length"))


def text(driver, element_id: str) -> str:
    """An element's visible text, or "" while the page that has it is still loading."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        return driver.find_element("id", element_id).text
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def attribute(driver, element_id: str, name: str) -> str:
    """An element's attribute, or "" while the page that has it is still loading."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        return driver.find_element("id", element_id).get_attribute(name) or ""
    except (NoSuchElementException, StaleElementReferenceException):
        return ""
