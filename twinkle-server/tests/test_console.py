"""The web console in a real headless browser (Debian's chromium through selenium): a tenant's loss curve appears
and grows while the tenant trains through the Tinker SDK, and a native-API adapter's run shows its steps and curve;
another tenant sees neither (page and JSON); a full-parameter base's training is listed for its owner and admins only;
a screenshot is kept. One server (a shared base and alice's full-parameter one) and one browser serve every test."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from twinkle_server.testing import TINY_BASE, ServerProcess, tiny_model_section, tiny_server_config

pytestmark = [pytest.mark.timeout(300)]

KEYS = {"alice": "tml-console-alice", "bob": "tml-console-bob01", "root": "tml-console-root1"}
FULL = "team/full-qwen"  # alice's full-parameter base


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("console")
    config = tiny_server_config(directory, tenants=KEYS, admins=("root",), base_models=[
        {"name": TINY_BASE, "model": tiny_model_section(), "max_lora_rank": 8},
        {"name": FULL, "model": tiny_model_section(), "full_parameter": {"owner": "alice"}}])
    with ServerProcess(config) as running:
        yield running


@pytest.fixture(scope="module")
def driver():
    chrome = browser()
    yield chrome
    chrome.quit()


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


def attribute(driver, element_id: str, name: str) -> str | None:
    """An attribute of the element with this id, read in one script: the page redraws the chart every second, so
    an element found by one WebDriver call can be replaced (stale) before the next reads it."""
    return driver.execute_script("const e = document.getElementById(arguments[0]); "
                                 "return e === null ? null : e.getAttribute(arguments[1]);", element_id, name)


def text_of(driver, element_id: str) -> str:
    """The text of the element with this id, read in one script (see :func:`attribute`)."""
    return driver.execute_script("const e = document.getElementById(arguments[0]); "
                                 "return e === null ? '' : e.innerText;", element_id)


def points_shown(driver) -> int:
    return int(attribute(driver, "chart", "data-points") or 0)


def wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("the page did not show it in time")


def log_in(driver, server, tenant: str) -> None:
    """A fresh page with ``tenant``'s key typed in, once it shows that tenant."""
    driver.get(f"{server.base_url}/console")
    driver.execute_script("sessionStorage.clear()")  # no earlier key polls in the fresh page
    driver.get(f"{server.base_url}/console")
    driver.find_element("id", "key").send_keys(KEYS[tenant])
    driver.find_element("css selector", "#login button").click()
    wait_for(lambda: f"tenant {tenant}" in text_of(driver, "who"))


def shown_runs(driver, kind: str | None = None) -> list[dict[str, str]]:
    """The runs table as the page shows it now, one dict (column -> text, ``id``: the run's id) per row, read in one
    snapshot: the page redraws the table every second."""
    runs = driver.execute_script("""
        const heads = [...document.querySelectorAll("#runs thead th")].map((h) => h.textContent);
        return [...document.querySelectorAll("#runs tbody tr")].map((row) => Object.assign(
            Object.fromEntries([...row.cells].map((c, i) => [heads[i], c.textContent])), {id: row.dataset.modelId}));
    """)
    return [r for r in runs if kind is None or r["kind"] == kind]


def select(driver, run_id: str) -> None:
    """Click the run's row (looked up at the click: the page redraws it every second)."""
    driver.execute_script("""
        [...document.querySelectorAll("#runs tbody tr")].find((row) => row.dataset.modelId === arguments[0]).click();
    """, run_id)


def console(server, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEYS[tenant]}, timeout=30)


def batch(step: int) -> dict[str, torch.Tensor]:
    """Two rows of byte-level tokens (the tiny model's tokenizer is bytes), every token a label."""
    ids = torch.tensor([list(f"upper: ab{step} -> AB{step}".encode()), list(f"lower: XY{step} -> xy{step}".encode())])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def native_steps(model, count: int) -> list[float]:
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for step in range(count):
        losses.append(float(model.forward_backward(inputs=batch(step))["loss"]))
        model.clip_grad_and_step(max_grad_norm=1.0)
    return losses


def test_a_tenant_watches_its_loss_curve_grow(server, driver, tmp_path: Path):
    tinker = pytest.importorskip("tinker")
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEYS["alice"])
    client = service.create_lora_training_client(base_model=TINY_BASE, rank=4)
    for step in range(2):
        sft_step(client, step)

    log_in(driver, server, "alice")
    tinker_runs = wait_for(lambda: shown_runs(driver, "Tinker run"))
    assert len(tinker_runs) == 1 and tinker_runs[0]["tenant"] == "alice"
    assert tinker_runs[0]["base model"] == TINY_BASE
    select(driver, tinker_runs[0]["id"])
    wait_for(lambda: points_shown(driver) >= 2)
    first_line = attribute(driver, "loss-line", "points")

    for step in range(2, 5):  # the page polls: new steps appear without a reload
        sft_step(client, step)
    wait_for(lambda: points_shown(driver) >= 5)
    assert attribute(driver, "loss-line", "points") != first_line
    screenshot = tmp_path / "console.png"
    driver.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000
    print(f"console screenshot: {screenshot}")

    service.close("success").result(timeout=60)  # the session ends while the server is up

    # another tenant's key shows none of alice's runs; a wrong key shows the error
    log_in(driver, server, "bob")
    assert shown_runs(driver) == []
    key = driver.find_element("id", "key")
    key.clear()
    key.send_keys("tml-not-a-tenant")
    driver.find_element("css selector", "#login button").click()
    wait_for(lambda: "unknown API key" in text_of(driver, "error"))


def test_a_native_adapters_steps_and_curve_show_for_its_tenant_only(server, driver):
    from twinkle_server.client import TransformersModel

    model = TransformersModel(model_id=TINY_BASE, base_url=server.base_url, api_key=KEYS["alice"])
    model.add_adapter_to_model("console-sft", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    losses = native_steps(model, 3)

    log_in(driver, server, "alice")
    shown = wait_for(lambda: [r for r in shown_runs(driver, "native adapter") if r["run"] == "console-sft"])[0]
    assert (shown["tenant"], shown["base model"], shown["rank"], shown["steps"]) == ("alice", TINY_BASE, "4", "3")
    assert shown["last loss"] == f"{losses[-1]:.4f}"
    run_id = shown["id"]
    select(driver, run_id)
    wait_for(lambda: points_shown(driver) == 3 and "console-sft" in text_of(driver, "chart-title"))
    assert len(attribute(driver, "loss-line", "points").split()) == 3

    # bob: not in his page, and its curve is the 404 of a run that does not exist; an admin sees both
    log_in(driver, server, "bob")
    assert not any(r["run"] == "console-sft" for r in shown_runs(driver))
    with console(server, "bob") as bob, console(server, "root") as root:
        assert bob.get(f"/console/api/runs/{run_id}/metrics").status_code == 404
        assert run_id not in bob.get("/console/api/overview").text
        points = root.get(f"/console/api/runs/{run_id}/metrics").json()["points"]
        assert [p["loss"] for p in points if "loss" in p] == pytest.approx(losses, rel=1e-5)
        assert [p["step"] for p in points if p["kind"] == "optim_step"] == [1, 2, 3]


def test_a_full_parameter_run_shows_for_its_owner_and_admins_only(server):
    from twinkle_server.client import TransformersModel

    model = TransformersModel(model_id=FULL, base_url=server.base_url, api_key=KEYS["alice"])
    losses = native_steps(model, 2)
    with console(server, "alice") as alice, console(server, "bob") as bob, console(server, "root") as root:
        run = next(r for r in alice.get("/console/api/overview").json()["runs"] if r["kind"] == "full parameter")
        assert (run["base_model"], run["steps"], run["last_loss"]) == (FULL, 2, pytest.approx(losses[-1], rel=1e-5))
        assert FULL not in bob.get("/console/api/overview").text  # nobody else learns that the base exists
        for path in (f"/console/api/runs/{run['model_id']}/metrics", f"/console/api/runs/full:{TINY_BASE}/metrics"):
            assert bob.get(path).status_code == 404
        assert run["model_id"] in root.get("/console/api/overview").text
        assert len(alice.get(f"/console/api/runs/{run['model_id']}/metrics").json()["points"]) == 4


def test_metrics_survive_a_restart_and_a_torn_last_line(tmp_path: Path):
    from twinkle_server.metrics_log import MetricsLog, full_key

    key = full_key("team/full-qwen")  # a '/' in a key names no directory
    log = MetricsLog(tmp_path)
    for loss in (3.0, 2.0):
        log.record("alice", key, "forward_backward", {"loss": loss, "skipped": float("nan")})
    path = tmp_path / "tenants" / "alice" / "full:team%2Ffull-qwen" / "metrics.jsonl"
    with open(path, "a") as handle:
        handle.write('{"time": 1, "kind": "optim')  # a crash cut the last write

    restarted = MetricsLog(tmp_path)  # training goes on before anyone looks: the older points are still there
    restarted.record("alice", key, "optim_step", {"step": 1})
    assert [(p["index"], p["kind"], p.get("loss")) for p in restarted.points("alice", key)] == [
        (0, "forward_backward", 3.0), (1, "forward_backward", 2.0), (2, "optim_step", None)]
    assert [p["index"] for p in MetricsLog(tmp_path).points("alice", key)] == [0, 1, 2]
    assert MetricsLog(tmp_path).points("bob", key) == []  # keyed per tenant
