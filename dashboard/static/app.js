/* batchgen dashboard: shared helpers for the page scripts (formatting, fetching, uPlot charts). */
"use strict";

const bg = (() => {
  const DASH = "–";
  const missing = (v) => v === null || v === undefined || Number.isNaN(v) || !Number.isFinite(Number(v));

  // Same output as dashboard/formatting.py
  const fmt = {
    num(v, digits = 0) {
      if (missing(v)) return DASH;
      return Number(v).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
    },
    rate(v) {
      if (missing(v)) return DASH;
      if (v >= 100) return fmt.num(v, 0);
      if (v >= 10) return v.toFixed(1);
      return v.toFixed(2);
    },
    duration(s) {
      if (missing(s)) return DASH;
      if (s < 1) return s >= 0.001 ? `${(s * 1000).toFixed(0)} ms` : `${(s * 1e6).toFixed(0)} µs`;
      if (s < 60) return `${s.toFixed(1)} s`;
      let m = Math.floor(Math.round(s) / 60);
      const sec = Math.round(s) % 60;
      if (m < 60) return `${m}m ${String(sec).padStart(2, "0")}s`;
      const h = Math.floor(m / 60);
      m %= 60;
      return h < 48 ? `${h}h ${String(m).padStart(2, "0")}m` : `${Math.floor(h / 24)}d ${String(h % 24).padStart(2, "0")}h`;
    },
    /* Axis ticks: a duration with the fewest characters that still tells ticks apart. */
    axisDuration(s) {
      if (missing(s)) return "";
      if (s === 0) return "0";
      if (s < 1) return `${+(s * 1000).toPrecision(3)} ms`;
      return `${+s.toPrecision(3)} s`;
    },
    compact(v) {
      if (missing(v)) return "";
      const a = Math.abs(v);
      if (a >= 1e6) return `${+(v / 1e6).toPrecision(3)}M`;
      if (a >= 1e3) return `${+(v / 1e3).toPrecision(3)}k`;
      return `${+v.toPrecision(4)}`;
    },
  };

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
    return body;
  }

  /* Element builder: el("td", {class: "num"}, "12") -- text only, never HTML. */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "style") node.style.cssText = v;
      else node.setAttribute(k, v);
    }
    for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
    return node;
  }

  const colors = {
    blue: "#2f6fde", green: "#1f9d55", orange: "#e08a1e", red: "#d64545", purple: "#7b57d1",
    grey: "#8a93a6", teal: "#1a9aa0",
  };
  const alpha = (hex, a) => hex + Math.round(a * 255).toString(16).padStart(2, "0");

  const charts = new WeakMap(); // container element -> uPlot

  function chartHeight(container) {
    return container.classList.contains("small") ? 170 : 240;
  }

  /* Draw (or redraw) a uPlot chart in `container`. data[0] is x; no x values -> an empty note. */
  function chart(container, opts, data, emptyText = "no data yet") {
    const old = charts.get(container);
    const n = data[0] ? data[0].length : 0;
    container.dataset.points = String(n);
    if (n === 0) {
      if (old) { old.destroy(); charts.delete(container); }
      container.replaceChildren(el("div", { class: "chart-empty" }, emptyText));
      return null;
    }
    if (old && old.series.length === opts.series.length) {
      old.setData(data);
      return old;
    }
    if (old) old.destroy();
    container.replaceChildren();
    const width = Math.max(container.clientWidth, 200);
    const u = new uPlot({ width, height: chartHeight(container), ...opts }, data, container);
    charts.set(container, u);
    new ResizeObserver(() => {
      const w = Math.max(container.clientWidth, 200);
      if (w !== u.width) u.setSize({ width: w, height: chartHeight(container) });
    }).observe(container);
    return u;
  }

  function chartError(container, error) {
    container.dataset.points = "0";
    container.replaceChildren(el("div", { class: "chart-empty" }, `could not load: ${error.message}`));
  }

  /* Vertical marker lines (e.g. p50 / p90 / p99) drawn over a chart, labelled at the top. */
  function markersPlugin(markers) {
    return {
      hooks: {
        draw: [(u) => {
          const { ctx } = u;
          const top = u.bbox.top;
          const bottom = top + u.bbox.height;
          ctx.save();
          ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
          ctx.textAlign = "left";
          for (const m of markers) {
            if (missing(m.value)) continue;
            const x = Math.round(u.valToPos(m.value, "x", true));
            ctx.strokeStyle = m.color;
            ctx.fillStyle = m.color;
            ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
            ctx.lineWidth = devicePixelRatio;
            ctx.beginPath();
            ctx.moveTo(x, top);
            ctx.lineTo(x, bottom);
            ctx.stroke();
            const y = top + (12 + 12 * (m.row || 0)) * devicePixelRatio;
            const w = ctx.measureText(m.label).width;
            const right = u.bbox.left + u.bbox.width;
            ctx.fillText(m.label, x + 3 * devicePixelRatio + w > right ? x - w - 3 * devicePixelRatio : x + 3 * devicePixelRatio, y);
          }
          ctx.restore();
        }],
      },
    };
  }

  /* Text next to each point of one series (e.g. the swept knob's value). */
  function pointLabelsPlugin(seriesIdx, labels, color) {
    return {
      hooks: {
        draw: [(u) => {
          const { ctx } = u;
          ctx.save();
          ctx.font = `${10 * devicePixelRatio}px system-ui, sans-serif`;
          ctx.fillStyle = color;
          const xs = u.data[0];
          const ys = u.data[seriesIdx];
          for (let i = 0; i < xs.length; i++) {
            if (missing(ys[i])) continue;
            const x = u.valToPos(xs[i], "x", true);
            const y = u.valToPos(ys[i], u.series[seriesIdx].scale, true);
            ctx.fillText(labels[i], x + 5 * devicePixelRatio, y - 5 * devicePixelRatio);
          }
          ctx.restore();
        }],
      },
    };
  }

  const axisStyle = { stroke: "#687185", grid: { stroke: "#eceef2", width: 1 }, ticks: { stroke: "#e1e4ea", width: 1 } };

  /* Axis size that fits its widest tick label plus its title: labels never run into the title.
     uPlot re-asks while sizes settle (a new size changes the plot's height, so its splits and labels):
     within one layout the size only grows, so it settles, and it always fits the labels drawn last. */
  function fitAxisSize(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    const before = cycleNum > 1 ? axis._size || 0 : 0;
    let widest = 0;
    if (values) {
      u.ctx.save();
      u.ctx.font = axis.font[0];
      for (const v of values) widest = Math.max(widest, u.ctx.measureText(String(v ?? "")).width);
      u.ctx.restore();
    }
    const title = axis.label ? (axis.labelSize ?? 30) : 0;
    return Math.max(before, Math.ceil(widest / devicePixelRatio + axis.ticks.size + axis.gap + title + 6));
  }

  /* Tick increments for an axis of counts: whole numbers only (never "2.5 requests"). */
  const countIncrs = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9].map((p) => m * p))
    .sort((a, b) => a - b);

  /* Local wall-clock time of epoch seconds, to the precision a tick increment needs. */
  function clockLabel(ts, incr) {
    const d = new Date(ts * 1000);
    const two = (n) => String(n).padStart(2, "0");
    const hm = `${two(d.getHours())}:${two(d.getMinutes())}`;
    if (incr >= 60) return hm;
    const hms = `${hm}:${two(d.getSeconds())}`;
    if (incr >= 1) return hms;
    const digits = incr >= 0.1 ? 1 : incr >= 0.01 ? 2 : 3;
    return `${hms}.${String(d.getMilliseconds()).padStart(3, "0").slice(0, digits)}`;
  }

  /* A time x axis with one-line labels, spaced so the widest label for the increment fits. */
  const timeAxis = {
    ...axisStyle,
    space: 84, // px between ticks at least: "00:00:00.00" at 12px is ~70px
    values: (u, splits, axisIdx, space, incr) => splits.map((v) => clockLabel(v, incr)),
  };

  /* The last value of a series that is not null (what its legend shows when the cursor is away). */
  function lastValue(values) {
    for (let i = (values || []).length - 1; i >= 0; i--) if (!missing(values[i])) return values[i];
    return null;
  }

  /* A legend formatter that shows the series' latest value while the cursor is not on the chart. */
  const latest = (format) => (u, v, sidx, idx) => format(idx === null || idx === undefined ? lastValue(u.data[sidx]) : v);

  /* The x series of a time chart: its legend reads "latest" (and when) away from the cursor. */
  const timeSeries = {
    label: "time",
    value: (u, v, sidx, idx) => {
      if (idx === null || idx === undefined) {
        const t = lastValue(u.data[0]);
        return t === null ? DASH : `latest (${clockLabel(t, 1)})`;
      }
      return missing(v) ? DASH : new Date(v * 1000).toLocaleString();
    },
  };

  /* Charts that share one time axis: the same range at first, hover in step, a drag-zoom on one
     zooms all, double-click resets them all. Add `group.opts` to each chart's options and call
     `group.fit()` after (re)loading their data (new data resets a chart's range to its own). */
  function timeGroup(key) {
    const members = new Set();
    let zoom = null; // [min, max] a user zoomed to, or null for the whole extent

    function extent() {
      let lo = Infinity, hi = -Infinity;
      for (const u of members) {
        const xs = u.data[0];
        if (xs && xs.length) { lo = Math.min(lo, xs[0]); hi = Math.max(hi, xs[xs.length - 1]); }
      }
      return lo <= hi ? [lo, hi > lo ? hi : lo + 1] : null;
    }

    function fit() {
      const range = zoom || extent();
      if (!range) return;
      for (const u of members) {
        u.setScale("x", { min: range[0], max: range[1] });
        if (u.cursor.idx === null || u.cursor.idx === undefined) u.setLegend({ idx: null }); // new data: new latest
      }
    }

    const opts = {
      cursor: {
        sync: { key, setSeries: false },
        drag: { x: true, y: false, setScale: false }, // the selection hook zooms every member
        bind: { dblclick: () => () => { zoom = null; fit(); return null; } },
      },
      hooks: {
        ready: [(u) => { members.add(u); fit(); }],
        destroy: [(u) => members.delete(u)],
        setSelect: [(u) => {
          if (u.select.width < 2) return;
          zoom = [u.posToVal(u.select.left, "x"), u.posToVal(u.select.left + u.select.width, "x")];
          u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
          fit();
        }],
      },
    };
    return { opts, fit };
  }

  /* The uPlot instance drawn in a container (the browser tests read axes and legends through it). */
  const chartOf = (container) => charts.get(container) || null;

  return {
    fmt, getJSON, el, colors, alpha, chart, chartError, chartOf, markersPlugin, pointLabelsPlugin, axisStyle,
    missing, fitAxisSize, countIncrs, timeAxis, timeSeries, timeGroup, latest, lastValue,
  };
})();
