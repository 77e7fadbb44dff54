"""A real headless Chromium for the tests that look at a page as a user does: Debian's
`chromium` with its `chromium-driver`, driven by selenium.

No browser is a failure, not a skip: `.ci/run` installs one.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def start_browser(javascript: bool = True) -> webdriver.Chrome:
    install = "install them: apt-get update && apt-get install -y chromium chromium-driver"
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).is_file()]
    if missing:  # (and selenium must not go looking for a driver on the network)
        pytest.fail(f"no headless Chromium here: {', '.join(missing)} missing; {install}")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp(prefix='rose-chromium-')}", "--window-size=1400,1000",
    ):  # fmt: skip
        options.add_argument(flag)
    # Every request the browser makes, from the DevTools network events.
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2}
        )
    try:
        return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    except (WebDriverException, OSError) as err:
        pytest.fail(f"cannot start headless Chromium ({CHROMIUM} with {CHROMEDRIVER}): {err}")
