/* Sweeps page: for each sweep, TTFT and ITL (p50, p99) against output tokens/s, one point per configuration. */
"use strict";

(() => {
  const { chart, colors, fmt, axisStyle, pointLabelsPlugin } = bg;
  const knob = { max_num_seqs: "seqs", max_num_batched_tokens: "budget" };

  function knobLabel(c) {
    if (c.swept === "max_num_seqs") return `${knob.max_num_seqs}=${c.max_num_seqs}`;
    if (c.swept === "max_num_batched_tokens") return `${knob.max_num_batched_tokens}=${c.max_num_batched_tokens}`;
    return `${c.max_num_seqs}/${c.max_num_batched_tokens}`;
  }

  function latencyChart(container, configs, p50Key, p99Key) {
    const x = configs.map((c) => c.output_tokens_per_s);
    const pts = (color) => ({ show: true, size: 7, stroke: color, fill: color });
    chart(container, {
      scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
      series: [{ label: "output tok/s", value: (u, v) => fmt.rate(v) },
        { label: "p50", stroke: colors.blue, width: 1.5, points: pts(colors.blue), value: (u, v) => fmt.duration(v) },
        { label: "p99", stroke: colors.red, width: 1.5, points: pts(colors.red), value: (u, v) => fmt.duration(v) }],
      axes: [{ ...axisStyle, label: "output tokens / s", labelSize: 18, values: (u, v) => v.map(fmt.compact) },
        { ...axisStyle, size: 60, values: (u, v) => v.map(fmt.axisDuration) }],
      plugins: [pointLabelsPlugin(2, configs.map(knobLabel), "#687185")],
    }, [x, configs.map((c) => c[p50Key]), configs.map((c) => c[p99Key])], "no configurations");
  }

  for (const section of document.querySelectorAll(".sweep")) {
    const configs = JSON.parse(section.querySelector(".sweep-data").textContent)
      .sort((a, b) => a.output_tokens_per_s - b.output_tokens_per_s);
    latencyChart(section.querySelector(".sweep-ttft"), configs, "ttft_p50_s", "ttft_p99_s");
    latencyChart(section.querySelector(".sweep-itl"), configs, "itl_p50_s", "itl_p99_s");
  }
})();
