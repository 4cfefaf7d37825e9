// The fleet view beside the session: every replica with its slice, readiness and the sessions it
// holds; the open session's owner and epoch; each takeover as the page server saw it; and a
// button per fault. It polls the page server, which samples the fleet and sends the faults: this
// page never talks to a replica or to the fleet's control endpoint, and holds none of its secrets.
// Rows are made once per replica and updated in place, so a button is never replaced under a
// pointer between its press and its release.
"use strict";

(() => {
  const POLL_MS = 500;
  const $ = (id) => document.getElementById(id);
  const view = {
    last: null,        // the last /api/fleet answer
    error: null,
    status: null,      // {ok, text, at}: what the last fault did
    busy: new Set(),   // replicas with a fault on its way
    rows: new Map(),   // replica name -> {root, name, badge, meta, sessions, buttons}
    groups: new Map(), // slice -> {root, summary, list}
    baseline: null,    // the session whose takeovers were already known when it was opened here
    seen: new Set(),
  };

  const FAULTS = [
    { verb: "kill", label: "Kill", cls: "danger",
      title: "SIGKILL: the process dies at once; the fleet starts it again and another replica takes its sessions" },
    { verb: "freeze", label: "Freeze", undo: "thaw", undoLabel: "Thaw",
      title: "SIGSTOP: the process stops answering but keeps its sessions (thaw resumes it)" },
    { verb: "drain", label: "Drain",
      title: "SIGTERM: it finishes its turns in flight, hands its sessions back and exits" },
    { verb: "restart", label: "Restart",
      title: "drain, then start again at once on the same address" },
    { verb: "partition", label: "Partition", undo: "heal", undoLabel: "Heal", storage: true,
      title: "cut the replica's storage mount off, as a network partition would" },
  ];

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function seconds(s) {
    return s < 10 ? `${s.toFixed(1)} s` : `${Math.round(s)} s`;
  }

  function clock(at) {
    return new Date(at * 1000).toLocaleTimeString([], { hour12: false });
  }

  // -- talking to the page server ----------------------------------------------------------

  async function poll() {
    const current = window.fleetPage.current();
    const query = current ? `?session_id=${encodeURIComponent(current)}` : "";
    try {
      const response = await fetch(`/api/fleet${query}`);
      const text = await response.text();
      let data = null;
      try { data = JSON.parse(text); } catch (_) { data = null; }
      if (!response.ok) throw new Error((data && data.error) || text.trim() || response.statusText);
      if (current === window.fleetPage.current()) {
        view.last = data;
        view.error = null;
      }
    } catch (err) {
      view.error = `the page server did not answer: ${err.message}`;
    }
    try {
      draw();
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  async function fault(verb, target) {
    view.busy.add(target);
    draw();
    try {
      const response = await fetch("/api/fault", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ verb, target }),
      });
      let data = {};
      try { data = await response.json(); } catch (_) { data = {}; }
      view.status = response.ok
        ? { ok: true, text: data.message, at: Date.now() / 1000 }
        : { ok: false, text: `${verb} ${target}: ${data.error || response.statusText}`, at: Date.now() / 1000 };
    } catch (err) {
      view.status = { ok: false, text: `${verb} ${target}: ${err.message}`, at: Date.now() / 1000 };
    } finally {
      view.busy.delete(target);
      draw();
    }
  }

  // -- drawing -------------------------------------------------------------------------------

  function draw() {
    const data = view.last;
    const problem = $("fleet-problem");
    const trouble = view.error || (data && (data.state_error || data.control_error));
    problem.hidden = !trouble;
    problem.textContent = trouble || "";
    if (!data) return;
    const ready = data.replicas.filter((r) => r.badge === "ready").length;
    $("fleet-meta").textContent =
      `${ready} of ${data.replicas.length} replicas ready · ${data.substrate}`;
    drawSession(data.session);
    drawReplicas(data);
    drawProcesses(data.processes);
    drawTakeovers(data.session);
    drawStatus();
  }

  function drawSession(session) {
    const card = $("fleet-session");
    const owner = $("fleet-owner");
    const detail = $("fleet-owner-detail");
    owner.replaceChildren();
    if (!session) {
      card.className = "session-card idle";
      owner.textContent = "No session open";
      detail.textContent = "Open a session to see which replica holds it.";
      return;
    }
    if (session.status === "held") {
      card.className = "session-card held";
      owner.append(el("span", "owner-name", session.owner), " holds it",
                   el("span", "epoch", `epoch ${session.epoch}`));
      const doing = session.running ? "running a turn" : "idle";
      const streams = session.attached === 1 ? "1 stream" : `${session.attached} streams`;
      detail.textContent = `${doing} · ${streams} attached · for ${seconds(session.held_for_s)}`;
    } else if (session.status === "moving") {
      card.className = "session-card moving";
      owner.append("Moving: ", el("span", "owner-name", session.previous), ` ${session.cause}`);
      detail.textContent =
        `no replica holds it yet · ${seconds(session.missing_for_s)} so far · was epoch ${session.epoch}`;
    } else if (session.status === "released") {
      card.className = "session-card idle";
      owner.textContent = "Not open on any replica";
      detail.textContent =
        `${session.previous} let it go; it opens again with the next prompt or stream.`;
    } else {
      card.className = "session-card idle";
      owner.textContent = "Not open on any replica yet";
      detail.textContent = "It opens with the first prompt or stream.";
    }
  }

  function group(slice) {
    let g = view.groups.get(slice);
    if (g) return g;
    const root = el("section", "slice");
    const head = el("div", "slice-head");
    const summary = el("span", "slice-summary");
    head.append(el("h3", null, `Slice ${slice}`), summary);
    const list = el("ul", "replicas");
    root.append(head, list);
    $("fleet-slices").append(root);
    g = { root, summary, list };
    view.groups.set(slice, g);
    return g;
  }

  function row(r) {
    let parts = view.rows.get(r.name);
    if (parts) return parts;
    const root = el("li", "replica");
    root.dataset.name = r.name;
    const top = el("div", "r-top");
    const name = el("span", "r-name", r.name);
    const badge = el("span", "state");
    const live = el("span", "r-live");
    const meta = el("span", "r-meta");
    top.append(name, badge, live, meta);
    const sessions = el("div", "r-sessions");
    const actions = el("div", "r-actions");
    const buttons = new Map();
    for (const f of FAULTS) {
      const button = el("button", `fault ${f.cls || ""}`.trim(), f.label);
      button.type = "button";
      button.dataset.verb = f.verb;
      button.title = f.title;
      button.addEventListener("click", () => fault(button.dataset.verb, r.name));
      buttons.set(f.verb, button);
      actions.append(button);
    }
    root.append(top, sessions, actions);
    group(r.slice).list.append(root);
    parts = { root, badge, live, meta, sessions, buttons };
    view.rows.set(r.name, parts);
    return parts;
  }

  function allowed(verb, r) {
    const running = r.state === "up" || r.state === "frozen";
    switch (verb) {
      case "kill": case "drain": return running;
      case "freeze": return r.state === "up";
      case "thaw": return r.state === "frozen";
      case "restart": return r.state !== null && r.state !== "starting";
      default: return r.state !== null;
    }
  }

  function drawReplicas(data) {
    const counts = new Map();
    for (const r of data.replicas) {
      const c = counts.get(r.slice) || { all: 0, ready: 0 };
      c.all += 1;
      if (r.badge === "ready") c.ready += 1;
      counts.set(r.slice, c);
      const parts = row(r);
      parts.root.classList.toggle("owner", r.owns_open);
      parts.root.classList.toggle("out", r.badge === "down" || r.badge === "silent");
      parts.badge.className = `state ${r.badge}`;
      parts.badge.textContent = r.label;
      parts.badge.title = r.readiness;
      const restarts = r.restarts ? ` · ↻ ${r.restarts}` : "";
      parts.meta.textContent = r.pid ? `pid ${r.pid}${restarts}` : restarts.slice(3);
      parts.meta.title = r.restarts
        ? `started again ${r.restarts === 1 ? "once" : `${r.restarts} times`} by the fleet`
        : "";
      drawOwned(parts, r);
      for (const f of FAULTS) {
        const button = parts.buttons.get(f.verb);
        if (f.storage) button.hidden = !data.verbs.includes(f.verb);
        const undo = f.undo && (f.storage ? r.storage.includes(f.verb) : r.state === "frozen");
        const verb = undo ? f.undo : f.verb;
        button.dataset.verb = verb;
        button.textContent = undo ? f.undoLabel : f.label;
        button.classList.toggle("undo", Boolean(undo));
        button.disabled = view.busy.has(r.name) || !allowed(verb, r);
      }
    }
    for (const [slice, c] of counts) {
      group(slice).summary.textContent = `${c.ready} of ${c.all} ready`;
    }
  }

  function drawOwned(parts, r) {
    const box = parts.sessions;
    box.replaceChildren();
    const running = r.running ? ` · ${r.running} running` : "";
    parts.live.textContent = r.live === null ? "sessions unknown" : `${r.live} live${running}`;
    box.hidden = !r.owned.length;
    for (const s of r.owned) {
      const chip = el("span", s.open ? "sid open" : "sid", s.id);
      if (s.running) chip.classList.add("running");
      chip.title = s.open ? "the session open in this page" : "another session";
      box.append(chip);
    }
    if (r.owned_more) box.append(el("span", "muted", `+${r.owned_more} more`));
  }

  function drawProcesses(processes) {
    const list = $("fleet-processes");
    list.replaceChildren();
    for (const p of processes) {
      const state = p.state || "unknown";
      const chip = el("li", `chip ${state}`);
      chip.append(el("span", "dot"), el("span", null, p.name));
      chip.title = `${p.name}: ${state}${p.pid ? `, pid ${p.pid}` : ""}` +
                   `${p.restarts ? `, restarted ${p.restarts}×` : ""}`;
      if (state !== "up") chip.append(el("span", "chip-state", state));
      list.append(chip);
    }
  }

  function cause(t) {
    const back = t.from === t.to ? ", then took it back once started again" : "";
    return `${t.from} ${t.cause}${back}`;
  }

  function takeoverLine(t) {
    const unavailable = t.unavailable_s === null ? "" : ` after ${t.unavailable_s.toFixed(1)} s unavailable`;
    return `${t.from} → ${t.to}${unavailable}, epoch ${t.from_epoch} → ${t.to_epoch}`;
  }

  function drawTakeovers(session) {
    const list = $("fleet-takeovers");
    list.replaceChildren();
    const takeovers = session ? session.takeovers : [];
    if (!takeovers.length) {
      list.append(el("li", "muted", session ? "none yet: press Kill on the owner to see one" : "no session open"));
    }
    for (const t of takeovers) {
      const item = el("li", "takeover");
      const head = el("div", "t-head");
      head.append(el("span", "t-move", `${t.from} → ${t.to}`));
      const gap = el("span", "t-gap",
        t.unavailable_s === null ? "not measured" : `${t.unavailable_s.toFixed(1)} s unavailable`);
      gap.title = $("fleet-measure").textContent;
      head.append(gap);
      const why = t.unavailable_s === null ? " · sampling had paused" : "";
      item.append(head, el("div", "t-detail",
        `epoch ${t.from_epoch} → ${t.to_epoch} · ${cause(t)}${why} · ${clock(t.at)}`));
      list.append(item);
    }
    noteTakeovers(session);
  }

  // Each takeover seen while this page has the session open also goes into its transcript.
  function noteTakeovers(session) {
    if (!session || session.session_id !== window.fleetPage.current()) return;
    const fresh = view.baseline === session.session_id;
    for (const t of [...session.takeovers].reverse()) {
      const key = `${session.session_id} ${t.seq}`;
      if (view.seen.has(key)) continue;
      view.seen.add(key);
      if (fresh) window.fleetPage.mark(`⇄ ${takeoverLine(t)} (${cause(t)})`, "takeover");
    }
    view.baseline = session.session_id;
  }

  function drawStatus() {
    const line = $("fleet-status");
    const s = view.status;
    line.hidden = !s;
    if (!s) return;
    line.className = s.ok ? "fault-status ok" : "fault-status bad";
    line.replaceChildren(el("span", "when", clock(s.at)), el("span", null, s.text));
  }

  async function boot() {
    const response = await fetch("/api/config");
    const config = await response.json();
    if (!config.fleet) return;
    $("fleet").hidden = false;
    $("main").classList.add("with-fleet");
    poll();
  }

  window.fleetView = {
    last() { return view.last; },
    status() { return view.status; },
  };

  boot().catch(() => { /* no fleet view: the session page works without one */ });
})();
