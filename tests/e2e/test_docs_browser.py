"""``/docs`` in a real headless browser (R24): Swagger UI renders from the assets
the server ships, with no request leaving the server (the browser cannot resolve any other
host), shows the operations and an Authorize button, and "Authorize" + "Try it out" sends the
API key so that a keyed route answers 200. ``/redoc`` renders the same way.

Needs chromium and chromedriver (``apt-get install -y chromium chromium-driver``) and the
``selenium`` package (test extra); skipped with that reason when either is missing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from tests.e2e.conftest import RunningFleet
from tests.helpers import TEST_API_KEY

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[object]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install .[test])")
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver found: apt-get install -y chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-sync",
        "--window-size=1400,1000",
        # offline: no host but this one resolves, so a CDN asset could not load
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def requested_urls(driver: object) -> list[str]:
    """Every URL the page sent a request to (Chrome's DevTools network log), less those the
    browser refused to send under the page's Content-Security-Policy."""
    sent: dict[str, str] = {}
    blocked: set[str] = set()
    for entry in driver.get_log("performance"):  # type: ignore[attr-defined]
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            sent[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.loadingFailed" and params.get("blockedReason") == "csp":
            blocked.add(params["requestId"])
    return [url for request_id, url in sent.items() if request_id not in blocked]


def assert_only_this_server(urls: list[str], api_url: str) -> None:
    here = urlsplit(api_url).netloc
    elsewhere = [url for url in urls if urlsplit(url).scheme not in ("data", "blob") and urlsplit(url).netloc != here]
    assert not elsewhere, f"requests left the server: {elsewhere}"
    assert urls


def test_swagger_ui_renders_offline_and_authorize_sends_the_key(fleet: RunningFleet, browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as until
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(f"{fleet.local.api_url}/docs")  # type: ignore[attr-defined]
    wait = WebDriverWait(driver, 60)
    wait.until(until.presence_of_element_located((By.CSS_SELECTOR, ".opblock")))
    operations = driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")  # type: ignore[attr-defined]
    paths = {element.get_attribute("data-path") for element in operations}
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/images/generations", "/health"} <= paths
    assert not [path for path in paths if path and path.startswith("/internal")]
    # Authorize: the bearer scheme's dialog takes the key.
    driver.find_element(By.CSS_SELECTOR, ".auth-wrapper .authorize").click()  # type: ignore[attr-defined]
    field = wait.until(until.presence_of_element_located((By.CSS_SELECTOR, ".auth-container input")))
    field.send_keys(TEST_API_KEY)
    driver.find_element(By.CSS_SELECTOR, ".auth-btn-wrapper .authorize").click()  # type: ignore[attr-defined]
    driver.find_element(By.CSS_SELECTOR, ".auth-btn-wrapper .btn-done").click()  # type: ignore[attr-defined]
    # Try it out on GET /v1/models, a keyed route: 200 with the registered model.
    block = driver.find_element(By.CSS_SELECTOR, "[id^='operations-'][id$='_v1_models_get']")  # type: ignore[attr-defined]
    block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait.until(lambda _: block.find_elements(By.CSS_SELECTOR, ".try-out__btn"))[0].click()
    wait.until(lambda _: block.find_elements(By.CSS_SELECTOR, ".execute"))[0].click()
    status = wait.until(
        lambda _: block.find_elements(By.CSS_SELECTOR, ".live-responses-table tr.response .response-col_status")
    )
    assert status[0].text.strip().startswith("200"), status[0].text
    assert fleet.model in block.find_element(By.CSS_SELECTOR, ".live-responses-table .microlight").text
    assert_only_this_server(requested_urls(driver), fleet.local.api_url)


def test_redoc_renders_offline(fleet: RunningFleet, browser: object) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    driver.get(f"{fleet.local.api_url}/redoc")  # type: ignore[attr-defined]
    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "[data-section-id^='operation/']"))
    sections = driver.find_elements(By.CSS_SELECTOR, "[data-section-id^='operation/']")  # type: ignore[attr-defined]
    assert len(sections) >= 15
    assert "Homefleet" in driver.title  # type: ignore[attr-defined]
    assert_only_this_server(requested_urls(driver), fleet.local.api_url)
