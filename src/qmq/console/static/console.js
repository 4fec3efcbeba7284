// qmq console: draws the charts of a page with uPlot (vendored) from the JSON each chart's
// element carries: {"t": [epoch s...], "labels": [...], "series": [[value...]...]}.
(function () {
  "use strict";
  var COLOURS = ["#2f5fd0", "#c4271d", "#1a7f37", "#9a6700", "#8250df", "#0a7ea4", "#bf3989", "#57606a"];

  function draw(el) {
    if (el.dataset.drawn) return;
    var doc = JSON.parse(el.querySelector("script[type='application/json']").textContent);
    el.dataset.points = String(doc.t.length);
    if (doc.t.length === 0) return;  // the page says there are no samples yet
    var series = [{}];
    doc.labels.forEach(function (label, i) {
      series.push({ label: label, stroke: COLOURS[i % COLOURS.length], width: 1.5, spanGaps: false });
    });
    var width = Math.min(el.parentElement.clientWidth || 900, 900);
    var opts = {
      title: el.dataset.title || "",
      width: width, height: 220, series: series,
      axes: [{}, { label: el.dataset.unit || "", size: 60 }],
      scales: { x: { time: true } },
    };
    new uPlot(opts, [doc.t].concat(doc.series), el);
    el.dataset.drawn = "1";
  }

  function drawAll(root) {
    (root || document).querySelectorAll("[data-chart]").forEach(draw);
  }

  document.addEventListener("DOMContentLoaded", function () { drawAll(document); });
  document.addEventListener("htmx:afterSettle", function (e) { drawAll(e.target); });
})();
