// Open-loop HTTP load generator for the batchpilot benchmarks (Node.js >= 18, no dependencies).
//
// Usage: node bench/loadgen.mjs SPEC.json   -> prints one JSON object on stdout.
//
// SPEC: {
//   "url": "http://127.0.0.1:8000/v2/models/m/infer",   // only loopback targets are allowed
//   "headers": {...}, "body": "<request body text>",
//   "mode": "open" | "closed",
//   "offsets": [0.0, 0.0012, ...],     // open: send times in seconds from start (a finite schedule)
//   "concurrency": 64, "duration": 5,  // closed: N workers, each sends the next request on reply
//   "timeout": 10,                     // per-request cap in seconds (counted as an error)
//   "expect_status": 200
// }
//
// Open loop: every request is sent at its scheduled time whether or not earlier ones have been
// answered, and its latency is measured from the *scheduled* time, so a slow server (or a late
// generator) cannot hide queueing (no coordinated omission). The generator reports its own lag
// behind the schedule and its CPU time, so one can tell whether it kept up.
import http from "node:http";
import fs from "node:fs";

const spec = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const url = new URL(spec.url);
if (!["127.0.0.1", "localhost", "[::1]"].includes(url.hostname)) {
  throw new Error(`refusing non-loopback target ${url.hostname}`);
}
const body = Buffer.from(spec.body, spec.body_encoding || "utf8");
const headers = { "Content-Type": "application/json", "Content-Length": body.length, ...(spec.headers || {}) };
const agent = new http.Agent({ keepAlive: true, maxSockets: spec.max_sockets || 1024, maxFreeSockets: 1024 });
const timeoutMs = (spec.timeout || 10) * 1000;
const expect = spec.expect_status || 200;

const latOk = []; // ms, from scheduled time, status == expect
const latAll = []; // ms, any completion
const lags = []; // ms, actual send - scheduled
const statuses = {};
let errors = 0;
let done = 0;
let sent = 0;

function send(scheduled, onDone) {
  const start = performance.now();
  lags.push(start - scheduled);
  sent++;
  let finished = false;
  const finish = (status) => {
    if (finished) return;
    finished = true;
    const lat = performance.now() - scheduled;
    statuses[status] = (statuses[status] || 0) + 1;
    latAll.push(lat);
    if (status === expect) latOk.push(lat);
    else errors++;
    done++;
    if (onDone) onDone();
  };
  const req = http.request(
    { host: url.hostname, port: url.port, path: url.pathname, method: "POST", headers, agent, timeout: timeoutMs },
    (res) => {
      res.on("data", () => {});
      res.on("end", () => finish(res.statusCode));
      res.on("error", () => finish("error"));
    },
  );
  req.on("timeout", () => { req.destroy(); finish("timeout"); });
  req.on("error", () => finish("error"));
  req.end(body);
}

function pct(sorted, q) {
  if (!sorted.length) return null;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1));
  return sorted[i];
}

function summary(wall) {
  const cpu = process.cpuUsage(cpu0);
  const ok = latOk.slice().sort((a, b) => a - b);
  // SLO view: a failed request counts as infinitely slow.
  const slo = latOk.slice();
  for (let i = 0; i < errors; i++) slo.push(Infinity);
  slo.sort((a, b) => a - b);
  const lg = lags.slice().sort((a, b) => a - b);
  const r = (x) => (x === null ? null : x === Infinity ? "inf" : Math.round(x * 1000) / 1000);
  return {
    sent, completed: done, ok: ok.length, errors, statuses,
    wall_s: r(wall / 1000),
    ok_per_s: r(ok.length / (wall / 1000)),
    latency_ms: { p50: r(pct(ok, 0.5)), p90: r(pct(ok, 0.9)), p99: r(pct(ok, 0.99)), max: r(ok[ok.length - 1] ?? null) },
    slo_p99_ms: r(pct(slo, 0.99)),
    send_lag_ms: { p50: r(pct(lg, 0.5)), p99: r(pct(lg, 0.99)), max: r(lg[lg.length - 1] ?? null) },
    generator_cpu_s: r((cpu.user + cpu.system) / 1e6),
    generator_cpu_frac: r((cpu.user + cpu.system) / 1e3 / wall),
  };
}

const cpu0 = process.cpuUsage();
const t0 = performance.now() + 20;

function finishRun() {
  process.stdout.write(JSON.stringify(summary(performance.now() - t0)) + "\n");
  agent.destroy();
  process.exit(0);
}

if (spec.mode === "closed") {
  const end = t0 + spec.duration * 1000;
  let live = spec.concurrency;
  const worker = () => {
    if (performance.now() >= end) { if (--live === 0) finishRun(); return; }
    send(performance.now(), worker);
  };
  setTimeout(() => { for (let i = 0; i < spec.concurrency; i++) worker(); }, 20);
  setTimeout(() => { process.stdout.write(JSON.stringify({ ...summary(performance.now() - t0), hung: true }) + "\n"); process.exit(0); }, spec.duration * 1000 + timeoutMs + 5000);
} else {
  const offs = spec.offsets.map((s) => t0 + s * 1000);
  const total = offs.length;
  let next = 0;
  const onDone = () => { if (done === total) finishRun(); };
  const tick = () => {
    const now = performance.now();
    while (next < total && offs[next] <= now) send(offs[next++], onDone);
    if (next < total) setTimeout(tick, Math.max(0, offs[next] - performance.now() - 0.5));
  };
  setTimeout(tick, 0);
  const last = total ? spec.offsets[total - 1] : 0;
  setTimeout(() => { process.stdout.write(JSON.stringify({ ...summary(performance.now() - t0), hung: true }) + "\n"); process.exit(0); }, last * 1000 + timeoutMs + 5000);
}
