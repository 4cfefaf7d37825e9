// The session page. The committed transcript is the truth: it comes from the stream's catch-up
// and, after each `committed` frame, from a get_messages command. The turn in flight is drawn
// from its event frames and replaced by the transcript once its output is committed. A resumed
// stream's catch-up replays the turn in flight from its start, so the live block is rebuilt from
// it rather than appended to: every reply is shown once, whatever the stream went through.
// A reply whose replica died mid-turn is not replayed by the replica that takes the session
// over (the prompt is committed, the run is lost): the page keeps what it had streamed, marked
// lost, rather than letting it vanish.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  sessions: [],
  current: null,
  source: null,
  opens: 0,            // opens of the current EventSource: past the first, it resumed by itself
  reconnects: 0,
  lastEventId: "",
  receivedIds: [],     // ids carried by catch-up and committed frames, in arrival order
  catchups: [],        // {after, opens, messageIds, turnFrames}: what each (re)connect brought
  timeline: [],        // {kind: "message", message} | {kind: "mark", text, cls} | {kind: "lost", text}
  brokeAt: null,       // when the stream last broke (performance.now()), until it resumes
  messageIds: new Set(),
  committedLeaves: new Set(),
  live: null,          // {runId, frames, ended}
  doneRuns: new Set(), // runs whose output the transcript already shows
  syncing: Promise.resolve(),
  problems: [],
};

// -- talking to the page server --------------------------------------------------------------

async function api(method, path, body) {
  const init = { method, headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!response.ok) {
    const why = (data && data.error) || text.trim();
    throw new Error(`${response.status}: ${why || response.statusText}`);
  }
  return data;
}

function agentPath(sessionId) {
  return `/api/agent?session_id=${encodeURIComponent(sessionId)}`;
}

function notice(text, bad) {
  const el = $("notice");
  el.textContent = text;
  el.className = bad ? "bad" : "muted";
}

// -- sessions --------------------------------------------------------------------------------

async function loadSessions() {
  const data = await api("GET", "/api/sessions");
  state.sessions = data.sessions;
  drawSessions();
  return state.sessions;
}

function drawSessions() {
  const list = $("sessions");
  list.replaceChildren();
  if (!state.sessions.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "none yet";
    list.append(li);
    return;
  }
  for (const s of state.sessions) {
    const li = document.createElement("li");
    if (s.session_id === state.current) li.className = "current";
    const pick = document.createElement("button");
    pick.type = "button";
    pick.className = "pick";
    pick.title = s.tenant ? `tenant ${s.tenant}` : "attached";
    pick.textContent = s.session_id;
    pick.addEventListener("click", () => follow(s.session_id));
    const drop = document.createElement("button");
    drop.type = "button";
    drop.className = "link";
    drop.title = "forget this session here";
    drop.textContent = "✕";
    drop.addEventListener("click", () => forget(s.session_id));
    li.append(pick, drop);
    list.append(li);
  }
}

async function forget(sessionId) {
  await api("DELETE", `/api/sessions?session_id=${encodeURIComponent(sessionId)}`).catch(() => {});
  if (state.current === sessionId) unfollow();
  await loadSessions();
}

// -- the stream ------------------------------------------------------------------------------

function resetView() {
  Object.assign(state, {
    opens: 0, reconnects: 0, lastEventId: "", receivedIds: [], catchups: [], timeline: [], brokeAt: null,
    messageIds: new Set(), committedLeaves: new Set(), live: null, doneRuns: new Set(),
    syncing: Promise.resolve(),
  });
}

function unfollow() {
  if (state.source) state.source.close();
  state.source = null;
  state.current = null;
  setStreamState("idle", "not following");
  setComposer(false);
  draw();
}

function follow(sessionId) {
  if (state.source) state.source.close();
  resetView();
  state.current = sessionId;
  drawSessions();
  setComposer(true);
  setStreamState("reconnecting", "connecting…");
  const source = new EventSource(`/api/events?session_id=${encodeURIComponent(sessionId)}`);
  state.source = source;
  source.addEventListener("open", () => {
    if (source !== state.source) return;
    state.opens += 1;
    if (state.opens > 1) state.reconnects += 1;
    setStreamState("live", "live");
  });
  source.addEventListener("message", (event) => {
    if (source !== state.source) return;
    let frame;
    try { frame = JSON.parse(event.data); } catch (_) { return; }
    onFrame(frame, event.lastEventId);
  });
  // The replica drops a reader that fell too far behind; the browser resumes on its own.
  source.addEventListener("reconnect", () => {
    if (source !== state.source) return;
    mark("the stream fell behind and is resuming", "reconnect");
  });
  source.addEventListener("error", () => {
    if (source !== state.source) return;
    if (source.readyState === EventSource.CLOSED) {
      setStreamState("closed", "closed");
      mark("the stream was refused; pick the session again to follow it", "problem");
    } else {
      if (state.brokeAt === null) state.brokeAt = performance.now();
      setStreamState("reconnecting", "reconnecting…");
    }
  });
  draw();
}

function onFrame(frame, eventId) {
  switch (frame.type) {
    case "catchup": {
      const after = state.lastEventId;
      if (state.opens > 1) {
        const lost = keepLostReply(frame);
        const gap = state.brokeAt === null ? "" :
          ` (${((performance.now() - state.brokeAt) / 1000).toFixed(1)} s without a stream)`;
        mark(`↻ stream resumed after ${after ? short(after) : "the start"}: ` +
             `${frame.messages.length} new message(s), turn replayed from ${frame.turn.length} frame(s)${gap}`,
             "reconnect");
        if (lost) {
          mark("the replica running that reply stopped, so the reply was lost; the prompt is " +
               "kept in the transcript: send a new prompt to go on", "problem");
        }
      }
      state.brokeAt = null;
      state.catchups.push({
        after, opens: state.opens,
        messageIds: frame.messages.map((m) => m.id), turnFrames: frame.turn.length,
      });
      addMessages(frame.messages);
      if (frame.leaf_id) {
        state.committedLeaves.add(frame.leaf_id);
        state.receivedIds.push(frame.leaf_id);
      }
      state.live = null;
      for (const f of frame.turn) if (f.type === "event") onEvent(f.event);
      if (frame.turn_truncated) mark("the turn in flight was too long to replay in full", "problem");
      break;
    }
    case "event":
      onEvent(frame.event);
      break;
    case "committed":
      if (frame.leaf_id) {
        state.committedLeaves.add(frame.leaf_id);
        state.receivedIds.push(frame.leaf_id);
      }
      sync();
      break;
    case "session_superseded":
      mark("another replica took this session over; the stream resumes there", "problem");
      break;
    case "error":
      mark(`error: ${frame.error}`, "problem");
      break;
    default:
      break;
  }
  if (eventId) state.lastEventId = eventId;
  draw();
}

// The replica that ran the reply in flight is gone if the catch-up neither replays that run nor
// brings a reply committed meanwhile.
function keepLostReply(frame) {
  const live = state.live;
  if (!live || live.ended) return false;
  const replayed = frame.turn.some((f) => f.type === "event" && f.event.run_id === live.runId);
  const committed = frame.messages.some((m) => m.role === "assistant");
  if (replayed || committed) return false;
  const text = live.frames.filter((f) => f.kind === "text_delta").map((f) => f.text).join("");
  state.timeline.push({ kind: "lost", text, runId: live.runId });
  state.doneRuns.add(live.runId);
  return true;
}

function onEvent(event) {
  if (state.doneRuns.has(event.run_id)) return;
  if (event.kind === "turn_started" || !state.live || state.live.runId !== event.run_id) {
    state.live = { runId: event.run_id, frames: [], ended: null };
  }
  state.live.frames.push(event);
  if (event.kind === "turn_ended") state.live.ended = event;
}

function addMessages(messages) {
  const added = [];
  for (const m of messages) {
    if (state.messageIds.has(m.id)) continue;
    state.messageIds.add(m.id);
    state.timeline.push({ kind: "message", message: m });
    added.push(m);
  }
  return added;
}

function lastMessageId() {
  for (let i = state.timeline.length - 1; i >= 0; i -= 1) {
    if (state.timeline[i].kind === "message") return state.timeline[i].message.id;
  }
  return null;
}

// Fetch what a `committed` frame made durable. Chained, so each asks after the previous one.
function sync() {
  const sessionId = state.current;
  state.syncing = state.syncing.then(async () => {
    const since = lastMessageId();
    const command = { type: "get_messages" };
    if (since) command.since = since;
    const data = await api("POST", agentPath(sessionId), command);
    if (sessionId !== state.current || !data.success) return;
    const added = addMessages(data.data.messages);
    if (state.live && added.some((m) => m.role === "assistant")) {
      state.doneRuns.add(state.live.runId);
      state.live = null;
    }
    draw();
  }).catch((err) => notice(`could not read the transcript: ${err.message}`, true));
}

function mark(text, cls) {
  state.timeline.push({ kind: "mark", text, cls });
  draw();
}

// -- drawing ---------------------------------------------------------------------------------

let drawPending = false;

function draw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; drawNow(); });
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function short(id) {
  return id.length > 10 ? id.slice(0, 10) : id;
}

function callText(name, args) {
  try {
    const parsed = JSON.parse(args);
    if (parsed && typeof parsed.command === "string") return `${name}: ${parsed.command}`;
  } catch (_) { /* arguments still streaming or not JSON: show them raw */ }
  return `${name} ${args}`;
}

function drawMessage(m) {
  if (m.role === "tool") {
    const failed = typeof m.exit_code === "number" && m.exit_code !== 0;
    return el("div", failed ? "result error msg-tool" : "result msg-tool", m.content);
  }
  const box = el("div", `msg ${m.role}`);
  const who = el("div", "who", m.role === "user" ? "You" : m.role === "assistant" ? "Agent" : m.role);
  if (m.stop) who.append(el("span", m.stop === "stop" ? "badge ok" : "badge bad", m.stop));
  box.append(who);
  if (m.content) box.append(el("div", "text", m.content));
  for (const call of m.tool_calls || []) box.append(el("div", "call", callText(call.name, call.arguments)));
  return box;
}

function drawLive(live) {
  const box = el("div", live.ended ? "msg assistant live ended" : "msg assistant live");
  const who = el("div", "who", "Agent");
  who.append(el("span", "badge", live.ended ? "finishing" : "streaming"));
  box.append(who);
  let text = null;
  for (const f of live.frames) {
    if (f.kind === "text_delta") {
      if (!text) { text = el("div", "text", ""); box.append(text); }
      text.textContent += f.text;
    } else if (f.kind === "tool_call") {
      text = null;
      box.append(el("div", "call", callText(f.name, f.arguments)));
    } else if (f.kind === "tool_result") {
      text = null;
      box.append(el("div", f.is_error ? "result error" : "result", f.content));
    } else if (f.kind === "error") {
      box.append(el("div", "result error", `error: ${f.error}`));
    } else if (f.kind === "turn_ended") {
      box.append(el("div", "who", `turn ${f.outcome} (${f.reason})`));
    }
  }
  if (!text && !live.ended) box.append(el("div", "text", ""));
  return box;
}

function drawNow() {
  const view = $("transcript");
  const nearBottom = view.scrollHeight - view.scrollTop - view.clientHeight < 80;
  view.replaceChildren();
  if (!state.current) {
    view.append(el("p", "muted empty", "Open or attach a session to follow it."));
  } else if (!state.timeline.length && !state.live) {
    view.append(el("p", "muted empty", "No messages yet: send a prompt."));
  }
  for (const item of state.timeline) {
    if (item.kind === "mark") {
      view.append(el("div", `mark ${item.cls}`, item.text));
      continue;
    }
    if (item.kind === "lost") {
      const box = el("div", "msg assistant lost");
      const who = el("div", "who", "Agent");
      who.append(el("span", "badge bad", "lost"));
      box.append(who, el("div", "text", item.text || "(nothing had arrived yet)"));
      view.append(box);
      continue;
    }
    view.append(drawMessage(item.message));
    if (state.committedLeaves.has(item.message.id)) {
      view.append(el("div", "mark committed", `✓ committed ${short(item.message.id)}`));
    }
  }
  if (state.live) view.append(drawLive(state.live));
  if (nearBottom) view.scrollTop = view.scrollHeight;
  $("info-session").textContent = state.current || "-";
  $("info-last-id").textContent = state.lastEventId || "-";
  $("info-reconnects").textContent = String(state.reconnects);
}

function setStreamState(cls, text) {
  const pill = $("stream-state");
  pill.className = `pill ${cls}`;
  pill.textContent = text;
}

function setComposer(enabled) {
  for (const id of ["prompt", "send", "abort"]) $(id).disabled = !enabled;
}

// -- actions ---------------------------------------------------------------------------------

async function send(command) {
  if (!state.current) return;
  try {
    const answer = await api("POST", agentPath(state.current), command);
    if (answer && answer.type === "response" && !answer.success) throw new Error(answer.error);
    return answer;
  } catch (err) {
    notice(`${command.type} failed: ${err.message}`, true);
    return null;
  }
}

async function sendPrompt() {
  const box = $("prompt");
  const message = box.value;
  if (!message.trim()) return;
  const ack = await send({ type: "prompt", message });
  if (ack) {
    box.value = "";
    notice("sent");
  }
}

function wire() {
  $("mint-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      const made = await api("POST", "/api/sessions", { tenant: $("tenant").value.trim() });
      await loadSessions();
      follow(made.session_id);
      notice(`opened ${made.session_id}`);
    } catch (err) {
      notice(`could not open a session: ${err.message}`, true);
    }
  });
  $("attach-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    try {
      const made = await api("POST", "/api/sessions/attach", {
        session_id: $("attach-id").value.trim(), grant: $("attach-grant").value.trim(),
      });
      $("attach-grant").value = "";
      $("attach-id").value = "";
      await loadSessions();
      follow(made.session_id);
    } catch (err) {
      notice(`could not attach: ${err.message}`, true);
    }
  });
  $("prompt-form").addEventListener("submit", (e) => { e.preventDefault(); sendPrompt(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); sendPrompt(); }
  });
  $("abort").addEventListener("click", () => send({ type: "abort" }));
}

async function boot() {
  wire();
  try {
    const config = await api("GET", "/api/config");
    $("edge").textContent = `edge ${config.edge_url}`;
    $("mint").disabled = !config.can_mint;
    const sessions = await loadSessions();
    if (sessions.length) follow(sessions[sessions.length - 1].session_id);
  } catch (err) {
    notice(`the page server did not answer: ${err.message}`, true);
  }
}

// Read-only view for scripts that drive the page (the browser tests read it).
window.fleetPage = {
  snapshot() {
    return {
      current: state.current,
      opens: state.opens,
      reconnects: state.reconnects,
      lastEventId: state.lastEventId,
      receivedIds: [...state.receivedIds],
      catchups: state.catchups.map((c) => ({ ...c })),
      messages: state.timeline.filter((i) => i.kind === "message").map((i) => i.message),
      live: state.live && {
        runId: state.live.runId,
        kinds: state.live.frames.map((f) => f.kind),
        text: state.live.frames.filter((f) => f.kind === "text_delta").map((f) => f.text).join(""),
        ended: Boolean(state.live.ended),
      },
      readyState: state.source ? state.source.readyState : null,
      marks: state.timeline.filter((i) => i.kind === "mark").map((i) => i.text),
      lost: state.timeline.filter((i) => i.kind === "lost").map((i) => i.text),
    };
  },
  current() { return state.current; },
  mark,
  follow,
  send,
};

boot();
