"""The playground at / in a real browser: headless Chromium (Debian's chromium and
chromium-driver; .ci/run installs them) driven through selenium against a server on a
free loopback port. It types a prime and samples - the text arrives, and it is the text
`zlm sample --seed` makes - then pastes text and scores it: the heat map shows every
character in `zlm score --html`'s colour for its bits, and hovering shows them.

A missing browser fails the test (it is never skipped): the dev setup installs it.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
from serve_fixtures import PALETTE, Client, build_app, tiny_run

import zlm
from zlm.cli.heatmap import bins
from zlm.serve.server import ServerThread

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"


def find_browser() -> tuple[str, str]:
    """(browser, driver) executables; the test fails, naming the fix, when either is missing."""
    browser = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = shutil.which(DRIVER) or (os.path.exists("/usr/lib/chromium/chromedriver")
                                      and "/usr/lib/chromium/chromedriver")
    if not browser or not driver:
        pytest.fail("headless Chromium is missing: apt-get install -y chromium chromium-driver "
                    "(.ci/run installs them)")
    return browser, driver


def start_chromium(width: int = 1280, height: int = 900):
    """A headless Chromium under selenium, offline (no driver download)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # selenium manager: never fetch anything
    browser, driver = find_browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--window-size={width},{height}", "--hide-scrollbars"):
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=Service(executable_path=driver))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("serve-browser"))


def _rgb(colour: str) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


@pytest.mark.timeout(180)
def test_the_playground_samples_and_scores_in_chromium(run):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    app, _ = build_app(run, max_streams=4)
    with ServerThread(app) as url:
        client = Client(url)
        page = client.get("/")[2].decode()
        assert not re.findall(r"https?://|src=|url\(|@import", page), "the page must load nothing"
        driver = start_chromium()
        try:
            driver.get(url + "/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: ":" in d.find_element(By.ID, "model").text)  # /v1/model answered
            assert "2 x 32 zoneout LSTM" in driver.find_element(By.ID, "model").text
            prime = driver.find_element(By.ID, "prime")
            prime.send_keys("ROMEO:")
            for field, value in (("temperature", "0.7"), ("length", "400"), ("seed", "123")):
                box = driver.find_element(By.ID, field)
                box.clear()
                box.send_keys(value)
            driver.find_element(By.ID, "sample").click()
            wait.until(lambda d: d.find_element(By.ID, "output").get_attribute("data-done") == "1")
            shown = driver.find_element(By.ID, "out-text").get_attribute("textContent")
            alone = zlm.load(run, device="cpu", precision="auto")
            want = alone.sample("ROMEO:", 400, temperature=0.7, top_p=1.0, seed=123)[len("ROMEO:"):]
            assert shown == want
            assert driver.find_element(By.ID, "out-prime").get_attribute("textContent") == "ROMEO:"
            assert "400 characters in" in driver.find_element(By.ID, "sample-status").text
            assert client.streams_in_use() == 0

            text = "First Citizen:\nYou are all resolved rather to die than to famish?\n"
            box = driver.find_element(By.ID, "score-text")
            driver.execute_script(  # a paste: the text lands at once, then an input event
                "arguments[0].value = arguments[1];"
                "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));", box, text)
            driver.find_element(By.ID, "score").click()
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#heatmap span")) == len(text))
            cells = driver.execute_script(
                "return [...document.querySelectorAll('#heatmap span')].map(s => "
                "[s.textContent, s.dataset.bits, s.style.backgroundColor]);")
            _, scored = client.json("POST", "/v1/score", {"text": text})
            bits = np.array([np.nan if c["bits"] is None else c["bits"] for c in scored["characters"]])
            colours = [PALETTE.colours[k] if k >= 0 else PALETTE.context for k in bins(bits)]
            assert [c[0] for c in cells] == list(text)
            assert [c[1] for c in cells] == [f"{b:.4f}" for b in bits]
            assert [c[2] for c in cells] == [_rgb(c) for c in colours]
            assert "bits/character over" in driver.find_element(By.ID, "score-status").text
            span = driver.find_elements(By.CSS_SELECTOR, "#heatmap span")[3]
            ActionChains(driver).move_to_element(span).perform()
            tip = driver.find_element(By.ID, "tip")
            wait.until(lambda d: tip.is_displayed())
            assert f"{bits[3]:.3f} bits" in tip.text and "model expected:" in tip.text
            assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        finally:
            driver.quit()
