// A small time-series line chart on a canvas: no library, just what the dashboard needs.
"use strict";

const Chart = (() => {
  const COLORS = ["#2f7df6", "#e8572a", "#23a26d", "#9b59b6"];

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function format(v, unit) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (unit === "%") return `${(v * 100).toFixed(1)}%`;
    const s = Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2);
    return unit ? `${s} ${unit}` : s;
  }

  // figure: the <figure> with a canvas and a legend; points: [{t, ...}]; series: [{key,
  // name}]; windowS: seconds shown, ending at the newest point; opts.unit, opts.max.
  function draw(figure, points, series, windowS, opts = {}) {
    const canvas = figure.querySelector("canvas");
    const legend = figure.querySelector(".legend");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 400;
    const h = canvas.clientHeight || 160;
    canvas.width = w * dpr;
    canvas.height = h * dpr;
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.clearRect(0, 0, w, h);
    const pad = { l: 48, r: 8, t: 8, b: 18 };
    const end = points.length ? points[points.length - 1].t : Date.now() / 1000;
    const start = end - windowS;
    const shown = points.filter((p) => p.t >= start);
    let top = 0;
    for (const s of series) for (const p of shown) if (p[s.key] !== null) top = Math.max(top, p[s.key]);
    const ymax = opts.max !== undefined ? opts.max : niceMax(top);
    const x = (t) => pad.l + ((t - start) / windowS) * (w - pad.l - pad.r);
    const y = (v) => h - pad.b - (v / ymax) * (h - pad.t - pad.b);
    // Grid and labels.
    ctx.strokeStyle = "rgba(128,128,128,0.25)";
    ctx.fillStyle = "rgba(128,128,128,0.9)";
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const v = (ymax * i) / 4;
      ctx.beginPath();
      ctx.moveTo(pad.l, y(v));
      ctx.lineTo(w - pad.r, y(v));
      ctx.stroke();
      ctx.fillText(format(v, opts.unit === "%" ? "%" : ""), 2, y(v) + 4);
    }
    ctx.fillText(`-${Math.round(windowS / 60)} min`, pad.l, h - 4);
    ctx.fillText("now", w - pad.r - 22, h - 4);
    // One line per series; a null value breaks the line.
    series.forEach((s, i) => {
      ctx.strokeStyle = COLORS[i % COLORS.length];
      ctx.lineWidth = 1.8;
      ctx.beginPath();
      let pen = false;
      for (const p of shown) {
        const v = p[s.key];
        if (v === null || v === undefined) {
          pen = false;
          continue;
        }
        if (pen) ctx.lineTo(x(p.t), y(v));
        else ctx.moveTo(x(p.t), y(v));
        pen = true;
      }
      ctx.stroke();
      if (opts.dots) {  // sparse series (null between values): each value visible alone
        ctx.fillStyle = COLORS[i % COLORS.length];
        for (const p of shown) {
          if (p[s.key] !== null && p[s.key] !== undefined) ctx.fillRect(x(p.t) - 1.5, y(p[s.key]) - 1.5, 3, 3);
        }
      }
    });
    // The legend: each series' newest value; data attributes say what was drawn.
    legend.replaceChildren();
    const last = {};
    series.forEach((s, i) => {
      let v = null;
      for (let j = shown.length - 1; j >= 0; j--) {
        if (shown[j][s.key] !== null && shown[j][s.key] !== undefined) {
          v = shown[j][s.key];
          break;
        }
      }
      last[s.key] = v;
      const item = document.createElement("span");
      item.className = "legend-item";
      item.style.setProperty("--c", COLORS[i % COLORS.length]);
      item.textContent = `${s.name} ${format(v, opts.unit)}`;
      legend.append(item);
    });
    figure.dataset.points = String(shown.length);
    figure.dataset.max = String(top);
    figure.dataset.last = JSON.stringify(last);
  }

  return { draw, format };
})();
