// The dashboard's pages: each asks the server's JSON API every second and redraws.
"use strict";

const PERIOD_MS = 1000;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 90) return seconds.toFixed(0) + " s";
  if (seconds < 5400) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function showEtcd(etcd) {
  const banner = document.getElementById("etcd");
  document.getElementById("sources").textContent = etcd.sources
    .map((s) => s.backend + " under " + s.prefix).join(", ");
  if (etcd.error) {
    banner.textContent = "etcd is unreachable (for " + age(etcd.error_for) + "): " + etcd.error +
      ". Showing what was last seen; retrying.";
    banner.hidden = false;
    document.body.dataset.etcd = "error";
  } else if (!etcd.ok) {
    banner.textContent = "Reading etcd...";
    banner.hidden = false;
    document.body.dataset.etcd = "starting";
  } else {
    banner.hidden = true;
    document.body.dataset.etcd = "ok";
  }
}

function serverLost(error) {
  const banner = document.getElementById("etcd");
  banner.textContent = "The dashboard server does not answer: " + error;
  banner.hidden = false;
  document.body.dataset.etcd = "server";
}

function repeat(step) {
  const tick = () => step().catch(serverLost).finally(() => setTimeout(tick, PERIOD_MS));
  tick();
}

async function getJson(url) {
  const answer = await fetch(url, { cache: "no-store" });
  if (!answer.ok && answer.status !== 404) throw new Error("HTTP " + answer.status);
  return { status: answer.status, body: await answer.json() };
}

function runLink(row) {
  const query = new URLSearchParams({ backend: row.backend, run_id: row.run_id });
  const link = el("a", row.run_id);
  link.href = "/run?" + query.toString();
  return link;
}

function followRuns() {
  repeat(async () => {
    const { body } = await getJson("/api/runs");
    showEtcd(body.etcd);
    const rows = document.querySelector("#runs tbody");
    rows.replaceChildren();
    for (const run of body.runs) {
      const tr = el("tr");
      tr.dataset.run = run.backend + "/" + run.run_id;
      tr.dataset.phase = run.phase;
      if (run.missing) tr.className = "trouble";
      const name = el("td");
      name.append(runLink(run));
      const phase = el("td");
      phase.append(el("span", run.phase, "phase phase-" + run.phase));
      tr.append(el("td", run.backend), name, phase, el("td", run.version ?? "-"),
        el("td", run.world_size, "num"), el("td", run.participants, "num"),
        el("td", run.waiting, "num"), el("td", run.missing, "num"),
        el("td", age(run.oldest_sign_of_life), "num"), el("td", age(run.waiting_for), "num"),
        el("td", run.round_formed_ago === null ? "-" : age(run.round_formed_ago) + " ago", "num"),
        el("td", run.finished ? "yes" : "no"));
      rows.append(tr);
    }
    document.getElementById("empty").hidden = body.runs.length > 0;
    document.body.dataset.runs = String(body.runs.length);
  });
}

function names(some) {
  if (!some.count) return "-";
  const more = some.count - some.names.length;
  return some.names.join(", ") + (more > 0 ? " and " + more + " more" : "");
}

function fact(list, name, value) {
  list.append(el("dt", name), el("dd", value));
}

function followRun() {
  const params = new URLSearchParams(location.search);
  const backend = params.get("backend"), runId = params.get("run_id");
  document.getElementById("title").textContent = runId + " (" + backend + ")";
  document.title = "etcd-rendezvous: " + runId;
  let offset = 0;
  const limit = Number(params.get("limit") || 100);
  const filter = document.getElementById("filter"), problems = document.getElementById("problems");
  filter.addEventListener("input", () => { offset = 0; });
  problems.addEventListener("change", () => { offset = 0; });
  document.getElementById("prev").onclick = () => { offset = Math.max(0, offset - limit); };
  document.getElementById("next").onclick = () => { offset += limit; };
  repeat(async () => {
    const query = new URLSearchParams({ backend: backend, run_id: runId, offset: offset,
      limit: limit, q: filter.value, problems: problems.checked ? "1" : "" });
    const { status, body } = await getJson("/api/run?" + query.toString());
    document.getElementById("gone").hidden = status !== 404;
    document.body.dataset.found = status === 404 ? "no" : "yes";
    if (status === 404) return;
    showEtcd(body.etcd);
    const run = body.run;
    document.body.dataset.phase = run.phase;
    document.body.dataset.round = run.version ?? "";
    document.body.dataset.missing = String(run.missing);
    const facts = document.getElementById("facts");
    facts.replaceChildren();
    const phase = el("span", run.phase, "phase phase-" + run.phase);
    facts.append(el("dt", "Phase"));
    const dd = el("dd"); dd.append(phase, " for " + age(run.phase_for)); facts.append(dd);
    fact(facts, run.backend === "etcd" ? "Version" : "Round", run.version ?? "-");
    fact(facts, "World size", run.world_size + " (last round formed " +
      (run.round_formed_ago === null ? "-" : age(run.round_formed_ago) + " ago") + ")");
    fact(facts, "Participants", run.participants);
    fact(facts, "Waiting", run.waiting + (run.waiting_for === null ? "" : " for " + age(run.waiting_for)));
    fact(facts, "Missing", run.missing);
    fact(facts, "Oldest sign of life", age(run.oldest_sign_of_life));
    if (body.deadline) fact(facts, "Last-call deadline", body.deadline + " (the workers' clock)");
    fact(facts, "State key", (body.key ?? "-") + (body.state_ttl === null || body.state_ttl === undefined ? "" : " (TTL " + body.state_ttl + " s)"));
    fact(facts, "Wait list", names(body.wait_list));
    fact(facts, "Redundancy list", names(body.redundancy_list));
    fact(facts, "Done", run.finished ? "yes (no worker left)" : "no");
    fact(facts, "Seen for", age(run.observed_for) + ", last change " + age(run.changed_ago) + " ago");
    if (!body.valid) fact(facts, "INVALID STATE", body.error);
    document.getElementById("counts").textContent = "(" + Object.entries(body.counts)
      .map(([state, count]) => count + " " + state).join(", ") + ")";
    const members = body.members;
    offset = members.offset;
    document.getElementById("page").textContent = members.matching === 0 ? "none" :
      (members.offset + 1) + "-" + Math.min(members.offset + members.limit, members.matching) +
      " of " + members.matching + (members.matching !== members.total ? " (of " + members.total + ")" : "");
    const rows = document.querySelector("#members tbody");
    rows.replaceChildren();
    for (const member of members.rows) {
      const tr = el("tr");
      tr.dataset.member = member.name;
      tr.dataset.state = member.state;
      if (member.state === "lapsed" || member.state === "missing") tr.className = "trouble";
      const state = el("td");
      state.append(el("span", member.state, "state state-" + member.state));
      tr.append(el("td", member.rank ?? "-", "num"), el("td", member.name), state,
        el("td", member.seen_ago === null ? "-" : age(member.seen_ago) + " ago", "num"),
        el("td", member.gone_ago === null ? "-" : age(member.gone_ago), "num"),
        el("td", member.ttl === null ? "-" : member.ttl + " s", "num"),
        el("td", member.heartbeat ?? "-"));
      rows.append(tr);
    }
    const timeline = document.getElementById("timeline");
    timeline.replaceChildren();
    for (const entry of body.timeline) {
      let text = (run.backend === "etcd" ? "version " : "round ") + entry.round + ": " + entry.size +
        " members, formed " + entry.formed_at + " (" + age(entry.formed_ago) + " ago)";
      if (entry.before_start) text += ", before the dashboard started";
      if (entry.joined.count) text += "; joined: " + names(entry.joined);
      if (entry.left.count) text += "; left: " + names(entry.left);
      const item = el("li", text);
      item.dataset.round = entry.round;
      timeline.append(item);
    }
  });
}
