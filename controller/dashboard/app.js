// The operator dashboard (docs/decisions/0035): read-only, a client of the
// API like any other. The API token lives in this tab's sessionStorage and
// nowhere else; every call sends it as a bearer token, so the page sees what
// the token may see. Lists are read from /v1; the event stream (sse.js) says
// when something changed, and what changed is listed again (level-triggered:
// an event is a reason to look, the list is the truth), with no reload.

import { EventStream } from "./sse.js";
import * as view from "./view.js";

const KEY = "mesh.dashboard.token";
const store = window.sessionStorage;
const $ = (id) => document.getElementById(id);

/// Most events kept in the feed.
const FEED = 60;
/// Rollout states that are not over.
const IN_PROGRESS = new Set(["awaiting_approval", "running", "paused"]);

const state = {
  nodes: [],
  heartbeat: null,
  modules: [],
  alerts: new Map(),
  rollouts: [],
  // The controller's clock minus ours (from `Date` headers), so ages are
  // the controller's.
  skew: 0,
};

class Unauthorized extends Error {}

function token() {
  return store.getItem(KEY) || "";
}

function now() {
  return Date.now() + state.skew;
}

function noteClock(response) {
  const date = Date.parse(response.headers.get("date") || "");
  if (Number.isNaN(date)) return;
  // `Date` has whole seconds: move only on a real difference.
  const skew = date + 500 - Date.now();
  if (Math.abs(skew - state.skew) > 2000) state.skew = skew;
}

/// GET `path` with the token; a problem's title and detail on failure.
async function api(path) {
  const t = token();
  if (!t) throw new Unauthorized("no token");
  const response = await fetch(path, {
    headers: { Authorization: `Bearer ${t}`, Accept: "application/json" },
    cache: "no-store",
    credentials: "omit",
  });
  noteClock(response);
  if (response.status === 401) throw new Unauthorized("the controller refused the token");
  if (!response.ok) {
    const p = await response.json().catch(() => ({}));
    const what = [p.title, p.detail].filter(Boolean).join(": ");
    throw new Error(`${path}: ${response.status}${what ? ` ${what}` : ""}`);
  }
  return response.json();
}

/// Every page of a list (`key`: the array's name), with the last page.
async function all(path, key) {
  const items = [];
  let after = null;
  let page = null;
  for (let i = 0; i < 10000; i++) {
    const sep = path.includes("?") ? "&" : "?";
    page = await api(after === null ? path : `${path}${sep}after=${encodeURIComponent(after)}`);
    items.push(...page[key]);
    if (!page.next) break;
    after = page.next;
  }
  return [items, page];
}

// ------------------------------------------------------------------ loading

const loaders = {
  async nodes() {
    const [nodes, last] = await all("/v1/nodes", "nodes");
    state.nodes = nodes;
    state.heartbeat = last ? last.heartbeat : null;
  },
  async modules() {
    const [modules] = await all("/v1/modules", "modules");
    state.modules = modules;
  },
  async alerts() {
    const list = await api("/v1/alerts?state=open&limit=500");
    state.alerts = new Map(list.alerts.map((a) => [a.id, a]));
  },
  async rollouts() {
    const list = await api("/v1/rollouts");
    state.rollouts = list.rollouts.filter((r) => IN_PROGRESS.has(r.state));
  },
};

const wanted = new Set();
let loading = null;
let timer = null;

/// List `what` again soon (changes close together are listed once).
function want(...what) {
  for (const w of what) wanted.add(w);
  if (timer === null) timer = setTimeout(load, 250);
}

async function load() {
  timer = null;
  if (loading) {
    // One round at a time; this one comes right after.
    await loading;
    if (timer === null && wanted.size) timer = setTimeout(load, 0);
    return;
  }
  const round = [...wanted];
  wanted.clear();
  loading = Promise.all(
    round.map(async (what) => {
      const error = $(`${what}-error`);
      try {
        await loaders[what]();
        error.textContent = "";
        render(what);
      } catch (e) {
        if (e instanceof Unauthorized) {
          signOut(e.message);
        } else {
          error.textContent = e.message;
        }
      }
    }),
  );
  await loading;
  loading = null;
}

// ---------------------------------------------------------------- rendering

function render(what) {
  const board = $("board");
  switch (what) {
    case "nodes":
      $("nodes").replaceChildren(...view.nodes(state.nodes, now(), state.heartbeat));
      $("nodes-count").textContent = String(state.nodes.length);
      break;
    case "modules":
      $("modules").replaceChildren(...view.modules(state.modules));
      $("modules-count").textContent = String(state.modules.length);
      break;
    case "alerts": {
      const open = [...state.alerts.values()].sort((a, b) => (a.since < b.since ? 1 : -1));
      $("alerts").replaceChildren(...view.alerts(open));
      $("alerts-count").textContent = String(open.length);
      break;
    }
    case "rollouts":
      $("rollouts").replaceChildren(...view.rollouts(state.rollouts));
      $("rollouts-count").textContent = String(state.rollouts.length);
      break;
    default:
      break;
  }
  summary();
  view.tick(board, now());
}

function summary() {
  const by = {};
  for (const n of state.nodes) by[n.state] = (by[n.state] || 0) + 1;
  const health = {};
  for (const m of state.modules) {
    const h = m.health ? m.health.health : "unknown";
    health[h] = (health[h] || 0) + 1;
  }
  const parts = [];
  const stat = (n, label, kind) =>
    view.el("span", { class: `stat ${kind || ""}` }, view.el("b", {}, String(n)), ` ${label}`);
  parts.push(stat(by.alive || 0, "alive", "alive"));
  if (by.unreachable) parts.push(stat(by.unreachable, "unreachable", "unreachable"));
  for (const s of ["draining", "drained", "refused", "revoked"]) {
    if (by[s]) parts.push(stat(by[s], s, s));
  }
  parts.push(view.el("span", { class: "sep" }));
  for (const h of ["healthy", "degraded", "down"]) {
    if (health[h]) parts.push(stat(health[h], `${h}`, h));
  }
  if (state.alerts.size) parts.push(stat(state.alerts.size, "open alerts", "critical"));
  if (state.heartbeat) {
    parts.push(
      view.el("span", { class: "stat muted", title: "heartbeat interval; grace plus one sweep" },
        `beat ${view.span(state.heartbeat.interval_ms)} · detect ${(state.heartbeat.detection_ms / 1000).toFixed(1)}s`),
    );
  }
  $("summary").replaceChildren(...parts);
}

// ------------------------------------------------------------------- events

function onEvent(message) {
  let e;
  try {
    e = JSON.parse(message.data);
  } catch {
    return;
  }
  if (!e || typeof e.context !== "string" || typeof e.event !== "string") return;
  const feed = $("events");
  feed.prepend(view.event(e));
  while (feed.children.length > FEED) feed.lastElementChild.remove();

  const b = e.body || {};
  if (e.context === "inventory" && e.event.startsWith("node.")) {
    // At once, then the list says the rest (a drained node alive is `drained`).
    if (b.state === "unreachable") setNodeState(b.node, "unreachable");
    want("nodes");
  } else if (e.context === "identity") {
    want("nodes");
  } else if (e.context === "inventory" && e.event.startsWith("module.")) {
    want("modules");
  } else if (e.context === "observability" && e.event === "module.health") {
    // At once (inventory learns it from the record a moment later), then
    // the list says the rest.
    const m = state.modules.find((x) => x.name === b.module);
    if (m && Array.isArray(b.replicas)) {
      m.health = { health: b.health, replicas: b.replicas, at: b.at };
      render("modules");
    }
    want("modules");
  } else if (e.context === "observability" && e.event === "alert.raised") {
    state.alerts.set(b.id, { ...b, state: "open" });
    render("alerts");
  } else if (e.context === "observability" && e.event === "alert.resolved") {
    state.alerts.delete(b.id);
    render("alerts");
  } else if (e.context === "delivery") {
    want("rollouts", "modules");
  }
}

function setNodeState(id, s) {
  const n = state.nodes.find((x) => x.id === id);
  if (!n || n.state === "revoked" || n.state === "refused") return;
  n.state = s;
  render("nodes");
}

function onStatus(status, detail) {
  const link = $("link");
  link.dataset.state = status;
  link.textContent = { connecting: "connecting…", live: "live", reconnecting: "reconnecting…", off: "offline" }[status] || status;
  link.title = detail ? `The event stream: ${detail}` : "The event stream";
}

const stream = new EventStream({
  url: "/v1/events",
  token,
  onEvent,
  onStatus,
  // Open without a position: whatever happened before is in the lists.
  onRelist: () => want("nodes", "modules", "alerts", "rollouts"),
  onUnauthorized: () => signOut("the controller refused the token"),
});

// ------------------------------------------------------------------ session

let clocks = [];

function signIn() {
  $("login").hidden = true;
  $("board").hidden = false;
  $("signout").hidden = false;
  stream.start();
  // The age of each heartbeat ticks; lists that events do not cover (a
  // node's last heartbeat, a rollout's progress) are read again on a clock.
  clocks = [
    setInterval(() => view.tick($("board"), now()), 1000),
    setInterval(() => want("nodes"), Math.max(5000, state.heartbeat ? state.heartbeat.interval_ms : 0)),
    setInterval(() => {
      if (state.rollouts.length) want("rollouts");
    }, 5000),
    setInterval(() => want("rollouts", "alerts"), 60000),
  ];
}

function signOut(reason) {
  store.removeItem(KEY);
  stream.stop();
  clocks.forEach(clearInterval);
  clocks = [];
  $("board").hidden = true;
  $("signout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = reason || "";
  $("token").value = "";
  $("token").focus();
}

async function submit(event) {
  event.preventDefault();
  const input = $("token");
  const t = input.value.trim();
  if (!t) return;
  $("login-submit").disabled = true;
  store.setItem(KEY, t);
  input.value = "";
  try {
    // Checked before the board shows: a wrong token is said here.
    await api("/v1/nodes?limit=1");
    $("login-error").textContent = "";
    signIn();
  } catch (e) {
    store.removeItem(KEY);
    $("login-error").textContent =
      e instanceof Unauthorized ? "The controller refused this token." : e.message;
  } finally {
    $("login-submit").disabled = false;
  }
}

function main() {
  $("login-form").addEventListener("submit", submit);
  $("signout").addEventListener("click", () => signOut(""));
  if (token()) {
    signIn();
  } else {
    signOut("");
  }
}

main();
