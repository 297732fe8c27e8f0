// The dashboard: polls /ui/api/stats once a second and redraws the charts.
"use strict";

const CHARTS = [
  ["chart-tps", [{ key: "output_tps", name: "output" }], { unit: "tok/s" }],
  ["chart-requests", [{ key: "running", name: "running" }, { key: "waiting", name: "waiting" }], {}],
  [
    "chart-kv",
    [
      { key: "kv_pages_used", name: "used" },
      { key: "kv_pages_cached", name: "cached" },
    ],
    {},
  ],
  ["chart-hit", [{ key: "prefix_hit_rate", name: "hit rate" }], { unit: "%", max: 1, dots: true }],
  ["chart-ttft", [{ key: "ttft_p50_ms", name: "p50" }, { key: "ttft_p99_ms", name: "p99" }], { unit: "ms" }],
  ["chart-itl", [{ key: "itl_p50_ms", name: "p50" }, { key: "itl_p99_ms", name: "p99" }], { unit: "ms" }],
  ["chart-spec", [{ key: "spec_acceptance", name: "accepted" }], { unit: "%", max: 1 }],
];

const dash = { points: [], span: 600, failures: 0, inFlight: false };

function redraw() {
  const windowS = Number(document.getElementById("window").value);
  const points = dash.points;
  const hasSpec = points.some((p) => p.spec_acceptance !== undefined && p.spec_acceptance !== null);
  document.getElementById("chart-spec").hidden = !hasSpec;
  for (const [id, series, opts] of CHARTS) {
    const figure = document.getElementById(id);
    if (!figure.hidden) Chart.draw(figure, points, series, windowS, opts);
  }
  const p = points[points.length - 1];
  if (!p) return;
  document.getElementById("tile-tps").textContent = p.output_tps.toFixed(0);
  document.getElementById("tile-requests").textContent = `${p.running} / ${p.waiting}`;
  document.getElementById("tile-kv").textContent =
    `${p.kv_pages_used} / ${p.kv_pages_cached} / ${p.kv_pages}`;
  document.getElementById("kv-pool").textContent = `(pool of ${p.kv_pages})`;
  document.getElementById("tile-hit").textContent = Chart.format(p.prefix_hit_rate_total, "%");
}

async function poll() {
  if (dash.inFlight) return; // a slow answer or an open key dialog: one poll at a time
  dash.inFlight = true;
  try {
    await pollOnce();
  } finally {
    dash.inFlight = false;
  }
}

async function pollOnce() {
  const last = dash.points.length ? dash.points[dash.points.length - 1].t : null;
  const status = document.getElementById("status");
  try {
    const resp = await Tandem.api(`/ui/api/stats${last === null ? "" : `?since=${last}`}`);
    if (!resp.ok) {
      status.textContent = `Stats unavailable: ${await Tandem.errorText(resp)}`;
      status.hidden = false;
      return;
    }
    const body = await resp.json();
    dash.span = body.span_s;
    document.getElementById("model-name").textContent =
      `${body.model} · context ${body.max_model_len}`;
    dash.points.push(...body.points);
    const cut = dash.points.length - body.span_s;
    if (cut > 0) dash.points.splice(0, cut);
    status.hidden = dash.points.length > 0;
    dash.failures = 0;
    redraw();
  } catch (e) {
    dash.failures += 1;
    status.textContent = `The server does not answer (${e.message}); retrying.`;
    status.hidden = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("window").addEventListener("change", redraw);
  window.addEventListener("resize", redraw);
  poll();
  setInterval(poll, 1000);
});
