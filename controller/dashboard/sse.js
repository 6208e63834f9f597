// Server-sent events over fetch (docs/decisions/0035).
//
// EventSource cannot send an Authorization header, so the stream is read
// with fetch and a ReadableStream, and parsed here as the HTML standard's
// event-stream format says: lines end with CRLF, LF or CR; `:` starts a
// comment (the controller's keep-alive); `data` lines join with LF; `id`
// sets the last event id; a blank line dispatches.
//
// After a disconnect the stream resumes with `Last-Event-ID`, so no event is
// missed or repeated. A 410 means the position is older than what the
// controller keeps: the caller re-lists, and the stream follows from now.
// Without a position (the first connection, or after a 410) the caller is
// told to re-list once the stream is open, so that nothing that happened
// before the stream started is missed either.

/// The event-stream parser: feed it text as it arrives, it returns the
/// complete events ({type, data, id}) in order.
export class SseParser {
  constructor() {
    this.buffer = "";
    this.data = [];
    this.type = "";
    this.id = null; // the last event id buffer
    this.retry = null;
  }

  push(text) {
    this.buffer += text;
    const events = [];
    for (;;) {
      const m = /[\r\n]/.exec(this.buffer);
      if (!m) break;
      const i = m.index;
      // A CR at the very end may be the first half of a CRLF: wait for more.
      if (this.buffer[i] === "\r" && i === this.buffer.length - 1) break;
      const line = this.buffer.slice(0, i);
      const skip = this.buffer[i] === "\r" && this.buffer[i + 1] === "\n" ? 2 : 1;
      this.buffer = this.buffer.slice(i + skip);
      const event = this.line(line);
      if (event) events.push(event);
    }
    return events;
  }

  line(line) {
    if (line === "") {
      const data = this.data;
      const type = this.type || "message";
      this.data = [];
      this.type = "";
      if (data.length === 0) return null;
      return { type, data: data.join("\n"), id: this.id };
    }
    if (line.startsWith(":")) return null;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    switch (field) {
      case "data":
        this.data.push(value);
        break;
      case "event":
        this.type = value;
        break;
      case "id":
        if (!value.includes("\0")) this.id = value;
        break;
      case "retry":
        if (/^\d+$/.test(value)) this.retry = Number(value);
        break;
      default:
        break;
    }
    return null;
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/// Longest silence before the connection is taken for dead: the controller
/// sends a keep-alive comment every 15 s.
const SILENCE_MS = 45000;

/// One followed stream. `options`: `url`; `token()` → the bearer token;
/// `onEvent({type, data, id})`; `onStatus("connecting" | "live" |
/// "reconnecting" | "off", detail)`; `onRelist()` (the stream is open
/// without a position: list everything now); `onUnauthorized()`.
export class EventStream {
  constructor(options) {
    this.options = options;
    this.lastId = null;
    this.stopped = true;
    this.controller = null;
    this.generation = 0;
  }

  /// Follow the stream from now (the caller is told to list first).
  start() {
    if (!this.stopped) return;
    this.stopped = false;
    this.lastId = null;
    this.generation += 1;
    this.run(this.generation);
  }

  stop() {
    this.stopped = true;
    if (this.controller) this.controller.abort();
    this.options.onStatus("off");
  }

  /// One loop per start: a loop of an earlier start ends at its next turn.
  async run(generation) {
    const o = this.options;
    let backoff = 500;
    o.onStatus("connecting");
    while (!this.stopped && generation === this.generation) {
      const controller = new AbortController();
      this.controller = controller;
      const headers = { Authorization: `Bearer ${o.token()}`, Accept: "text/event-stream" };
      if (this.lastId !== null) headers["Last-Event-ID"] = this.lastId;
      let detail = "";
      try {
        const response = await fetch(o.url, {
          headers,
          signal: controller.signal,
          cache: "no-store",
          credentials: "omit",
        });
        if (response.status === 401) {
          this.stopped = true;
          o.onUnauthorized();
          return;
        }
        if (response.status === 410) {
          // Older than what the controller keeps: follow from now, re-list.
          this.lastId = null;
          continue;
        }
        if (!response.ok || !response.body) {
          throw new Error(`the event stream answered ${response.status}`);
        }
        o.onStatus("live");
        backoff = 500;
        if (this.lastId === null) o.onRelist();
        await this.read(response.body, controller);
        detail = "the stream ended";
      } catch (e) {
        if (this.stopped) return;
        detail = e && e.message ? e.message : String(e);
      }
      if (this.stopped || generation !== this.generation) return;
      o.onStatus("reconnecting", detail);
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 15000);
    }
  }

  async read(body, controller) {
    const parser = new SseParser();
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let timer = null;
    const watch = () => {
      clearTimeout(timer);
      timer = setTimeout(() => controller.abort(), SILENCE_MS);
    };
    watch();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        watch();
        for (const event of parser.push(value)) {
          // An empty id resets the position (the standard's rule).
          if (event.id !== null) this.lastId = event.id === "" ? null : event.id;
          if (event.type === "dropped") {
            // The controller let us go (we read too slowly): resume.
            return;
          }
          try {
            this.options.onEvent(event);
          } catch (e) {
            console.error("event handler", e);
          }
        }
      }
    } finally {
      clearTimeout(timer);
      reader.cancel().catch(() => {});
    }
  }
}
