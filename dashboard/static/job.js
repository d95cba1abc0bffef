/* Job page: charts from /api/jobs/<id>/{throughput,iterations,latency}; stats refresh while live. */
"use strict";

(() => {
  const root = document.getElementById("job-page");
  const { chart, chartError, colors, alpha, fmt, axisStyle, markersPlugin, latest } = bg;
  const $ = (id) => document.getElementById(id);

  // every quantity drawn is >= 0: start the y axis at 0 so heights compare
  const fromZero = { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.08 : 1] };
  const timeX = { x: { time: true }, y: fromZero };
  // the time charts share one x range: zoom one, all follow (bg.timeGroup)
  const timeline = bg.timeGroup("job-time");
  const xAxis = bg.timeAxis;
  const yAxis = (label, extra = {}) => ({ ...axisStyle, label, labelSize: 18, size: bg.fitAxisSize, values: (u, v) => v.map(fmt.compact), ...extra });
  // engine values hold from one iteration to the next: draw them as steps
  const steps = uPlot.paths.stepped({ align: 1 });
  const line = (label, color, extra = {}) => ({ label, stroke: color, width: 1.5, points: { show: false }, ...extra });
  const stepLine = (label, color, extra = {}) => line(label, color, { paths: steps, ...extra });
  const area = (label, color, extra = {}) => line(label, color, { fill: alpha(color, 0.18), ...extra });
  const dashed = (label, color, extra = {}) => line(label, color, { dash: [6, 4], width: 1.2, ...extra });
  // legends show each series' latest value until the cursor points at another time
  const valueFmt = (digits) => latest((v) => fmt.num(v, digits));
  // right padding: the last tick's label is centred on it and must not run off the canvas
  const timeChart = (id, opts, data, emptyText) => chart($(id), {
    ...timeline.opts, padding: [null, opts.axes.length > 2 ? null : 40, null, null], ...opts,
    series: [bg.timeSeries, ...opts.series.slice(1)],
  }, data, emptyText);

  function drawThroughput(tp) {
    const s = tp.series;
    timeChart("chart-throughput", {
      scales: timeX,
      series: [{}, area("output tok/s", colors.blue, { value: latest(fmt.rate) })],
      axes: [xAxis, yAxis("tokens / s")],
    }, [s.ts, s.output_tokens_per_s], "no tokens generated yet");
  }

  function drawConcurrency(it) {
    const s = it.series;
    timeChart("chart-concurrency", {
      scales: timeX,
      series: [{},
        stepLine("job requests outstanding", colors.orange, { width: 2, value: valueFmt(0) }),
        area("engine running seqs", colors.blue, { paths: steps, value: valueFmt(1) }),
        stepLine("engine waiting", colors.purple, { value: valueFmt(1) }),
        dashed("max_num_seqs", colors.grey, { paths: steps, value: valueFmt(0) })],
      axes: [xAxis, yAxis("sequences / requests", { incrs: bg.countIncrs })],
    }, s.ts ? [s.ts, s.outstanding_requests, s.num_running, s.num_waiting, s.max_num_seqs] : [[]],
    "no engine iterations yet");
  }

  function drawBudget(it) {
    const s = it.series;
    timeChart("chart-budget", {
      scales: timeX,
      series: [{},
        area("prefill + decode", colors.teal, { paths: steps, value: valueFmt(1) }),
        area("decode", colors.green, { paths: steps, value: valueFmt(1), fill: alpha(colors.green, 0.35) }),
        dashed("token budget", colors.red, { paths: steps, value: valueFmt(0) })],
      axes: [xAxis, yAxis("tokens / iteration")],
    }, s.ts ? [s.ts, s.scheduled_tokens, s.decode_tokens, s.token_budget] : [[]], "no engine iterations yet");
  }

  function drawKv(it) {
    const s = it.series;
    timeChart("chart-kv", {
      scales: { ...timeX, p: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.2] } },
      series: [{},
        area("KV blocks used", colors.purple, { paths: steps, value: valueFmt(0) }),
        dashed("KV blocks total", colors.grey, { paths: steps, value: valueFmt(0) }),
        { label: "preempted", stroke: colors.red, fill: alpha(colors.red, 0.6), scale: "p", width: 0,
          paths: uPlot.paths.bars({ size: [0.9, 6] }), points: { show: false }, value: valueFmt(0) }],
      axes: [xAxis, yAxis("KV blocks", { incrs: bg.countIncrs }),
        { ...axisStyle, scale: "p", side: 1, label: "preempted", labelSize: 18, size: bg.fitAxisSize, grid: { show: false },
          incrs: bg.countIncrs, values: (u, v) => v.map(fmt.compact) }],
    }, s.ts ? [s.ts, s.kv_blocks_used, s.kv_blocks_total, s.num_preempted] : [[]], "no engine iterations yet");
  }

  function drawStructured(it) {
    const s = it.series;
    const maskMs = s.mask_fill_s ? s.mask_fill_s.map((v) => v * 1000) : [];
    timeChart("chart-structured", {
      scales: { ...timeX, ms: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.2 : 1] } },
      series: [{},
        area("constrained seqs", colors.teal, { paths: steps, value: valueFmt(1) }),
        stepLine("mask fill ms / iteration", colors.orange, { scale: "ms", value: valueFmt(2) })],
      axes: [xAxis, yAxis("sequences", { incrs: bg.countIncrs }),
        { ...axisStyle, scale: "ms", side: 1, label: "mask fill ms", labelSize: 18, size: bg.fitAxisSize,
          grid: { show: false }, values: (u, v) => v.map(fmt.compact) }],
    }, s.ts ? [s.ts, s.num_constrained_seqs, maskMs] : [[]], "no engine iterations yet");
  }

  function drawHistogram(metric, d) {
    const h = d.histogram || { lo: [], count: [] };
    const centers = h.lo.map((lo) => lo + h.width / 2);
    const markers = [
      { value: d.p50, label: `p50 ${fmt.duration(d.p50)}`, color: colors.green, row: 0 },
      { value: d.p90, label: `p90 ${fmt.duration(d.p90)}`, color: colors.orange, row: 1 },
      { value: d.p99, label: `p99 ${fmt.duration(d.p99)}`, color: colors.red, row: 2 },
    ];
    const pad = (h.width || 0) * 0.6;
    chart($(`chart-${metric}`), {
      scales: { x: { time: false, range: (u, lo, hi) => [lo - pad, hi + pad] }, y: fromZero },
      series: [{ value: (u, v) => fmt.duration(v) },
        { label: "requests", stroke: colors.blue, fill: alpha(colors.blue, 0.45), width: 1,
          paths: uPlot.paths.bars({ size: [0.92, Infinity], align: 0 }), points: { show: false } }],
      axes: [{ ...axisStyle, space: 64, values: (u, v) => v.map(fmt.axisDuration) }, yAxis("requests", { incrs: bg.countIncrs })],
      plugins: [markersPlugin(markers)],
      legend: { show: false },
    }, [centers, h.count], "no finished requests yet");
  }

  function iterationsNote(it) {
    const note = $("iterations-note");
    if (!it.num_iterations) { note.textContent = ""; return; }
    const workers = it.num_workers === 1 ? "1 worker" : `${it.num_workers} workers`;
    note.textContent = it.downsampled
      ? `${fmt.num(it.num_iterations)} engine iterations on ${workers}, shown as ${fmt.duration(it.bucket_s)} buckets (each worker's mean per iteration, summed over workers).`
      : `${fmt.num(it.num_iterations)} engine iterations on ${workers}, one point each. Engine series count every job the worker served in those iterations.`;
  }

  // a large job's request figures come from a sample of its requests (jobs.store.digests): say so
  function sampleNote(id, sample, what) {
    const note = $(id);
    if (note) {
      note.textContent = sample
        ? `${what} from a 1 in ${fmt.num(2 ** sample.level)} sample of the job's ${fmt.num(sample.request_rows)} requests.`
        : "";
    }
  }

  async function load(url, draw, ids) {
    try {
      draw(await bg.getJSON(url));
    } catch (error) {
      ids.forEach((id) => chartError($(id), error));
    }
  }

  function loadCharts() {
    return Promise.all([
      load(root.dataset.apiThroughput, (tp) => {
        drawThroughput(tp);
        sampleNote("throughput-note", tp.sample, "Output tokens/s (scaled to the exact total)");
      }, ["chart-throughput"]),
      load(root.dataset.apiIterations, (it) => {
        drawConcurrency(it); drawBudget(it); drawKv(it); drawStructured(it); iterationsNote(it);
        sampleNote("concurrency-note", it.outstanding_sample, "Request concurrency estimated");
      }, ["chart-concurrency", "chart-budget", "chart-kv", "chart-structured"]),
      load(root.dataset.apiLatency, (lat) => {
        for (const metric of ["ttft_s", "itl_s", "e2e_s"]) drawHistogram(metric, lat[metric]);
        sampleNote("latency-note", lat.sample,
          "Percentiles and histograms (counts, means, minima and maxima are exact)");
      }, ["chart-ttft_s", "chart-itl_s", "chart-e2e_s"]),
    ]).then(() => timeline.fit()); // new data resets each chart's range: bring them back in line
  }

  const shown = {
    rows_done: fmt.num, num_requests: fmt.num, output_tokens: fmt.num, output_tokens_per_s: fmt.rate,
    elapsed_s: fmt.duration, eta_s: fmt.duration, error_rows: fmt.num, shards_failed: fmt.num,
  };

  function updateStats(body) {
    const job = body.job;
    for (const [name, f] of Object.entries(shown)) {
      const node = root.querySelector(`[data-stat="${name}"]`);
      if (node) { node.textContent = f(job[name]); node.dataset.value = job[name] ?? ""; }
    }
    const shards = root.querySelector('[data-stat="shards_completed"]');
    shards.textContent = `${job.shards_completed} / ${fmt.num(job.num_shards)}`;
    const badge = $("job-status").querySelector(".badge");
    badge.textContent = job.status;
    badge.className = `badge status-${job.status}`;
    const fill = root.querySelector("#job-progress .progress-fill");
    fill.style.width = `${(100 * job.progress).toFixed(1)}%`;
    fill.className = `progress-fill status-${job.status}`;
    root.querySelector("#job-progress .progress-label").textContent = `${fmt.num(job.rows_done)} / ${fmt.num(job.num_requests)}`;
    return job.live;
  }

  async function refresh() {
    let live = false;
    try {
      live = updateStats(await bg.getJSON(root.dataset.apiJob));
      await loadCharts();
    } catch (error) {
      console.warn("refresh failed:", error.message);
      live = true; // a writer may be busy: try again next time
    }
    if (live) setTimeout(refresh, 1000 * Number(root.dataset.refreshS));
    else window.location.reload(); // finished: show the final shards and outputs
  }

  loadCharts().then(() => { root.dataset.chartsReady = "1"; });
  if (root.dataset.live === "1") setTimeout(refresh, 1000 * Number(root.dataset.refreshS));
})();
