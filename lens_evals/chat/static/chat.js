// lens-evals chat: the page's script (vanilla JS, no build step, nothing fetched but this server's API).
"use strict";

const state = { info: null, messages: [], busy: false, selected: null };
window.chatState = state; // read by the browser test
const $ = (id) => document.getElementById(id);

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function api(path, body) {
  const response = await fetch(path, body === undefined ? {} : {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try { message = (await response.json()).error || message; } catch (e) { /* not JSON: keep the status line */ }
    throw new Error(message);
  }
  return response;
}

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = value; o.textContent = text;
  select.appendChild(o);
}

function probeName() { return $("probe").value || null; }

function colour(score, scale) {
  const strength = scale > 0 ? Math.min(1, Math.abs(score) / scale) : 0;
  const rgb = score > 0 ? "220,38,38" : "37,99,235";
  return `rgba(${rgb},${(0.1 + 0.6 * strength).toFixed(3)})`;
}

function scoreScale(probe) {
  let scale = 0;
  for (const m of state.messages) for (const t of m.tokens || []) {
    const s = t.scores && t.scores[probe];
    if (s !== undefined && Number.isFinite(s)) scale = Math.max(scale, Math.abs(s));
  }
  return scale;
}

function recolour() {
  const probe = probeName();
  const scale = probe ? scoreScale(probe) : 0;
  document.querySelectorAll(".tok[data-m]").forEach((span) => {
    const token = state.messages[+span.dataset.m].tokens[+span.dataset.t];
    const score = probe && token.scores ? token.scores[probe] : undefined;
    span.style.background = score === undefined ? "" : colour(score, scale);
    span.title = score === undefined ? "" : `${probe}: ${score.toFixed(3)}`;
  });
}

function messageBox(message) {
  const box = document.createElement("div");
  box.className = `msg ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role + (message.steering ? " " : "");
  if (message.steering) {
    const s = document.createElement("span");
    s.className = "steer"; s.textContent = `steered: ${message.steering}`;
    role.appendChild(s);
  }
  const text = document.createElement("div");
  text.className = "text";
  box.append(role, text);
  $("log").appendChild(box);
  return text;
}

function showDetails(m, t) {
  const token = state.messages[m].tokens[t];
  document.querySelectorAll(".tok.selected").forEach((s) => s.classList.remove("selected"));
  const span = document.querySelector(`.tok[data-m="${m}"][data-t="${t}"]`);
  if (span) span.classList.add("selected");
  state.selected = { m, t };
  const body = $("detail-body");
  body.textContent = "";
  const head = document.createElement("p");
  const probe = probeName();
  const score = probe && token.scores ? token.scores[probe] : undefined;
  head.textContent = `token ${JSON.stringify(token.text)} at position ${token.position}` +
    (score === undefined ? "" : `; ${probe}: ${score.toFixed(3)}`);
  body.appendChild(head);
  if (token.lens && token.lens.length) {
    const table = document.createElement("table");
    table.className = "lens";
    for (const entry of token.lens.slice().reverse()) {
      const row = table.insertRow();
      row.insertCell().textContent = `L${entry.layer}`;
      row.insertCell().textContent = entry.top.map(([text, p]) => `${JSON.stringify(text)} ${p.toFixed(2)}`).join("  ");
    }
    body.appendChild(table);
  }
  if (token.sae && token.sae.length) {
    const sae = document.createElement("p");
    sae.className = "sae";
    sae.textContent = `SAE ${state.info.sae.name} (layer ${state.info.sae.layer}): ` +
      token.sae.map(([id, v]) => `#${id} ${v.toFixed(2)}`).join(", ");
    body.appendChild(sae);
  }
}

function renderTokens(index, target) {
  target.textContent = "";
  state.messages[index].tokens.forEach((token, t) => {
    const span = document.createElement("span");
    span.className = "tok";
    span.dataset.m = index; span.dataset.t = t;
    span.textContent = token.text;
    span.addEventListener("mouseenter", () => showDetails(index, t));
    span.addEventListener("click", () => showDetails(index, t));
    target.appendChild(span);
  });
  recolour();
}

function steeringChoice() {
  const source = $("steer-source").value;
  if (!source) return null;
  return {
    source, layer: +$("steer-layer").value, scale: +$("steer-scale").value,
    vector: source === "vector" ? $("steer-vector").value : null,
    positive: source === "pair" ? $("steer-positive").value : null,
    negative: source === "pair" ? $("steer-negative").value : null,
  };
}

function steeringLabel(choice) {
  if (!choice) return null;
  const what = choice.source === "vector" ? choice.vector : `"${choice.positive}" - "${choice.negative}"`;
  return `${what} at layer ${choice.layer} x ${choice.scale}`;
}

function plain(messages) { return messages.map((m) => ({ role: m.role, content: m.content })); }

async function send(text) {
  if (state.busy || !text.trim()) return;
  state.busy = true; showError("");
  $("send").disabled = true;
  state.messages.push({ role: "user", content: text });
  messageBox(state.messages[state.messages.length - 1]).textContent = text;
  const steering = steeringChoice();
  const reply = { role: "assistant", content: "", tokens: null, steering: steeringLabel(steering) };
  const body = { messages: plain(state.messages), max_tokens: +$("max-tokens").value,
    temperature: +$("temperature").value, steering };
  const target = messageBox(reply);
  try {
    const response = await api("/api/chat", body);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const raw of events) {
        if (!raw.startsWith("data: ")) continue;
        const event = JSON.parse(raw.slice(6));
        if (event.type === "token") {
          const span = document.createElement("span");
          span.className = "tok pending"; span.textContent = event.text;
          target.appendChild(span);
          reply.content += event.text;
        } else if (event.type === "done") {
          reply.tokens = event.tokens;
          reply.content = event.tokens.map((t) => t.text).join("");
          state.messages.push(reply);
          renderTokens(state.messages.length - 1, target);
        } else if (event.type === "error") {
          throw new Error(event.message);
        }
      }
    }
    if (!reply.tokens) throw new Error("the reply ended without its final event");
  } catch (e) {
    showError(e.message); // the turn is taken back: the user's text returns to the input
    if (reply.tokens) state.messages.pop();
    state.messages.pop();
    const box = target.parentElement;
    box.previousSibling.remove();
    box.remove();
    $("input").value = text;
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

async function exportHtml() {
  const body = { model: state.info.model, probe: probeName(), messages: state.messages };
  return (await api("/api/export", body)).text();
}
window.exportHtml = exportHtml;

async function download() {
  try {
    const blob = new Blob([await exportHtml()], { type: "text/html" });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = "conversation.html";
    link.click();
    URL.revokeObjectURL(link.href);
  } catch (e) { showError(e.message); }
}

async function askOracle() {
  const out = $("oracle-answer");
  out.textContent = "asking...";
  try {
    if (!state.messages.length) throw new Error("chat first: the oracle reads the conversation's activations");
    const question = $("oracle-question").value;
    const answer = await (await api("/api/oracle", { messages: plain(state.messages), question })).json();
    out.textContent = `oracle (layer ${answer.target_layer}, ${answer.positions} positions): ${answer.answer}`;
  } catch (e) { out.textContent = e.message; }
}

async function start() {
  try {
    state.info = await (await api("/api/info")).json();
  } catch (e) { showError(`cannot read the page's settings: ${e.message}`); return; }
  const info = state.info;
  $("model").textContent = `${info.model} at ${info.server}; ${info.num_layers} layers`;
  option($("probe"), "", "none");
  for (const p of info.probes) option($("probe"), p.name, `${p.name} (layer ${p.layer})`);
  if (info.probes.length) $("probe").value = info.probes[0].name;
  for (const v of info.vectors) option($("steer-vector"), v, v);
  $("steer-layer").max = info.num_layers - 1;
  $("oracle-question").placeholder += ` (adapter ${info.oracle_lora})`;
  $("probe").addEventListener("change", () => {
    recolour();
    if (state.selected) showDetails(state.selected.m, state.selected.t);
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("clear").addEventListener("click", () => {
    state.messages = []; state.selected = null;
    $("log").textContent = ""; $("detail-body").textContent = ""; showError("");
  });
  $("export").addEventListener("click", download);
  $("oracle-ask").addEventListener("click", askOracle);
  state.ready = true;
}

start();
