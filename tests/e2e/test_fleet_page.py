"""The fleet page at ``/`` in a real headless browser, on the session's shared fleet:
it loads from this server alone (the browser cannot resolve any other host; R24's offline
rule as for /docs), asks for the API key once and keeps it for the tab, lists the machines,
follows a submitted job's progress over SSE (fetch streaming: EventSource cannot send the key)
until its thumbnail appears, and shows the reason of a refused submission as the API gives it.

Needs chromium, chromedriver and selenium; skipped with that reason without them
(tests/e2e/test_docs_browser.py)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import httpx
import pytest

from app.api.routes.page import PAGE_CSP
from app.client import ApiError
from app.core.states import JobState
from app.core.tls import tls_context
from app.devtools.train_colour_lora import COLOUR_LORA
from app.devtools.train_recolour import RECOLOUR_MODEL
from tests.e2e.conftest import ADAPTER, EDIT_MODEL, KOHYA_ADAPTER, UPSCALE_MODEL, RunningFleet
from tests.e2e.test_docs_browser import assert_only_this_server, browser, requested_urls
from tests.helpers import LONG_SIZE, TEST_API_KEY, end_running, pause, resume

pytestmark = pytest.mark.e2e
__all__ = ["browser"]  # the fixture, shared with the /docs tests


#: ``make screenshots`` sets it: the tests then save a PNG of each view there (docs/screenshots/).
SCREENSHOTS = os.environ.get("HOMEFLEET_SCREENSHOTS")


def snap(driver: object, view: str) -> None:
    """Save the window as ``<view>.png`` under ``$HOMEFLEET_SCREENSHOTS`` when it is set, in 128
    colours (docs, kept small)."""
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        path = Path(SCREENSHOTS) / f"{view}.png"
        assert driver.save_screenshot(str(path))  # type: ignore[attr-defined]
        shrink(path)


def shrink(path: Path) -> None:
    """Rewrite the PNG at ``path`` in a 128-colour palette."""
    from PIL import Image

    with Image.open(path) as shot:
        small = shot.convert("RGB").quantize(colors=128)
    small.save(path, optimize=True)


def select_filter(wait: object, element_id: str, value: str) -> None:
    """Pick ``value`` in the select ``element_id``, again if the page re-rendered it meanwhile
    (the gallery redraws its filters when new results arrive)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def pick(driver: object) -> bool:
        try:
            Select(driver.find_element(By.ID, element_id)).select_by_value(value)  # type: ignore[attr-defined]
        except StaleElementReferenceException:
            return False
        return True

    wait.until(pick)  # type: ignore[attr-defined]


def captions(wait: object, css: str = "#gallery figcaption") -> list[str]:
    """The texts of the elements ``css`` selects, read again if the page re-rendered them meanwhile."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def read(driver: object) -> list[str] | None:
        try:
            return [f.text for f in driver.find_elements(By.CSS_SELECTOR, css)]  # type: ignore[attr-defined]
        except StaleElementReferenceException:
            return None

    return wait.until(read)  # type: ignore[attr-defined]


def shown_field(driver: object, name: str) -> bool:
    """Whether the Submit form shows a field for param ``name`` (it is rebuilt for each kind and model)."""
    return bool(
        driver.execute_script(  # type: ignore[attr-defined]
            "const label = document.querySelector(`#submit-form label[data-param='${arguments[0]}']`);"
            "return Boolean(label && label.offsetParent !== null)",
            name,
        )
    )


def open_page(driver: object, api_url: str, view: str = "fleet") -> object:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as until
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{api_url}/#{view}")  # type: ignore[attr-defined]
    wait = WebDriverWait(driver, 60)
    field = wait.until(until.visibility_of_element_located((By.ID, "key-input")))
    field.send_keys(TEST_API_KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button").click()  # type: ignore[attr-defined]
    wait.until(until.invisibility_of_element_located((By.ID, "key-form")))  # asked once, then out of the way
    return wait


def submit_form_for(driver: object, fleet: RunningFleet, target: str) -> tuple[object, object]:
    """The Submit view opened, with the fleet's model and ``target`` chosen: (its wait, the form)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    wait = open_page(driver, fleet.local.api_url, "submit")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#submit-form select[name=target] option[value='{target}']"))  # type: ignore[attr-defined]
    form = driver.find_element(By.ID, "submit-form")  # type: ignore[attr-defined]
    Select(form.find_element(By.NAME, "model")).select_by_value(fleet.model)
    Select(form.find_element(By.NAME, "target")).select_by_value(target)
    return wait, form


def test_page_is_served_without_a_key_with_a_self_only_csp(fleet: RunningFleet) -> None:
    """The page holds no data: served without a key, under a 'self'-only CSP; the data routes
    still need the key (a request without it: 401)."""
    for path in ("/", "/page/app.js", "/page/style.css"):
        answer = httpx.get(f"{fleet.local.api_url}{path}", verify=tls_context())
        assert answer.status_code == 200, (path, answer.text)
        assert answer.headers["content-security-policy"] == PAGE_CSP
        assert "'unsafe-inline'" not in PAGE_CSP and "http" not in PAGE_CSP
    assert httpx.get(f"{fleet.local.api_url}/page/secrets.txt", verify=tls_context()).status_code == 404
    assert httpx.get(f"{fleet.local.api_url}/v1/jobs", verify=tls_context()).status_code == 401


def test_fleet_view_loads_offline_and_lists_the_machines(fleet: RunningFleet, browser: object) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    wait = open_page(driver, fleet.local.api_url)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#machines tr[data-machine='m3']"))
    # one snapshot in the page (it re-renders its rows every few seconds: elements go stale)
    rows = driver.execute_script(  # type: ignore[attr-defined]
        "return Object.fromEntries([...document.querySelectorAll('#machines tbody tr')]"
        ".map(row => [row.dataset.machine, row.innerText]))"
    )
    assert set(rows) == {"server", "m1", "m2", "m3"}
    assert "online" in rows["m1"] and "offline" in rows["m3"]  # m3 has no worker
    assert driver.execute_script("return sessionStorage.getItem('homefleet.api_key')") == TEST_API_KEY  # type: ignore[attr-defined]
    driver.execute_script("document.querySelector(\"#machines tr[data-machine='m1']\").click()")  # type: ignore[attr-defined]
    wait.until(lambda d: "Queue of m1" in d.find_element(By.CSS_SELECTOR, "#machine-queue h2").text)
    snap(driver, "fleet")
    assert_only_this_server(requested_urls(driver), fleet.local.api_url)
    # the server stops answering (every fetch fails, as when it is down): the banner says so in
    # the page's words, not the browser's bare "Failed to fetch", and goes once it answers again
    driver.execute_script(
        "window.realFetch = window.fetch; window.fetch = () => Promise.reject(new TypeError('Failed to fetch'))"
    )  # type: ignore[attr-defined]
    banner = wait.until(lambda d: (e := d.find_element(By.ID, "error")).is_displayed() and e.text)
    assert banner.startswith("server_unreachable: the server does not answer (Failed to fetch)"), banner
    driver.execute_script("window.fetch = window.realFetch")  # type: ignore[attr-defined]
    wait.until(lambda d: not d.find_element(By.ID, "error").is_displayed())


#: seconds a page waits for a job it submitted to end: a deadline on the job's steps, which a slow,
#: shared CI host stretches (the 60-step job below ran 46 s on one core beside the other tests)
JOB_WAIT_S = 300


def test_submitted_job_shows_moving_progress_then_its_thumbnail_in_the_gallery(
    fleet: RunningFleet, browser: object
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    wait, form = submit_form_for(driver, fleet, "m1")
    form.find_element(By.NAME, "prompt").clear()
    form.find_element(By.NAME, "prompt").send_keys("a page-drawn lighthouse")
    steps = form.find_element(By.NAME, "steps")
    steps.clear()
    steps.send_keys("60")
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    # the dry run's explanation is shown first: m1 would run it
    wait.until(lambda d: "Would run on m1" in d.find_element(By.ID, "explanation").text)
    # the job's 60 steps: a deadline for the job, not for the page (65 s on one loaded core)
    image = WebDriverWait(driver, JOB_WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#submitted .result img[src^='blob:']")
    )[0]
    wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 64)
    job_id = driver.find_element(By.ID, "submitted").get_attribute("data-job")  # type: ignore[attr-defined]
    snap(driver, "submit")
    progress = driver.find_element(By.ID, "submitted-progress")  # type: ignore[attr-defined]
    seen = [int(step) for step in progress.get_attribute("data-seen").split(",")]
    assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] == 60, seen  # the bar moved, step by step, to the end
    assert fleet.client.get(job_id)["state"] == "succeeded"
    # the gallery shows it, with its prompt and machine, and its model filter keeps it
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#gallery figure[data-job='{job_id}'] img[src^='blob:']"))
    caption = driver.find_element(By.CSS_SELECTOR, f"#gallery figure[data-job='{job_id}'] figcaption").text  # type: ignore[attr-defined]
    assert "a page-drawn lighthouse" in caption and "on m1" in caption and fleet.model in caption
    snap(driver, "gallery")
    select_filter(wait, "filter-machine", "m1")
    assert driver.find_elements(By.CSS_SELECTOR, f"#gallery figure[data-job='{job_id}']")  # type: ignore[attr-defined]
    assert not [text for text in captions(wait) if "on m1" not in text]
    # the job opens its provenance in the Jobs view
    driver.get(f"{fleet.local.api_url}/#jobs")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{job_id}']"))
    driver.set_window_size(390, 844)  # type: ignore[attr-defined]  # a phone: the table is tall, the id long
    try:
        driver.execute_script(f"document.querySelector(\"#jobs tr[data-job='{job_id}'] button\").click()")  # type: ignore[attr-defined]  # rows re-render each second
        wait.until(lambda d: job_id in d.find_element(By.CSS_SELECTOR, "#job-detail h2").text)
        assert "a page-drawn lighthouse" in driver.find_element(By.CSS_SELECTOR, "#job-detail pre").text  # type: ignore[attr-defined]
        top, height, wide, window = driver.execute_script(  # type: ignore[attr-defined]
            "return [document.querySelector('#job-detail').getBoundingClientRect().top, window.innerHeight,"
            " document.documentElement.scrollWidth, window.innerWidth]"
        )
        assert 0 <= top < height, (top, height)  # brought into view, not left below the table
        assert wide <= window, (wide, window)  # the 32-hex id wraps: no sideways scroll
    finally:
        driver.set_window_size(1400, 1000)  # type: ignore[attr-defined]  # as the fixture made it
    snap(driver, "jobs")
    assert_only_this_server(requested_urls(driver), fleet.local.api_url)


def test_refused_submission_shows_its_reason(fleet: RunningFleet, browser: object) -> None:
    """A submission the API refuses (m3 has no worker) shows the API's reason on the page, and
    the dry run's explanation says so beforehand; the refusal is journaled with that reason."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    body = {
        "model": fleet.model,
        "kind": "txt2img",
        "target": "m3",
        "params": {"prompt": "a lighthouse at dusk", "width": 64, "height": 64, "steps": 4},
    }
    expected = httpx.post(
        f"{fleet.local.api_url}/v1/jobs",
        json=body,
        headers={"Authorization": f"Bearer {TEST_API_KEY}"},
        timeout=60,
        verify=tls_context(),
    ).json()["error"]
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "submit")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#submit-form select[name=target] option[value='m3']"))
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(fleet.model)  # type: ignore[attr-defined]
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=target]")).select_by_value("m3")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    refusal = wait.until(lambda d: d.find_elements(By.ID, "refusal"))[0]
    assert refusal.get_attribute("data-reason") == expected["reason"], (refusal.text, expected)
    assert expected["reason"] in refusal.text and expected["message"] in refusal.text
    assert fleet.client.get(expected["job_id"])["state"] == "rejected"
    assert "refused" in driver.find_element(By.ID, "explanation").text.lower()  # type: ignore[attr-defined]
    # a width the browser itself refuses (not a multiple of 8) sends nothing: the refusal above
    # no longer stands there as if it were this submission's
    driver.execute_script("document.querySelector('#submit-form').elements.width.value = '33'")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    status = wait.until(
        lambda d: (t := d.find_element(By.CSS_SELECTOR, "#submitted .status").text).startswith("Not sent") and t
    )
    assert status.startswith("Not sent: width: "), status
    assert not driver.find_elements(By.ID, "refusal")  # type: ignore[attr-defined]
    # nor the dry run's "Would be refused" of the submission before (it stood under "Not sent")
    assert driver.find_element(By.ID, "explanation").text == ""  # type: ignore[attr-defined]


def png_file(path: Path, side: int = 64) -> Path:
    """A ``side`` x ``side`` RGB PNG (a gradient) at ``path``."""
    from PIL import Image

    Image.frombytes(
        "RGB", (side, side), bytes((x * 4 + y) % 256 for y in range(side) for x in range(side) for _ in range(3))
    ).save(path)
    return path


def test_edit_submitted_from_the_page_uploads_its_png_and_shows_the_thumbnail(
    fleet: RunningFleet, browser: object, tmp_path: Path
) -> None:
    """The Submit form fits the kind (GET /v1/models' params): an edit lists the edit model
    only and asks for an input image, which a txt2img does not; the PNG is uploaded to
    POST /v1/files first and its id is the job's ``image``; the edited image (the input's size)
    appears, and in the Gallery. A non-image upload shows the API's refusal (422 input_type)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = browser
    wait = open_page(driver, fleet.local.api_url, "submit")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#submit-form select[name=kind] option[value='edit']"))
    form = driver.find_element(By.ID, "submit-form")  # type: ignore[attr-defined]
    model_ids = "return [...document.querySelectorAll('#submit-form select[name=model] option')].map(o => o.value)"
    assert (shown_field(driver, "image"), shown_field(driver, "width")) == (False, True)  # txt2img: a size, no input
    assert EDIT_MODEL not in driver.execute_script(model_ids)  # type: ignore[attr-defined]
    Select(form.find_element(By.NAME, "kind")).select_by_value("edit")
    assert (shown_field(driver, "image"), shown_field(driver, "width")) == (True, False)  # edit: the input's size
    # the models that run edits (the shared fleet's random pix2pix and the trained recolour model), no other
    assert sorted(driver.execute_script(model_ids)) == sorted([EDIT_MODEL, RECOLOUR_MODEL])  # type: ignore[attr-defined]
    Select(form.find_element(By.NAME, "model")).select_by_value(EDIT_MODEL)
    Select(form.find_element(By.NAME, "target")).select_by_value("server")
    form.find_element(By.NAME, "prompt").clear()
    form.find_element(By.NAME, "prompt").send_keys("make it a page-edited sunset")
    # a file that is no image: the server's refusal, shown with its reason
    not_png = tmp_path / "notes.png"
    not_png.write_text("not an image at all")
    form.find_element(By.NAME, "image").send_keys(str(not_png))
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    refusal = wait.until(lambda d: d.find_elements(By.ID, "refusal"))[0]
    assert refusal.get_attribute("data-reason") == "input_type", refusal.text
    # a PNG: uploaded, then the edit runs on server
    source = png_file(tmp_path / "input.png")
    stored = fleet.client.upload(source.read_bytes())  # content-addressed: the id the page gets too
    form.find_element(By.NAME, "image").clear()
    form.find_element(By.NAME, "image").send_keys(str(source))
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    wait.until(lambda d: "Would run on server" in d.find_element(By.ID, "explanation").text)
    image = WebDriverWait(driver, JOB_WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#submitted .result img[src^='blob:']")
    )[0]
    wait.until(lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 64)
    snap(driver, "submit-edit")
    job = fleet.client.get(driver.find_element(By.ID, "submitted").get_attribute("data-job"))  # type: ignore[attr-defined]
    assert (job["state"], job["kind"], job["model"], job["machine"]) == ("succeeded", "edit", EDIT_MODEL, "server")
    assert job["params"]["image"] == stored["id"] and job["params"]["prompt"] == "make it a page-edited sunset"
    assert "width" not in job["params"]
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#gallery figure[data-job='{job['id']}'] img[src^='blob:']"))
    select_filter(wait, "filter-model", EDIT_MODEL)
    shown = captions(wait)
    assert shown and all(EDIT_MODEL in caption for caption in shown), shown


def test_fleet_rows_follow_running_jobs_over_sse_and_open_the_queue_in_order(
    fleet: RunningFleet, browser: object
) -> None:
    """A running job's bar in the Fleet view moves from its events (SSE, data-seen lists the
    steps they brought); m2's row opens its backlog oldest first, running before queued."""

    params = {"prompt": "a long fleet-page run", "steps": 150, **LONG_SIZE}
    running = fleet.client.submit(fleet.model, "txt2img", params, target="m2")["id"]
    queued = fleet.client.submit(fleet.model, "txt2img", {**params, "steps": 1}, target="m2")["id"]
    try:
        driver = browser
        wait = open_page(driver, fleet.local.api_url)
        bar = f"#machines tr[data-machine='m2'] progress[data-job='{running}']"
        seen = f'return document.querySelector("{bar}")?.dataset.seen'
        wait.until(lambda d: len((d.execute_script(seen) or "").split(",")) >= 3)
        steps = [int(step) for step in driver.execute_script(seen).split(",")]  # type: ignore[attr-defined]
        assert steps == sorted(steps) and len(set(steps)) >= 3, steps
        pause(fleet.ctx, running)  # still running, at no CPU, while the queue is looked at
        driver.execute_script("document.querySelector(\"#machines tr[data-machine='m2']\").click()")  # type: ignore[attr-defined]
        order = "return [...document.querySelectorAll('#machine-queue li[data-job]')].map(li => li.dataset.job)"
        wait.until(lambda d: d.execute_script(order) == [running, queued])
        assert any(url.endswith(f"/v1/jobs/{running}/events") for url in requested_urls(driver))
        snap(driver, "fleet-queue")
    finally:
        with contextlib.suppress(ApiError):  # it may have started already: then it ends on its own
            fleet.client.cancel(queued)
        if fleet.ctx.journal.state_of(running) == JobState.running:  # done with it: its steps would hold a core
            end_running(fleet.ctx, running)
        for job_id in (running, queued):  # m2 idle again for the tests after this one
            fleet.client.wait(job_id, timeout_s=300)


def test_two_tabs_following_running_jobs_keep_polling(fleet: RunningFleet, browser: object) -> None:
    """Two tabs of the page, each following every running job's events (server, m1 and m2 busy):
    a browser keeps 6 connections to a server, shared by its tabs, and each stream holds one. The
    tabs' streams together stay under that, so both keep polling: a job submitted afterwards shows
    in each (both froze at 6 streams, their views stuck until a job ended)."""
    from selenium.webdriver.common.by import By

    params = {"prompt": "a run two tabs follow", "steps": 150, **LONG_SIZE}
    running = [fleet.client.submit(fleet.model, "txt2img", params, target=m)["id"] for m in ("server", "m1", "m2")]
    later = None
    try:
        for job_id in running:
            pause(fleet.ctx, job_id)  # running, at no CPU, for as long as the test looks
        driver = browser
        tabs = []
        for _ in range(2):
            if tabs:
                driver.switch_to.new_window("tab")  # type: ignore[attr-defined]
            tabs.append(driver.current_window_handle)  # type: ignore[attr-defined]
            wait = open_page(driver, fleet.local.api_url, "jobs")
            for job_id in running:  # its rows drawn: the tab follows each running job's events
                bar = f"#jobs tr[data-job='{job_id}'] progress"
                wait.until(lambda d, bar=bar: d.find_elements(By.CSS_SELECTOR, bar))
        later = fleet.client.submit(fleet.model, "txt2img", {**params, "steps": 1}, target="m1")["id"]
        for tab in tabs:
            driver.switch_to.window(tab)  # type: ignore[attr-defined]
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{later}']"))
    finally:
        if later:
            with contextlib.suppress(ApiError):
                fleet.client.cancel(later)
        for job_id in running:
            if fleet.ctx.journal.state_of(job_id) == JobState.running:
                end_running(fleet.ctx, job_id)
        for job_id in [*running, later]:
            if job_id:
                fleet.client.wait(job_id, timeout_s=300)


def pixels(png: bytes) -> list[tuple[int, int, int]]:
    """The RGB pixels of a PNG, row by row."""
    import io

    from PIL import Image

    return list(Image.open(io.BytesIO(png)).convert("RGB").getdata())


def click(driver: object, css: str) -> None:
    """Click the element ``css`` selects from the page itself (views re-render every second, so an
    element found by the driver may be replaced before its click lands)."""
    driver.execute_script(f"document.querySelector({css!r}).click()")  # type: ignore[attr-defined]


def wait_refreshes(driver: object, wait: object, count: int) -> None:
    """Wait until the page has refreshed its view ``count`` times from now. Its refreshes run one
    at a time, each starting with a read of the newest jobs (``/v1/jobs?limit=…``, no ``after``):
    the read after ``count`` more starts once they have all been drawn."""
    driver.execute_script(  # type: ignore[attr-defined]
        "if (window.polls === undefined) { window.polls = 0; const counted = window.fetch;"
        " window.fetch = (url, ...rest) => { const path = String(url);"
        " if (path.startsWith('/v1/jobs?limit') && !path.includes('after=')) window.polls += 1;"
        " return counted(url, ...rest); }; }"
    )
    start = driver.execute_script("return window.polls")  # type: ignore[attr-defined]
    wait.until(lambda d: d.execute_script("return window.polls") >= start + count + 1)  # type: ignore[attr-defined]


def submitted_result(driver: object) -> str:
    """The job id of the Submit view's job, once its result image is shown."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, JOB_WAIT_S).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#submitted .result img[src^='blob:']")
    )
    return str(driver.find_element(By.ID, "submitted").get_attribute("data-job"))  # type: ignore[attr-defined]


def test_a_result_not_read_yet_or_read_in_vain_is_read_again_and_saved_as_the_server_names_it(
    fleet: RunningFleet, browser: object, tmp_path: Path
) -> None:
    """A result the page could not read (the server restarting: every read of it fails) is read
    again the next time it is shown (it stayed "result unavailable" for the tab's life); its
    Download link pressed before the result was read saves nothing (it pointed at the page
    itself); once read, it saves the result's bytes as ``<job id>.png``."""
    from selenium.webdriver.common.by import By

    done = fleet.client.wait(
        fleet.client.submit(fleet.model, "txt2img", {"prompt": "a result read twice", "steps": 1}, target="m1")["id"],
        timeout_s=JOB_WAIT_S,
    )
    job_id = done["id"]
    driver = browser
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})  # type: ignore[attr-defined]
    wait = open_page(driver, fleet.local.api_url, "jobs")
    # the result route does not answer for now: each read of a result waits, then fails
    driver.execute_script(  # type: ignore[attr-defined]
        "window.realFetch = window.fetch; window.held = [];"
        "window.fetch = (url, ...rest) => (String(url).includes('/result')"
        " ? new Promise((_, reject) => window.held.push(reject)) : window.realFetch(url, ...rest))"
    )
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{job_id}']"))
    click(driver, f"#jobs tr[data-job='{job_id}'] button")
    wait.until(lambda d: d.execute_script("return window.held.length") >= 1)
    click(driver, "#job-detail .download")  # pressed before the result was read
    driver.execute_script("for (const reject of window.held) reject(new TypeError('Failed to fetch'))")  # type: ignore[attr-defined]
    wait.until(lambda d: "result unavailable" in d.find_element(By.CSS_SELECTOR, "#job-detail .result").text)
    driver.execute_script("window.fetch = window.realFetch")  # type: ignore[attr-defined]
    driver.execute_script("location.hash = '#gallery'")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#gallery figure[data-job='{job_id}'] img[src^='blob:']"))
    link = f"#gallery figure[data-job='{job_id}'] .download:not([aria-disabled])"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, link))
    click(driver, link)
    saved = tmp_path / f"{job_id}.png"
    wait.until(lambda d: saved.exists() and not list(tmp_path.glob("*.crdownload")))
    assert sorted(path.name for path in tmp_path.iterdir()) == [saved.name]  # the one file: no page saved before
    assert saved.read_bytes() == fleet.client.download(job_id)


def test_text_selected_in_a_jobs_details_stays_selected_across_refreshes(fleet: RunningFleet, browser: object) -> None:
    """A user selects the job's details (its provenance, to copy the seed) in the Jobs view: the
    selection stays while the view refreshes every second (the details were rewritten each time,
    and the selection dropped before it could be copied)."""
    from selenium.webdriver.common.by import By

    job_id = fleet.client.submit(fleet.model, "txt2img", {"prompt": "details to copy", "steps": 1}, target="m1")["id"]
    fleet.client.wait(job_id, timeout_s=JOB_WAIT_S)
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "jobs")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{job_id}']"))
    click(driver, f"#jobs tr[data-job='{job_id}'] button")
    wait.until(lambda d: '"seed"' in d.find_element(By.CSS_SELECTOR, "#job-detail pre").text)
    selected = driver.execute_script(  # type: ignore[attr-defined]
        "const range = document.createRange(); range.selectNodeContents(document.querySelector('#job-detail pre'));"
        "getSelection().removeAllRanges(); getSelection().addRange(range); return getSelection().toString()"
    )
    assert '"seed"' in selected
    wait_refreshes(driver, wait, 2)  # two refreshes of the view
    assert driver.execute_script("return getSelection().toString()") == selected  # type: ignore[attr-defined]


def test_text_selected_in_the_jobs_table_stays_selected_across_refreshes(fleet: RunningFleet, browser: object) -> None:
    """A user selects a job's prompt in the Jobs table to copy it: the table's rows were drawn anew
    every second, and the selection dropped before it could be copied. A job keeps its row, and a
    cell is written only when what it shows changed: the selection stays while another job's row
    follows that job (queued, then cancelled) in place."""
    from selenium.webdriver.common.by import By

    from app.db.tables import Job

    prompt = "a prompt to copy from its row"
    done = fleet.client.submit(fleet.model, "txt2img", {"prompt": prompt, "steps": 1}, target="m1")["id"]
    fleet.client.wait(done, timeout_s=JOB_WAIT_S)
    # a job waiting on m3, which has no worker: it stays queued until cancelled below
    queued = Job(state=JobState.queued, model_id=fleet.model, kind="txt2img", params={}, target="m3", machine="m3")
    waiting = fleet.ctx.journal.add(queued).id
    try:
        driver = browser
        wait = open_page(driver, fleet.local.api_url, "jobs")
        row, other = f"#jobs tr[data-job='{done}']", f"#jobs tr[data-job='{waiting}']"
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row) and d.find_elements(By.CSS_SELECTOR, other))
        selected = driver.execute_script(  # type: ignore[attr-defined]
            "const range = document.createRange(); range.selectNodeContents(document.querySelector(arguments[0]));"
            "getSelection().removeAllRanges(); getSelection().addRange(range); return getSelection().toString()",
            f"{row} td.prompt",
        )
        assert selected == prompt
        find = "return document.querySelector(arguments[0])"
        rows = [driver.execute_script(find, css) for css in (row, other)]  # type: ignore[attr-defined]
        state = f"return document.querySelector({other!r} + ' td[data-label=State]').innerText"
        assert driver.execute_script(state) == "queued"  # type: ignore[attr-defined]
        fleet.client.cancel(waiting)
        wait.until(lambda d: d.execute_script(state) == "cancelled")
        wait_refreshes(driver, wait, 2)
        assert driver.execute_script("return getSelection().toString()") == selected  # type: ignore[attr-defined]
        assert [driver.execute_script(find, css) for css in (row, other)] == rows  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(ApiError):
            fleet.client.cancel(waiting)


def test_a_slow_server_gets_one_poll_at_a_time(fleet: RunningFleet, browser: object) -> None:
    """A server slow to answer the page's poll: while one poll waits for its answer, the page's
    1 s ticks send no other (they piled up, 5 at once at 4 s an answer, and landed out of order);
    once answered, the page polls again."""
    driver = browser
    # each tick of the page's refresh timer counted (window.ticks), from before the page's own code runs
    driver.execute_cdp_cmd(  # type: ignore[attr-defined]
        "Page.addScriptToEvaluateOnNewDocument",
        {
            "source": "window.ticks = 0; const every = window.setInterval;"
            "window.setInterval = (run, ms, ...rest) => every(() => { window.ticks += 1; run(); }, ms, ...rest);"
        },
    )
    wait = open_page(driver, fleet.local.api_url, "jobs")
    # the jobs poll's answers held back until the test lets them go (a server slow to answer)
    driver.execute_script(  # type: ignore[attr-defined]
        "window.realFetch = window.fetch; window.held = [];"
        "window.fetch = (url, ...rest) => (String(url).startsWith('/v1/jobs?limit')"
        " ? new Promise((resolve) => window.held.push(() => resolve(window.realFetch(url, ...rest))))"
        " : window.realFetch(url, ...rest))"
    )
    wait.until(lambda d: d.execute_script("return window.held.length") >= 1)
    ticks = driver.execute_script("return window.ticks")  # type: ignore[attr-defined]
    wait.until(lambda d: d.execute_script("return window.ticks") >= ticks + 3)
    assert driver.execute_script("return window.held.length") == 1  # type: ignore[attr-defined]
    driver.execute_script("window.held[0]()")  # type: ignore[attr-defined]
    wait.until(lambda d: d.execute_script("return window.held.length") >= 2)  # answered: the next poll goes out
    driver.execute_script("window.fetch = window.realFetch; for (const go of window.held.slice(1)) go()")  # type: ignore[attr-defined]


def test_form_is_built_from_the_models_spec_with_its_ranges_and_defaults(fleet: RunningFleet, browser: object) -> None:
    """GET /v1/models gives each kind's params, defaults and ranges; the Submit form shows every
    param of the chosen kind with them, the model's own defaults first (the shapes models: 32 px,
    guidance 4), only the kinds models run (no ``adapter``), and the adapters that fit the chosen
    model (its ``adapters``, R22): of the family's three, tiny-sd's own two, then the shapes
    models' colour adapter alone, never one the submission would refuse."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from app.devtools.train_shapes import MODEL_NAMES

    models = {
        m["id"]: m
        for m in httpx.get(
            f"{fleet.local.api_url}/v1/models",
            timeout=60,
            headers={"Authorization": f"Bearer {TEST_API_KEY}"},
            verify=tls_context(),
        ).json()["data"]
    }
    txt2img = models[fleet.model]["params"]["txt2img"]
    assert txt2img["defaults"]["steps"] == 4 and txt2img["ranges"]["guidance_scale"] == {
        "min": 0.0,
        "max": 50.0,
        "integer": False,
    }
    assert txt2img["ranges"]["width"]["step"] == 8 and txt2img["ranges"]["n"] == {"integer": True, "min": 1, "max": 4}
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "submit")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#submit-form select[name=kind] option[value='inpaint']"))
    kinds = driver.execute_script(  # type: ignore[attr-defined]
        "return [...document.querySelectorAll('#submit-form select[name=kind] option')].map(o => o.value)"
    )
    assert "adapter" not in kinds and {"txt2img", "img2img", "inpaint", "edit"} <= set(kinds), kinds
    form = driver.find_element(By.ID, "submit-form")  # type: ignore[attr-defined]
    Select(form.find_element(By.NAME, "model")).select_by_value(fleet.model)
    for name in ("prompt", "negative_prompt", "width", "height", "steps", "guidance_scale", "seed", "n"):
        assert shown_field(driver, name), name
    guidance = form.find_element(By.NAME, "guidance_scale")
    shown = (guidance.get_attribute("min"), guidance.get_attribute("max"), guidance.get_attribute("value"))
    assert shown == ("0", "50", "7.5"), shown
    assert form.find_element(By.NAME, "width").get_attribute("step") == "8"
    adapters = driver.execute_script(  # type: ignore[attr-defined]
        "return [...document.querySelectorAll('#adapters [data-adapter]')].map(a => a.dataset.adapter)"
    )
    family = {a for a in models if models[a]["kinds"] == ["adapter"] and models[a]["family"] == "sd1"}
    assert family == {ADAPTER, KOHYA_ADAPTER, COLOUR_LORA}, family
    assert adapters == models[fleet.model]["adapters"] == [ADAPTER, KOHYA_ADAPTER], adapters
    Select(form.find_element(By.NAME, "model")).select_by_value(MODEL_NAMES["filled"])
    adapters = driver.execute_script(  # type: ignore[attr-defined]
        "return [...document.querySelectorAll('#adapters [data-adapter]')].map(a => a.dataset.adapter)"
    )
    assert adapters == [COLOUR_LORA], adapters
    assert form.find_element(By.NAME, "width").get_attribute("value") == "32"  # the model's own default
    assert form.find_element(By.NAME, "guidance_scale").get_attribute("value") == "4"
    Select(form.find_element(By.NAME, "kind")).select_by_value("img2img")
    assert shown_field(driver, "strength") and shown_field(driver, "image") and not shown_field(driver, "width")


def test_a_mask_drawn_with_the_pointer_inpaints_only_inside_it(
    fleet: RunningFleet, browser: object, tmp_path: Path
) -> None:
    """Inpaint from the page: the input uploaded, the mask painted on the canvas with pointer
    events (a stroke, part of it erased), sent as the mask file; the result's pixels outside the
    painted area are the input's, and some inside differ."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    wait = open_page(driver, fleet.local.api_url, "submit")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#submit-form select[name=target] option[value='m1']"))
    form = driver.find_element(By.ID, "submit-form")  # type: ignore[attr-defined]
    Select(form.find_element(By.NAME, "kind")).select_by_value("inpaint")
    Select(form.find_element(By.NAME, "model")).select_by_value(fleet.model)
    Select(form.find_element(By.NAME, "target")).select_by_value("m1")
    source = png_file(tmp_path / "inpaint-input.png")
    form.find_element(By.NAME, "image").send_keys(str(source))
    wait.until(lambda d: d.execute_script("return document.querySelector('#mask-canvas').width") == 64)
    canvas = driver.find_element(By.ID, "mask-canvas")  # type: ignore[attr-defined]
    side = canvas.size["width"]  # shown larger than the image: the stroke is scaled to image pixels
    ActionChains(driver).move_to_element_with_offset(canvas, -side // 4, -side // 4).click_and_hold().move_by_offset(
        side // 2, 0
    ).move_by_offset(0, side // 4).release().perform()
    click(driver, "#mask-erase")
    ActionChains(driver).move_to_element_with_offset(canvas, side // 4, -side // 4).click_and_hold().move_by_offset(
        0, side // 8
    ).release().perform()
    painted = driver.execute_script(  # type: ignore[attr-defined]
        "const c = document.querySelector('#mask-canvas');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "return Array.from({length: c.width * c.height}, (_, i) => d[i * 4 + 3] >= 128)"
    )
    assert 0 < sum(painted) < 64 * 64 / 2, sum(painted)
    # the brush shows black and white stripes, seen on any image (its red vanished on a red one)
    dark, light = driver.execute_script(  # type: ignore[attr-defined]
        "const c = document.querySelector('#mask-canvas');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let dark = 0, light = 0;"
        "for (let i = 0; i < d.length; i += 4) if (d[i + 3] >= 128) { if (d[i] < 64) dark++; if (d[i] > 192) light++; }"
        "return [dark, light]"
    )
    assert dark > 0 and light > 0, (dark, light)
    prompt = form.find_element(By.NAME, "prompt")
    prompt.clear()
    prompt.send_keys("a page-painted fox")
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    job = fleet.client.wait(submitted_result(driver), timeout_s=JOB_WAIT_S)
    assert (job["state"], job["kind"], job["machine"]) == ("succeeded", "inpaint", "m1")
    snap(driver, "submit-inpaint")
    before, after = pixels(source.read_bytes()), pixels(fleet.client.download(job["id"]))
    outside = [i for i, inside in enumerate(painted) if not inside]
    assert [after[i] for i in outside] == [before[i] for i in outside]
    assert any(after[i] != before[i] for i, inside in enumerate(painted) if inside)


def test_a_remix_with_the_same_seed_reproduces_the_pixels(fleet: RunningFleet, browser: object) -> None:
    """Gallery → Same settings fills the form from the job (model, kind, target, params, seed);
    submitted, it gives the same pixels. New seed fills another seed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    params = {"prompt": "a remixed lighthouse", "width": 64, "height": 64, "steps": 3, "seed": 4242}
    submitted = fleet.client.submit(fleet.model, "txt2img", params, target="m1")["id"]
    original = fleet.client.wait(submitted, timeout_s=JOB_WAIT_S)
    assert original["state"] == "succeeded"
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "gallery")
    figure = f"#gallery figure[data-job='{original['id']}']"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} img[src^='blob:']"))
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#submit-form select[name=target] option[value='m1']"))
    driver.set_window_size(1280, 720)  # type: ignore[attr-defined]  # a laptop's window
    try:
        click(driver, f"{figure} .remix-enlarge")
        wait.until(
            lambda d: d.execute_script(
                "const dialog = document.querySelector('#enlarged'); "
                "return dialog.open && dialog.querySelector('img').complete && dialog.querySelector('img').src"
            ).startswith("blob:")
        )
        # The enlarged image leaves its Close button inside the window, and a real click on it
        # (the driver's, at its place on the screen) closes the dialog, as a user does it.
        bottom, height = driver.execute_script(  # type: ignore[attr-defined]
            "return [document.querySelector('#enlarged form button').getBoundingClientRect().bottom, innerHeight]"
        )
        assert bottom <= height, (bottom, height)
        driver.find_element(By.CSS_SELECTOR, "#enlarged form button").click()  # type: ignore[attr-defined]
        wait.until(lambda d: not d.execute_script("return document.querySelector('#enlarged').open"))
    finally:
        driver.set_window_size(1400, 1000)  # type: ignore[attr-defined]  # as the fixture made it
    assert driver.execute_script(  # type: ignore[attr-defined]
        f"return document.querySelector({figure + ' a.download'!r}).href"
    ).startswith("blob:")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-new-seed"))
    click(driver, f"{figure} .remix-new-seed")
    wait.until(lambda d: d.execute_script("return location.hash") == "#submit")
    assert form_value(driver, "seed") not in ("", "4242")
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-same"))
    click(driver, f"{figure} .remix-same")
    wait.until(lambda d: d.execute_script("return location.hash") == "#submit")
    assert [form_value(driver, name) for name in ("kind", "model", "target", "prompt", "steps", "seed")] == [
        "txt2img",
        fleet.model,
        "m1",
        "a remixed lighthouse",
        "3",
        "4242",
    ]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    again = fleet.client.wait(submitted_result(driver), timeout_s=JOB_WAIT_S)
    assert again["id"] != original["id"] and again["seed"] == 4242 and again["state"] == "succeeded"
    assert pixels(fleet.client.download(again["id"])) == pixels(fleet.client.download(original["id"]))
    # send to img2img: the result is the input (its digest as params.image)
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-send-img2img"))
    click(driver, f"{figure} .remix-send-img2img")
    wait.until(lambda d: form_value(d, "kind") == "img2img")
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(fleet.model)  # type: ignore[attr-defined]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    sent = fleet.client.wait(submitted_result(driver), timeout_s=JOB_WAIT_S)
    assert (sent["state"], sent["kind"]) == ("succeeded", "img2img")
    assert sent["params"]["image"] == original["result"]["digest"]


#: seeds a double cannot hold (2^53 + 1 reads as 2^53, 2^63 - 1 as 2^63, past the API's range)
BIG_SEEDS = (2**53 + 1, 2**63 - 1)


def test_same_settings_keeps_a_seed_past_2_53_to_the_last_digit(fleet: RunningFleet, browser: object) -> None:
    """The seed field's hint shows the API's range exactly (0–9223372036854775807), and Same
    settings of a job seeded 2^53 + 1 or 2^63 - 1 fills the form with that seed's digits and
    submits it unchanged: the new job (journal, API) has the very same seed."""
    from selenium.webdriver.common.by import By

    params = {"prompt": "a seed past two to the fifty-three", "width": 64, "height": 64, "steps": 1}
    originals = {
        seed: fleet.client.submit(fleet.model, "txt2img", {**params, "seed": seed}, target="m1")["id"]
        for seed in BIG_SEEDS
    }
    for seed, job_id in originals.items():
        assert fleet.client.wait(job_id, timeout_s=JOB_WAIT_S)["seed"] == seed
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "gallery")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#submit-form select[name=target] option[value='m1']"))
    for seed, job_id in originals.items():
        driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
        figure = f"#gallery figure[data-job='{job_id}']"
        wait.until(lambda d, css=f"{figure} .remix-same": d.find_elements(By.CSS_SELECTOR, css))
        click(driver, f"{figure} .remix-same")
        wait.until(lambda d: d.execute_script("return location.hash") == "#submit")
        assert form_value(driver, "seed") == str(seed)
        assert "0–9223372036854775807" in driver.find_element(By.ID, "hint-seed").text  # type: ignore[attr-defined]
        driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
        again = fleet.client.wait(submitted_result(driver), timeout_s=JOB_WAIT_S)
        assert (again["state"], again["seed"]) == ("succeeded", seed), again
        assert again["id"] != job_id and fleet.ctx.journal.get(again["id"]).params["seed"] == seed


def shown_results(driver: object, root: str) -> list[dict[str, object]]:
    """The results shown under ``root``, in order: each image's job, index, digest (as the page
    labels it), blob: URL and width once loaded, and its download link's file name and blob: URL."""
    return driver.execute_script(  # type: ignore[attr-defined, no-any-return]
        "return [...document.querySelectorAll(arguments[0] + ' img[data-digest]')].map(img => {"
        " const link = img.closest('figure, .result-item').querySelector('a.download');"
        " return {job: img.dataset.job, index: img.dataset.index, digest: img.dataset.digest, src: img.src,"
        " width: img.complete ? img.naturalWidth : 0, file: link.getAttribute('download'), href: link.href}; })",
        root,
    )


def shown_pixels(driver: object, src: str) -> list[tuple[int, int, int]]:
    """The RGB pixels, row by row, of the image the page shows from ``src`` (a blob: URL)."""
    flat = driver.execute_script(  # type: ignore[attr-defined]
        "const img = [...document.images].find(i => i.src === arguments[0]);"
        "const canvas = document.createElement('canvas');"
        "canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;"
        "const context = canvas.getContext('2d'); context.drawImage(img, 0, 0);"
        "return Array.from(context.getImageData(0, 0, canvas.width, canvas.height).data)",
        src,
    )
    return [tuple(flat[i : i + 3]) for i in range(0, len(flat), 4)]


def test_a_job_of_two_images_shows_and_sends_each_of_them(fleet: RunningFleet, browser: object) -> None:
    """A job with n = 2 shows both images, in order, in the Gallery (a figure each, its own
    download) and in the Jobs view's details; each shows and downloads that image's pixels
    (``GET /v1/jobs/{id}/result?index=i``), and "→ img2img" on the second sends the second
    (the new job's params.image)."""
    from selenium.webdriver.common.by import By

    params = {"prompt": "two page-shown lighthouses", "width": 64, "height": 64, "steps": 2, "n": 2}
    job = fleet.client.wait(
        fleet.client.submit(fleet.model, "txt2img", params, target="m1")["id"], timeout_s=JOB_WAIT_S
    )
    assert job["state"] == "succeeded"
    digests = [r["digest"] for r in job["results"]]
    assert len(set(digests)) == 2, job["results"]
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "gallery")
    figures = f"#gallery figure[data-job='{job['id']}']"
    ready = lambda d, root: [r for r in shown_results(d, root) if r["width"] == 64 and r["href"].startswith("blob:")]  # noqa: E731
    wait.until(lambda d: len(ready(d, figures)) == 2)
    for root in (figures, "#job-detail .result"):
        if root != figures:
            driver.get(f"{fleet.local.api_url}/#jobs")  # type: ignore[attr-defined]
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#jobs tr[data-job='{job['id']}']"))
            click(driver, f"#jobs tr[data-job='{job['id']}']")
            wait.until(lambda d, r=root: len(ready(d, r)) == 2)
        shown = shown_results(driver, root)
        assert [(r["job"], r["index"], r["digest"]) for r in shown] == [
            (job["id"], "0", digests[0]),
            (job["id"], "1", digests[1]),
        ]
        assert len({r["src"] for r in shown}) == len({r["file"] for r in shown}) == 2, shown
        assert [r["href"] for r in shown] == [r["src"] for r in shown]  # each link saves the image shown above it
        assert [shown_pixels(driver, str(r["src"])) for r in shown] == [
            pixels(fleet.client.download(job["id"], index)) for index in (0, 1)
        ]
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    second = f"{figures}[data-index='1'] .remix-send-img2img"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, second))
    click(driver, second)
    wait.until(lambda d: form_value(d, "kind") == "img2img")
    driver.execute_script("document.querySelector('#submit-form').elements.steps.value = '2'")  # type: ignore[attr-defined]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    sent = fleet.client.wait(submitted_result(driver), timeout_s=JOB_WAIT_S)
    assert (sent["state"], sent["kind"], sent["model"]) == ("succeeded", "img2img", fleet.model)
    assert sent["params"]["image"] == digests[1]
    # Same settings on the second image makes that image again: its own seed (seed + 1), one image
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    same = f"{figures}[data-index='1'] .remix-same"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, same))
    click(driver, same)
    wait.until(lambda d: d.execute_script("return location.hash") == "#submit")
    assert [form_value(driver, name) for name in ("kind", "prompt", "n", "seed")] == [
        "txt2img",
        "two page-shown lighthouses",
        "1",
        str(job["seed"] + 1),
    ]
    assert f"Form filled from image 2 of 2 of job {job['id']}" in driver.find_element(By.ID, "notice").text  # type: ignore[attr-defined]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    again = fleet.client.wait(submitted_result(driver), timeout_s=JOB_WAIT_S)
    assert (again["state"], again["seed"], again["params"]["n"]) == ("succeeded", job["seed"] + 1, 1), again
    assert again["results"][0]["seed"] == job["results"][1]["seed"]


def test_send_to_keeps_the_jobs_model_or_asks_for_one(fleet: RunningFleet, browser: object) -> None:
    """A tiny-sd picture sent "→ img2img" keeps tiny-sd chosen (another model is first in the
    list); sent "→ edit", which tiny-sd does not run, it chooses none: the list asks for a model,
    the notice says why, a submission is refused on the page until one is chosen, and the prompt
    stays."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    params = {"prompt": "a lighthouse sent onwards", "width": 64, "height": 64, "steps": 1}
    job = fleet.client.wait(
        fleet.client.submit(fleet.model, "txt2img", params, target="m1")["id"], timeout_s=JOB_WAIT_S
    )
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "gallery")
    figure = f"#gallery figure[data-job='{job['id']}']"
    models = "return [...document.querySelector('#submit-form').elements.model.options].map(o => o.value)"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-send-img2img"))
    click(driver, f"{figure} .remix-send-img2img")
    wait.until(lambda d: form_value(d, "kind") == "img2img")
    assert driver.execute_script(models)[0] != fleet.model  # type: ignore[attr-defined]
    assert (form_value(driver, "model"), form_value(driver, "prompt")) == (fleet.model, "a lighthouse sent onwards")
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-send-edit"))
    click(driver, f"{figure} .remix-send-edit")
    wait.until(lambda d: form_value(d, "kind") == "edit")
    assert form_value(driver, "model") == "" and driver.execute_script(models)[1:] == sorted(
        [EDIT_MODEL, RECOLOUR_MODEL]
    )  # type: ignore[attr-defined]
    assert f"its model {fleet.model} does not run edit" in driver.find_element(By.ID, "notice").text  # type: ignore[attr-defined]
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    refusal = wait.until(lambda d: d.find_elements(By.ID, "refusal"))[0]
    assert refusal.get_attribute("data-reason") == "invalid_model", refusal.text
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(EDIT_MODEL)  # type: ignore[attr-defined]
    assert form_value(driver, "prompt") == "a lighthouse sent onwards"
    click(driver, "#dry-run")
    wait.until(lambda d: "Would run on server" in d.find_element(By.ID, "explanation").text)
    # "→ upscale": no prompt, neither the job's nor the form's example, once a model is chosen
    driver.get(f"{fleet.local.api_url}/#gallery")  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-send-upscale"))
    click(driver, f"{figure} .remix-send-upscale")
    wait.until(lambda d: form_value(d, "kind") == "upscale")
    assert (form_value(driver, "model"), form_value(driver, "prompt")) == ("", "")
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(UPSCALE_MODEL)  # type: ignore[attr-defined]
    assert form_value(driver, "prompt") == ""


def form_value(driver: object, name: str) -> str:
    return str(
        driver.execute_script(  # type: ignore[attr-defined]
            "return document.querySelector('#submit-form').elements[arguments[0]].value", name
        )
    )


def test_queue_control_interrupts_cancels_and_requeues(fleet: RunningFleet, browser: object) -> None:
    """The Fleet view names m2's running job with its step, elapsed and remaining time; the Jobs
    view cancels the queued job behind it (cancelled), interrupts the running one (the API's
    cancel: it ends cancelled) and requeues an ended one (a new job, requeued_from it) from the keyboard."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    params = {"prompt": "a long interrupted run", "steps": 150, **LONG_SIZE}
    running = fleet.client.submit(fleet.model, "txt2img", params, target="m2")["id"]
    queued = fleet.client.submit(fleet.model, "txt2img", {**params, "steps": 1}, target="m2")["id"]
    requeued = None
    try:
        driver = browser
        wait = open_page(driver, fleet.local.api_url)
        line = f"#machines tr[data-machine='m2'] .running-job[data-job='{running}']"
        wait.until(lambda d: "step" in (d.execute_script(f"return document.querySelector({line!r})?.innerText") or ""))
        text = driver.execute_script(f"return document.querySelector({line!r}).innerText")  # type: ignore[attr-defined]
        assert running[:8] in text and "elapsed" in text and "left" in text, text
        pid = pause(fleet.ctx, running)  # running, at no CPU, until it is interrupted below
        driver.get(f"{fleet.local.api_url}/#jobs")  # type: ignore[attr-defined]
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f".act-cancel[data-job='{queued}']"))
        click(driver, f".act-cancel[data-job='{queued}']")
        wait.until(lambda d: fleet.client.get(queued)["state"] == "cancelled")
        # and the page has the answer, as its user sees it before the next click (an answer still
        # on its way would otherwise land after the interrupt's and replace its notice)
        wait.until(lambda d: d.find_element(By.ID, "notice").text == f"Job {queued} cancelled")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f".act-interrupt[data-job='{running}']"))
        resume(pid)  # it stops at its next step: it must take one
        click(driver, f".act-interrupt[data-job='{running}']")
        ended = fleet.client.wait(running, timeout_s=JOB_WAIT_S)
        assert ended["state"] == "cancelled", ended
        # "is stopping at its next step" while the answer found it running, then the notice follows it
        # to its end: "cancelled" (it stayed "interrupted" after the job had ended cancelled: a user pass)
        wait.until(lambda d: d.find_element(By.ID, "notice").text == f"Job {running} cancelled")
        # cut short, it reported no run time: its row gives the seconds it held m2, claim to end (quotas' figure)
        cell = f"#jobs tr[data-job='{running}'] td[data-label='Actual']"
        read_actual = f"return document.querySelector({cell!r})?.innerText"
        wait.until(lambda d: "held" in (d.execute_script(read_actual) or ""))
        shown = driver.execute_script(read_actual)  # type: ignore[attr-defined]
        job = fleet.ctx.journal.get(running)
        assert job.run_s is None and job.started_at is not None and job.finished_at is not None
        held_s = (job.finished_at - job.started_at).total_seconds()
        assert re.fullmatch(r"(\d+\.\d) s held", shown), shown
        assert abs(float(shown.split()[0]) - held_s) <= 0.051, (shown, held_s)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f".act-requeue[data-job='{queued}']"))
        # from the keyboard: the focused button keeps its focus through the view's re-renders, Enter presses it
        driver.execute_script(f"document.querySelector(\".act-requeue[data-job='{queued}']\").focus()")  # type: ignore[attr-defined]
        wait_refreshes(driver, wait, 1)
        focused = "return document.activeElement.dataset.key"
        assert driver.execute_script(focused) == f"requeue:{queued}"  # type: ignore[attr-defined]
        driver.switch_to.active_element.send_keys(Keys.ENTER)  # type: ignore[attr-defined]
        wait.until(lambda d: "requeued as" in d.find_element(By.ID, "notice").text)
        requeued = driver.find_element(By.ID, "notice").text.split("requeued as ")[1].split()[0]  # type: ignore[attr-defined]
        again = fleet.client.wait(requeued, timeout_s=JOB_WAIT_S)
        assert (again["state"], again["requeued_from"], again["params"]["steps"]) == ("succeeded", queued, 1)
    finally:
        if fleet.ctx.journal.state_of(running) == JobState.running:
            end_running(fleet.ctx, running)
        for job_id in (running, queued, requeued):
            if job_id:
                fleet.client.wait(job_id, timeout_s=300)


def notice_text(driver: object) -> str:
    return str(driver.find_element("id", "notice").text)  # type: ignore[attr-defined]


def test_a_notice_clears_on_its_own_or_when_closed_and_an_error_stays_until_dismissed(
    fleet: RunningFleet, browser: object
) -> None:
    """A notice ("Job … requeued as …") stayed for the tab's life: it now clears on its own a while
    later, or at its close button; a refused action's error is listed apart and stays, older than
    a notice that cleared meanwhile, until its own close button."""
    from selenium.webdriver.common.by import By

    submitted = fleet.client.submit(fleet.model, "txt2img", {"prompt": "a notice to dismiss", "steps": 1}, target="m1")
    job_id = fleet.client.wait(submitted["id"], timeout_s=JOB_WAIT_S)["id"]
    requeued: list[str] = []
    driver = browser
    try:
        wait = open_page(driver, fleet.local.api_url, "jobs")
        button = f".act-requeue[data-job='{job_id}']"
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, button))
        # the server does not answer the requeue: its error is listed
        driver.execute_script(  # type: ignore[attr-defined]
            "window.realFetch = window.fetch; window.fetch = (url, ...rest) => (String(url).endsWith('/requeue')"
            " ? Promise.reject(new TypeError('Failed to fetch')) : window.realFetch(url, ...rest))"
        )
        click(driver, button)
        alert = "#alerts .alert"
        read_alert = f"return document.querySelector({alert!r})?.innerText"
        refused = f"requeue of {job_id} refused: server_unreachable"
        wait.until(lambda d: refused in (d.execute_script(read_alert) or ""))
        driver.execute_script("window.fetch = window.realFetch")  # type: ignore[attr-defined]
        click(driver, button)  # answered: the notice says so, beside the error
        wait.until(lambda d: "requeued as" in notice_text(d))
        requeued.append(notice_text(driver).split("requeued as ")[1].split()[0])
        assert driver.find_element(By.ID, "notice-close").is_displayed()  # type: ignore[attr-defined]
        # it clears on its own; the error, said before it, stays until dismissed
        wait.until(lambda d: not d.find_element(By.ID, "notice-box").is_displayed())
        assert refused in driver.execute_script(read_alert)  # type: ignore[attr-defined]
        click(driver, f"{alert} button.close")
        assert not driver.find_elements(By.CSS_SELECTOR, alert)  # type: ignore[attr-defined]
        click(driver, button)  # another notice, closed at its button
        wait.until(lambda d: "requeued as" in notice_text(d))
        requeued.append(notice_text(driver).split("requeued as ")[1].split()[0])
        click(driver, "#notice-close")
        assert not driver.find_element(By.ID, "notice-box").is_displayed()  # type: ignore[attr-defined]
    finally:
        for again in requeued:
            fleet.client.wait(again, timeout_s=JOB_WAIT_S)


#: the jobs the page reads at a time (app/api/page/app.js PAGE)
PAGE = 200
#: the model id of the jobs written straight into the journal below: none runs it
OLD_MODEL = "paging-old"


def add_old_jobs(fleet: RunningFleet, count: int, days: float, queued_first: bool = False) -> list[str]:
    """``count`` rejected jobs written into the journal as submitted ``days`` ago, a second apart,
    oldest first (the first one ``queued`` on m3, which has no worker, with ``queued_first``); their ids."""
    from datetime import timedelta

    from app.db.tables import Job, utcnow

    start = utcnow() - timedelta(days=days)
    ids = []
    for index in range(count):
        waits = queued_first and index == 0
        job = Job(
            state=JobState.queued if waits else JobState.rejected,
            model_id=OLD_MODEL,
            kind="txt2img",
            params={"prompt": f"old job {index}"},
            target="m3",
            machine="m3" if waits else None,
            reason=None if waits else "paging_test",
            message=None if waits else "written by the paging test",
            created_at=start + timedelta(seconds=index),
        )
        ids.append(fleet.ctx.journal.add(job).id)
    return ids


def delete_jobs(fleet: RunningFleet, ids: list[str]) -> None:
    """Take the jobs ``ids`` and their events out of the journal (the shared fleet's other tests
    never see them)."""
    from sqlmodel import Session, col, delete

    from app.db.tables import Job, JobEvent

    with Session(fleet.ctx.journal.engine) as session:
        session.exec(delete(JobEvent).where(col(JobEvent.job_id).in_(ids)))  # type: ignore[call-overload]
        session.exec(delete(Job).where(col(Job.id).in_(ids)))  # type: ignore[call-overload]
        session.commit()


def load_older(driver: object, wait: object, box: str, until: str | None = None) -> int:
    """Press the Load older button of ``box`` (``#jobs-paging``, ``#gallery-paging``) until it is
    gone (every job loaded) or the element ``until`` is shown; how many times it was pressed."""
    button = f"{box} .load-older"
    settled = f"const b = document.querySelector({button!r}); return b.hidden || !b.disabled"
    presses = 0
    while not (until and driver.execute_script("return Boolean(document.querySelector(arguments[0]))", until)):  # type: ignore[attr-defined]
        wait.until(lambda d: d.execute_script(settled))  # type: ignore[attr-defined]
        if driver.execute_script(f"return document.querySelector({button!r}).hidden"):  # type: ignore[attr-defined]
            break
        click(driver, button)
        presses += 1
        wait.until(lambda d: d.execute_script(settled))  # type: ignore[attr-defined]
    return presses


def paging_text(driver: object, box: str) -> str:
    return str(driver.execute_script(f"return document.querySelector('{box} .paging-status').textContent"))  # type: ignore[attr-defined]


def test_older_jobs_are_loaded_page_by_page_in_the_jobs_view_and_the_gallery(
    fleet: RunningFleet, browser: object
) -> None:
    """The Jobs view and the Gallery read the 200 newest jobs and offered no way to older ones. Each
    now says how many jobs it shows and whether older ones exist, and Load older adds the next page
    (the API's ``after=`` cursor) after them, down to the oldest; the 1 s refresh reads the newest
    page alone, the older rows staying as loaded, an older job that changes (queued, then
    cancelled) updated in its row; the Gallery's filters apply to every job loaded."""
    from selenium.webdriver.common.by import By

    old = add_old_jobs(fleet, PAGE + 30, days=10, queued_first=True)
    total = len(fleet.ctx.journal.page(limit=10**6))
    oldest = f"#jobs tr[data-job='{old[0]}']"
    rows = "return document.querySelectorAll('#jobs tbody tr').length"
    try:
        driver = browser
        wait = open_page(driver, fleet.local.api_url, "jobs")
        wait.until(lambda d: d.execute_script(rows) == PAGE)
        assert (
            paging_text(driver, "#jobs-paging")
            == f"Showing {PAGE} jobs, newest first; older jobs exist, not loaded yet"
        )
        assert not driver.find_elements(By.CSS_SELECTOR, oldest)  # type: ignore[attr-defined]
        driver.execute_script(  # type: ignore[attr-defined]
            "window.olderReads = 0; const counted = window.fetch; window.fetch = (url, ...rest) => {"
            " if (String(url).includes('after=')) window.olderReads += 1; return counted(url, ...rest); }"
        )
        presses = load_older(driver, wait, "#jobs-paging")
        assert presses >= 1 and driver.execute_script(rows) == total  # type: ignore[attr-defined]
        assert paging_text(driver, "#jobs-paging") == f"Showing {total} jobs, newest first: every job"
        state = f"return document.querySelector({oldest!r} + ' td[data-label=State]').innerText"
        assert driver.execute_script(state) == "queued"  # type: ignore[attr-defined]
        fleet.client.cancel(old[0])  # the oldest job changes: its row follows
        wait.until(lambda d: d.execute_script(state) == "cancelled")
        wait_refreshes(driver, wait, 3)  # the older rows stay, the older pages never read again
        assert driver.execute_script(rows) == total  # type: ignore[attr-defined]
        assert driver.execute_script("return window.olderReads") == presses  # type: ignore[attr-defined]
        # the Gallery, the page loaded again: its own Load older, its filters on what is loaded
        driver.execute_script("location.hash = '#gallery'; location.reload()")  # type: ignore[attr-defined]
        wait.until(lambda d: paging_text(d, "#gallery-paging").startswith(f"{PAGE} jobs loaded"))
        assert paging_text(driver, "#gallery-paging").endswith("older jobs exist, not loaded yet")
        load_older(driver, wait, "#gallery-paging")
        assert paging_text(driver, "#gallery-paging") == f"{total} jobs loaded, newest first: every job"
        select_filter(wait, "filter-model", OLD_MODEL)
        scope = f"Filters apply to the {total} jobs loaded: {len(old)} results shown"
        wait.until(lambda d: d.find_element(By.ID, "gallery-scope").text == scope)
        figures = "return [...document.querySelectorAll('#gallery figure')].map((f) => f.dataset.job)"
        assert sorted(driver.execute_script(figures)) == sorted(old)  # type: ignore[attr-defined]
        # the filter's list is not drawn anew while its values stay (an open list closed each second)
        keep = "window.keptOption = document.querySelector('#filter-model').selectedOptions[0]"
        driver.execute_script(keep)  # type: ignore[attr-defined]
        wait_refreshes(driver, wait, 2)
        kept = "return document.querySelector('#filter-model').selectedOptions[0] === window.keptOption"
        assert driver.execute_script(kept)  # type: ignore[attr-defined]
        assert driver.execute_script("return window.keptOption.text") == OLD_MODEL  # type: ignore[attr-defined]
    finally:
        with contextlib.suppress(ApiError):
            fleet.client.cancel(old[0])
        delete_jobs(fleet, old)


def test_the_submitted_column_shows_the_date_of_a_job_not_submitted_today(fleet: RunningFleet, browser: object) -> None:
    """The Submitted column showed a time alone, so jobs of different days looked alike: a job
    submitted 3 days ago shows its date too, in the browser's locale, and today's the time alone;
    each names its whole timestamp in its title."""
    old, today = add_old_jobs(fleet, 1, days=3)[0], add_old_jobs(fleet, 1, days=0)[0]
    cell = "#jobs tr[data-job='{}'] td[data-label=Submitted]"
    read = (
        "const time = document.querySelector(arguments[0] + ' time');"
        " return [time.innerText, time.title, time.dateTime]"
    )
    # the date and the time of day, as this browser writes them
    local = (
        "const at = new Date(arguments[0]); return [new Intl.DateTimeFormat([], {dateStyle: 'medium'}).format(at),"
        " at.toLocaleTimeString([], {hour12: false}), String(at.getFullYear())]"
    )
    try:
        driver = browser
        wait = open_page(driver, fleet.local.api_url, "jobs")
        wait.until(
            lambda d: d.execute_script("return Boolean(document.querySelector(arguments[0]))", cell.format(today))
        )
        load_older(driver, wait, "#jobs-paging", until=cell.format(old))
        for job_id, dated in ((old, True), (today, False)):
            text, title, stamp = driver.execute_script(read, cell.format(job_id))  # type: ignore[attr-defined]
            date, time_of_day, year = driver.execute_script(local, stamp)  # type: ignore[attr-defined]
            assert text == (f"{date} {time_of_day}" if dated else time_of_day), (text, date, time_of_day)
            assert year in title and title != text, title
            created = fleet.ctx.journal.get(job_id).created_at
            assert stamp.startswith(created.strftime("%Y-%m-%dT%H:%M:%S")), (stamp, created)
    finally:
        delete_jobs(fleet, [old, today])


#: the widths every view is checked and photographed at (CSS pixels of the viewport)
WIDTHS = (400, 1400)


def test_every_view_fits_400_and_1400_px_without_sideways_scroll(fleet: RunningFleet, browser: object) -> None:
    """At 400 px every view is one column (tables as stacked cards) with no horizontal scroll
    (document scrollWidth <= 400), and at 1400 px too; each view is photographed at both widths
    with a job running (``make screenshots``). Controls carry names a screen reader reads."""
    from selenium.webdriver.common.by import By

    params = {"prompt": "a job running for the screenshots", "steps": 150, **LONG_SIZE}
    running = fleet.client.submit(fleet.model, "txt2img", params, target="m2")["id"]
    try:
        driver = browser
        wait = open_page(driver, fleet.local.api_url)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"#machines .running-job[data-job='{running}'] progress"))
        pause(fleet.ctx, running)  # running, at no CPU, while it is photographed
        for width in WIDTHS:
            driver.execute_cdp_cmd(
                "Emulation.setDeviceMetricsOverride",  # type: ignore[attr-defined]
                {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            )
            for view, ready in (
                ("fleet", "#machines tbody tr"),
                ("jobs", f"#jobs tr[data-job='{running}']"),
                ("gallery", "#gallery figure"),
                ("submit", "#params label[data-param='prompt']"),
            ):
                driver.execute_script(f"location.hash = '#{view}'")  # type: ignore[attr-defined]
                shown = f"#view-{view}:not([hidden]) {ready}"
                wait.until(lambda d, css=shown: d.find_elements(By.CSS_SELECTOR, css))
                scroll = driver.execute_script("return document.documentElement.scrollWidth")  # type: ignore[attr-defined]
                assert scroll <= width, (view, width, scroll)
                unnamed = driver.execute_script(  # type: ignore[attr-defined]
                    "return [...document.querySelectorAll('main button, main input, main select, main textarea')]"
                    ".filter(e => e.offsetParent !== null && !(e.labels && e.labels.length)"
                    " && !e.getAttribute('aria-label') && !e.textContent.trim()).map(e => e.outerHTML)"
                )
                assert unnamed == [], unnamed
                snap(driver, f"{view}-{width}")
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})  # type: ignore[attr-defined]
    finally:
        if fleet.ctx.journal.state_of(running) == JobState.running:  # done with it
            end_running(fleet.ctx, running)
        else:
            with contextlib.suppress(ApiError):  # it ended already
                fleet.client.cancel(running)
        fleet.client.wait(running, timeout_s=300)


def test_same_settings_on_a_retired_models_job_asks_for_a_model(
    fleet: RunningFleet, browser: object, tiny_models_dir: Path
) -> None:
    """A job whose model was retired since (``homefleet models retire``): Same settings chooses
    no model, saying the model is no longer in service, instead of running another model under
    the job's settings; once one is chosen, the job's prompt, seed and steps are in the form."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    model = fleet.ctx.registry.add(tiny_models_dir / "tiny-sd", "zz-page-retired").id
    params = {"prompt": "a model about to retire", "width": 64, "height": 64, "steps": 1, "seed": 77}
    fleet.local.wait_online(["server"], model_id=model, timeout_s=JOB_WAIT_S)  # verified there (R4)
    submitted = fleet.client.submit(model, "txt2img", params, target="server")
    job = fleet.client.wait(submitted["id"], timeout_s=JOB_WAIT_S)
    assert job["state"] == "succeeded", job
    fleet.ctx.registry.retire(model)
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "gallery")
    figure = f"#gallery figure[data-job='{job['id']}']"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"{figure} .remix-same"))
    click(driver, f"{figure} .remix-same")
    wait.until(lambda d: form_value(d, "prompt") == "a model about to retire")
    assert form_value(driver, "model") == ""
    notice = driver.find_element(By.ID, "notice").text  # type: ignore[attr-defined]
    assert f"its model {model} is no longer in service (retired), choose a model" in notice, notice
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(fleet.model)  # type: ignore[attr-defined]
    assert [form_value(driver, name) for name in ("prompt", "seed", "steps")] == ["a model about to retire", "77", "1"]


def test_a_reload_mid_job_follows_the_submitted_job_again(fleet: RunningFleet, browser: object) -> None:
    """The Submit view's panel of the job it submitted survives a reload of the tab: the job is
    followed again from its current state to its result (it was lost; Jobs and Fleet still had it)."""
    from selenium.webdriver.common.by import By

    driver = browser
    wait, _ = submit_form_for(driver, fleet, "m1")
    driver.execute_script(  # type: ignore[attr-defined]
        "const f = document.querySelector('#submit-form'); f.elements.steps.value = '40';"
        "f.elements.prompt.value = 'a lighthouse followed across a reload'"
    )
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    job_id = wait.until(lambda d: d.find_element(By.ID, "submitted").get_attribute("data-job"))
    wait.until(lambda d: "running" in d.find_element(By.CSS_SELECTOR, "#submitted .status").text)
    driver.refresh()  # type: ignore[attr-defined]
    wait.until(lambda d: d.find_element(By.ID, "submitted").get_attribute("data-job") == job_id)
    assert submitted_result(driver) == job_id  # followed to its result after the reload
    status = driver.find_element(By.CSS_SELECTOR, "#submitted .status").text  # type: ignore[attr-defined]
    assert status == f"Job {job_id} succeeded on m1", status


def submit_long_job(driver: object, fleet: RunningFleet, steps: int, prompt: str) -> tuple[object, str]:
    """From the Submit view, a job on m1 of ``steps`` steps at LONG_SIZE, once running: (the
    wait, its id)."""
    from selenium.webdriver.common.by import By

    wait, _ = submit_form_for(driver, fleet, "m1")
    driver.execute_script(  # type: ignore[attr-defined]
        f"const f = document.querySelector('#submit-form'); f.elements.steps.value = '{steps}';"
        f"f.elements.width.value = '{LONG_SIZE['width']}'; f.elements.height.value = '{LONG_SIZE['height']}';"
        f"f.elements.prompt.value = {prompt!r}"
    )
    driver.find_element(By.ID, "submit-job").click()  # type: ignore[attr-defined]
    job_id = wait.until(lambda d: d.find_element(By.ID, "submitted").get_attribute("data-job"))  # type: ignore[attr-defined]
    wait.until(lambda d: "running" in d.find_element(By.CSS_SELECTOR, "#submitted .status").text)  # type: ignore[attr-defined]
    return wait, str(job_id)


def test_the_submit_panel_follows_its_job_across_a_server_restart(fleet: RunningFleet, browser: object) -> None:
    """The server restarted while the Submit panel followed its running job: its event stream
    ended without the job's end, and the panel is followed again until the result (it stayed on
    "running … Interrupt" for good, while the Jobs view had it succeeded: a user pass)."""
    from selenium.webdriver.common.by import By

    from app.devtools.procs import stop_process_group

    driver = browser
    wait, job_id = submit_long_job(driver, fleet, 60, "a run followed across a restart")
    try:
        stop_process_group(fleet.local.processes.pop("api"))  # SIGTERM: the event stream ends there
        wait.until(lambda d: "following its events again" in d.find_element(By.CSS_SELECTOR, "#submitted .status").text)
    finally:
        fleet.local.start_api()
    assert submitted_result(driver) == job_id  # followed again to its result
    status = driver.find_element(By.CSS_SELECTOR, "#submitted .status").text  # type: ignore[attr-defined]
    assert status == f"Job {job_id} succeeded on m1", status


def test_the_submit_panels_interrupt_notice_follows_the_job_to_its_end(fleet: RunningFleet, browser: object) -> None:
    """The Submit panel's button reads Interrupt once its job runs; pressed, the notice says the
    job is stopping, then that it ended cancelled (it stayed "stopping" outside the Jobs view: a
    user pass), and the panel says the state once before the job's message."""
    from selenium.webdriver.common.by import By

    driver = browser
    wait, job_id = submit_long_job(driver, fleet, 150, "a run interrupted from its panel")
    try:
        button = driver.find_element(By.ID, "interrupt-submitted")  # type: ignore[attr-defined]
        assert button.text == "Interrupt", button.text
        button.click()
        wait.until(lambda d: d.find_element(By.ID, "notice").text == f"Job {job_id} cancelled")
        ended = driver.find_element(By.CSS_SELECTOR, "#submitted .status").text  # type: ignore[attr-defined]
        assert ended.startswith("cancelled: cancelled by request while running, after "), ended
        assert fleet.client.get(job_id)["state"] == "cancelled"
    finally:
        fleet.client.wait(job_id, timeout_s=300)


def test_what_was_typed_survives_a_change_of_model_or_kind(fleet: RunningFleet, browser: object) -> None:
    """Prompt, steps and seed typed into the form stay when the model or the kind changes (every
    field went back to its default and the prompt to the example: a user pass); a field left
    untouched takes the new model's own default (the shapes models: 32 px, guidance 4)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from app.devtools.train_shapes import MODEL_NAMES

    driver = browser
    wait = open_page(driver, fleet.local.api_url, "submit")
    option = f"#submit-form select[name=model] option[value='{fleet.model}']"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, option))
    form = driver.find_element(By.ID, "submit-form")  # type: ignore[attr-defined]
    Select(form.find_element(By.NAME, "kind")).select_by_value("txt2img")
    Select(form.find_element(By.NAME, "model")).select_by_value(fleet.model)
    typed = {"prompt": "my own words, kept", "steps": "9", "seed": "42"}
    for name, value in typed.items():
        field = form.find_element(By.NAME, name)
        field.clear()
        field.send_keys(value)

    def values() -> dict[str, str]:
        return {name: form.find_element(By.NAME, name).get_attribute("value") for name in typed}

    Select(form.find_element(By.NAME, "model")).select_by_value(MODEL_NAMES["filled"])
    assert values() == typed
    assert form.find_element(By.NAME, "width").get_attribute("value") == "32"  # untouched: its default
    assert form.find_element(By.NAME, "guidance_scale").get_attribute("value") == "4"
    Select(form.find_element(By.NAME, "kind")).select_by_value("img2img")
    assert values() == typed
    Select(form.find_element(By.NAME, "kind")).select_by_value("txt2img")
    assert values() == typed


def test_the_submit_form_follows_models_registered_and_retired_while_the_tab_is_open(
    fleet: RunningFleet, browser: object, tiny_models_dir: Path
) -> None:
    """A model registered while the page is open is offered by the Submit form without a reload,
    and one retired is no longer offered; what the user typed there stays. The form changes only
    while another view is shown, never under the user's hands."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = browser
    wait = open_page(driver, fleet.local.api_url, "submit")
    wait.until(
        lambda d: d.find_elements(By.CSS_SELECTOR, f"#submit-form select[name=model] option[value='{fleet.model}']")
    )
    Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(fleet.model)  # type: ignore[attr-defined]
    prompt = driver.find_element(By.CSS_SELECTOR, "#submit-form textarea[name=prompt]")  # type: ignore[attr-defined]
    prompt.clear()
    prompt.send_keys("typed before the registry changed")
    offered = lambda d: d.execute_script(  # noqa: E731
        "return [...document.querySelectorAll('#submit-form select[name=model] option')].map((o) => o.value)"
    )
    model = fleet.ctx.registry.add(tiny_models_dir / "tiny-sd", "zz-page-followed").id
    try:
        fleet.local.wait_online(["server"], model_id=model, timeout_s=JOB_WAIT_S)
        driver.execute_script("location.hash = '#jobs'")  # type: ignore[attr-defined]
        WebDriverWait(driver, 30).until(lambda d: model in offered(d))
        driver.execute_script("location.hash = '#submit'")  # type: ignore[attr-defined]
        assert form_value(driver, "prompt") == "typed before the registry changed"
        assert form_value(driver, "model") == fleet.model  # the choice stays
        Select(driver.find_element(By.CSS_SELECTOR, "#submit-form select[name=model]")).select_by_value(model)  # type: ignore[attr-defined]
    finally:
        fleet.ctx.registry.retire(model)
    driver.execute_script("location.hash = '#gallery'")  # type: ignore[attr-defined]
    WebDriverWait(driver, 30).until(lambda d: model not in offered(d) and fleet.model in offered(d))
    # the chosen model was retired meanwhile: none is chosen in its place, and the notice says why
    driver.execute_script("location.hash = '#submit'")  # type: ignore[attr-defined]
    assert form_value(driver, "model") == "" and form_value(driver, "prompt") == "typed before the registry changed"
    notice = driver.find_element(By.ID, "notice").text  # type: ignore[attr-defined]
    assert f"The model {model} is no longer in service for txt2img" in notice, notice


def test_a_mask_painted_on_a_sent_result_stays_while_the_registry_changes(
    fleet: RunningFleet, browser: object, tiny_models_dir: Path
) -> None:
    """A result sent "→ inpaint" and a mask painted over it (no file chosen): a model registered
    meanwhile leaves the form as it is (it would have rebuilt the mask editor, erasing the mask);
    the new model is offered once the mask is sent or cleared."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    params = {"prompt": "a picture to paint over", "width": 64, "height": 64, "steps": 1}
    submitted = fleet.client.submit(fleet.model, "txt2img", params, target="m1")
    job = fleet.client.wait(submitted["id"], timeout_s=JOB_WAIT_S)
    driver = browser
    wait = open_page(driver, fleet.local.api_url, "gallery")
    send = f"#gallery figure[data-job='{job['id']}'] .remix-send-inpaint"
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, send))
    click(driver, send)
    wait.until(lambda d: d.execute_script("return document.querySelector('#mask-canvas')?.width") == 64)
    canvas = driver.find_element(By.ID, "mask-canvas")  # type: ignore[attr-defined]
    side = canvas.size["width"]
    ActionChains(driver).move_to_element_with_offset(canvas, -side // 4, 0).click_and_hold().move_by_offset(
        side // 2, 0
    ).release().perform()
    count = "const c = document.querySelector('#mask-canvas'); const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; return Array.from({length: c.width * c.height}, (_, i) => d[i * 4 + 3] >= 128).filter(Boolean).length"  # noqa: E501
    painted = driver.execute_script(count)  # type: ignore[attr-defined]
    assert painted > 0
    offered = "return [...document.querySelectorAll('#submit-form select[name=model] option')].map((o) => o.value)"
    model = fleet.ctx.registry.add(tiny_models_dir / "tiny-sd", "zz-page-masked").id
    try:
        fleet.local.wait_online(["server"], model_id=model, timeout_s=JOB_WAIT_S)
        driver.execute_script("location.hash = '#jobs'")  # type: ignore[attr-defined]
        time.sleep(8)  # past the page's 5 s re-read of the models
        driver.execute_script("location.hash = '#submit'")  # type: ignore[attr-defined]
        assert driver.execute_script(count) == painted  # type: ignore[attr-defined]
        assert model not in driver.execute_script(offered)  # type: ignore[attr-defined]
        click(driver, "#mask-clear")
        driver.execute_script("location.hash = '#jobs'")  # type: ignore[attr-defined]
        WebDriverWait(driver, 30).until(lambda d: model in d.execute_script(offered))
    finally:
        fleet.ctx.registry.retire(model)
