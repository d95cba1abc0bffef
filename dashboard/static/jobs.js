/* Jobs page: re-render the table from /api/jobs while any job is queued or running. */
"use strict";

(() => {
  const root = document.getElementById("jobs-page");
  const { el, fmt } = bg;
  const refreshS = Number(root.dataset.refreshS);
  const IDLE_REFRESH_S = 30; // with nothing live, look for new jobs now and then

  function progressBar(job) {
    const label = `${fmt.num(job.rows_done)} / ${fmt.num(job.num_requests)}`;
    return el("div", { class: "progress", title: `${label} rows` },
      el("div", { class: `progress-fill status-${job.status}`, style: `width: ${(100 * job.progress).toFixed(1)}%` }),
      el("span", { class: "progress-label" }, label));
  }

  function errorsCell(job) {
    let text = fmt.num(job.error_rows);
    if (job.shards_failed) text += ` · ${job.shards_failed} shard${job.shards_failed > 1 ? "s" : ""} failed`;
    const bad = job.error_rows || job.shards_failed;
    return el("td", { class: `num ${bad ? "bad" : ""}`, "data-field": "errors", title: job.error || "" }, text);
  }

  function row(job) {
    const link = el("a", { href: root.dataset.jobUrl.replace("JOB_ID", encodeURIComponent(job.job_id)) }, job.job_id);
    return el("tr", { "data-job-id": job.job_id },
      el("td", {}, link),
      el("td", {}, el("span", { class: `badge status-${job.status}` }, job.status)),
      el("td", { class: "ellipsis", title: job.model || "" }, job.model || "–"),
      el("td", {}, progressBar(job)),
      el("td", { class: "num", "data-field": "output_tokens_per_s" }, fmt.rate(job.output_tokens_per_s)),
      el("td", { class: "num", "data-field": "eta_s" }, job.live ? fmt.duration(job.eta_s) : "–"),
      errorsCell(job),
      el("td", { class: "num" }, `${job.shards_completed}/${fmt.num(job.num_shards)}`),
      el("td", { class: "num", "data-field": "age_s" }, fmt.duration(job.age_s)));
  }

  function render(jobs) {
    const table = document.getElementById("jobs-table");
    table.tBodies[0].replaceChildren(...jobs.map(row));
    table.hidden = jobs.length === 0;
    document.getElementById("jobs-empty").hidden = jobs.length > 0;
    const live = jobs.some((j) => j.live);
    document.getElementById("refresh-note").textContent = live ? `live: refreshing every ${refreshS} s` : "";
    return live;
  }

  async function refresh() {
    let live = true;
    try {
      live = render((await bg.getJSON(root.dataset.api)).jobs);
    } catch (error) {
      console.warn("refresh failed:", error.message); // a busy writer: try again next time
    }
    setTimeout(refresh, 1000 * (live ? refreshS : IDLE_REFRESH_S));
  }

  const anyLive = document.getElementById("refresh-note").textContent.trim() !== "";
  setTimeout(refresh, 1000 * (anyLive ? refreshS : IDLE_REFRESH_S));
})();
