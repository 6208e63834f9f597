// Rendering: every node is built with createElement and textContent, never
// from markup, so nothing the API returns (node ids, labels, messages) can
// become script. The page's policy (Trusted Types) refuses markup strings.

/// An element: `attrs` become attributes (`class`, `data-*`, `title`, ...),
/// `children` strings become text.
export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

/// A duration in words: `4s`, `2m 5s`, `3h 2m`, `4d 3h`.
export function span(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const h = Math.floor(m / 60);
  if (h < 24) return `${h}h ${m % 60}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

/// An element whose text is the age of `since` (ISO time), kept current by
/// `tick`: `prefix` + age + `suffix`.
export function age(since, prefix = "", suffix = " ago") {
  return el("time", {
    class: "age",
    datetime: since,
    "data-since": Date.parse(since),
    "data-prefix": prefix,
    "data-suffix": suffix,
    title: new Date(since).toLocaleString(),
  });
}

/// Bring every age on the page to `now` (ms, the controller's clock).
export function tick(root, now) {
  for (const t of root.querySelectorAll("time.age")) {
    const ms = now - Number(t.dataset.since);
    t.textContent = `${t.dataset.prefix}${span(ms)}${t.dataset.suffix}`;
  }
}

function pill(kind, text) {
  return el("span", { class: `pill ${kind}` }, text ?? kind);
}

function empty(text) {
  return el("p", { class: "empty" }, text);
}

/// The fleet as a grid of cards, by id. A heartbeat's age, as of this
/// listing (`now`, the controller's clock), is `late` past two intervals and
/// `stale` past the detection time (`heartbeat`: the fleet's, from
/// `GET /v1/nodes`); between listings the age ticks on without judging.
export function nodes(nodes, now, heartbeat) {
  if (nodes.length === 0) return [empty("No node has joined yet.")];
  return nodes.map((n) => {
    // What selects (the node's id, `mesh.io/node`, is its card's title),
    // then what it states of itself that selects nothing, marked as stated.
    const effective = n.labels || {};
    const labels = [
      ...Object.entries(effective)
        .filter(([k]) => !k.startsWith("mesh.io/"))
        .map(([k, v]) => el("li", {}, `${k}=${v}`)),
      ...Object.entries(n.stated || {})
        .filter(([k, v]) => effective[k] !== v)
        .map(([k, v]) => el("li", { class: "stated", title: "stated by the node: selects nothing" }, `${k}=${v}`)),
    ].slice(0, 8);
    const heard = age(n.last_seen, "heard ", " ago");
    heard.classList.add("heard");
    if (heartbeat) {
      const ms = now - Date.parse(n.last_seen);
      const lag = heartbeat.last_seen_lag_ms;
      // A listing takes a moment: a second of slack before `late`.
      heard.classList.toggle("late", ms > 2 * heartbeat.interval_ms + lag + 1000);
      heard.classList.toggle("stale", ms > heartbeat.detection_ms + lag);
    }
    return el(
      "article",
      { class: "node", "data-node": n.id, "data-state": n.state },
      el("header", {}, el("span", { class: "dot", "aria-hidden": "true" }), el("strong", { class: "id" }, n.id), pill(n.state)),
      el("div", { class: "host" }, n.hostname),
      el("div", { class: "beat" }, heard),
      labels.length
        ? el("ul", { class: "labels" }, labels)
        : null,
    );
  });
}

/// Modules with their replicas' health.
export function modules(modules) {
  if (modules.length === 0) return [empty("No module is declared.")];
  return modules.map((m) => {
    const health = m.health ? m.health.health : "unknown";
    const replicas = m.health ? m.health.replicas : [];
    const healthy = replicas.filter((r) => r.health === "healthy").length;
    const assignments = m.assignments || [];
    const placed = assignments.length;
    const ooms = assignments.reduce((n, a) => n + (a.oom_kills || 0), 0);
    // A replica's box as its node reported it: uid, OOM kills, data volume.
    const box = (r) => {
      const a = assignments.find((x) => x.node === r.node && x.name === r.unit);
      if (!a) return "";
      const parts = [];
      if (a.uid !== null && a.uid !== undefined) parts.push(`uid ${a.uid}`);
      if (a.oom_kills) parts.push(`${a.oom_kills} OOM kills`);
      if (a.data_bytes !== null && a.data_bytes !== undefined) parts.push(`data ${a.data_bytes} B`);
      return parts.length ? `; ${parts.join(", ")}` : "";
    };
    return el(
      "article",
      { class: "row module", "data-module": m.name, "data-health": health },
      el("div", { class: "main" },
        el("strong", {}, m.name),
        pill(health),
        m.desired === "stopped" ? pill("stopped") : null,
        m.unit && m.unit.user === "root" ? pill("root") : null),
      el("div", { class: "replicas" },
        el("span", { class: "ratio" }, `${healthy}/${m.effective_replicas} healthy`),
        el("span", { class: "dots" }, replicas.map((r) =>
          el("span", {
            class: `rep ${r.health}`,
            title: `${r.unit} on ${r.node}: ${r.health}${r.reason ? ` (${r.reason})` : ""}${box(r)}`,
          }))),
        placed < m.effective_replicas ? el("span", { class: "warn" }, `${placed} placed`) : null,
        ooms > 0 ? el("span", { class: "warn", "data-oom-kills": String(ooms) }, `${ooms} OOM kills`) : null),
      m.placement_error ? el("div", { class: "detail error" }, m.placement_error) : null,
    );
  });
}

/// Open alerts, newest first.
export function alerts(alerts) {
  if (alerts.length === 0) return [empty("No open alert.")];
  return alerts.map((a) =>
    el(
      "article",
      { class: "row alert", "data-alert": a.id, "data-severity": a.severity },
      el("div", { class: "main" }, pill(a.severity), el("strong", {}, a.subject), age(a.since, "for ", "")),
      el("div", { class: "detail" }, a.message),
    ));
}

/// Rollouts that are not over.
export function rollouts(rollouts) {
  if (rollouts.length === 0) return [empty("No rollout in progress.")];
  return rollouts.map((r) =>
    el(
      "article",
      { class: "row rollout", "data-rollout": r.id },
      el("div", { class: "main" },
        el("strong", {}, r.module),
        pill(r.state),
        el("span", { class: "muted" }, `step ${r.step}/${r.steps}`),
        age(r.created_at, "started ", " ago")),
      el("div", { class: "progress" },
        el("progress", { max: Math.max(1, r.nodes_total), value: r.nodes_done }),
        el("span", { class: "muted" }, `${r.nodes_done}/${r.nodes_total} nodes`)),
      r.paused_reason ? el("div", { class: "detail" }, r.paused_reason) : null,
    ));
}

/// What an event says, in a few words.
function gist(e) {
  const b = e.body || {};
  if (e.context === "observability" && e.event.startsWith("alert.")) return b.message;
  if (e.event === "module.health") return `${b.module}: ${b.health}`;
  if (b.state) return `${b.node}: ${b.state}`;
  if (e.event === "fleet.conditions") {
    const n = (b.conditions || []).length;
    return n === 0 ? "no condition" : (b.conditions || []).map((c) => c.message).join("; ");
  }
  if (e.event === "module.placed") return `${b.module} on ${(b.nodes || []).join(", ") || "no node"}`;
  return [e.node, e.module].filter(Boolean).join(" · ");
}

/// One line of the event feed.
export function event(e) {
  const at = new Date(e.sent_at);
  return el(
    "li",
    { "data-position": e.position, "data-kind": `${e.context}.${e.event}` },
    el("time", { datetime: e.sent_at, title: at.toLocaleString() }, at.toLocaleTimeString([], { hour12: false })),
    el("span", { class: `kind ${e.context}` }, `${e.context}.${e.event}`),
    el("span", { class: "gist" }, gist(e) || ""),
  );
}
