"""The dashboard in a real browser: Debian's chromium driven by playwright, the app served on 127.0.0.1.

Each page must draw its charts (a canvas with painted pixels and points behind it) with no console
error. Screenshots go to the test's tmp dir. Skipped when /usr/bin/chromium is missing, unless CI is
set (then that is a failure).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from dashboard import create_app
from dashboard.formatting import fmt_rate
from jobs.store.parts import Store
from jobs.store.schemas import JobRecord, ShardEvent
from tests.dashboard import synthetic
from tests.dashboard.conftest import JOB_ID

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
TIME_CHARTS = ["chart-throughput", "chart-concurrency", "chart-budget", "chart-kv", "chart-structured"]
JOB_CHARTS = [*TIME_CHARTS, "chart-ttft_s", "chart-itl_s", "chart-e2e_s"]

# For each chart container: [id, points drawn, painted pixels of its canvas]
CHART_STATE_JS = """(ids) => ids.map((id) => {
    const box = document.getElementById(id);
    const canvas = box && box.querySelector("canvas");
    if (!canvas) return [id, 0, 0];
    const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let painted = 0;
    for (let i = 3; i < data.length; i += 4) if (data[i] !== 0) painted++;
    return [id, Number(box.dataset.points), painted];
})"""


# Every drawn axis tick label as a box in the canvas (CSS px): overlapping boxes, boxes running off
# the canvas, and y labels running into their axis title are returned as problems.
AXIS_LABEL_PROBLEMS_JS = """(ids) => {
    const problems = [];
    const ctx = document.createElement("canvas").getContext("2d");
    for (const id of ids) {
        const u = bg.chartOf(document.getElementById(id));
        if (!u) { problems.push(`${id}: no chart`); continue; }
        const px = devicePixelRatio;
        u.axes.forEach((axis, i) => {
            if (!axis.show || !axis._values) return;
            ctx.font = axis.font[0];
            const horizontal = axis.side % 2 === 0;
            const boxes = axis._splits.map((v, k) => {
                const text = String(axis._values[k] ?? "");
                if (!text) return null;
                const w = ctx.measureText(text).width / px, h = axis.font[1] / px;
                const at = u.valToPos(v, axis.scale) + (horizontal ? u.bbox.left : u.bbox.top) / px;
                return { text, lo: at - (horizontal ? w : h) / 2, hi: at + (horizontal ? w : h) / 2, w };
            }).filter((b) => b && b.hi >= 0 && b.lo <= (horizontal ? u.width : u.height));
            const limit = horizontal ? u.width : u.height;
            const room = axis._size - axis.ticks.size - axis.gap - (axis.label ? axis.labelSize : 0);
            const say = (text) => problems.push(`${id} axis ${i}: ${text}`);
            boxes.sort((a, b) => a.lo - b.lo).forEach((b, k) => {
                if (k > 0 && b.lo < boxes[k - 1].hi + 1) say(`"${boxes[k - 1].text}" overlaps "${b.text}"`);
                if (b.lo < 0 || b.hi > limit) say(`"${b.text}" runs off the canvas`);
                if (!horizontal && b.w > room) say(`"${b.text}" runs into the axis title`);
            });
        });
    }
    return problems;
}"""

# The time charts' x ranges [min, max]
X_RANGES_JS = "(ids) => ids.map((id) => { const u = bg.chartOf(document.getElementById(id)); " \
              "return [u.scales.x.min, u.scales.x.max]; })"

# Each time chart's legend: [series label, shown value] pairs
LEGENDS_JS = """(ids) => ids.map((id) => [...document.querySelectorAll(`#${id} .u-legend .u-series`)]
    .map((row) => [row.querySelector('.u-label').textContent, row.querySelector('.u-value').textContent]))"""


def require_chromium() -> None:
    if CHROMIUM.exists():
        return
    if os.environ.get("CI"):
        pytest.fail(f"{CHROMIUM} is missing and CI is set: install it (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` to run the browser tests")


@contextmanager
def serve(app) -> Iterator[str]:
    """The app on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.fixture(scope="module")
def browser():
    require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS)
        yield browser
        browser.close()


class Page:
    """A browser tab that records console errors, page errors and failed requests."""

    def __init__(self, browser, width: int = 1400) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.tab = self.context.new_page()
        self.problems: list[str] = []
        self.tab.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                    if m.type == "error" else None)
        self.tab.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.tab.on("requestfailed", lambda r: self.problems.append(f"request failed: {r.url} {r.failure}"))

    def open(self, url: str) -> None:
        response = self.tab.goto(url)
        assert response is not None and response.status == 200, url

    def charts(self, ids: list[str]) -> dict[str, tuple[int, int]]:
        return {row[0]: (row[1], row[2]) for row in self.tab.evaluate(CHART_STATE_JS, ids)}

    def assert_drawn(self, ids: list[str]) -> None:
        for chart_id, (points, painted) in self.charts(ids).items():
            assert points > 0, f"{chart_id}: no points"
            assert painted > 500, f"{chart_id}: canvas is empty"

    def screenshot(self, path: Path) -> None:
        self.tab.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000


@pytest.fixture
def page(browser):
    tab = Page(browser)
    yield tab
    tab.context.close()


@pytest.fixture(params=[1400, 1000], ids=lambda w: f"{w}px")
def sized_page(request, browser):
    tab = Page(browser, request.param)
    yield tab
    tab.context.close()


def test_jobs_page_and_a_finished_job(page, job_data_dir, tmp_path):
    app = create_app({"DATA_DIR": job_data_dir})
    with serve(app) as base:
        page.open(base + "/")
        row = page.tab.locator(f'tr[data-job-id="{JOB_ID}"]')
        assert row.locator(".badge").inner_text() == "completed"
        assert row.locator(".progress-label").inner_text() == "16 / 16"
        page.screenshot(tmp_path / "jobs.png")

        row.locator("a").click()
        page.tab.wait_for_selector('main[data-charts-ready="1"]')
        assert page.tab.url == f"{base}/jobs/{JOB_ID}"
        page.assert_drawn(JOB_CHARTS)
        assert page.tab.locator("#shards-table tbody tr").count() == 2
        assert page.tab.locator("#outputs-table tbody tr").count() == 16
        page.screenshot(tmp_path / "job.png")
    assert page.problems == []


@pytest.mark.parametrize("which", ["small", "big"])
def test_job_charts_share_one_time_axis_with_labels_apart(sized_page, which, job_data_dir, big_data_dir,
                                                          tmp_path):
    """Axis labels never overlap (nor leave the canvas), the time charts span one range, a drag-zoom on one
    zooms all and a double-click resets them, and legends show the latest values until hovered."""
    data_dir, job_id = (job_data_dir, JOB_ID) if which == "small" else (big_data_dir, synthetic.JOB_ID)
    app = create_app({"DATA_DIR": data_dir})
    page = sized_page
    with serve(app) as base:
        page.open(f"{base}/jobs/{job_id}")
        page.tab.wait_for_selector('main[data-charts-ready="1"]', timeout=30_000)
        assert page.tab.evaluate(AXIS_LABEL_PROBLEMS_JS, JOB_CHARTS) == []
        full = page.tab.evaluate(X_RANGES_JS, TIME_CHARTS)
        assert all(r == full[0] for r in full), full

        legends = page.tab.evaluate(LEGENDS_JS, TIME_CHARTS)
        for legend in legends:
            assert legend[0][1].startswith("latest ("), legend
            assert all(value not in ("", "–") for _, value in legend[1:]), legend
        throughput = as_json_get(app, f"/api/jobs/{job_id}/throughput")["series"]["output_tokens_per_s"]
        assert dict(legends[0])["output tok/s"] == fmt_rate(throughput[-1])

        over = page.tab.locator("#chart-budget .u-over")
        box = over.bounding_box()
        mid = box["y"] + box["height"] / 2
        page.tab.mouse.move(box["x"] + box["width"] * 0.5, mid)
        hovered = page.tab.evaluate(LEGENDS_JS, ["chart-throughput"])[0]
        assert not hovered[0][1].startswith("latest"), "the cursor's time shows while hovering"
        page.tab.mouse.move(box["x"] + box["width"] * 0.25, mid)
        page.tab.mouse.down()
        page.tab.mouse.move(box["x"] + box["width"] * 0.6, mid, steps=5)
        page.tab.mouse.up()
        zoomed = page.tab.evaluate(X_RANGES_JS, TIME_CHARTS)
        assert all(r == zoomed[0] for r in zoomed), zoomed
        assert full[0][0] < zoomed[0][0] < zoomed[0][1] < full[0][1]
        assert page.tab.evaluate(AXIS_LABEL_PROBLEMS_JS, TIME_CHARTS) == []
        page.screenshot(tmp_path / f"zoomed-{which}.png")

        page.tab.mouse.dblclick(box["x"] + box["width"] * 0.5, mid)
        assert page.tab.evaluate(X_RANGES_JS, TIME_CHARTS) == full
        page.tab.mouse.move(0, 0)
        assert page.tab.evaluate(LEGENDS_JS, TIME_CHARTS) == legends
    assert page.problems == []


# Draw charts whose y axis is sized by bg.fitAxisSize (fractional ticks, a title), in small and normal
# containers, for maxima where the first layout's labels ("0", "2", "4", "6") are narrower than the
# final ones ("2.5", "7.5": uPlot's padding, set after the first cycle, shrinks the plot): their ids
FIT_CHARTS_JS = """([maxima, classes]) => {
    const ids = [];
    const host = document.createElement("div");
    document.body.appendChild(host);
    for (const max of maxima) for (const cls of classes) {
        const box = document.createElement("div");
        box.className = cls;
        box.id = `fit-${String(max).replace(".", "_")}-${cls.replace(" ", "-")}`;
        host.appendChild(box);
        const ys = [0, max / 3, max];
        bg.chart(box, {
            legend: { show: false },
            scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, hi * 1.08] } },
            series: [{}, { label: "requests", stroke: "#000" }],
            axes: [{ space: 64, values: (u, v) => v.map(String) },
                   { label: "requests", labelSize: 18, size: bg.fitAxisSize,
                     values: (u, v) => v.map(String) }],
        }, [[0, 1, 2], ys]);
        ids.push(box.id);
    }
    return ids;
}"""


def test_axis_sizes_fit_the_labels_drawn_last(page, job_data_dir):
    """An axis sized to its labels still fits them when resizing it changed the plot, so its ticks."""
    app = create_app({"DATA_DIR": job_data_dir})
    with serve(app) as base:
        page.open(base + "/")
        maxima = [*range(1, 17), 99, 1234.5, 0.075]
        ids = page.tab.evaluate(FIT_CHARTS_JS, [maxima, ["chart small", "chart"]])
        assert len(ids) == 38
        assert page.tab.evaluate(AXIS_LABEL_PROBLEMS_JS, ids) == []
    assert page.problems == []


def as_json_get(app, url: str) -> dict:
    response = app.test_client().get(url)
    assert response.status_code == 200, url
    return response.get_json()


def test_workers_and_sql_pages(page, job_data_dir, tmp_path):
    app = create_app({"DATA_DIR": job_data_dir})
    with serve(app) as base:
        page.open(base + "/workers")
        assert page.tab.locator("#workers-table > tbody > tr").count() == 1
        page.screenshot(tmp_path / "workers.png")

        page.open(base + "/sql")
        page.tab.fill("#sql-text", f"SELECT request_id, output_tokens FROM outputs WHERE job_id = '{JOB_ID}'")
        page.tab.click("#sql-run")
        page.tab.wait_for_selector("#sql-result:not([hidden]) tbody tr")
        assert page.tab.locator("#sql-result tbody tr").count() == 16
        assert "16 rows" in page.tab.inner_text("#sql-status")
        page.screenshot(tmp_path / "sql.png")
        assert page.problems == []

        page.tab.fill("#sql-text", "COPY outputs TO '/tmp/stolen.csv'")
        page.tab.click("#sql-run")
        page.tab.wait_for_selector("#sql-error:not([hidden])")
        assert "not COPY" in page.tab.inner_text("#sql-error")
    # the refused query's 400 is the only thing the console reports
    assert len(page.problems) == 1 and "400" in page.problems[0], page.problems


def test_big_job_and_sweeps_draw_fast(page, big_data_dir, tmp_path):
    app = create_app({"DATA_DIR": big_data_dir})
    with serve(app) as base:
        start = time.perf_counter()
        page.open(f"{base}/jobs/{synthetic.JOB_ID}")
        page.tab.wait_for_selector('main[data-charts-ready="1"]', timeout=30_000)
        elapsed = time.perf_counter() - start
        page.assert_drawn(JOB_CHARTS)
        points = page.charts(["chart-concurrency"])["chart-concurrency"][0]
        assert 100 < points <= app.config["MAX_POINTS"]  # 100k iterations, bucketed on the server
        assert elapsed < 20, f"job page with 100k iterations took {elapsed:.1f} s to draw"
        page.screenshot(tmp_path / "big-job.png")

        page.open(base + "/sweeps")
        section = page.tab.locator(f'section[data-sweep-id="{synthetic.SWEEP_ID}"]')
        assert section.locator(".sweep-ttft canvas").count() == 1
        painted = page.tab.evaluate("""() => [...document.querySelectorAll('.sweep .chart')].map((box) => {
            const c = box.querySelector('canvas');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
            return [Number(box.dataset.points), n];
        })""")
        assert len(painted) == 2 and all(points == 5 and pixels > 500 for points, pixels in painted)
        page.screenshot(tmp_path / "sweeps.png")
    assert page.problems == []


def test_live_job_refreshes_itself(page, tmp_path):
    """A running job's row and page move on their own when a shard commits."""
    store = Store(tmp_path / "data")
    store.record_job(JobRecord("live-job", "tiny-random", 8, 2, time.time()))
    store.record_shard_events([ShardEvent("live-job", s, "queued", time.time()) for s in range(2)])
    attempt = store.begin_attempt("live-job", 0, 1, "w-live", num_requests=4)
    app = create_app({"DATA_DIR": tmp_path / "data", "REFRESH_S": 1})
    with serve(app) as base:
        page.open(base + "/")
        label = page.tab.locator('tr[data-job-id="live-job"] .progress-label')
        assert label.inner_text() == "0 / 8"
        assert "refreshing" in page.tab.inner_text("#refresh-note")
        attempt.add_outputs([{"request_id": str(i), "output_text": "x", "finish_reason": "stop",
                              "prompt_tokens": 3, "output_tokens": 2, "error": None} for i in range(4)])
        attempt.commit()
        label_js = "document.querySelector('tr[data-job-id=\"live-job\"] .progress-label').textContent"
        page.tab.wait_for_function(f"() => {label_js} === '4 / 8'", timeout=10_000)
        page.screenshot(tmp_path / "live-jobs.png")
    assert page.problems == []
