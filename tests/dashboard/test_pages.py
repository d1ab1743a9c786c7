"""The dashboard in headless Chromium (Playwright) against a real uvicorn server seeded through the API.

Needs a Chromium binary: CMTUNE_CHROMIUM (CI installs Debian's chromium and sets it) or
/usr/bin/chromium.  Screenshots of every page go to test-artifacts/dashboard/.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from cmtune.service.launcher import running_server
from tests.service import conftest as contract
from tests.service.conftest import HARDWARE

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = os.environ.get("CMTUNE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(
    not CHROMIUM, reason="no Chromium: install Debian's chromium or set CMTUNE_CHROMIUM to its path")
playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")


class Seeder:
    """Creates studies and reports synthetic results through the real API (as workers would)."""

    def __init__(self, url: str, admin: str, worker: str):
        self.admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        self.worker = contract.register(
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {worker}"}, timeout=30), "seed-worker")

    def run_trial(self) -> dict | None:
        return contract.run_trial(self.worker)


@contextmanager
def submitted_tiny(directory: Path, **options):
    """A real server on a fresh SQLite file, its tokens, a `Seeder`, and the tiny model submitted
    on data=1,model=8 with ``options`` (budget, confirm_top, ...)."""
    url = f"sqlite:///{directory / 'ui.sqlite'}"
    tokens = contract.create_tokens(url)
    with running_server(database_url=url) as server:
        seed = Seeder(server.url, tokens["admin"], tokens["worker"])
        body = {"model": "tiny", "mesh": {"axes": {"data": 1, "model": 8}}, "hardware": HARDWARE} | options
        yield server, tokens, seed, seed.admin.post("/v1/studies", json=body).json()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    with submitted_tiny(tmp_path_factory.mktemp("ui"), budget={"trials": 5}) as (server, tokens, seed, created):
        first = created["studies"][0]["id"]
        # finish the first study completely, and two trials of the second
        while (grant := seed.run_trial()) is not None and grant["trial"]["study_id"] == first:
            pass
        seed.run_trial()
        yield {"url": server.url, "tokens": tokens, "seed": seed, "first": first,
               "second": created["studies"][1]["id"], "submission": created["submission_id"]}


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield instance
        instance.close()


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    page.goto(f"{site['url']}/ui?token={site['tokens']['reader']}")
    page.wait_for_selector("#studies")
    yield page
    context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_overview_lists_studies_and_workers(page, site):
    rows = page.locator("#studies tbody tr")
    assert rows.count() == 10  # the tiny preset: 9 unique problems (forward, input and weight gradients), the step
    assert "step:tiny" in page.locator("#studies").inner_text()
    assert "?token=" not in page.url  # the token went to local storage, not the address bar
    text = page.locator("main").inner_text()
    assert "completed" in text and "allgather_matmul:512x256x768:float32:8" in text
    assert page.locator("#workers-online").inner_text() == "1"
    assert "×" in text  # speedups carry their unit
    assert page.locator("#models a").get_attribute("href") == f"/ui/submissions/{site['submission']}"
    shot(page, "overview")


def test_clicking_a_study_opens_it_with_its_trials_and_plots(page, site):
    page.locator("#studies").get_by_role("link", name=f"#{site['first']}", exact=True).click()
    page.wait_for_url(f"**/ui/studies/{site['first']}")
    page.wait_for_selector("#trial-plot")
    study = site["seed"].admin.get(f"/v1/studies/{site['first']}/trials").json()
    finished = [t for t in study if t["kind"] == "search" and t["state"] == "completed"]
    assert page.locator("#trial-plot circle.trial-point").count() == len(finished) == 5
    assert page.locator("#trial-plot .baseline-line").count() == 1
    assert page.locator("#field-plot circle.field-point").count() == len(finished) - 1  # rings only
    assert "ring-" in page.locator("#tuned").inner_text()
    assert page.locator("#trials tbody tr").count() == len(study)
    assert " ms" in page.locator("#trials").inner_text()
    shot(page, "study")


def test_sorting_and_filtering_the_trials_table(page, site):
    page.goto(f"{site['url']}/ui/studies/{site['first']}")
    page.wait_for_selector("#trials tbody tr")
    page.locator("#trials th[data-key=median]").click()
    page.wait_for_selector("#trials th.sorted-asc[data-key=median]")

    def medians():
        cells = page.locator("#trials tbody tr td:nth-child(4)").all_inner_texts()
        return [float(c.split()[0]) for c in cells if c != "–"]

    ascending = medians()
    assert ascending == sorted(ascending) and len(ascending) >= 5
    page.locator("#trials th[data-key=median]").click()
    page.wait_for_selector("#trials th.sorted-desc[data-key=median]")
    assert medians() == sorted(ascending, reverse=True)
    page.locator("#trials-filter").fill("baseline")
    page.wait_for_function("document.querySelectorAll('#trials tbody tr').length === 1")


def test_overview_updates_without_reload(page, site):
    page.evaluate("window.__marker = 'same page'")
    second = site["second"]
    row = page.locator("#studies tbody tr").filter(
        has=page.get_by_role("link", name=f"#{second}", exact=True))
    before = row.locator(".progress").inner_text()
    site["seed"].run_trial()  # the second study progresses
    done_before = before.split()[0]
    page.wait_for_function(
        """([study, done]) => [...document.querySelectorAll('#studies tbody tr')].some(r =>
             r.querySelector('a')?.innerText === '#' + study
             && r.querySelector('.progress').innerText.split(' ')[0] !== done)""",
        arg=[second, done_before], timeout=15000)
    assert page.evaluate("window.__marker") == "same page"


def test_workers_configs_and_model_pages(page, site):
    page.goto(f"{site['url']}/ui/workers")
    page.wait_for_selector("#workers tbody tr")
    assert "seed-worker" in page.locator("#workers").inner_text()
    assert "s ago" in page.locator("#workers").inner_text()
    shot(page, "workers")

    page.goto(f"{site['url']}/ui/configs?platform=cpu")
    page.wait_for_selector("#configs tbody tr")
    assert page.locator("#configs tbody tr").count() == 1
    with page.expect_download() as download:
        page.locator("#download").click()
    assert '"format": "cmtune.bundle"' in Path(download.value.path()).read_text()
    shot(page, "configs")

    page.goto(f"{site['url']}/ui/submissions/{site['submission']}")
    page.wait_for_selector("#roles tbody tr")
    assert page.locator("#roles tbody tr").count() == 9
    assert "mlp_up" in page.locator("#roles").inner_text()
    assert "when every study is done" in page.locator("#saved-per-step").inner_text()
    shot(page, "model")


def test_laptop_width_and_no_external_assets(browser, site):
    context = browser.new_context(viewport={"width": 1280, "height": 720})
    page = context.new_page()
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(f"{site['url']}/ui/studies/{site['first']}?token={site['tokens']['reader']}")
    page.wait_for_selector("#trial-plot")
    assert all(url.startswith(site["url"]) or url.startswith("blob:") for url in requests), requests
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280 + 1
    context.close()


def test_without_a_token_the_page_asks_for_one(browser, site):
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{site['url']}/ui")
    page.wait_for_selector("#token-form")
    page.fill("#token-form input", site["tokens"]["reader"])
    page.click("#token-form button")
    page.wait_for_selector("#studies tbody tr")
    context.close()


@pytest.fixture(scope="module")
def measured_site(tmp_path_factory):
    """A model whose studies and step study all ran (synthetic results), and whose mlp_up was set back."""
    with submitted_tiny(tmp_path_factory.mktemp("ui-step"), budget={"trials": 2}, confirm_top=1) as (
            server, tokens, seed, created):
        while (grant := seed.worker.post(f"/v1/workers/{seed.worker}/lease").json())["trial"]["kind"] != "step":
            contract.report(seed.worker, grant)
        seconds = contract.STEP_SECONDS | {"tuned-minus-mlp_up": 0.7}
        fresh = {"as-written": 1.0, "baseline": 0.95, "tuned-minus-mlp_up": 0.75}
        step = contract.step_result(grant["trial"], seconds, confirmation=fresh)
        seed.worker.post(f"/v1/trials/{grant['trial']['id']}/result",
                         json={"lease_id": grant["lease"]["id"], "step": step})
        yield {"url": server.url, "tokens": tokens, "submission": created["submission_id"]}


def test_the_model_page_shows_the_step_measured_against_the_estimate(browser, measured_site):
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    page.goto(f"{measured_site['url']}/ui/submissions/{measured_site['submission']}?token="
              f"{measured_site['tokens']['reader']}")
    page.wait_for_selector("#variants tbody tr")
    assert page.locator("#step-vs-reference").inner_text().startswith("1.33×")  # 1.0 / 0.75: the fresh rounds
    assert "tuned-minus-mlp_up (runs)" in page.locator("#confirmation").inner_text()
    assert "ms" in page.locator("#saved-measured").inner_text() and "ms" in page.locator("#saved-per-step").inner_text()
    assert "tuned-minus-mlp_up (runs)" in page.locator("#variants").inner_text()
    assert "set back to the baseline" in page.locator("#overrides").inner_text()
    shot(page, "model-measured")
    context.close()
