// commpatch's HTML report: draws the page from the JSON block #data. No library, no network:
// SVG charts (hover for values, click a legend entry to hide a series), a canvas heatmap and
// tables that sort on a click of their header.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("data").textContent);
  const app = document.getElementById("app");
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#2357b5", "#d1495b", "#2a9d8f", "#e9a23b", "#6a4c93", "#3d8b37", "#8c564b", "#e377c2",
                  "#7f7f7f", "#17becf", "#bcbd22", "#1f3a5f"];
  const ROWS_SHOWN = 200;

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else if (k === "on") for (const [n, f] of Object.entries(v)) e.addEventListener(n, f);
      else e.setAttribute(k, v);
    }
    for (const c of kids) if (c != null) e.append(c);
    return e;
  }
  function sv(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    if (parent) parent.appendChild(e);
    return e;
  }

  // ---- formatting: the text report's rules (render/text.py _fmt) ----
  function bytes(n) {
    if (n == null) return "-";
    for (const [u, s] of [["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) if (Math.abs(n) >= s) return (n / s).toFixed(2) + " " + u;
    return Math.round(n) + " B";
  }
  function sig(v, d) { return Number(v.toPrecision(d)).toString(); }
  function fmt(v, col) {
    if (v == null) return "-";
    if (typeof v !== "number") return String(v);
    if (col === "size_bucket") return "<= " + bytes(v);
    if (col === "bytes" || col.endsWith("_bytes")) return bytes(v);
    if (col === "time_share" || col.endsWith("_share")) return (100 * v).toFixed(1) + "%";
    if (col.endsWith("_us")) return v.toLocaleString("en-US", {minimumFractionDigits: 1, maximumFractionDigits: 1});
    if (col.endsWith("_gbps")) return Math.abs(v) < 1 ? sig(v, 3) : v.toFixed(3);
    if (col.endsWith("_per_s") || col === "efficiency" || col === "speedup")
      return v.toLocaleString("en-US", {maximumFractionDigits: Math.abs(v) < 100 ? 2 : 0});
    if (!Number.isInteger(v)) return sig(v, 3);
    return String(v);
  }
  function ms(us) {
    if (us == null) return "-";
    if (us >= 1e6) return sig(us / 1e6, 3) + " s";
    return us >= 100 ? sig(us / 1e3, 3) + " ms" : sig(us, 3) + " us";
  }
  function pct(x) { return x == null ? "-" : (x > 0 && x < 0.005 ? "<1%" : Math.round(100 * x) + "%"); }

  // ---- tooltip ----
  const tip = el("div", {id: "tip"});
  document.body.appendChild(tip);
  function showTip(ev, text) {
    tip.textContent = text; tip.style.display = "block";
    const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 4);
    tip.style.left = x + "px"; tip.style.top = (ev.clientY + 14) + "px";
  }
  function hideTip() { tip.style.display = "none"; }
  function hover(node, text) {
    node.addEventListener("mousemove", (ev) => showTip(ev, typeof text === "function" ? text(ev) : text));
    node.addEventListener("mouseleave", hideTip);
  }

  // ---- scales and axes ----
  function scale(lo, hi, a, b, log) {
    if (log) { lo = Math.log10(lo); hi = Math.log10(hi); }
    if (hi === lo) { hi = lo + 1; lo = lo - (log ? 0 : 0); }
    const f = (v) => a + ((log ? Math.log10(v) : v) - lo) / (hi - lo) * (b - a);
    return f;
  }
  function ticks(lo, hi, log) {
    if (log) {
      const out = [];
      for (let p = Math.floor(Math.log10(lo)); p <= Math.ceil(Math.log10(hi)); p++) {
        const v = Math.pow(10, p);
        if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
      }
      if (out.length < 2) return [lo, hi];
      return out;
    }
    const span = hi - lo || 1, step0 = Math.pow(10, Math.floor(Math.log10(span / 5)));
    const step = [1, 2, 5, 10].map((m) => m * step0).find((s) => span / s <= 6);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
    return out;
  }
  function extent(values, log) {
    const v = values.filter((x) => x != null && isFinite(x) && (!log || x > 0));
    if (!v.length) return [log ? 1 : 0, log ? 10 : 1];
    let lo = Math.min(...v), hi = Math.max(...v);
    if (log) { if (lo === hi) { lo /= 2; hi *= 2; } return [lo / 1.3, hi * 1.3]; }
    if (lo === hi) { lo -= 1; hi += 1; }
    return [Math.min(0, lo), hi + (hi - lo) * 0.08];
  }
  function axes(g, box, xs, ys, opt) {
    const {x0, x1, y0, y1} = box;
    sv("line", {x1: x0, y1: y1, x2: x1, y2: y1, stroke: "#888"}, g);
    sv("line", {x1: x0, y1: y0, x2: x0, y2: y1, stroke: "#888"}, g);
    for (const t of opt.xticks) {
      const x = xs(t);
      sv("line", {x1: x, y1: y1, x2: x, y2: y1 + 4, stroke: "#888"}, g);
      sv("text", {x: x, y: y1 + 16, "text-anchor": "middle", "font-size": 11, fill: "#444", text: opt.xfmt(t)}, g);
    }
    for (const t of opt.yticks) {
      const y = ys(t);
      sv("line", {x1: x0, y1: y, x2: x1, y2: y, stroke: "#eee"}, g);
      sv("text", {x: x0 - 6, y: y + 4, "text-anchor": "end", "font-size": 11, fill: "#444", text: opt.yfmt(t)}, g);
    }
    sv("text", {x: (x0 + x1) / 2, y: y1 + 32, "text-anchor": "middle", "font-size": 12, fill: "#333", text: opt.xlabel}, g);
    sv("text", {x: 14, y: (y0 + y1) / 2, "text-anchor": "middle", "font-size": 12, fill: "#333", text: opt.ylabel,
                transform: `rotate(-90 14 ${(y0 + y1) / 2})`}, g);
  }
  function plotBox(name, title, caption) {
    const box = el("div", {class: "plot", "data-plot": name}, el("h3", {text: title}));
    if (caption) box.append(el("div", {class: "caption", text: caption}));
    return box;
  }
  function legend(names, toggle, colors) {
    const lg = el("div", {class: "legend"});
    names.forEach((n, i) => {
      const c = colors ? colors[i] : COLORS[i % COLORS.length];
      const s = el("span", {title: "click to hide or show"}, el("i", {style: `background:${c}`}), n);
      s.addEventListener("click", () => { s.classList.toggle("off"); toggle(i, !s.classList.contains("off")); });
      lg.append(s);
    });
    return lg;
  }

  // lines with points: series [{name, x[], y[], tip?(i)}]
  function lineChart(name, title, caption, series, opt) {
    const box = plotBox(name, title, caption);
    const W = opt.width || 900, H = opt.height || 320, m = {l: 70, r: 16, t: 10, b: 42};
    const s = sv("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title});
    const xe = opt.xrange || extent(series.flatMap((d) => d.x), opt.xlog);
    const ye = opt.yrange || extent(series.flatMap((d) => d.y), opt.ylog);
    const b = {x0: m.l, x1: W - m.r, y0: m.t, y1: H - m.b};
    const xs = scale(xe[0], xe[1], b.x0, b.x1, opt.xlog), ys = scale(ye[0], ye[1], b.y1, b.y0, opt.ylog);
    axes(s, b, xs, ys, {xticks: opt.xticks || ticks(xe[0], xe[1], opt.xlog), yticks: ticks(ye[0], ye[1], opt.ylog),
                        xfmt: opt.xfmt || ((v) => sig(v, 3)), yfmt: opt.yfmt || ((v) => sig(v, 3)),
                        xlabel: opt.xlabel, ylabel: opt.ylabel});
    const groups = series.map((d, i) => {
      const g = sv("g", {"data-series": d.name}, s), color = COLORS[i % COLORS.length];
      const pts = d.x.map((x, j) => [x, d.y[j], j]).filter((p) => p[1] != null && (!opt.ylog || p[1] > 0));
      sv("polyline", {points: pts.map((p) => `${xs(p[0])},${ys(p[1])}`).join(" "), fill: "none", stroke: color,
                      "stroke-width": 2, "stroke-dasharray": d.dash || ""}, g);
      for (const p of pts) {
        const c = sv("circle", {cx: xs(p[0]), cy: ys(p[1]), r: 4, fill: color}, g);
        hover(c, d.tip ? d.tip(p[2]) : `${d.name}\n${opt.xlabel}: ${(opt.xfmt || String)(p[0])}\n${opt.ylabel}: ${sig(p[1], 4)}`);
      }
      return g;
    });
    box.append(legend(series.map((d) => d.name), (i, on) => { groups[i].style.display = on ? "" : "none"; }), s);
    return box;
  }

  // ---- headline, findings, advice ----
  function headline() {
    const h = D.headline;
    if (!h) return null;
    const sec = el("section", {id: "headline"}, el("h2", {text: "Headline"}));
    const cards = el("div", {class: "cards"});
    const text = Object.fromEntries(D.headline_text);
    const st = h.straggler || {}, hang = h.hang || {};
    const items = [
      ["step time", h.step_us == null ? "unknown" : ms(h.step_us), "", text["step time"]],
      ["communication", h.comm_share == null ? "unknown" : `${pct(h.comm_share)} / ${pct(h.exposed_share)}`,
       "", text["communication"]],
      ["top collective", h.top_collective ? String(h.top_collective.collective ?? h.top_collective.op ?? "") : "-", "",
       text["top collective"]],
      ["straggler", st.verdict === "straggler" ? `rank ${st.rank}` : st.verdict === "none" ? "none" : "unknown",
       st.verdict === "straggler" ? "bad" : st.verdict === "none" ? "ok" : "", text["straggler"]],
      ["hang", {possible: "possible", none_seen: "no sign", unknown: "unknown"}[hang.verdict] || "unknown",
       hang.verdict === "possible" ? "bad" : hang.verdict === "none_seen" ? "ok" : "", text["hang"]],
      ["mismatches", h.mismatches == null ? "not checked" : String(h.mismatches),
       h.mismatches ? "bad" : h.mismatches === 0 ? "ok" : "", text["mismatches"]],
    ];
    for (const [label, big, cls, sentence] of items)
      cards.append(el("div", {class: "card " + cls, "data-headline": label}, el("div", {class: "label", text: label}),
                      el("div", {class: "big", text: big}), el("div", {class: "text", text: sentence || ""})));
    sec.append(cards);
    return sec;
  }
  function findings() {
    if (!D.findings.length) return null;
    const ul = el("ul", {class: "findings"});
    for (const f of D.findings)
      ul.append(el("li", {class: f.kind === "error" ? "error" : ""}, (f.kind === "error" ? "ERROR: " : "") + f.text + " ",
                   el("a", {class: "section-ref", href: "#table-" + f.section, text: `[table: ${f.section}]`})));
    return el("section", {id: "findings"}, el("h2", {text: "Findings"}), ul);
  }
  function advice() {
    if (!D.advice || !D.advice.length) return null;
    const sec = el("section", {id: "advice"}, el("h2", {text: "Advice"}));
    for (const item of D.advice) {
      if (item.rule != null && item.gain != null) {  // an analysis.advice.Advice: worded as the text report
        const box = el("div", {class: "advice"}, el("strong", {text: String(item.title) + ": "}), String(item.text ?? ""));
        if (item.change) box.append(el("p", {}, "change: ", el("code", {text: String(item.change)})));
        box.append(el("p", {}, `expected gain: ${item.gain} [rule: ${item.rule}; `,
                      el("a", {class: "section-ref", href: "#table-" + item.section, text: `table: ${item.section}`}), "]"));
        const ev = Object.entries(item.evidence || {});
        if (ev.length) {
          const rows = ev.map(([k, v]) => el("tr", {}, el("td", {text: k}), el("td", {text: v == null ? "unknown" : fmt(v, k)})));
          box.append(el("details", {}, el("summary", {text: "evidence"}), el("table", {class: "evidence"}, el("tbody", {}, ...rows))));
        }
        sec.append(box);
        continue;
      }
      const title = item.title ?? item.change ?? item.kind ?? "";
      const dl = el("dl");
      for (const [k, v] of Object.entries(item)) {
        if (k === "title" || v == null || v === "") continue;
        dl.append(el("dt", {text: k}), el("dd", {text: typeof v === "object" ? JSON.stringify(v) : String(v)}));
      }
      sec.append(el("div", {class: "advice"}, el("strong", {text: String(title)}), dl));
    }
    return sec;
  }

  // ---- plots ----
  function bandwidthPlot(series) {
    if (!series || !series.length) return null;
    const data = series.map((d) => ({name: d.name, x: d.x, y: d.y,
      tip: (j) => `${d.name}\nsize <= ${bytes(d.x[j])}\nbusbw ${sig(d.y[j], 4)} GB/s\n${d.calls[j]} calls`}));
    return lineChart("bandwidth", "Bus bandwidth vs message size", "one line per op (the function called); busbw of " +
                     "its calls per message size bucket; log axes", data,
                     {xlog: true, ylog: true, xlabel: "message size bucket (upper bound)", ylabel: "busbw (GB/s)",
                      xfmt: bytes, yfmt: (v) => sig(v, 2)});
  }
  function stepsPlot(d) {
    if (!d || !d.step || !d.step.length) return null;
    const box = plotBox("steps", "Communication per step", "per rank, mean over ranks: exposed (the training thread's " +
                        "wait), overlapped with compute, and async / device-timed calls whose overlap is unknown " +
                        "(ms, bars); communication and exposed shares of the step (%, lines, right axis)");
    const W = 900, H = 320, m = {l: 70, r: 56, t: 10, b: 42};
    const s = sv("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "communication per step"});
    const parts = [["exposed_us", "exposed", "#d1495b"], ["overlapped_us", "overlapped", "#2a9d8f"],
                   ["overlap_unknown_us", "overlap unknown", "#e9a23b"]].filter((p) => d[p[0]]);
    const n = d.step.length, totals = d.step.map((_, i) => parts.reduce((a, p) => a + (d[p[0]][i] || 0), 0) / 1e3);
    const steady = totals.filter((_, i) => d.stage && d.stage[i] === "steady");
    const top = Math.max(...(steady.length ? steady : totals), 1e-9) * 1.25;
    const b = {x0: m.l, x1: W - m.r, y0: m.t, y1: H - m.b};
    const xs = scale(-0.5, n - 0.5, b.x0, b.x1, false), ys = scale(0, top, b.y1, b.y0, false);
    const every = Math.max(1, Math.ceil(n / 12));
    axes(s, b, xs, ys, {xticks: d.step.map((_, i) => i).filter((i) => i % every === 0), yticks: ticks(0, top, false),
                        xfmt: (i) => String(d.step[i]), yfmt: (v) => sig(v, 3), xlabel: "step", ylabel: "ms per rank"});
    const bw = Math.max(1, (b.x1 - b.x0) / n * 0.8);
    const layers = parts.map(() => sv("g", {}, s));
    for (let i = 0; i < n; i++) {
      let acc = 0;
      parts.forEach((p, k) => {
        const v = (d[p[0]][i] || 0) / 1e3;
        const y0 = ys(Math.min(acc + v, top)), y1 = ys(Math.min(acc, top));
        acc += v;
        if (y1 - y0 <= 0) return;
        const r = sv("rect", {x: xs(i) - bw / 2, y: y0, width: bw, height: y1 - y0, fill: p[2]}, layers[k]);
        hover(r, `step ${d.step[i]} (${d.stage ? d.stage[i] : ""})\n${p[1]}: ${sig(v, 4)} ms\nstep time: ` +
                 `${ms(d.step_us ? d.step_us[i] : null)}\ncommunication share: ${pct(d.comm_share ? d.comm_share[i] : null)}` +
                 `\nexposed share: ${pct(d.exposed_share ? d.exposed_share[i] : null)}`);
      });
      if (totals[i] > top) sv("text", {x: xs(i) + 3, y: b.y0 + 10, "font-size": 10, fill: "#333",
                                       text: `${sig(totals[i], 3)} ms`}, s);
    }
    const y2 = scale(0, 1, b.y1, b.y0, false);
    for (const t of [0, 0.25, 0.5, 0.75, 1])
      sv("text", {x: b.x1 + 6, y: y2(t) + 4, "font-size": 11, fill: "#444", text: `${100 * t}%`}, s);
    // wide and light under thin and dashed: both show where they coincide (all the wait exposed)
    const lines = [["comm_share", "#1d2330", "", 5, 0.45], ["exposed_share", "#d1495b", "5 3", 1.5, 1]]
      .filter((l) => d[l[0]]).map(([col, color, dash, width, opacity]) => {
        const g = sv("g", {"data-line": col}, s);
        const pts = d[col].map((v, i) => [i, v]).filter((p) => p[1] != null);
        sv("polyline", {points: pts.map((p) => `${xs(p[0])},${y2(p[1])}`).join(" "), fill: "none", stroke: color,
                        "stroke-width": width, "stroke-opacity": opacity, "stroke-dasharray": dash}, g);
        return g;
      });
    const shares = [["comm_share", "communication share (wide)", "#1d2330"], ["exposed_share", "exposed share (dashed)", "#d1495b"]]
      .filter((l) => d[l[0]]);
    const names = parts.map((p) => p[1]).concat(shares.map((l) => l[1]));
    const targets = layers.concat(lines);
    box.append(legend(names, (i, on) => { targets[i].style.display = on ? "" : "none"; },
                      parts.map((p) => p[2]).concat(shares.map((l) => l[2]))), s);
    return box;
  }
  function heat(t) {        // 0..1 -> a magma-like colour
    const stops = [[0, [252, 253, 191]], [0.25, [252, 137, 97]], [0.5, [183, 55, 121]], [0.75, [81, 18, 124]], [1, [0, 0, 4]]];
    t = Math.max(0, Math.min(1, t));
    for (let i = 1; i < stops.length; i++) if (t <= stops[i][0]) {
      const [a, ca] = stops[i - 1], [b, cb] = stops[i], f = (t - a) / (b - a);
      return ca.map((c, k) => Math.round(c + f * (cb[k] - c)));
    }
    return stops[stops.length - 1][1];
  }
  function heatmapPlot(h) {
    if (!h) return null;
    const box = plotBox("heatmap", "Arrival delay behind the earliest rank", "per rank (rows) and collective " +
                        "(columns: the collectives in order, binned" + (h.steps ? "; a tick where a step starts" :
                        ": each column starts at the collective number shown") + "), mean ms; dark: late");
    const R = h.ranks.length, C = h.columns.length;
    const cw = Math.max(2, Math.min(24, Math.floor(900 / C))), rh = Math.max(1, Math.min(40, Math.floor(640 / R)));
    const L = 56, T = 6, B = 34, RIGHT = 90;
    const cv = el("canvas", {width: L + C * cw + RIGHT, height: T + R * rh + B});
    const ctx = cv.getContext("2d");
    let hi = 0;
    for (const row of h.ms) for (const v of row) if (v != null && v > hi) hi = v;
    hi = hi || 1;
    const img = ctx.createImageData(C * cw, R * rh);
    for (let r = 0; r < R; r++) for (let c = 0; c < C; c++) {
      const v = h.ms[r][c], col = v == null ? [235, 235, 235] : heat(v / hi);
      for (let y = r * rh; y < (r + 1) * rh; y++) for (let x = c * cw; x < (c + 1) * cw; x++) {
        const o = (y * C * cw + x) * 4;
        img.data[o] = col[0]; img.data[o + 1] = col[1]; img.data[o + 2] = col[2]; img.data[o + 3] = 255;
      }
    }
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
    ctx.putImageData(img, L, T);
    ctx.fillStyle = "#444"; ctx.font = "11px sans-serif"; ctx.textAlign = "right";
    const rstep = Math.max(1, Math.ceil(12 / rh));
    for (let r = 0; r < R; r += rstep) ctx.fillText(String(h.ranks[r]), L - 4, T + r * rh + rh / 2 + 4);
    ctx.textAlign = "center";
    if (h.steps) {  // ticks on whole steps: at a step's first column, at least 60 px apart
      let last = -1e9;
      for (let c = 0; c < C; c++) {
        if (c > 0 && h.steps[c] === h.steps[c - 1]) continue;
        const x = L + c * cw;
        if (x - last < 60) continue;
        ctx.fillRect(x, T + R * rh, 1, 4);
        ctx.fillText(String(h.steps[c]), x, T + R * rh + 14);
        last = x;
      }
      ctx.fillText("step (a tick at its first collective)", L + C * cw / 2, T + R * rh + 30);
    } else {
      const cstep = Math.max(1, Math.ceil(60 / cw));
      for (let c = 0; c < C; c += cstep) ctx.fillText(String(h.columns[c] + 1), L + c * cw + cw / 2, T + R * rh + 14);
      ctx.fillText("collective (in order, binned)", L + C * cw / 2, T + R * rh + 30);
    }
    ctx.save(); ctx.translate(12, T + R * rh / 2); ctx.rotate(-Math.PI / 2); ctx.fillText("rank", 0, 0); ctx.restore();
    const gx = L + C * cw + 14, gh = Math.min(R * rh, 200);
    for (let y = 0; y < gh; y++) { const c = heat(1 - y / gh); ctx.fillStyle = `rgb(${c})`; ctx.fillRect(gx, T + y, 12, 1); }
    ctx.fillStyle = "#444"; ctx.textAlign = "left";
    ctx.fillText(`${sig(hi, 3)} ms`, gx + 15, T + 9); ctx.fillText("0", gx + 15, T + gh);
    hover(cv, (ev) => {
      const rect = cv.getBoundingClientRect(), k = cv.width / rect.width;
      const x = (ev.clientX - rect.left) * k - L, y = (ev.clientY - rect.top) * k - T;
      const c = Math.floor(x / cw), r = Math.floor(y / rh);
      if (c < 0 || r < 0 || c >= C || r >= R) return "";
      const step = h.steps ? `step ${h.steps[c]}\n` : "";
      return `rank ${h.ranks[r]}\n${step}collectives from #${h.columns[c] + 1}\ndelay ${h.ms[r][c] == null ? "-" : h.ms[r][c] + " ms"}`;
    });
    box.append(cv);
    return box;
  }
  function timelinePlot(t) {
    if (!t || !t.calls.length) return null;
    const which = t.stage === "steady" ? "the steady-state step nearest the median step time"
      : `step ${t.step} (${t.stage || "no step"}: no steady-state step to show)`;
    const box = plotBox("timeline", `Timeline excerpt: step ${t.step}`, `the calls of ${which} ` +
                        `on ${t.ranks.length} of ${t.of_ranks} rank(s), ms from its ` +
                        `first call; black ticks: each rank's step start${t.cut ? "; the first calls only" : ""}. ` +
                        "The whole run: --trace FILE (Perfetto).");
    // calls that overlap on a rank (async, DDP's buckets) go to sub-lanes of its row
    const sub = new Map(), lanesOf = {};
    for (const r of t.ranks) {
      const ends = [];
      t.calls.map((c, i) => [c, i]).filter(([c]) => c[0] === r).sort((a, b) => a[0][3] - b[0][3]).forEach(([c, i]) => {
        let k = ends.findIndex((e) => e <= c[3]);
        if (k < 0) { k = ends.length; ends.push(0); }
        ends[k] = c[3] + (c[4] || 0);
        sub.set(i, k);
      });
      lanesOf[r] = Math.max(1, ends.length);
    }
    const lane = Math.max(18, 10 * Math.max(...Object.values(lanesOf)));
    const W = 900, m = {l: 70, r: 16, t: 8, b: 42}, H = m.t + t.ranks.length * lane + m.b;
    const s = sv("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "timeline excerpt"});
    const end = Math.max(...t.calls.map((c) => c[3] + (c[4] || 0)), 1e-6);
    const b = {x0: m.l, x1: W - m.r, y0: m.t, y1: H - m.b};
    const xs = scale(0, end, b.x0, b.x1, false), row = Object.fromEntries(t.ranks.map((r, i) => [r, i]));
    axes(s, b, xs, (v) => v, {xticks: ticks(0, end, false), yticks: [], xfmt: (v) => sig(v, 3), yfmt: String,
                              xlabel: "ms from the step's first call", ylabel: "rank"});
    t.ranks.forEach((r, i) => sv("text", {x: b.x0 - 6, y: b.y0 + i * lane + 13, "text-anchor": "end", "font-size": 11,
                                          fill: "#444", text: String(r)}, s));
    const ops = [...new Set(t.calls.map((c) => c[2]))];
    const groups = ops.map(() => sv("g", {}, s));
    t.calls.forEach(([r, g, op, st, dur, nb], i) => {
      const k = ops.indexOf(op), h = (lane - 4) / lanesOf[r];
      const rect = sv("rect", {x: xs(st), y: b.y0 + row[r] * lane + 2 + sub.get(i) * h,
                               width: Math.max(1, xs(st + (dur || 0)) - xs(st)), height: Math.max(1, h - 1),
                               fill: COLORS[k % COLORS.length], stroke: "#fff", "stroke-width": 0.5}, groups[k]);
      hover(rect, `rank ${r}, group ${g}\n${op}, ${bytes(nb)}\nat ${sig(st, 4)} ms, ${dur == null ? "-" : sig(dur, 4) + " ms"}`);
    });
    for (const [r, x] of Object.entries(t.step_starts))
      if (r in row) sv("line", {x1: xs(x), x2: xs(x), y1: b.y0 + row[r] * lane, y2: b.y0 + (row[r] + 1) * lane,
                                stroke: "#000", "stroke-width": 2, "data-step-marker": r}, s);
    box.append(legend(ops, (i, on) => { groups[i].style.display = on ? "" : "none"; }), s);
    return box;
  }
  function scalingPlots(sc) {
    if (!sc || !sc.world_size) return null;
    const ws = sc.world_size, xt = [...new Set(ws)], f = (v) => String(v);
    const o = {xticks: xt, xfmt: f, xlabel: "world size", width: 600, height: 300};
    const wrap = el("div", {class: "grid4"});
    wrap.append(lineChart("scaling-step", "Step time", "median steady-state step (ms)",
      [{name: "step time", x: ws, y: sc.step_us.map((v) => v == null ? null : v / 1e3)}], {...o, ylabel: "ms"}));
    wrap.append(lineChart("scaling-efficiency", "Efficiency and speed-up", "against the smallest run",
      [{name: "efficiency", x: ws, y: sc.efficiency}, {name: "speed-up", x: ws, y: sc.speedup, dash: "5 3"}],
      {...o, ylabel: "ratio"}));
    wrap.append(lineChart("scaling-shares", "Communication share of step", "medians over the steady state (%)",
      [{name: "in flight", x: ws, y: sc.comm_share.map((v) => v == null ? null : 100 * v)},
       {name: "exposed", x: ws, y: sc.exposed_share.map((v) => v == null ? null : 100 * v), dash: "5 3"}],
      {...o, ylabel: "% of step"}));
    const bw = sc.busbw.filter((d) => d.x.length > 1 || sc.busbw.length < 8)
      .map((d) => ({name: `${d.collective} <= ${bytes(d.size)}`, x: d.x, y: d.y}));
    if (bw.length) wrap.append(lineChart("scaling-busbw", "Bus bandwidth (steady state)", "per collective and message " +
                                         "size (GB/s)", bw, {...o, ylabel: "busbw (GB/s)"}));
    return wrap;
  }

  // ---- tables ----
  function tableView(key, t) {
    const sec = el("section", {id: "table-" + key}, el("h2", {text: t.title}));
    const table = el("table", {"data-table": key}), thead = el("thead"), tbody = el("tbody"), tr = el("tr");
    let rows = t.rows.slice(), limit = ROWS_SHOWN;
    const draw = () => {
      tbody.textContent = "";
      for (const r of rows.slice(0, limit))
        tbody.append(el("tr", {}, ...r.map((v, i) => el("td", {class: t.numeric[i] ? "num" : "", text: fmt(v, t.columns[i])}))));
      more.textContent = rows.length > limit ? `${limit} of ${rows.length} rows shown ` : "";
      if (rows.length > limit) more.append(el("button", {text: "show all", on: {click: () => { limit = rows.length; draw(); }}}));
    };
    t.columns.forEach((c, i) => {
      const th = el("th", {class: t.numeric[i] ? "num" : "", title: "click to sort", text: c});
      th.addEventListener("click", () => {
        const down = th.getAttribute("aria-sort") === "ascending";
        for (const o of tr.children) o.removeAttribute("aria-sort");
        th.setAttribute("aria-sort", down ? "descending" : "ascending");
        const sign = down ? -1 : 1;
        rows.sort((a, b) => {
          const x = a[i], y = b[i];
          if (x == null || y == null) return x == null ? (y == null ? 0 : 1) : -1;      // unknown last
          return sign * (typeof x === "number" && typeof y === "number" ? x - y
                         : String(x).localeCompare(String(y), undefined, {numeric: true}));
        });
        draw();
      });
      tr.append(th);
    });
    thead.append(tr);
    table.append(thead, tbody);
    const more = el("div", {class: "more"});
    sec.append(el("div", {class: "tablewrap"}, table), more);
    if (t.total > t.rows.length) sec.append(el("div", {class: "more", text: `the first ${t.rows.length} of ${t.total} rows ` +
                                                "(commpatch report --format json or csv for all)"}));
    draw();
    return sec;
  }

  // ---- the page ----
  const nav = el("nav");
  const parts = [];
  const add = (id, label, node) => { if (node) { parts.push(node); nav.append(el("a", {href: "#" + id, text: label})); } };
  add("headline", "Headline", headline());
  add("findings", "Findings", findings());
  add("advice", "Advice", advice());
  const P = D.plots || {};
  const plots = [bandwidthPlot(P.bandwidth), stepsPlot(P.steps), heatmapPlot(P.heatmap), scalingPlots(P.scaling),
                 timelinePlot(P.timeline)].filter(Boolean);
  if (plots.length) add("plots", "Plots", el("section", {id: "plots"}, el("h2", {text: "Plots"}), ...plots));
  for (const [key, t] of Object.entries(D.tables || {})) if (t.rows.length) add("table-" + key, key, tableView(key, t));
  if (D.notes && D.notes.length)
    add("notes", "Notes", el("section", {id: "notes"}, el("h2", {text: "Notes"}),
                             el("ul", {class: "notes"}, ...D.notes.map((n) => el("li", {text: n})))));
  app.append(nav, ...parts);
  document.documentElement.setAttribute("data-ready", "1");
})();
