"""The web console in a real headless browser (Debian's chromium through selenium): a tenant's loss curve appears
and grows while the tenant trains through the Tinker SDK; another tenant does not see it; a screenshot is kept."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from twinkle_server.testing import TINY_BASE, ServerProcess, tiny_server_config

pytestmark = [pytest.mark.timeout(300)]

KEYS = {"alice": "tml-console-alice", "bob": "tml-console-bob01"}


def browser():
    """Headless chromium; absent locally it skips, but under CI (CI=true) its absence is a failure: .ci/run
    installs it."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the console test needs {', '.join(missing)}: apt-get install chromium chromium-driver")
        pytest.skip(f"needs {', '.join(missing)}")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1000,900"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def sft_step(client, step: int) -> float:
    import tinker

    text = list(f"upper: step{step} -> STEP{step}".encode())
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(text[:-1]),
                               loss_fn_inputs={"target_tokens": text[1:], "weights": [1.0] * (len(text) - 1)})
    result = client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    return result.metrics["loss:sum"]


def points_shown(driver) -> int:
    return int(driver.find_element("id", "chart").get_attribute("data-points") or 0)


def wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("the page did not show it in time")


def test_a_tenant_watches_its_loss_curve_grow(tmp_path: Path):
    tinker = pytest.importorskip("tinker")
    driver = browser()
    try:
        with ServerProcess(tiny_server_config(tmp_path / "server", tenants=KEYS)) as server:
            service = tinker.ServiceClient(base_url=server.base_url, api_key=KEYS["alice"])
            client = service.create_lora_training_client(base_model=TINY_BASE, rank=4)
            for step in range(2):
                sft_step(client, step)

            driver.get(f"{server.base_url}/console")
            driver.find_element("id", "key").send_keys(KEYS["alice"])
            driver.find_element("css selector", "#login button").click()
            wait_for(lambda: points_shown(driver) >= 2)
            rows = driver.find_elements("css selector", "#runs tbody tr")
            assert len(rows) == 1 and "alice" in rows[0].text and TINY_BASE in rows[0].text
            first_line = driver.find_element("id", "loss-line").get_attribute("points")

            for step in range(2, 5):  # the page polls: new steps appear without a reload
                sft_step(client, step)
            wait_for(lambda: points_shown(driver) >= 5)
            assert driver.find_element("id", "loss-line").get_attribute("points") != first_line
            assert "tenant alice" in driver.find_element("id", "who").text
            screenshot = tmp_path / "console.png"
            driver.save_screenshot(str(screenshot))
            assert screenshot.stat().st_size > 10_000
            print(f"console screenshot: {screenshot}")

            service.close("success").result(timeout=60)  # the session ends while the server is up

            # another tenant's key shows none of alice's runs; a wrong key shows the error
            driver.execute_script("sessionStorage.clear()")
            driver.get(f"{server.base_url}/console")
            driver.find_element("id", "key").send_keys(KEYS["bob"])
            driver.find_element("css selector", "#login button").click()
            wait_for(lambda: "tenant bob" in driver.find_element("id", "who").text)
            assert driver.find_elements("css selector", "#runs tbody tr") == []
            key = driver.find_element("id", "key")
            key.clear()
            key.send_keys("tml-not-a-tenant")
            driver.find_element("css selector", "#login button").click()
            wait_for(lambda: "unknown API key" in driver.find_element("id", "error").text)
    finally:
        driver.quit()
