"""The dashboard in headless Chromium (Playwright) against a real uvicorn server seeded through the API.

Needs a Chromium binary: CMTUNE_CHROMIUM (CI installs Debian's chromium and sets it) or
/usr/bin/chromium.  Screenshots of every page go to test-artifacts/dashboard/.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from cmtune.launcher import running_server
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

    def run_trial(self, bounds_s: tuple[float, float, float] | None = None) -> dict | None:
        return contract.run_trial(self.worker, bounds_s=bounds_s)


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


BOUNDS = (0.5e-3, 0.3e-3, 1e-3)  # compute, communication, baseline: the bound is half the baseline


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    with submitted_tiny(tmp_path_factory.mktemp("ui"), budget={"trials": 5}) as (server, tokens, seed, created):
        first = created["studies"][0]["id"]
        # finish the first study completely (its confirmation with bounds), and two trials of the second
        while (grant := seed.run_trial(BOUNDS)) is not None and grant["trial"]["study_id"] == first:
            pass
        seed.run_trial()
        yield {"url": server.url, "tokens": tokens, "seed": seed, "first": first,
               "second": created["studies"][1]["id"], "submission": created["submission_id"]}


@pytest.fixture(scope="module")
def chromium():
    """Playwright's Chromium type (one Playwright per thread: a test that needs its own browser starts it here)."""
    with playwright_api.sync_playwright() as p:
        yield p.chromium


@pytest.fixture(scope="module")
def browser(chromium):
    instance = chromium.launch(executable_path=CHROMIUM, args=FLAGS)
    yield instance
    instance.close()


def link(url: str, path: str, token: str) -> str:
    """A sign-in link as `cmtune demo` prints it: the token in the fragment, which no request carries."""
    return f"{url}{path}#token={token}"


@pytest.fixture
def page(browser, site):
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    page.goto(link(site["url"], "/ui", site["tokens"]["reader"]))
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
    assert "token" not in page.url  # the token went to local storage, not the address bar
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


def bar_widths(figure) -> dict[str, float]:
    return {name: float(figure.locator(f"rect.bar-{name}").get_attribute("width"))
            for name in ("compute", "communication", "bound", "baseline", "tuned")}


def test_a_tuned_config_is_drawn_against_its_bounds(page, site):
    page.goto(f"{site['url']}/ui/studies/{site['first']}")
    page.wait_for_selector("#bounds figure.bounds rect.bar-tuned")
    tuned = site["seed"].admin.get(f"/v1/studies/{site['first']}").json()["tuned"]
    figure = page.locator("#bounds figure.bounds")
    widths = bar_widths(figure)
    # one time scale: communication 0.3 ms < compute = bound 0.5 ms < tuned (0.7-0.8 ms) < baseline 1 ms
    assert widths["communication"] < widths["compute"] == widths["bound"] < widths["tuned"] < widths["baseline"]
    assert widths["compute"] / widths["baseline"] == pytest.approx(tuned["compute_s"] / tuned["baseline_s"], rel=1e-3)
    text = figure.inner_text()
    assert f"hidden: {tuned['hidden_fraction']:.0%}" in text and tuned["reason"] in text
    assert "0.500 ms" in text and "0.300 ms" in text  # the numbers beside the bars
    shot(page, "study-bounds")

    page.goto(f"{site['url']}/ui/configs")
    page.wait_for_selector("#bounds-pictures figure.bounds rect.bar-tuned")
    assert page.locator("#bounds-pictures figure.bounds").count() == 1
    assert bar_widths(page.locator("#bounds-pictures figure.bounds")) == widths
    assert "hidden" in page.locator("#configs thead").inner_text()
    assert f"{tuned['hidden_fraction']:.0%}" in page.locator("#configs tbody").inner_text()
    # the winner's compiled program: its schedule's verdict and memory per device (the ring's, as measured)
    assert "overlap" in page.locator("#configs thead").inner_text()
    row = page.locator("#configs tbody").inner_text()
    assert tuned["overlap"] == "synchronous" and "synchronous" in row
    assert f"{tuned['memory_bytes'] / 2 ** 20:.1f} MiB" in row

    page.goto(f"{site['url']}/ui/submissions/{site['submission']}")
    page.wait_for_selector("#bounds-pictures figure.bounds rect.bar-tuned")
    assert page.locator("#bounds-pictures figure.bounds").count() == 1  # the one problem tuned so far
    assert bar_widths(page.locator("#bounds-pictures figure.bounds")) == widths


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
    page.goto(link(site["url"], f"/ui/studies/{site['first']}", site["tokens"]["reader"]))
    page.wait_for_selector("#trial-plot")
    assert all(url.startswith(site["url"]) or url.startswith("blob:") for url in requests), requests
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280 + 1
    context.close()


@pytest.mark.parametrize("width", [1400, 2200])
def test_the_configs_table_shows_every_configs_verdict_and_memory_at_an_ordinary_width(browser, site, width):
    """The overlap and memory columns sit in the window, not behind the table's scroll bar (the long keys wrap);
    at 2200 px every column does."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    page.goto(link(site["url"], "/ui/configs", site["tokens"]["reader"]))
    page.wait_for_selector("#configs tbody tr")
    for key in ("decomposition", "speedup", "overlap", "memory"):
        box = page.locator(f'#configs th[data-key="{key}"]').bounding_box()
        assert box and box["x"] + box["width"] <= width, (key, box)
    fits = page.evaluate("(() => { const t = document.querySelector('#configs'); "
                         "return t.parentElement.scrollWidth <= t.parentElement.clientWidth + 1; })()")
    assert fits or width < 2200
    shot(page, f"configs-{width}")
    context.close()


def test_an_fsdp_problem_is_studied_and_listed_under_its_own_key(browser, tmp_path):
    """A weight-gathered problem (FSDP's) submitted alone and tuned: its study page names it by its own key, with
    its plots and tuned ring, and its config is listed under that key on the configs page."""
    url = f"sqlite:///{tmp_path / 'ui.sqlite'}"
    tokens = contract.create_tokens(url)
    problem = contract.PROBLEM | {"collective": "weight_allgather_matmul_k"}
    with running_server(database_url=url) as server:
        seed = Seeder(server.url, tokens["admin"], tokens["worker"])
        created = seed.admin.post("/v1/studies", json={"problem": problem, "hardware": HARDWARE,
                                                      "budget": {"trials": 4}, "warm_start": False})
        assert created.status_code == 201, created.text
        (study,) = created.json()["studies"]
        key = study["problem_key"]
        assert key.startswith("weight_allgather_matmul_k:")
        while seed.run_trial(BOUNDS) is not None:
            pass
        context = browser.new_context(viewport={"width": 1366, "height": 800})
        page = context.new_page()
        page.goto(link(server.url, f"/ui/studies/{study['id']}", tokens["reader"]))
        page.wait_for_selector("#trial-plot circle.trial-point")
        assert page.locator("#study-problem").inner_text() == key
        assert "ring-" in page.locator("#tuned").inner_text()
        shot(page, "study-fsdp")
        page.goto(f"{server.url}/ui/configs")
        page.wait_for_selector("#configs tbody tr")
        rows = page.locator("#configs tbody").inner_text()
        assert key in rows and "allgather_matmul:" not in rows.replace(key, "")
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


def sent(requests: list) -> list[tuple[str, dict[str, str]]]:
    """Each request's URL and every header the browser sent with it (Referer and Cookie included)."""
    return [(request.url, request.all_headers()) for request in requests]


def leaks(requests: list[tuple[str, dict[str, str]]], token: str) -> list[tuple[str, str]]:
    """Where ``token`` went other than as the bearer of an API call: (URL, "url" or the header's name)."""
    found = [(url, "url") for url, _ in requests if token in url]
    for url, headers in requests:
        bearer = urlsplit(url).path.startswith("/v1/") and headers.get("authorization") == f"Bearer {token}"
        found += [(url, name) for name, value in headers.items()
                  if token in value and not (name == "authorization" and bearer)]
    return found


def signed_in(page) -> bool:
    return page.locator("#logout").is_visible() and page.locator("#token-form").count() == 0


def test_the_printed_link_signs_in_and_no_request_carries_its_token(browser, site):
    token = site["tokens"]["reader"]
    context = browser.new_context()
    requests = []
    context.on("request", lambda request: requests.append(request))
    page = context.new_page()
    page.goto(link(site["url"], f"/ui/submissions/{site['submission']}", token))
    page.wait_for_selector("#roles tbody tr")
    page.locator("nav a[data-nav=workers]").click()  # and on to another page
    page.wait_for_selector("#workers tbody tr")
    assert signed_in(page)
    assert token not in page.url and token not in page.evaluate("location.href")
    seen = sent(requests)
    assert leaks(seen, token) == [], leaks(seen, token)
    assert [url for url, headers in seen if "referer" in headers] == []  # Referrer-Policy: no-referrer
    assert any(headers.get("authorization") == f"Bearer {token}" for _, headers in seen)  # it did read the API
    context.close()


def test_an_old_query_link_still_signs_in_once_and_goes_no_further(browser, site):
    """A ``?token=`` link (from before the fragment) is sent with its first request, as it always was, but
    the token goes on in no Referer nor any later URL, and leaves the address bar."""
    token = site["tokens"]["reader"]
    context = browser.new_context()
    requests = []
    context.on("request", lambda request: requests.append(request))
    page = context.new_page()
    page.goto(f"{site['url']}/ui/studies/{site['first']}?token={token}")
    page.wait_for_selector("#trial-plot")
    assert signed_in(page) and token not in page.url
    seen = sent(requests)
    assert leaks(seen, token) == [(f"{site['url']}/ui/studies/{site['first']}?token={token}", "url")]
    context.close()


def test_a_fragment_link_pasted_over_an_open_page_signs_in(browser, site):
    """Only the fragment differs: the browser navigates within the open page, without loading it again."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{site['url']}/ui")
    page.wait_for_selector("#token-form")
    page.goto(link(site["url"], "/ui", site["tokens"]["reader"]))
    page.wait_for_selector("#studies tbody tr")
    assert signed_in(page) and "token" not in page.url
    context.close()


def test_every_dashboard_answer_says_no_referrer(browser, site):
    context = browser.new_context()
    responses = []
    context.on("response", lambda response: responses.append(response))
    page = context.new_page()
    page.goto(link(site["url"], f"/ui/submissions/{site['submission']}", site["tokens"]["reader"]))
    page.wait_for_selector("#roles tbody tr")
    policies = {urlsplit(r.url).path: r.all_headers().get("referrer-policy") for r in responses
                if urlsplit(r.url).path.startswith("/ui")}
    assert policies == {f"/ui/submissions/{site['submission']}": "no-referrer", "/ui/static/app.js": "no-referrer",
                        "/ui/static/style.css": "no-referrer"}
    assert page.locator('meta[name="referrer"]').get_attribute("content") == "no-referrer"
    context.close()
    first = httpx.get(f"{site['url']}/ui/static/app.js")
    again = httpx.get(f"{site['url']}/ui/static/app.js", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.headers["referrer-policy"] == "no-referrer"


def test_a_persistent_profile_keeps_the_token_only_in_the_history_of_the_link_itself(chromium, site, tmp_path):
    """What a profile on disk keeps after the printed link was opened.  Chromium records the link in its
    History when the navigation commits, before the page runs a line of script: no page or server can keep
    it out (not ``history.replaceState``, ``location.replace``, a redirect or an error status).  Everything
    after it is clean: the page's own entry, the pages it went on to, and the HTTP cache (keyed by URL
    without the fragment; a ``?token=`` link left the token there)."""
    token = site["tokens"]["reader"]
    opened = link(site["url"], f"/ui/submissions/{site['submission']}", token)
    context = chromium.launch_persistent_context(tmp_path / "profile", executable_path=CHROMIUM, args=FLAGS)
    page = context.pages[0] if context.pages else context.new_page()
    page.goto(opened)
    page.wait_for_selector("#roles tbody tr")
    page.locator("nav a[data-nav=workers]").click()
    page.wait_for_selector("#workers tbody tr")
    context.close()  # the browser with it: the profile is on disk
    history = sqlite3.connect(f"file:{tmp_path / 'profile' / 'Default' / 'History'}?mode=ro", uri=True)
    try:
        urls = [url for (url,) in history.execute("SELECT url FROM urls")]
    finally:
        history.close()
    assert {f"{site['url']}/ui/submissions/{site['submission']}", f"{site['url']}/ui/workers"} <= set(urls)
    assert {url for url in urls if token in url} <= {opened}, urls
    cache = tmp_path / "profile" / "Default" / "Cache"
    assert cache.is_dir()
    assert [f.name for f in cache.rglob("*") if f.is_file() and token.encode() in f.read_bytes()] == []


@pytest.fixture(scope="module")
def measured_site(tmp_path_factory):
    """A model whose studies and step study all ran (synthetic results), and whose mlp_up was set back."""
    with submitted_tiny(tmp_path_factory.mktemp("ui-step"), budget={"trials": 2}, confirm_top=1,
                        step={"search_rounds": 1}) as (server, tokens, seed, created):  # one round of the menu
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
    page.goto(link(measured_site["url"], f"/ui/submissions/{measured_site['submission']}",
                   measured_site["tokens"]["reader"]))
    page.wait_for_selector("#variants tbody tr")
    assert page.locator("#step-vs-reference").inner_text().startswith("1.33×")  # 1.0 / 0.75: the fresh rounds
    assert "tuned-minus-mlp_up (runs)" in page.locator("#confirmation").inner_text()
    assert "ms" in page.locator("#saved-measured").inner_text() and "ms" in page.locator("#saved-per-step").inner_text()
    assert "tuned-minus-mlp_up (runs)" in page.locator("#variants").inner_text()
    assert "set back to the baseline" in page.locator("#overrides").inner_text()
    bound = page.locator("#step-bound").inner_text()  # the step against its own bound (these configs have none)
    assert bound.startswith("Against its bound (per layer): no step bound: 12 of its collective matmuls have no bounds")
    shot(page, "model-measured")
    context.close()


def test_a_seeded_study_shows_its_seeds_and_where_they_came_from(browser, measured_site):
    """A problem submitted after the model's studies finished is seeded from the nearest of them."""
    admin = httpx.Client(base_url=measured_site["url"], timeout=30,
                         headers={"Authorization": f"Bearer {measured_site['tokens']['admin']}"})
    tuned = next(s for s in admin.get("/v1/studies").json()["items"] if s["tuned"] is not None)
    problem = tuned["problem"] | {"m": tuned["problem"]["m"] * 2}
    (study,) = admin.post("/v1/studies", json={"problem": problem, "hardware": HARDWARE}).json()["studies"]
    assert study["seeds"]
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    page.goto(link(measured_site["url"], f"/ui/studies/{study['id']}", measured_site["tokens"]["reader"]))
    page.wait_for_selector("#study-seeds li")
    items = page.locator("#study-seeds li").all_inner_texts()
    assert len(items) == len(study["seeds"])
    for text, seed in zip(items, study["seeds"], strict=True):
        assert text.startswith(f"{seed['decomposition_id']}: the {seed['kind']} of {seed['neighbour']}")
        assert text.endswith(f"from study #{seed['study_id']}")
    source = page.locator("#study-seeds a").first.get_attribute("href")
    assert source == f"/ui/studies/{study['seeds'][0]['study_id']}"
    shot(page, "study-seeded")
    context.close()
    admin.close()


def test_the_step_studys_page_lists_its_search_rounds_by_their_variants(browser, tmp_path):
    """A step study that searched: each round is a trial of the study, shown with the variants it timed."""
    with submitted_tiny(tmp_path, budget={"trials": 2}, confirm_top=1, step={"search_rounds": 2}) as (
            server, tokens, seed, created):
        while seed.run_trial() is not None:
            pass
        step_id = created["studies"][-1]["id"]
        page = browser.new_page()
        page.goto(link(server.url, f"/ui/studies/{step_id}", tokens["reader"]))
        page.wait_for_selector("#trials tbody tr")
        rows = page.locator("#trials tbody tr").all_inner_texts()
        assert len(rows) == 3  # the seeds, one round of qkv, the grading
        assert "step: baseline, tuned" in rows[0] and "step: tuned, r2-qkv-" in rows[1]
        assert "step: baseline, tuned" in rows[2]
        page.close()


@pytest.fixture(scope="module")
def upgraded_site(tmp_path_factory):
    """Two problems tuned on jax 0.10.2; then a worker of jax 0.11.0 registered and re-confirmed one of them."""
    directory = tmp_path_factory.mktemp("ui-upgrade")
    url = f"sqlite:///{directory / 'ui.sqlite'}"
    tokens = contract.create_tokens(url)
    with running_server(database_url=url) as server:
        seed = Seeder(server.url, tokens["admin"], tokens["worker"])
        for m in (256, 512):
            seed.admin.post("/v1/studies", json={"problem": contract.PROBLEM | {"m": m}, "hardware": HARDWARE,
                                                 "budget": {"trials": 3}, "confirm_top": 1})
        while seed.run_trial() is not None:
            pass
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {tokens['worker']}"}, timeout=30)
        upgraded = contract.register(client, "upgraded", software={"jax": "0.11.0", "jaxlib": "0.11.0"})
        first = contract.run_trial(upgraded)["trial"]["study_id"]
        yield {"url": server.url, "tokens": tokens, "done": first}


def test_the_pages_say_what_was_reconfirmed_and_what_is_stale_on_a_new_stack(browser, upgraded_site):
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    page.goto(link(upgraded_site["url"], "/ui", upgraded_site["tokens"]["reader"]))
    page.wait_for_selector("#reconfirmations li")
    assert page.locator("#reconfirm-counts").inner_text() == "1 re-confirmed · 1 waiting"
    listed = page.locator("#reconfirmations").inner_text()
    assert "measured on jax 0.10.2, on jax 0.11.0, jaxlib 0.11.0" in listed
    assert "(re-confirmation on jax 0.11.0, jaxlib 0.11.0)" in page.locator("#studies").inner_text()
    shot(page, "reconfirmations")
    page.goto(f"{upgraded_site['url']}/ui/studies/{upgraded_site['done']}")
    page.wait_for_selector("#reconfirm")
    assert "jax 0.11.0, jaxlib 0.11.0" in page.locator("#study-software").inner_text()
    assert "measured on jax 0.10.2" in page.locator("#reconfirm").inner_text()
    assert "re-confirmed" in page.locator("#reconfirm").inner_text()
    page.goto(f"{upgraded_site['url']}/ui/configs")
    page.wait_for_selector("#configs tbody tr")
    assert page.locator("#configs tbody tr").count() == 3  # two on the old stack, one re-confirmed on the new
    rows = page.locator("#configs tbody tr").all_inner_texts()
    assert sum("stale for" not in r and "jax 0.11.0, jaxlib 0.11.0" in r.split("\t")[-1] for r in rows) == 1
    assert sum(r.split("\t")[-1] == "–" for r in rows) == 2  # the re-confirmed problem, on both stacks
    shot(page, "configs-stacks")
    page.goto(f"{upgraded_site['url']}/ui/workers")
    page.wait_for_selector("#workers tbody tr")
    assert "jax 0.11.0, jaxlib 0.11.0" in page.locator("#workers").inner_text()
    context.close()
