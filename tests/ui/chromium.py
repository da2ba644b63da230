"""Headless Chromium for the browser tests, through selenium and Debian's chromium-driver."""

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# Flags a sandboxed, offline root machine needs: no sandbox, no GPU, and no background calls to outside hosts.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")


def chromium_installed() -> bool:
    return Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()


@contextlib.contextmanager
def headless_chromium(profile_dir: Path, page_timeout_s: float, window: str) -> Iterator:
    """A selenium driver of headless Chromium with its own profile folder and a ``window`` size ("W,H"); quit after."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--window-size={window}", f"--user-data-dir={profile_dir}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(page_timeout_s)
    try:
        yield driver
    finally:
        driver.quit()
