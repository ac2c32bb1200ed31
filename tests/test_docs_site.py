"""The documentation site: ``mkdocs build --strict`` succeeds, fails on a broken link or a page missing from the
nav, and the built site loads in a real headless browser (Debian's chromium through selenium): the front page and
a page of the API reference generated from the docstrings. README.md's own links point at files that exist.

Locally a missing mkdocs or chromium skips these tests; under CI (CI=true) it is a failure.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 240
#: a Markdown link or image target
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def need(condition: bool, what: str) -> None:
    if not condition:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the documentation test needs {what}")
        pytest.skip(f"needs {what}")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    need(shutil.which("mkdocs") is not None or _importable("mkdocs"), "mkdocs (pip install -r requirements/dev.txt)")
    need(_importable("mkdocstrings_handlers.python"), "mkdocstrings[python] (pip install -r requirements/dev.txt)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("site")
    result = mkdocs_build(ROOT / "mkdocs.yml", directory)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return directory


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on a free loopback port, for the life of the module's tests."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        """Requests are not logged: the test output shows failures only."""


@pytest.fixture(scope="module")
def driver():
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    need(not missing and _importable("selenium"),
         "chromium, chromium-driver (apt) and selenium (pip): " + ", ".join(missing or ["selenium"]))
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,900"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    chrome.set_page_load_timeout(30)
    try:
        yield chrome
    finally:
        chrome.quit()


def test_the_front_page_is_the_readme_in_a_browser(served, driver):
    from selenium.webdriver.common.by import By

    driver.get(f"{served}/index.html")
    assert driver.title.startswith("Twinkle"), driver.title
    assert driver.find_element(By.TAG_NAME, "h1").text.strip().rstrip("¶").strip() == "Twinkle"
    body = driver.find_element(By.TAG_NAME, "body").text
    assert "Two commands on a fresh machine" in body
    assert "twinkle-backend-megatron/" in body  # the distributions table
    # README's links into docs/ lead to the site's pages
    text = driver.find_element(By.CSS_SELECTOR, "div[role='main']")
    getting_started = text.find_element(By.LINK_TEXT, "Getting started")
    assert getting_started.get_attribute("href").rstrip("/").endswith("/getting-started")


def test_the_api_page_is_generated_from_the_docstrings_in_a_browser(served, driver):
    from selenium.webdriver.common.by import By

    from twinkle_core.model.base import TwinkleModel

    driver.get(f"{served}/api/twinkle-model/")
    assert "TwinkleModel" in driver.title
    headings = [element.text for element in driver.find_elements(By.CSS_SELECTOR, "h2, h3")]
    assert any("TwinkleModel" in heading for heading in headings), headings
    assert any("load_tokenizer" in heading for heading in headings), headings
    body = " ".join(driver.find_element(By.TAG_NAME, "body").text.split())
    # the docstring's opening words, up to its first piece of markup
    opening = " ".join(re.split(r"[`:]", inspect.getdoc(TwinkleModel.load_tokenizer), maxsplit=1)[0].split())
    assert len(opening) > 15 and opening in body, opening


def test_the_recipe_reference_lists_every_key_of_the_schema(site):
    from twinkle_core.train.recipe import schema

    page = (site / "recipe-reference" / "index.html").read_text(encoding="utf-8")
    for section in dataclasses.fields(schema.Recipe):
        assert f"<code>{section.name}</code>" in page, section.name
        default = section.default_factory() if section.default_factory is not dataclasses.MISSING else None
        for key in dataclasses.fields(default) if dataclasses.is_dataclass(default) else ():
            assert f"<code>{section.name}.{key.name}</code>" in page, f"{section.name}.{key.name}"


def test_a_broken_link_or_a_missing_nav_page_fails_the_build(tmp_path):
    """The same configuration over a copy of docs/ with one broken link and a nav entry without its file."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "getting-started.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [nowhere](no-such-page.md).\n", encoding="utf-8")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / hook) for hook in config["hooks"]]
    mkdocstrings = next(plugin["mkdocstrings"] for plugin in config["plugins"]
                        if isinstance(plugin, dict) and "mkdocstrings" in plugin)
    python = mkdocstrings["handlers"]["python"]
    python["paths"] = [str(ROOT / path) for path in python["paths"]]
    config["nav"].append({"Missing": "missing-page.md"})
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "no-such-page.md" in output, output
    assert "missing-page.md" in output, output


def test_the_readmes_links_point_at_files_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [target for target in LINK.findall(readme)
               if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]
    assert any(target.startswith("docs/") for target in targets), "README.md links into the documentation"
    missing = [target for target in targets if not (ROOT / target.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
