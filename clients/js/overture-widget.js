// Overture chat widget: an ES module, no build step, no dependencies.
//
//   import { Overture } from "/static/overture-widget.js";
//   Overture.attach({ form, input, output, endpoint: "", model: "demo", apiKey, sessionId });
//
// It sends one advisory (POST /v1/advisory) when the user starts typing a turn, so the
// server moves the conversation's KV into place while they type (Symphony §3.5). The
// advisory says only that a turn is coming, never what is typed. Clearing the draft, or
// leaving it untouched for `abandonAfterMs`, invalidates it (§3.6). A turn is a streaming
// chat completion under the session id; answers render as Markdown built from DOM nodes
// (model output never becomes HTML). The history is kept in localStorage.

const STORE_PREFIX = "overture-chat:";

function newSessionId() {
  const bytes = new Uint8Array(12);
  crypto.getRandomValues(bytes);
  return "chat-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// ---------------------------------------------------------------- Markdown, safely
// Fenced code, inline code, bold, italic, headings, lists and paragraphs, as DOM nodes:
// every piece of text goes in through textContent, so nothing in it is ever parsed as HTML.

function inline(parent, text) {
  const pattern = /(`[^`]+`|\*\*[^*]+\*\*|\*[^*\s][^*]*\*)/g;
  let last = 0;
  for (const m of text.matchAll(pattern)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    const token = m[0];
    let el;
    if (token.startsWith("`")) { el = document.createElement("code"); el.textContent = token.slice(1, -1); }
    else if (token.startsWith("**")) { el = document.createElement("strong"); el.textContent = token.slice(2, -2); }
    else { el = document.createElement("em"); el.textContent = token.slice(1, -1); }
    parent.append(el);
    last = m.index + token.length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

export function renderMarkdown(text) {
  const root = document.createDocumentFragment();
  const lines = text.split("\n");
  let list = null;
  let para = null;
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^```\s*([\w+-]*)\s*$/);
    if (fence) {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (fence[1]) code.dataset.lang = fence[1];
      const body = [];
      for (i++; i < lines.length && !/^```\s*$/.test(lines[i]); i++) body.push(lines[i]);
      code.textContent = body.join("\n");
      pre.append(code);
      root.append(pre);
      list = para = null;
      continue;
    }
    const item = line.match(/^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/);
    if (item) {
      const kind = item[1] ? "OL" : "UL";
      if (!list || list.tagName !== kind) { list = document.createElement(kind.toLowerCase()); root.append(list); }
      const li = document.createElement("li");
      inline(li, item[2]);
      list.append(li);
      para = null;
      continue;
    }
    list = null;
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      const h = document.createElement("h" + Math.min(6, heading[1].length + 2));
      inline(h, heading[2]);
      root.append(h);
      para = null;
      continue;
    }
    if (!line.trim()) { para = null; continue; }
    if (!para) { para = document.createElement("p"); root.append(para); }
    else para.append(document.createElement("br"));
    inline(para, line);
  }
  return root;
}

// ---------------------------------------------------------------- server-sent events

async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `the server answered ${response.status}`;
}

// ---------------------------------------------------------------- the widget

class ChatWidget {
  constructor(opts) {
    this.form = opts.form;
    this.input = opts.input;
    this.output = opts.output;
    this.endpoint = (opts.endpoint || "").replace(/\/$/, "");
    this.apiKey = opts.apiKey || "";
    this.model = opts.model;
    this.params = opts.params || {};
    this.debounceMs = opts.debounceMs ?? 150;
    this.abandonAfterMs = opts.abandonAfterMs ?? 60000;
    this.expectedArrivalS = opts.expectedArrivalS ?? 5;
    this.stopButton = opts.stopButton || null;
    this.storage = opts.storage === undefined ? window.localStorage : opts.storage;
    const saved = this._load(opts.sessionId);
    this.sessionId = saved.sessionId;
    this.history = saved.history; // [{role, content, status?}]
    this.advisoryId = null;
    this.advising = null;
    this.debounce = null;
    this.abandon = null;
    this.controller = null;
    this._bind();
    this.render();
  }

  // ------------------------------------------------------------ persistence
  _key(id) { return STORE_PREFIX + id; }

  _load(sessionId) {
    const id = sessionId || (this.storage && this.storage.getItem(STORE_PREFIX + "last")) || newSessionId();
    let history = [];
    try { history = JSON.parse((this.storage && this.storage.getItem(this._key(id))) || "[]"); } catch (_) { history = []; }
    return { sessionId: id, history: Array.isArray(history) ? history : [] };
  }

  _save() {
    if (!this.storage) return;
    this.storage.setItem(this._key(this.sessionId), JSON.stringify(this.history));
    this.storage.setItem(STORE_PREFIX + "last", this.sessionId);
  }

  newConversation() {
    this.stop();
    this._invalidate();
    this.sessionId = newSessionId();
    this.history = [];
    this._save();
    this.render();
  }

  // ------------------------------------------------------------ advisories
  _headers(extra = {}) {
    const h = { "Content-Type": "application/json", ...extra };
    if (this.apiKey) h.Authorization = "Bearer " + this.apiKey;
    return h;
  }

  _typing() {
    clearTimeout(this.abandon);
    if (!this.input.value.trim()) {
      clearTimeout(this.debounce);
      this._invalidate();
      return;
    }
    if (!this.advisoryId && !this.advising && !this.debounce) {
      this.debounce = setTimeout(() => { this.debounce = null; this._advise(); }, this.debounceMs);
    }
    this.abandon = setTimeout(() => this._invalidate(), this.abandonAfterMs);
  }

  async _advise() {
    if (this.controller) return; // (a turn is streaming: the next one is advised after it)
    const body = { session_id: this.sessionId, model: this.model, expected_arrival_s: this.expectedArrivalS };
    this.advising = fetch(this.endpoint + "/v1/advisory", {
      method: "POST", headers: this._headers(), body: JSON.stringify(body),
    }).then(async (r) => (r.status === 202 ? (await r.json()).advisory_id : null))
      .catch(() => null);
    const id = await this.advising;
    this.advising = null;
    if (id && !this.input.value.trim()) { this._delete(id); return; } // cleared meanwhile
    this.advisoryId = id;
  }

  _invalidate() {
    clearTimeout(this.abandon);
    const id = this.advisoryId;
    this.advisoryId = null;
    if (id) this._delete(id);
  }

  _delete(id) {
    fetch(this.endpoint + "/v1/advisory/" + encodeURIComponent(id), {
      method: "DELETE", headers: this._headers(),
    }).catch(() => {});
  }

  // ------------------------------------------------------------ turns
  _bind() {
    this.input.addEventListener("input", () => this._typing());
    this.input.addEventListener("paste", () => setTimeout(() => this._typing(), 0));
    this.form.addEventListener("submit", (e) => {
      e.preventDefault();
      const text = this.input.value.trim();
      if (!text || this.controller) return;
      this.input.value = "";
      clearTimeout(this.debounce); this.debounce = null;
      clearTimeout(this.abandon);
      this.advisoryId = null; // (the request follows it: the server ends it)
      this.history.push({ role: "user", content: text });
      this._turn();
    });
    if (this.stopButton) this.stopButton.addEventListener("click", (e) => { e.preventDefault(); this.stop(); });
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  edit(index, text) {
    // The edited message replaces index and drops everything after it; the server's
    // content hashes reuse the unchanged prefix.
    if (this.controller || this.history[index]?.role !== "user") return;
    this.history = this.history.slice(0, index);
    this.history.push({ role: "user", content: text });
    this._turn();
  }

  regenerate(index) {
    if (this.controller || this.history[index]?.role !== "assistant") return;
    this.history = this.history.slice(0, index);
    this._turn();
  }

  async _turn() {
    const answer = { role: "assistant", content: "", status: {} };
    this.history.push(answer);
    this._save();
    this.render();
    const messages = this.history.slice(0, -1).map(({ role, content }) => ({ role, content }));
    const controller = new AbortController();
    this.controller = controller;
    this._busy(true);
    const started = performance.now();
    try {
      const response = await fetch(this.endpoint + "/v1/chat/completions", {
        method: "POST", signal: controller.signal,
        headers: this._headers({ "X-Session-Id": this.sessionId }),
        body: JSON.stringify({ model: this.model, messages, stream: true,
                               stream_options: { include_usage: true }, ...this.params }),
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      answer.status.node = response.headers.get("X-Overture-Node") || "";
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (answer.status.ttftMs === undefined) answer.status.ttftMs = Math.round(performance.now() - started);
          answer.content += delta.content;
          this._renderLast();
        }
        if (chunk.usage) answer.status.cached = chunk.usage.prompt_tokens_details?.cached_tokens ?? 0;
      }
    } catch (err) {
      if (controller.signal.aborted) answer.status.stopped = true;
      else answer.status.error = String(err && err.message ? err.message : err);
    } finally {
      this.controller = null;
      this._busy(false);
      this._save();
      this.render();
    }
  }

  _busy(on) {
    if (this.stopButton) this.stopButton.hidden = !on;
    this.form.classList.toggle("overture-busy", on);
  }

  // ------------------------------------------------------------ rendering
  _message(msg, index) {
    const box = document.createElement("div");
    box.className = "overture-msg overture-" + msg.role;
    box.dataset.index = String(index);
    const body = document.createElement("div");
    body.className = "overture-body";
    if (msg.role === "assistant") body.append(renderMarkdown(msg.content));
    else body.textContent = msg.content;
    box.append(body);
    const st = msg.status;
    if (st && (st.error || st.stopped || st.node || st.ttftMs !== undefined)) {
      const line = document.createElement("div");
      line.className = st.error ? "overture-error" : "overture-status";
      if (st.error) line.textContent = "Error: " + st.error;
      else {
        const parts = [];
        if (st.ttftMs !== undefined) parts.push(`first token ${st.ttftMs} ms`);
        if (st.cached !== undefined) parts.push(`${st.cached} tokens cached`);
        if (st.node) parts.push(`served by ${st.node}`);
        if (st.stopped) parts.push("stopped");
        line.textContent = parts.join(" · ");
      }
      box.append(line);
    }
    if (!this.controller) {
      const tools = document.createElement("div");
      tools.className = "overture-tools";
      const button = (label, onClick) => {
        const b = document.createElement("button");
        b.type = "button"; b.textContent = label; b.className = "overture-" + label.toLowerCase();
        b.addEventListener("click", onClick);
        tools.append(b);
      };
      if (msg.role === "user") button("Edit", () => this._startEdit(box, index));
      if (msg.role === "assistant") button("Regenerate", () => this.regenerate(index));
      box.append(tools);
    }
    return box;
  }

  _startEdit(box, index) {
    const area = document.createElement("textarea");
    area.className = "overture-edit-text";
    area.value = this.history[index].content;
    const save = document.createElement("button");
    save.type = "button"; save.textContent = "Send"; save.className = "overture-send-edit";
    save.addEventListener("click", () => { const t = area.value.trim(); if (t) this.edit(index, t); });
    box.replaceChildren(area, save);
    area.focus();
  }

  render() {
    this.output.replaceChildren(...this.history.map((m, i) => this._message(m, i)));
    this.output.scrollTop = this.output.scrollHeight;
  }

  _renderLast() {
    const last = this.output.lastElementChild;
    const index = this.history.length - 1;
    const fresh = this._message(this.history[index], index);
    if (last) last.replaceWith(fresh); else this.output.append(fresh);
    this.output.scrollTop = this.output.scrollHeight;
  }
}

export const Overture = {
  attach(opts) {
    for (const key of ["form", "input", "output", "model"]) {
      if (!opts || !opts[key]) throw new Error(`Overture.attach: '${key}' is required`);
    }
    return new ChatWidget(opts);
  },
  renderMarkdown,
};

export default Overture;
