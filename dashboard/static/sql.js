/* SQL page: run the query through POST /api/sql and show the rows; the form itself downloads CSV. */
"use strict";

(() => {
  const root = document.getElementById("sql-page");
  const { el, fmt } = bg;
  const text = document.getElementById("sql-text");
  const status = document.getElementById("sql-status");
  const errorBox = document.getElementById("sql-error");
  const table = document.getElementById("sql-result");

  function cell(v) {
    if (v === null || v === undefined) return el("td", { class: "muted" }, "NULL");
    if (typeof v === "number") return el("td", { class: "num" }, Number.isInteger(v) ? String(v) : String(+v.toPrecision(8)));
    return el("td", {}, typeof v === "object" ? JSON.stringify(v) : v);
  }

  function show(result) {
    table.tHead.replaceChildren(el("tr", {}, ...result.columns.map((c) => el("th", {}, c))));
    table.tBodies[0].replaceChildren(...result.rows.map((r) => el("tr", {}, ...r.map(cell))));
    table.hidden = false;
    const cut = result.truncated ? ` (cut at the ${fmt.num(result.row_cap)}-row cap)` : "";
    status.textContent = `${fmt.num(result.rows.length)} rows${cut} in ${fmt.duration(result.elapsed_s)}`;
  }

  async function run() {
    errorBox.hidden = true;
    status.textContent = "running…";
    const response = await fetch(root.dataset.api, {
      method: "POST", headers: { "Content-Type": "application/json" }, credentials: "same-origin",
      body: JSON.stringify({ sql: text.value }),
    });
    const body = await response.json().catch(() => ({ error: `${response.status} ${response.statusText}` }));
    if (!response.ok) {
      errorBox.textContent = body.error;
      errorBox.hidden = false;
      table.hidden = true;
      status.textContent = "";
      return;
    }
    show(body);
  }

  document.getElementById("sql-run").addEventListener("click", run);
  text.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); run(); }
  });
  for (const a of document.querySelectorAll("a.example")) {
    a.addEventListener("click", (e) => { e.preventDefault(); text.value = a.dataset.sql; run(); });
  }
})();
