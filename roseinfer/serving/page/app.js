// The live page's script: a playground that streams through /v1/completions, and the
// engine drawn from /live/events (snapshots its thread takes between steps; see
// roseinfer/serving/live.py). It talks to its own server only, and needs no build step.
// Every URL is relative to the page, so the page works behind a proxy's path prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const STATES = { f: "free", u: "used", c: "cached" };
const HISTORY_S = 60; // the charts' window
const SAMPLE_MS = 500; // one chart point per this many ms

let apiKey = sessionStorage.getItem("rose-api-key") || "";
let latest = null; // the newest snapshot
let hovered = null; // the id of the request whose blocks are outlined
const steps = []; // step records for the timeline, oldest first
const history = []; // {t, tps, used, cached} chart points, oldest first

function headers(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

// The data of each event of a text/event-stream response, as it arrives.
async function readEvents(response, onData) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim());
      if (data.length) onData(data.join("\n"));
    }
  }
}

// The server's own words for a failed response (OpenAI's error shape).
async function errorMessage(response) {
  const text = await response.text();
  try {
    return JSON.parse(text).error.message;
  } catch {
    return `HTTP ${response.status}: ${text.slice(0, 200)}`;
  }
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setConnection(text, live = false) {
  $("connection").textContent = text;
  $("connection").classList.toggle("live", live);
}

// -- the engine's state, live --

let stream = null; // the AbortController of the open /live/events request

async function connect() {
  stream?.abort();
  const controller = new AbortController();
  stream = controller;
  setConnection("connecting…");
  try {
    const response = await fetch("live/events", { headers: headers(), signal: controller.signal });
    if (!response.ok) {
      showError(await errorMessage(response));
      if (response.status === 401) {
        setConnection("needs the API key");
        $("api-key").focus();
        return; // until a key is given
      }
      throw new Error(`HTTP ${response.status}`);
    }
    showError("");
    setConnection("live", true);
    await readEvents(response, (data) => draw(JSON.parse(data)));
  } catch (err) {
    if (controller.signal.aborted) return;
  }
  if (stream === controller) {
    setConnection("reconnecting…");
    setTimeout(() => stream === controller && connect(), 1000);
  }
}

function colour(requestId) {
  let hash = 0;
  for (const ch of requestId) hash = (hash * 31 + ch.charCodeAt(0)) | 0;
  return `hsl(${Math.abs(hash) % 360}, 65%, 52%)`;
}

function draw(snapshot) {
  latest = snapshot;
  for (const [step, prefill, decode, preempted] of snapshot.timeline) {
    if (!steps.length || step > steps[steps.length - 1].step) {
      steps.push({ step, prefill, decode, preempted });
    }
  }
  steps.splice(0, Math.max(0, steps.length - 400));
  drawPool(snapshot);
  drawQueue($("running"), snapshot.running, true);
  drawQueue($("waiting"), snapshot.waiting, false);
  $("running-count").textContent = `${snapshot.running.length} / ${snapshot.max_num_seqs}`;
  $("waiting-count").textContent = String(snapshot.waiting.length);
  drawTimeline();
}

function drawPool(snapshot) {
  const pool = $("blocks");
  const n = snapshot.blocks.length;
  if (pool.children.length !== n) {
    pool.replaceChildren();
    for (let i = 0; i < n; i++) {
      const cell = document.createElement("div");
      cell.className = "cell";
      cell.dataset.testid = "kv-block";
      cell.dataset.block = String(i);
      pool.append(cell);
    }
  }
  const holders = new Array(n).fill(null); // the oldest running request holding each block
  for (const request of snapshot.running) {
    for (const b of request.blocks) holders[b] ??= request.id;
  }
  const outlined = new Set(
    snapshot.running.find((r) => r.id === hovered)?.blocks ?? [],
  );
  let used = 0, cached = 0;
  for (let i = 0; i < n; i++) {
    const cell = pool.children[i];
    const state = STATES[snapshot.blocks[i]];
    used += state === "used";
    cached += state === "cached";
    if (cell.dataset.state !== state) cell.dataset.state = state;
    cell.style.background = state === "used" && holders[i] ? colour(holders[i]) : "";
    cell.classList.toggle("outlined", outlined.has(i));
    cell.title = `block ${i}: ${state}${holders[i] ? ` (${holders[i]})` : ""}`;
  }
  $("pool-summary").textContent =
    `${n} blocks of ${snapshot.kv_block_size} tokens: ${used} used, ${cached} cached, ` +
    `${n - used - cached} free · step ${snapshot.step} · ${snapshot.num_preemptions} preemptions · ` +
    `pool ${mib(snapshot.pool_bytes)}` +
    speculativeText(snapshot.speculative);
}

function speculativeText(spec) {
  if (!spec || spec.acceptance_rate === null) return "";
  return ` · drafts ${(100 * spec.acceptance_rate).toFixed(0)}% accepted, ` +
    `${spec.mean_accepted_length.toFixed(2)} tokens per verify step`;
}

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

function stateText(request) {
  if (request.state === "prefilling") return `prefilling ${request.computed}/${request.tokens}`;
  return request.state;
}

const MAX_ROWS = 50;

// A queue's rows, one per request, kept across snapshots (updated in place, so a row
// under the pointer stays the same element).
function drawQueue(body, requests, running) {
  const old = new Map([...body.children].map((row) => [row.dataset.requestId, row]));
  const rows = requests.slice(0, MAX_ROWS).map((request) => {
    const row = old.get(request.id) ?? newRow(request, running ? 5 : 4);
    row.classList.toggle("hovered", request.id === hovered);
    const values = [request.prompt_tokens, request.generated, stateText(request)];
    if (running) {
      row.dataset.state = request.state;
      row.dataset.blocks = request.blocks.join(" ");
      values.push(request.blocks.length);
    }
    values.forEach((value, i) => {
      const cell = row.children[i + 1];
      if (cell.textContent !== String(value)) cell.textContent = String(value);
    });
    return row;
  });
  if (requests.length > MAX_ROWS) {
    const more = document.createElement("tr");
    more.innerHTML = `<td colspan="5">… and ${requests.length - MAX_ROWS} more</td>`;
    rows.push(more);
  }
  body.replaceChildren(...rows);
}

function newRow(request, columns) {
  const row = document.createElement("tr");
  row.dataset.requestId = request.id;
  if (columns === 5) row.dataset.testid = "running-request";
  for (let i = 0; i < columns; i++) row.append(document.createElement("td"));
  const dot = document.createElement("span");
  dot.className = "dot";
  dot.style.background = colour(request.id);
  row.firstChild.append(dot, request.id);
  return row;
}

// Hovering a running request outlines its blocks (rows are redrawn, so listen on the body).
$("running").addEventListener("mouseover", (event) => {
  const row = event.target.closest("tr");
  if (row?.dataset.requestId && row.dataset.requestId !== hovered) {
    hovered = row.dataset.requestId;
    if (latest) draw({ ...latest, timeline: [] });
  }
});
$("running").addEventListener("mouseleave", () => {
  hovered = null;
  if (latest) draw({ ...latest, timeline: [] });
});

function sizedContext(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth * ratio, height = canvas.clientHeight * ratio;
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  const context = canvas.getContext("2d");
  context.clearRect(0, 0, width, height);
  return [context, width, height];
}

function cssColour(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// The last steps as bars, newest at the right: decode tokens below, prefill above, on
// a scale that fits the biggest step shown (its tokens are in the caption).
function drawTimeline() {
  const [context, width, height] = sizedContext($("timeline"));
  const bar = 4 * (window.devicePixelRatio || 1);
  const shown = steps.slice(-Math.ceil(width / (bar + 1)));
  const top = Math.max(1, ...shown.map((r) => r.prefill + r.decode));
  $("timeline-top").textContent = String(top);
  const scale = (tokens) => (height - 6) * (tokens / top);
  let x = width - bar;
  for (let i = steps.length - 1; i >= 0 && x > -bar; i--, x -= bar + 1) {
    const record = steps[i];
    const decode = scale(record.decode), prefill = scale(record.prefill + record.decode) - decode;
    context.fillStyle = cssColour("--decode");
    context.fillRect(x, height - decode, bar, decode);
    context.fillStyle = cssColour("--prefill");
    context.fillRect(x, height - decode - prefill, bar, prefill);
    if (record.preempted) {
      context.fillStyle = cssColour("--preempt");
      context.fillRect(x, 0, bar, 5);
    }
  }
}

function drawLine(canvas, values, top, colourName) {
  const [context, width, height] = sizedContext(canvas);
  context.strokeStyle = cssColour(colourName);
  context.lineWidth = 2;
  context.beginPath();
  const now = performance.now() / 1000;
  values.forEach(([t, value], i) => {
    const x = width * (1 - (now - t) / HISTORY_S);
    const y = height - 3 - (height - 6) * (top > 0 ? value / top : 0);
    if (i) context.lineTo(x, y);
    else context.moveTo(x, y);
  });
  context.stroke();
}

// Every SAMPLE_MS: tokens/s since the last point, and the pool's use, from the newest
// snapshot (an engine at rest sends none, and its rate is then zero).
let lastCount = null;
setInterval(() => {
  if (!latest) return;
  const t = performance.now() / 1000;
  const count = latest.generation_tokens;
  // (a restarted server counts from zero again: no negative rate)
  const tps = lastCount === null ? 0 : Math.max(0, count - lastCount.count) / (t - lastCount.t);
  lastCount = { t, count };
  const n = latest.blocks.length;
  const used = [...latest.blocks].filter((s) => s === "u").length / n;
  history.push({ t, tps, used });
  while (history.length && history[0].t < t - HISTORY_S) history.shift();
  const peak = Math.max(1, ...history.map((p) => p.tps));
  drawLine($("tps-chart"), history.map((p) => [p.t, p.tps]), peak, "--decode");
  drawLine($("pool-chart"), history.map((p) => [p.t, p.used]), 1, "--used");
  $("tps-now").textContent = tps.toFixed(0);
  $("pool-now").textContent = `${(100 * used).toFixed(0)}%`;
}, SAMPLE_MS);

// -- the playground --

let sent = 0; // requests sent from this page

function requestBody() {
  const body = {
    prompt: $("prompt").value,
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("stop").value !== "") body.stop = $("stop").value.replaceAll("\\n", "\n");
  return body;
}

function outputCard() {
  const item = document.createElement("li");
  item.dataset.testid = "request";
  const meta = document.createElement("div");
  meta.className = "meta";
  const output = document.createElement("pre");
  output.dataset.testid = "output";
  item.append(meta, output);
  $("outputs").prepend(item);
  return { item, meta, output };
}

// One streamed completion into its card, with its time to first token and tokens/s.
async function complete(body, number) {
  const card = outputCard();
  const setMeta = (text, state) => {
    card.meta.textContent = `#${number} · ${text}`;
    card.item.dataset.state = state;
  };
  setMeta("sent", "running");
  const started = performance.now();
  let first = null, tokens = null, finish = null;
  try {
    const response = await fetch("v1/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
    });
    if (!response.ok) {
      card.meta.classList.add("failed");
      setMeta(await errorMessage(response), "failed");
      return;
    }
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices) {
        if (choice.text) {
          first ??= performance.now();
          card.output.textContent += choice.text;
        }
        finish = choice.finish_reason ?? finish;
      }
      if (first !== null) setMeta(`TTFT ${(first - started).toFixed(0)} ms · streaming`, "running");
    });
  } catch (err) {
    card.meta.classList.add("failed");
    setMeta(String(err), "failed");
    return;
  }
  const ended = performance.now();
  const ttft = first === null ? "no text" : `TTFT ${(first - started).toFixed(0)} ms`;
  const rate = tokens > 1 && first !== null ? (tokens - 1) / ((ended - first) / 1000) : null;
  const speed = rate === null ? "" : ` · ${rate.toFixed(1)} tokens/s`;
  setMeta(`${ttft}${speed} · ${tokens ?? "?"} tokens · ${finish ?? "?"}`, "done");
}

$("send-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const copies = Math.max(1, Number($("copies").value) || 1);
  for (let i = 0; i < copies; i++) complete(requestBody(), ++sent);
});

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem("rose-api-key", apiKey);
  connect();
});

$("api-key").value = apiKey;
connect();
