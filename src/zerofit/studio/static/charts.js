// zerofit studio's charts: small inline SVG line charts, written for the studio (no chart library).
"use strict";

const CHART_COLOURS = ["#4f8cff", "#e8743b", "#19a979", "#945ecf", "#ed4a7b", "#13a4b4"];

function svgEl(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function fmtNum(v) {
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a >= 1000) return v.toFixed(0);
  if (a >= 0.01) return v.toPrecision(3);
  return v.toExponential(1);
}

// series: [{name, points: [[x, y], ...]}]; options.limit: a horizontal line (a card's memory), labelled.
function lineChart(container, series, options = {}) {
  const w = 330, h = 170, left = 46, right = 8, top = 8, bottom = 22;
  const svg = svgEl("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  const pts = series.flatMap((s) => s.points);
  container.replaceChildren(svg);
  if (!pts.length) {
    const t = svgEl("text", { x: w / 2, y: h / 2, "text-anchor": "middle", fill: "#8a93a6", "font-size": 12 });
    t.textContent = "waiting for the first logged step";
    svg.appendChild(t);
    return;
  }
  let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  let ys = pts.map((p) => p[1]);
  if (options.limit != null) ys = ys.concat([options.limit]);
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 = y0 + Math.abs(y0 || 1) * 0.1; y0 = y0 - Math.abs(y0 || 1) * 0.1; }
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (w - left - right);
  const sy = (y) => top + (1 - (y - y0) / (y1 - y0)) * (h - top - bottom);
  svg.appendChild(svgEl("rect", { x: left, y: top, width: w - left - right, height: h - top - bottom, fill: "#fbfcfd", stroke: "#dde1e8" }));
  const labels = [[left - 4, sy(y1) + 4, fmtNum(y1), "end"], [left - 4, sy(y0), fmtNum(y0), "end"],
    [left, h - 6, `step ${fmtNum(x0)}`, "start"], [w - right, h - 6, `${fmtNum(x1)}`, "end"]];
  for (const [x, y, text, anchor] of labels) {
    const t = svgEl("text", { x, y, "text-anchor": anchor, fill: "#5a6478", "font-size": 10 });
    t.textContent = text;
    svg.appendChild(t);
  }
  if (options.limit != null) {
    svg.appendChild(svgEl("line", { x1: left, x2: w - right, y1: sy(options.limit), y2: sy(options.limit), stroke: "#b3261e", "stroke-dasharray": "4 3" }));
  }
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.appendChild(svgEl("path", { d, fill: "none", stroke: CHART_COLOURS[i % CHART_COLOURS.length], "stroke-width": 1.6 }));
    if (series.length > 1) {
      const t = svgEl("text", { x: w - right - 4, y: top + 12 + 12 * i, "text-anchor": "end", fill: CHART_COLOURS[i % CHART_COLOURS.length], "font-size": 10 });
      t.textContent = s.name;
      svg.appendChild(t);
    }
  });
}
