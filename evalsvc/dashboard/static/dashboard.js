// The dashboard's charts (from the JSON the page embeds), live job progress, and the job form.
"use strict";

const FINISHED = ["done", "failed", "cancelled"];
const LOG_FLOOR = 1e-16; // zeros on a log axis are drawn here (their hover text keeps the value)
const LAYOUT = {
  margin: { l: 60, r: 20, t: 10, b: 40 },
  legend: { orientation: "h", y: -0.25 },
  hovermode: "closest",
  font: { size: 11 },
};

function pageData() {
  const el = document.getElementById("page-data");
  return el ? JSON.parse(el.textContent) : null;
}

// ---- overview trends ------------------------------------------------------------------------

function trendFigure(data, chart, metric) {
  const log = metric !== "accept_length" && data.log;
  const traces = [];
  const fails = { x: [], y: [], text: [], customdata: [] };
  const expected = { x: [], y: [], text: [], customdata: [] };
  let lowest = Infinity;
  for (const s of chart.series.filter((s) => s.metric === metric)) {
    const x = s.c.map((i) => data.commits[i][1]);
    const y = s.y.map((v) => (log && v <= 0 ? LOG_FLOOR : v));
    const text = s.c.map((i, k) => `${data.commits[i][1]} (${data.commits[i][0].slice(0, 10)}): ${s.y[k]}`);
    lowest = Math.min(lowest, ...y);
    traces.push({ type: "scatter", mode: "lines+markers", name: s.name, x, y, text,
                  customdata: s.run, hovertemplate: "%{text}<extra>%{fullData.name}</extra>",
                  marker: { size: 5 } });
    for (const [marks, ks, word] of [[fails, s.fail, "fail"], [expected, s.expected, "expected"]]) {
      for (const k of ks) {
        marks.x.push(x[k]);
        marks.y.push(y[k]);
        marks.text.push(`${text[k]} (${word})`);
        marks.customdata.push(s.run[k]);
      }
    }
  }
  if (fails.x.length) {
    traces.push({ type: "scatter", mode: "markers", name: "fail", ...fails,
                  hovertemplate: "%{text}<extra>%{fullData.name}</extra>",
                  marker: { symbol: "x", size: 11, color: "#c62828", line: { width: 1 } } });
  }
  if (expected.x.length) { // a known failure: failing as triaged, not a new regression
    traces.push({ type: "scatter", mode: "markers", name: "expected (known failure)", ...expected,
                  hovertemplate: "%{text}<extra>%{fullData.name}</extra>",
                  marker: { symbol: "circle-open", size: 11, color: "#b26a00", line: { width: 2 } } });
  }
  const layout = { ...LAYOUT, yaxis: { type: log ? "log" : "linear", title: { text: metric },
                                       exponentformat: "e" },
                   xaxis: { type: "category", categoryorder: "array",
                            categoryarray: data.commits.map((c) => c[1]), title: { text: "commit" } },
                   shapes: [] };
  const threshold = metric === data.metric ? chart.threshold : null;
  if (log && threshold) {
    // the band starts a little below the lowest point (shapes count in the axis autorange)
    const bottom = Math.min(lowest, threshold) / 3;
    layout.shapes.push(
      { type: "rect", xref: "paper", x0: 0, x1: 1, yref: "y", y0: bottom, y1: threshold,
        fillcolor: "rgba(31, 138, 76, 0.12)", line: { width: 0 }, layer: "below" },
      { type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: threshold, y1: threshold,
        line: { color: "#1f8a4c", dash: "dash", width: 1 } });
  }
  return { traces, layout };
}

function drawTrend(el, data) {
  const chart = data.charts[Number(el.dataset.chart)];
  const { traces, layout } = trendFigure(data, chart, el.dataset.metric);
  Plotly.newPlot(el, traces, layout, { displaylogo: false, responsive: true });
  el.on("plotly_click", (ev) => {
    const run = ev.points[0].customdata;
    if (run) window.location.href = data.runs_url + run;
  });
}

function drawTrends(data) {
  const charts = document.querySelectorAll(".chart[data-chart]");
  // many configs: draw each chart when it scrolls into view
  const observer = new IntersectionObserver((entries) => {
    for (const e of entries) {
      if (e.isIntersecting) {
        observer.unobserve(e.target);
        drawTrend(e.target, data);
      }
    }
  }, { rootMargin: "300px" });
  charts.forEach((el) => observer.observe(el));
}

// ---- a sample's per-token KL ------------------------------------------------------------------

const onLog = (values) => values.map((v) => (v === null || v <= 0 ? LOG_FLOOR : v));

function drawTokenChart(el, data) {
  const x = data.k3.map((_, i) => i);
  const colours = x.map((i) => (i === data.first ? "#c62828" : i === data.position ? "#2f5fb3" : "#8a94a6"));
  const traces = [{ type: "bar", name: "generated", x, y: onLog(data.k3), marker: { color: colours },
                    customdata: data.k3,
                    hovertemplate: "generated token %{x}: k3 %{customdata:.3g}<extra></extra>" }];
  const layout = { ...LAYOUT, yaxis: { type: "log", title: { text: "k3 (nats)" }, exponentformat: "e" },
                   xaxis: { title: { text: "generated token position" } }, showlegend: false };
  const extend = data.extend_k3 || [];
  if (extend.length) {
    // the extend (prefilled on the cached prefix) beside the generated tokens, on one k3 scale
    const split = Math.min(0.5, Math.max(0.2, extend.length / (extend.length + x.length)));
    traces.unshift({ type: "bar", name: "extend", x: extend.map((_, i) => i), y: onLog(extend),
                     xaxis: "x2", marker: { color: "#b26a00" }, customdata: extend,
                     hovertemplate: "extend token %{x}: k3 %{customdata:.3g}<extra></extra>" });
    layout.xaxis2 = { domain: [0, split - 0.03], anchor: "y",
                      title: { text: "extend position (after the cached prefix)" } };
    layout.xaxis.domain = [split + 0.03, 1];
    layout.yaxis.anchor = "x2";
  }
  Plotly.newPlot(el, traces, layout, { displaylogo: false, responsive: true });
  el.on("plotly_click", (ev) => {
    const point = ev.points[0];
    if (point.data.name === "extend") {
      window.location.hash = `extend-${point.x}`;
      return;
    }
    const url = new URL(window.location.href);
    url.searchParams.set("position", point.x);
    window.location.href = url.toString();
  });
}

// ---- live job progress -----------------------------------------------------------------------

function showProgress(el, job) {
  const counts = Object.values(job.progress);
  const total = counts.reduce((a, b) => a + b, 0);
  const finished = (job.progress.done || 0) + (job.progress.cancelled || 0);
  const bar = el.querySelector("progress");
  bar.max = Math.max(total, 1);
  bar.value = finished;
  el.querySelector(".progress-text").textContent = `${finished} / ${total} runs`;
  const badge = el.querySelector(".status .badge");
  badge.textContent = job.status;
  badge.className = `badge v-${job.status}`;
}

async function follow(el) {
  try {
    const resp = await fetch(`/api/v1/jobs/${encodeURIComponent(el.dataset.pollJob)}`);
    if (!resp.ok) {
      el.querySelector(".progress-text").textContent = `progress unavailable (HTTP ${resp.status})`;
      return;
    }
    const job = await resp.json();
    showProgress(el, job);
    if (FINISHED.includes(job.status)) {
      window.location.reload(); // the finished job's verdicts render server-side
      return;
    }
  } catch (err) {
    el.querySelector(".progress-text").textContent = "connection lost, retrying";
  }
  setTimeout(() => follow(el), 2000);
}

// ---- the job form: choosing another matrix shows its configs ------------------------------------

function reloadWith(select) {
  const form = select.form;
  const url = new URL(form.dataset.newJob, window.location.href);
  for (const [name, value] of new FormData(form)) {
    if (name !== "csrf_token" && name !== "configs" && value !== "") url.searchParams.append(name, value);
  }
  window.location.href = url.toString();
}

// ---- start ------------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  const data = pageData();
  const tokenChart = document.getElementById("token-chart");
  if (tokenChart) drawTokenChart(tokenChart, data);
  else if (data) drawTrends(data);
  document.querySelectorAll("[data-poll-job]").forEach((el) => setTimeout(() => follow(el), 2000));
  document.querySelectorAll("select[data-reload-with]").forEach((el) =>
    el.addEventListener("change", () => reloadWith(el)));
});
