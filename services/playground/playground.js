// The logit-fusion playground: one page over the documented HTTP API, and a worked example of it.
//   GET  /v1/fusion/describe                         experts, rules and their params, profiles, defaults
//   POST /v1/chat/completions or /v1/completions     stream: true, logprobs, fusion: {..., attribution: true}
// Each streamed token carries `fusion.tokens[0].attribution`: every expert's weight at that step and
// its own probability of the token. A token is coloured by the expert that contributed most to it,
// weight x own probability (an expert that was not consulted contributes 0).
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const state = {
  description: null,
  colours: {},  // expert name -> colour
  defaults: {},  // expert name -> the weight the service uses by default
  controller: null,  // the running requests' AbortController
  key: "",  // the API key: in this page's memory only
};
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

// -- the API ---------------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, error) {
    const kind = [status ? `HTTP ${status}` : null, error.type || error.code].filter(Boolean).join(" ");
    super(`${kind}: ${error.message}`);
    this.status = status;
    this.error = error;
  }
}

function headers() {
  const out = {"Content-Type": "application/json"};
  if (state.key) out["Authorization"] = `Bearer ${state.key}`;
  return out;
}

async function failure(response) {
  let error = {message: response.statusText || "request failed"};
  try {
    const body = await response.json();
    if (body && body.error) error = body.error;
  } catch (_) { /* not JSON: keep the status text */ }
  return new ApiError(response.status, error);
}

async function getJson(path, signal) {
  const response = await fetch(path, {headers: headers(), signal, cache: "no-store"});
  if (!response.ok) throw await failure(response);
  return response.json();
}

// Server-sent events of one streamed request: yields each `data:` payload parsed (up to [DONE]).
async function* events(path, body, signal) {
  const response = await fetch(path, {method: "POST", headers: headers(), body: JSON.stringify(body), signal});
  if (!response.ok) throw await failure(response);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true}).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const payload = JSON.parse(data);
        if (payload.error) throw new ApiError(0, payload.error);  // an error after the stream started
        yield payload;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// One streamed token in one shape for both endpoints.
function tokensOf(chunk, chat) {
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return [];
  const attributions = (choice.fusion && choice.fusion.tokens) || [];
  const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
  let entries = [];
  if (chat && choice.logprobs) {
    entries = choice.logprobs.content.map((c) => ({token: c.token, logprob: c.logprob,
      top: (c.top_logprobs || []).map((t) => [t.token, t.logprob])}));
  } else if (!chat && choice.logprobs) {
    const lp = choice.logprobs;
    entries = lp.tokens.map((t, i) => ({token: t, logprob: lp.token_logprobs[i],
      top: Object.entries(lp.top_logprobs[i] || {})}));
  }
  return attributions.map((a, i) => ({
    text: i === 0 ? text : "", token_id: a.token_id, attribution: a.attribution,
    token: entries[i] ? entries[i].token : null, logprob: entries[i] ? entries[i].logprob : null,
    top: entries[i] ? entries[i].top : [], finish_reason: choice.finish_reason,
  }));
}

// The expert that contributed most to a token: the largest weight x own probability.
function leader(attribution) {
  let best = null, bestScore = -1;
  for (const a of attribution) {
    const score = a.prob == null ? 0 : a.weight * a.prob;
    if (score > bestScore) { best = a.expert; bestScore = score; }
  }
  return best;
}

// -- the form --------------------------------------------------------------------------------------
function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

async function connect() {
  state.key = $("key").value.trim();
  showError("");
  $("service").textContent = "loading the service description…";
  try {
    const description = await getJson("/v1/fusion/describe");
    state.description = description;
    fill(description);
    const experts = description.experts.map((e) => e.name).join(", ");
    $("service").textContent = `model ${description.model}: ${description.experts.length} experts (${experts})`;
    $("run").disabled = false;
  } catch (err) {
    $("service").textContent = "not connected";
    showError(`Could not load the service description: ${err.message}`);
  }
}

function fill(d) {
  d.experts.forEach((e, i) => { state.colours[e.name] = PALETTE[i % PALETTE.length]; });
  const specWeights = d.default_spec.weights;
  state.defaults = Object.fromEntries(d.experts.map((e) => [e.name, specWeights ? (specWeights[e.name] || 0) : e.default_weight]));

  const rule = $("rule");
  rule.replaceChildren(...Object.keys(d.rules).map((name) => el("option", {value: name, text: name})));
  rule.value = d.default_spec.rule;
  fillParams(d.default_spec.params || {});

  const profile = $("profile");
  profile.replaceChildren(el("option", {value: "", text: "(the weights below)"}),
    ...Object.keys(d.profiles).map((name) => el("option", {value: name, text: name})));
  profile.value = d.default_spec.profile || "";

  const max = Math.max(2, ...Object.values(state.defaults).map((w) => Math.ceil(w)));
  $("weights").replaceChildren(...d.experts.map((e) => {
    const value = state.defaults[e.name];
    const slider = el("input", {type: "range", min: "0", max: String(max), step: "0.05", value: String(value),
                                id: `weight-${e.name}`, "data-expert": e.name, "aria-label": `weight of ${e.name}`});
    const shown = el("output", {text: value.toFixed(2)});
    slider.addEventListener("input", () => { shown.textContent = Number(slider.value).toFixed(2); });
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = state.colours[e.name];
    return el("label", {class: "weight", title: e.model}, swatch, el("span", {text: e.name}), slider, shown);
  }));
  profileChanged();

  const s = d.default_sampling;
  $("temperature").value = s.temperature;
  $("top_p").value = s.top_p;
  $("top_k").value = s.top_k;
  $("max_tokens").value = Math.min(s.max_tokens, d.limits.max_tokens);
  $("max_tokens").max = d.limits.max_tokens;
  $("seed").value = s.seed == null ? "" : s.seed;
  $("stop").value = (s.stop || []).join(", ");
  $("ignore_eos").checked = !!s.ignore_eos;

  $("legend").replaceChildren(...d.experts.map((e) => {
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = state.colours[e.name];
    return el("span", {}, swatch, el("span", {text: e.name}));
  }));
}

function fillParams(values) {
  const names = state.description.rules[$("rule").value] || [];
  $("params").replaceChildren(...names.map((name) => {
    const value = values[name];
    const input = el("input", {type: "text", id: `param-${name}`, "data-param": name, placeholder: "default",
                               value: value == null ? "" : typeof value === "string" ? value : JSON.stringify(value)});
    return el("label", {class: "param"}, `params.${name} `, input);
  }));
}

function profileChanged() {
  const byProfile = $("profile").value !== "";
  for (const row of document.querySelectorAll(".weight")) {
    row.classList.toggle("disabled", byProfile);
    row.querySelector("input").disabled = byProfile;
  }
}

function number(id) {
  const raw = $(id).value.trim();
  return raw === "" ? null : Number(raw);
}

// The request bodies of one run: the fused answer, then (if asked) each expert alone.
function requests() {
  const chat = $("mode").value === "chat";
  const params = {};
  for (const input of document.querySelectorAll("#params input")) {
    const raw = input.value.trim();
    if (raw === "") continue;
    try { params[input.dataset.param] = JSON.parse(raw); } catch (_) { params[input.dataset.param] = raw; }
  }
  const fusion = {rule: $("rule").value, attribution: true};
  if (Object.keys(params).length) fusion.params = params;
  if ($("profile").value) {
    fusion.profile = $("profile").value;
  } else {
    const weights = {};
    let changed = false;
    for (const slider of document.querySelectorAll(".weight input")) {
      weights[slider.dataset.expert] = Number(slider.value);
      changed = changed || Math.abs(Number(slider.value) - state.defaults[slider.dataset.expert]) > 1e-9;
    }
    if (changed) fusion.weights = weights;  // unchanged: the service's own defaults
  }
  let seed = number("seed");
  if (seed == null) seed = Math.floor(Math.random() * 2 ** 31);  // one seed for every pane, so they compare
  const body = {model: state.description.model, stream: true, seed};
  for (const name of ["temperature", "top_p", "top_k", "max_tokens"]) {
    const value = number(name);
    if (value != null) body[name] = value;
  }
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if ($("ignore_eos").checked) body.ignore_eos = true;
  const top = number("top_logprobs") || 0;
  if (chat) {
    const messages = [];
    if ($("system").value.trim()) messages.push({role: "system", content: $("system").value});
    messages.push({role: "user", content: $("prompt").value});
    Object.assign(body, {messages, logprobs: true});
    if (top > 0) body.top_logprobs = top;
  } else {
    Object.assign(body, {prompt: $("prompt").value, logprobs: top});
  }
  const structured = structuredOutputs();
  if (structured) body.structured_outputs = structured;
  const path = chat ? "/v1/chat/completions" : "/v1/completions";
  const runs = [{id: "fused", title: `fused: ${fusion.rule}${fusion.profile ? ` (profile ${fusion.profile})` : ""}`,
                 path, chat, body: {...body, fusion}}];
  if ($("compare").checked) {
    for (const e of state.description.experts) {
      runs.push({id: `expert:${e.name}`, title: `${e.name} alone`, path, chat,
                 body: {...body, fusion: {rule: "single", params: {expert: e.name}, attribution: true}}});
    }
  }
  return runs;
}

// The `structured_outputs` extension the form asks for (null: free text); a bad schema is an error here.
function structuredOutputs() {
  const kind = $("structured-kind").value;
  const text = $("structured").value;
  if (!kind) return null;
  if (kind === "json_object") return {json_object: true};
  if (kind === "regex") return {regex: text};
  if (kind === "choice") return {choice: text.split("\n").map((s) => s.trim()).filter(Boolean)};
  try {
    return {json: JSON.parse(text)};
  } catch (err) {
    throw new Error(`Structured output: the schema is not JSON (${err.message})`);
  }
}

// -- a pane: one streamed answer, its tokens and charts ------------------------------------------------
class Pane {
  constructor(run) {
    this.run = run;
    this.tokens = [];
    this.node = el("article", {class: "pane", "data-pane": run.id, "data-state": "streaming"});
    this.stateLine = el("div", {class: "state", text: "waiting for the first token…"});
    this.output = el("div", {class: "output"});
    this.chart = el("div", {class: "chart"});
    this.node.append(el("h2", {text: run.title}), this.stateLine, this.output, this.chart);
    this.drawPending = false;
  }

  reset() {
    this.tokens = [];
    this.output.replaceChildren();
    this.chart.replaceChildren();
    this.setState("streaming", "waiting for a free stream of this key…");
  }

  setState(name, text) {
    this.node.dataset.state = name;
    this.stateLine.textContent = text;
  }

  add(token) {
    const index = this.tokens.length;
    const expert = leader(token.attribution);
    this.tokens.push({...token, expert});
    // Every token is reachable by keyboard: Tab focuses it (its details show), Enter or Space pins them.
    const span = el("span", {class: "tok", "data-index": String(index), "data-expert": expert || "", tabindex: "0",
                             role: "button", "aria-label": `token ${index}${expert ? `, driven by ${expert}` : ""}`});
    span.textContent = token.text;
    if (expert) {
      span.style.background = state.colours[expert] + "33";
      span.style.borderBottomColor = state.colours[expert];
    }
    span.addEventListener("mouseenter", () => showDetails(this, index, span));
    span.addEventListener("mouseleave", hideDetails);
    span.addEventListener("click", () => showDetails(this, index, span, true));
    span.addEventListener("focus", () => showDetails(this, index, span));
    span.addEventListener("blur", hideDetails);
    span.addEventListener("keydown", (e) => {
      if (e.key === "Enter" || e.key === " ") { e.preventDefault(); showDetails(this, index, span, true); }
    });
    this.output.append(span);
    this.stateLine.textContent = `streaming… ${this.tokens.length} tokens`;
    if (!this.drawPending) {
      this.drawPending = true;
      requestAnimationFrame(() => { this.drawPending = false; this.draw(); });
    }
  }

  draw() {
    const experts = state.description.experts.map((e) => e.name);
    const n = this.tokens.length;
    const counts = Object.fromEntries(experts.map((e) => [e, 0]));
    for (const t of this.tokens) if (t.expert in counts) counts[t.expert] += 1;
    const children = [el("div", {class: "caption", text: "share of tokens each expert drove"})];
    const bar = svg("svg", {viewBox: "0 0 100 8", preserveAspectRatio: "none", height: "14", class: "share"});
    let x = 0;
    for (const e of experts) {
      const width = n ? (100 * counts[e]) / n : 0;
      const rect = svg("rect", {x: String(x), y: "0", width: String(width), height: "8", fill: state.colours[e],
                                "data-expert": e, "data-count": String(counts[e])});
      rect.append(svg("title"));
      rect.firstChild.textContent = `${e}: ${counts[e]} of ${n}`;
      bar.append(rect);
      x += width;
    }
    children.push(bar, el("div", {class: "caption share-text",
      text: experts.map((e) => `${e} ${n ? Math.round((100 * counts[e]) / n) : 0}%`).join(" · ")}));
    // The weights over the sequence: the router's (or the confidence rule's) per-step weights.
    const varying = experts.some((e) => new Set(this.tokens.map((t) => weightOf(t, e))).size > 1);
    if (n > 0 && (this.run.body.fusion.rule === "route" || varying)) {
      children.push(el("div", {class: "caption", text: "weights over the sequence"}));
      const plot = svg("svg", {viewBox: `0 0 ${Math.max(n - 1, 1)} 1`, preserveAspectRatio: "none", height: "60",
                                class: "weights-chart"});
      plot.append(svg("rect", {x: "0", y: "0", width: String(Math.max(n - 1, 1)), height: "1", fill: "#f3f4f6"}));
      for (const e of experts) {
        const points = this.tokens.map((t, i) => `${i},${1 - weightOf(t, e)}`).join(" ");
        plot.append(svg("polyline", {points: n === 1 ? `${points} 1,${1 - weightOf(this.tokens[0], e)}` : points,
          fill: "none", stroke: state.colours[e], "stroke-width": "2", "vector-effect": "non-scaling-stroke",
          "data-expert": e}));
      }
      children.push(plot);
    }
    this.chart.replaceChildren(...children);
  }
}

function weightOf(token, expert) {
  const a = token.attribution.find((x) => x.expert === expert);
  return a ? a.weight : 0;
}

function fmt(value, digits = 3) {
  return value == null ? "—" : Number(value).toFixed(digits);
}

let pinned = null;

function showDetails(pane, index, span, pin = false) {
  if (pinned && !pin) return;
  if (pin) {
    if (pinned) pinned.classList.remove("selected");
    pinned = pinned === span ? null : span;
    if (pinned) span.classList.add("selected");
    else { hideDetails(); return; }
  }
  const t = pane.tokens[index];
  const box = $("details");
  box.dataset.pane = pane.run.id;
  box.dataset.index = String(index);
  const rows = t.attribution.map((a) => {
    const swatch = el("span", {class: "swatch"});
    swatch.style.background = state.colours[a.expert];
    const row = el("tr", {"data-expert": a.expert, "data-weight": String(a.weight), "data-prob": String(a.prob)},
      el("td", {}, swatch, ` ${a.expert}${a.expert === t.expert ? " ★" : ""}`),
      el("td", {class: "col-weight", text: fmt(a.weight)}),
      el("td", {class: "col-prob", text: fmt(a.prob)}),
      el("td", {text: a.prob == null ? "—" : fmt(a.weight * a.prob)}));
    return row;
  });
  const table = el("table", {}, el("tr", {}, el("th", {text: "expert"}), el("th", {text: "weight"}),
    el("th", {text: "own prob"}), el("th", {text: "w × p"})), ...rows);
  const shown = t.token != null ? t.token : t.text;
  const children = [
    el("div", {}, `token #${index} `, el("span", {class: "token", text: JSON.stringify(shown)}), ` id ${t.token_id}`),
    el("div", {class: "fused", "data-logprob": String(t.logprob)},
       `fused logprob ${fmt(t.logprob)}${t.logprob == null ? "" : ` (p = ${fmt(Math.exp(t.logprob))})`}`),
    table,
  ];
  if (t.top.length) {
    children.push(el("div", {text: "top alternatives (fused):"}));
    children.push(el("table", {class: "top"}, ...t.top.map(([tok, lp]) =>
      el("tr", {"data-token": tok, "data-logprob": String(lp)}, el("td", {}, el("span", {class: "token", text: JSON.stringify(tok)})),
         el("td", {text: fmt(lp)}), el("td", {text: `p ${fmt(Math.exp(lp))}`})))));
  }
  box.replaceChildren(...children);
  box.hidden = false;
  // Beside the token's pane (its text and charts stay in view), else below or above the token.
  const r = span.getBoundingClientRect(), p = pane.node.getBoundingClientRect();
  const width = box.offsetWidth, height = box.offsetHeight;
  let left, top;
  if (p.right + 8 + width <= window.innerWidth || p.left - 8 - width >= 0) {
    left = p.right + 8 + width <= window.innerWidth ? p.right + 8 : p.left - 8 - width;
    top = Math.min(r.top - 8, window.innerHeight - height - 4);
  } else {
    left = Math.min(r.left, window.innerWidth - width - 8);
    top = r.bottom + 6 + height < window.innerHeight ? r.bottom + 6 : r.top - height - 6;
  }
  box.style.left = `${Math.max(4, left)}px`;
  box.style.top = `${Math.max(4, top)}px`;
}

function hideDetails() {
  if (!pinned) $("details").hidden = true;
}

// -- a run -----------------------------------------------------------------------------------------
async function stream(pane, signal) {
  const started = performance.now();
  let finish = null;
  try {
    for await (const chunk of events(pane.run.path, pane.run.body, signal)) {
      for (const token of tokensOf(chunk, pane.run.chat)) {
        pane.add(token);
        finish = token.finish_reason || finish;
      }
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    pane.setState("done", `done (${finish || "end"}): ${pane.tokens.length} tokens in ${seconds} s`);
  } catch (err) {
    if (signal.aborted) pane.setState("stopped", `stopped after ${pane.tokens.length} tokens`);
    else pane.setState("error", err.message);
    if (!signal.aborted) throw err;
  } finally {
    pane.draw();
  }
}

async function run(event) {
  event.preventDefault();
  if (!state.description || state.controller) return;
  showError("");
  $("details").hidden = true;
  pinned = null;
  let runs;
  try {
    runs = requests();
  } catch (err) {
    showError(err.message);
    return;
  }
  const panes = runs.map((r) => new Pane(r));
  $("panes").replaceChildren(...panes.map((p) => p.node));
  const controller = new AbortController();
  state.controller = controller;
  $("run").disabled = true;
  $("stop-button").disabled = false;
  let results = await Promise.allSettled(panes.map((p) => stream(p, controller.signal)));
  // A key limited to fewer streams than the panes gets 429 for the rest: those run again one by one,
  // each once the others have finished (its slot is then free).
  const refused = panes.filter((p, i) => results[i].status === "rejected" && results[i].reason.status === 429);
  for (const pane of refused) {
    if (controller.signal.aborted) break;
    pane.reset();
    const [result] = await Promise.allSettled([stream(pane, controller.signal)]);
    results[panes.indexOf(pane)] = result;
  }
  const failed = results.find((r) => r.status === "rejected");
  if (failed) showError(failed.reason.message);
  if (state.controller === controller) state.controller = null;
  $("run").disabled = false;
  $("stop-button").disabled = true;
}

// Stop: aborting the fetches closes their connections; the server cancels the requests and frees
// their sessions on every expert.
function stop() {
  if (state.controller) state.controller.abort();
}

function init() {
  $("run").disabled = true;
  $("controls").addEventListener("submit", run);
  $("stop-button").addEventListener("click", stop);
  $("connect").addEventListener("click", connect);
  $("key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); connect(); } });
  $("rule").addEventListener("change", () => fillParams({}));
  $("profile").addEventListener("change", profileChanged);
  $("mode").addEventListener("change", () => { $("system-row").hidden = $("mode").value !== "chat"; });
  $("structured-kind").addEventListener("change", () => {
    const kind = $("structured-kind").value;
    $("structured").hidden = !kind || kind === "json_object";
  });
  // Ctrl+Enter (Cmd+Enter) runs from anywhere in the form, the prompt included.
  $("controls").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); $("controls").requestSubmit(); }
  });
  window.addEventListener("pagehide", stop);  // leaving the page cancels its requests too
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && pinned) { pinned.classList.remove("selected"); pinned = null; hideDetails(); } });
  connect();
}

document.addEventListener("DOMContentLoaded", init);
