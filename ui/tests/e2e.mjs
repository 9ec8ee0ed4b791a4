// End-to-end test of the timeline viewer in headless Chromium.
//
//   node ui/tests/e2e.mjs
//
// Needs: Debian's `chromium` (/usr/bin/chromium, or RINGWATCH_CHROMIUM=path) and
// playwright-core, which this script installs with `npm ci` in ui/tests when
// node_modules is absent. Serves ui/ and the recorded traces in
// ui/tests/fixtures/ from a loopback HTTP server of its own (and a mock of the
// agent's API for live mode), drives the page, and saves screenshots under
// target/ui-test/. Prints one line per check and `N passed, N failed` last;
// exits non-zero on any failure. Without Chromium it prints `SKIPPED: …` and
// exits 0, except under CI (CI=true), where a missing Chromium is a failure.
import { existsSync, mkdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { CHROMIUM, REPO_DIR, TESTS_DIR, UI_DIR, launch, loadPlaywright, startServer } from './harness.mjs';

const FIXTURES = join(TESTS_DIR, 'fixtures');
const OUT_DIR = join(REPO_DIR, 'target', 'ui-test');
const inCI = process.env.CI === 'true' || process.env.CI === '1';
// A deadline for hangs only: every wait returns as soon as its condition
// holds, so a slow (loaded) machine takes longer but never fails for it.
const WAIT = { timeout: 60_000 };

let passed = 0, failed = 0;
async function check(name, fn) {
  try {
    await fn();
    passed++;
    console.log(`ok   ${name}`);
  } catch (err) {
    failed++;
    console.log(`FAIL ${name}\n     ${String(err && err.stack || err).split('\n').slice(0, 4).join('\n     ')}`);
  }
}
function assert(cond, msg) { if (!cond) throw new Error(msg); }
function near(a, b, tol, msg) { if (!(Math.abs(a - b) <= tol)) throw new Error(`${msg}: ${a} is not within ${tol} of ${b}`); }

// The parser runs in the page's Worker; it is a module of its own (js/parse.js)
// that touches nothing of the page, so Node runs the very same code on edge
// cases first (no browser needed).
{
  const P = await import(pathToFileURL(join(UI_DIR, 'js', 'parse.js')).href);
  const parse = (text, opts) => P.parse(text, opts || {}).result;
  const procs = (r) => r.groups.flatMap((g) => g.processes.map((p) => ({ g: g.name, kind: g.kind, ...p })));
  await check('parser: unterminated arrays and objects are read up to the last complete event', async () => {
    let r = parse('[\n{"name":"A","ph":"X","ts":1,"dur":2,"pid":1,"tid":1},\n{"name":"B","ph":"X","ts":5,"dur":1,"pid":1,"tid":1},\n');
    assert(r.repaired && r.used === 2, 'trailing comma: ' + JSON.stringify([r.repaired, r.used]));
    r = parse('[{"name":"A","ph":"X","ts":1,"dur":2,"pid":1},{"name":"B","ph":"X","ts":5,"dur":1,"pid":1,"args":{"x":{"y":1}');
    assert(r.repaired && r.used === 1, 'cut inside an event: ' + r.used);
    r = parse('{"traceEvents":[{"name":"A","ph":"X","ts":1,"dur":2,"pid":1},');
    assert(r.repaired && r.used === 1, 'object form: ' + r.used);
    r = parse('[{"name":"A","ph":"X","ts":1,"dur":2,"pid":1}]');
    assert(!r.repaired, 'a complete file is not "repaired"');
    let threw = false;
    try { parse('{"hello": 1}'); } catch (e) { threw = /traceEvents/.test(e.message); }
    assert(threw, 'an object without traceEvents is an error that names traceEvents');
  });
  await check('parser: B/E pair per thread in time order even when the file is not sorted', async () => {
    const r = parse(JSON.stringify([
      { ph: 'E', ts: 30, pid: 1, tid: 2 }, { ph: 'B', name: 'outer', ts: 0, pid: 1, tid: 2 },
      { ph: 'E', ts: 20, pid: 1, tid: 2, args: { end: 1 } }, { ph: 'B', name: 'inner', ts: 10, pid: 1, tid: 2 },
      { ph: 'B', name: 'open', ts: 40, pid: 1, tid: 2 }, { ph: 'X', name: 'late', ts: 50, dur: 5, pid: 1, tid: 2 },
    ]));
    const t = r.groups[0].processes[0].tracks[0];
    const names = Array.from(t.slices.nm, (i) => r.strings[i]);
    assert(t.slices.levels === 2, 'levels ' + t.slices.levels);
    assert(names.join() === 'outer,open,inner,late', 'by (depth, start): ' + names);
    assert(t.slices.du[0] === 30 && t.slices.du[2] === 10, 'durations ' + Array.from(t.slices.du));
    assert(t.slices.du[1] === 15, 'an unclosed B lasts to the end of the trace: ' + t.slices.du[1]);
  });
  await check('parser: jobs from args.job or "<job> rank <n>" names, everything else ungrouped', async () => {
    const r = parse(JSON.stringify([
      { ph: 'M', name: 'process_name', pid: 7, args: { name: 'trainer', job: 'bert', rank: 1 } },
      { ph: 'M', name: 'process_name', pid: 8, args: { name: 'bert rank 0' } },
      { ph: 'M', name: 'process_name', pid: 9, args: { name: 'resnet/rank=3' } },
      { ph: 'M', name: 'process_name', pid: 10, args: { name: 'ranker service' } },
      ...[7, 8, 9, 10].map((pid) => ({ ph: 'X', name: 'running', ts: pid, dur: 1, pid, tid: pid })),
    ]), { defaultGroup: 'loose' });
    const ps = procs(r);
    const find = (pid) => ps.find((p) => p.pid === pid);
    assert(find(7).g === 'bert' && find(7).rank === 1 && find(8).g === 'bert' && find(8).rank === 0, 'bert ranks');
    assert(r.groups[0].name === 'bert' && r.groups[0].processes[0].pid === 8, 'ranks sorted by rank');
    assert(find(9).g === 'resnet' && find(9).rank === 3, 'resnet/rank=3: ' + JSON.stringify(find(9)));
    assert(find(10).kind === 'other' && find(10).g === 'loose', 'ranker service is not a rank: ' + JSON.stringify(find(10)));
    const t = find(7).tracks[0];
    assert(t.states.count === 1 && t.slices.count === 0, 'a "running" slice is a thread state, not an activity');
  });
  await check('parser: counters keep a series\' last value when an event leaves it out, and sort by time', async () => {
    const r = parse(JSON.stringify([
      { ph: 'C', name: 'tcp', id: 'a', pid: 1, ts: 20, args: { rx: 5 } },
      { ph: 'C', name: 'tcp', id: 'a', pid: 1, ts: 10, args: { tx: 1, rx: 2 } },
      { ph: 'C', name: 'tcp', id: 'a', pid: 1, ts: 30, args: { tx: 7 } },
    ]));
    const c = r.groups[0].processes[0].tracks[0];
    assert(c.kind === 'counter' && c.name === 'tcp a', 'counter name with id: ' + c.name);
    assert(Array.from(c.ts).join() === '10,20,30', 'sorted');
    const s = Object.fromEntries(c.series.map((x) => [x.name, Array.from(x.values).join()]));
    assert(s.tx === '1,1,7' && s.rx === '2,5,5', JSON.stringify(s));
    assert(c.max === 7 && c.min === 0, 'scale');
  });
  await check('parser: the live agent\'s job tracks (a thread per tensor, remote ranks on named pids) group job → rank', async () => {
    // The shapes agent/src/publish/tracks.rs writes (see ui/README.md).
    const r = parse(JSON.stringify([
      { ph: 'M', name: 'process_name', pid: 4101, args: { name: 'collbench (pid 4101)', job: 'j1', rank: 0 } },
      { ph: 'M', name: 'process_name', pid: 'j1 rank 1', args: { name: 'j1 rank 1 (n2 pid 77)', job: 'j1', rank: 1 } },
      { ph: 'M', name: 'thread_name', pid: 4101, tid: 'tensor grad.w', args: { name: 'grad.w' } },
      { ph: 'M', name: 'process_name', pid: 'gpu0', args: { name: 'GPU 0 (H100)' } },
      { ph: 'X', cat: 'thread_state', name: 'running', pid: 4101, tid: 4101, ts: 0, dur: 5 },
      { ph: 'X', cat: 'job', name: 'ALLREDUCE', pid: 4101, tid: 'tensor grad.w', ts: 10, dur: 500, args: { bytes: '4096' } },
      { ph: 'X', cat: 'job', name: 'QUEUE', pid: 4101, tid: 'tensor grad.w', ts: 20, dur: 30 },
      { ph: 'X', cat: 'job', name: 'ALLREDUCE', pid: 'j1 rank 1', tid: 'tensor grad.w', ts: 12, dur: 480 },
      { ph: 'C', cat: 'gpu', name: 'utilization', pid: 'gpu0', ts: 0, args: { gpu_percent: 80, memory_percent: 20 } },
    ]), { defaultGroup: 'other processes' });
    const job = r.groups.find((g) => g.name === 'j1');
    assert(job && job.processes.map((p) => p.rank).join() === '0,1', 'ranks of j1: ' + JSON.stringify(r.groups.map((g) => [g.name, g.processes.map((p) => p.pid)])));
    const tensor = job.processes[0].tracks.find((t) => t.name === 'grad.w');
    assert(tensor && tensor.slices.count === 2 && tensor.slices.levels === 2, 'tensor track: ' + JSON.stringify(tensor && tensor.slices));
    assert(job.processes[1].tracks[0].slices.count === 1, 'remote rank activity');
    const gpu = r.groups.find((g) => g.name === 'other processes');
    assert(gpu && gpu.processes[0].tracks[0].kind === 'counter', 'GPU counter under other processes');
    // A tensor track is labelled by its name alone; a thread by its name and tid.
    assert(tensor.label === 'grad.w', 'tensor label: ' + tensor.label);
    const thread = job.processes[0].tracks.find((t) => t.tid === 4101);
    assert(thread && thread.label === 'tid 4101', 'unnamed thread label: ' + (thread && thread.label));
  });
  await check('parser: tensor tracks in natural order (grad.2 before grad.10), named threads labelled with their tid', async () => {
    const names = ['grad.10', 'grad.2', 'grad.1', 'grad.100', 'grad.0'];
    const r = parse(JSON.stringify([
      { ph: 'M', name: 'thread_name', pid: 7, tid: 7, args: { name: 'python3' } },
      { ph: 'X', cat: 'thread_state', name: 'running', pid: 7, tid: 7, ts: 0, dur: 5 },
      ...names.flatMap((n, i) => [
        { ph: 'M', name: 'thread_name', pid: 7, tid: 'tensor ' + n, args: { name: n } },
        { ph: 'X', cat: 'job', name: 'ALLREDUCE', pid: 7, tid: 'tensor ' + n, ts: i, dur: 1 },
      ]),
    ]));
    const tracks = r.groups.flatMap((g) => g.processes).flatMap((p) => p.tracks);
    const order = tracks.filter((t) => String(t.tid).startsWith('tensor ')).map((t) => t.label).join();
    assert(order === 'grad.0,grad.1,grad.2,grad.10,grad.100', 'order: ' + order);
    assert(tracks[0].label === 'python3  7', 'thread label: ' + tracks[0].label);
  });
}

if (!existsSync(CHROMIUM)) {
  if (inCI) {
    console.error(`ui-test: ${CHROMIUM} is missing, and CI installs it (apt-get install -y chromium): failing`);
    console.log(`${passed} passed, ${failed + 1} failed`);
    process.exit(1);
  }
  console.log(`ui-test: parser checks ${passed} passed, ${failed} failed`);
  if (failed) { console.log(`${passed} passed, ${failed} failed`); process.exit(1); }
  console.log(`SKIPPED: ${CHROMIUM} not found (apt-get install -y chromium); the UI end-to-end test in a browser needs it`);
  process.exit(0);
}

// Ground truth from fixtures/make-fixtures.mjs.
const KNOWN = { name: 'MEMCPY_IN_FUSION_BUFFER', pid: 4101, tid: 4102, ts: 1_050_000 + 1_300 + 300, dur: 1_500 };
const EXPECTED_TRACKS = [
  ['resnet50', 0, 'python (main)'], ['resnet50', 0, 'horovod background'], ['resnet50', 0, 'tcp 127.0.0.1:29501'],
  ['resnet50', 1, 'python (main)'], ['resnet50', 1, 'horovod background'], ['resnet50', 1, 'tcp 127.0.0.1:29500'],
];

// A stand-in for the agent's API (the real one lives in the agent crate): it
// serves the fixture shifted so that it ends at "now", and records the queries.
const fixture = JSON.parse(readFileSync(join(FIXTURES, 'ringwatch-2ranks.json'), 'utf8'));
const fixtureEnd = fixture.metadata.now;
const clockStart = performance.now();
const agentNow = () => 5_000_000 + (performance.now() - clockStart) * 1000;
let jobTimelineAskedMs = null;
function mockApi(req, res, url) {
  const json = (code, body) => { res.writeHead(code, { 'content-type': 'application/json' }).end(JSON.stringify(body)); return true; };
  if (url.pathname === '/api/jobs') return json(200, [{ id: 'resnet50', ranks: [{ rank: 0, pid: 4101 }, { rank: 1, pid: 4201 }] }]);
  if (url.pathname === '/api/processes') return json(200, [{ pid: 4101, name: 'python train.py' }, { pid: 4201, name: 'python train.py' }]);
  if (url.pathname === '/api/timeline') {
    const from = url.searchParams.get('from') || '';
    const m = /^now-(\d+(?:\.\d+)?)s$/.exec(from);
    if (!m) return json(400, { error: 'from must be now-<seconds>s in this mock, got ' + from });
    const now = agentNow();
    const shift = now - fixtureEnd;
    const pid = url.searchParams.get('pid');
    const ev = fixture.traceEvents
      .filter((e) => pid == null || String(e.pid) === pid)
      .map((e) => (e.ts == null ? e : Object.assign({}, e, { ts: e.ts + shift })));
    const metadata = { now };
    if (url.searchParams.get('job') != null) {
      // As the agent with --job-timeline on-demand: the first request for a
      // job's timeline starts its tensor events, so that answer has none yet.
      const first = jobTimelineAskedMs == null;
      if (first) jobTimelineAskedMs = Date.now();
      metadata.job_timeline = { streaming_since_unix_ms: first ? null : jobTimelineAskedMs, note: 'on demand' };
    }
    return json(200, { traceEvents: ev, displayTimeUnit: 'ms', metadata });
  }
  return false;
}

const { chromium, version } = await loadPlaywright();
mkdirSync(OUT_DIR, { recursive: true });
const site = await startServer({ root: UI_DIR });
const agent = await startServer({ root: UI_DIR, api: mockApi });
const browser = await launch(chromium);
console.log(`ui-test: Chromium ${browser.version()} via playwright-core ${version}; serving ${site.base} and mock agent ${agent.base}`);

const context = await browser.newContext({ viewport: { width: 1400, height: 860 }, deviceScaleFactor: 1 });
context.setDefaultTimeout(WAIT.timeout);
const page = await context.newPage();
const pageErrors = [];
page.on('pageerror', (e) => pageErrors.push(String(e)));
page.on('console', (m) => { if (m.type() === 'error') pageErrors.push(m.text()); });

const hook = (fn, arg) => page.evaluate(fn, arg);
const ready = () => hook(() => window.ringwatchViewer.whenReady());
const frame = () => hook(() => window.ringwatchViewer.nextFrame());
const range = () => hook(() => window.ringwatchViewer.visibleRange());
async function canvasPoint(x, y) {
  const r = await hook(() => window.ringwatchViewer.canvasRect());
  return { x: r.x + x, y: r.y + y };
}
// Canvas coordinates of the middle of a slice (depth >= 0) or state (depth -1).
async function slicePoint(s) {
  return hook(({ s }) => {
    const v = window.ringwatchViewer;
    const t = v.tracks().find((r) => r.id === s.track);
    const x = v.timeToX(s.ts + s.dur / 2);
    const y = s.depth < 0 ? t.y + t.stateTop + t.stateHeight / 2 : t.y + t.sliceTop + s.depth * t.rowHeight + t.rowHeight / 2;
    return { x, y };
  }, { s });
}

try {
  await check('page loads the recorded trace from ?trace= and renders', async () => {
    await page.goto(`${site.base}/index.html?trace=tests/fixtures/ringwatch-2ranks.json`);
    const state = await ready();
    assert(state === 'ready', 'viewer state is ' + state + ': ' + await hook(() => window.ringwatchViewer.error));
    assert(await hook(() => window.ringwatchViewer.rendered) > 0, 'nothing rendered');
    assert(await hook(() => window.ringwatchViewer.usesWorker()), 'the trace was not parsed in a Worker');
    const status = await page.textContent('#status');
    assert(/events/.test(status), 'status line says nothing about the events: ' + status);
  });

  await check('a job opens on its overview: a lane per rank, threads folded under it, a verdict on the job row', async () => {
    const rows = await hook(() => window.ringwatchViewer.tracks());
    const overviews = rows.filter((r) => r.type === 'overview');
    assert(overviews.length === 2 && overviews[0].rank === 0 && overviews[1].rank === 1, 'overview rows: ' + JSON.stringify(overviews));
    assert(overviews.every((o) => o.threads > 0 && o.running > 0), 'the overview counts running threads: ' + JSON.stringify(overviews));
    assert(overviews.some((o) => o.share.coll > 0), 'the overview sees the collectives: ' + JSON.stringify(overviews.map((o) => o.share)));
    assert(!rows.some((r) => r.type === 'track' && r.job === 'resnet50' && r.kind === 'thread'), 'a rank thread is open on the first screen');
    const folds = rows.filter((r) => r.type === 'fold');
    assert(folds.length >= 2 && folds.every((f) => /^▸ \d+ threads?/.test(f.name)), 'folds: ' + JSON.stringify(folds.map((f) => f.name)));
    // The first screen holds every rank's overview.
    const view = await hook(() => window.ringwatchViewer.canvasRect());
    assert(overviews.every((o) => o.y + o.height <= view.height), 'an overview is below the fold: ' + JSON.stringify(overviews.map((o) => o.y)));
    const verdict = await hook(() => window.ringwatchViewer.jobVerdict('resnet50'));
    assert(verdict && /^looks (compute|network|scheduling)-bound/.test(verdict.text) && /threads running/.test(verdict.text), 'verdict: ' + JSON.stringify(verdict));
    await page.screenshot({ path: join(OUT_DIR, 'screenshot-overview.png') });
    // A click on a fold opens that rank's threads.
    const c = await canvasPoint(40, folds[0].y + folds[0].height / 2);
    await page.mouse.click(c.x, c.y);
    await frame();
    const after = await hook(() => window.ringwatchViewer.tracks());
    assert(after.some((r) => r.type === 'track' && r.kind === 'thread' && r.rank === folds[0].rank), 'the fold did not open');
    await hook(() => window.ringwatchViewer.expandAll());
  });

  await check('tracks are grouped job → rank → thread, with counters and an ungrouped GPU', async () => {
    const tracks = await hook(() => window.ringwatchViewer.tracks());
    const groups = tracks.filter((t) => t.type === 'group').map((t) => t.name);
    assert(groups[0] === 'resnet50' && groups.includes('other processes'), 'groups: ' + JSON.stringify(groups));
    const procs = tracks.filter((t) => t.type === 'process');
    assert(procs.length === 3, 'expected 2 ranks + 1 GPU process, got ' + JSON.stringify(procs.map((p) => p.name)));
    assert(/^rank 0\b/.test(procs[0].name) && /^rank 1\b/.test(procs[1].name), 'ranks in order: ' + procs.map((p) => p.name));
    for (const [job, rank, name] of EXPECTED_TRACKS) {
      assert(tracks.some((t) => t.type === 'track' && t.job === job && t.rank === rank && t.name === name), `missing track ${job}/rank ${rank}/${name}`);
    }
    const tcp = tracks.find((t) => t.name === 'tcp 127.0.0.1:29501');
    assert(tcp.kind === 'counter' && tcp.series.join() === 'tx_bytes_per_s,rx_bytes_per_s' && tcp.max > 2e9, 'tcp counter: ' + JSON.stringify(tcp));
    const gpu = tracks.find((t) => t.name === 'gpu0 utilization');
    assert(gpu && gpu.kind === 'counter' && gpu.job === null && gpu.group === 'other processes', 'gpu counter: ' + JSON.stringify(gpu));
    const bg = tracks.find((t) => t.rank === 0 && t.name === 'horovod background');
    assert(bg.levels === 2 && bg.slices === 20 * 6 && bg.states > 0 && bg.instants === 20, 'rank 0 bg thread: ' + JSON.stringify(bg));
  });

  await check('X and B/E activities nest the same way (MEMCPY_IN inside ALLREDUCE at depth 1)', async () => {
    const r0 = await hook((k) => window.ringwatchViewer.findSlices(k.name, k.pid, k.tid), KNOWN);
    const r1 = await hook(() => window.ringwatchViewer.findSlices('MEMCPY_IN_FUSION_BUFFER', 4201, 4202));
    assert(r0.length === 20 && r1.length === 20, `counts ${r0.length}, ${r1.length}`);
    assert(r0.every((s) => s.depth === 1) && r1.every((s) => s.depth === 1), 'not all at depth 1');
    const known = r0.find((s) => s.ts === KNOWN.ts);
    assert(known && known.dur === KNOWN.dur, 'known slice not found: ' + JSON.stringify(r0.slice(0, 6)));
    const ar = await hook(() => window.ringwatchViewer.findSlices('ALLREDUCE', 4201, 4202));
    assert(ar.length === 20 && ar.every((s) => s.depth === 0), 'rank 1 ALLREDUCE at depth 0');
  });

  await check('hover on a known slice shows its name, exact start, duration and args', async () => {
    await hook(() => window.ringwatchViewer.setRange(1_049_000, 1_061_000));
    const [s] = (await hook((k) => window.ringwatchViewer.findSlices(k.name, k.pid, k.tid), KNOWN)).filter((x) => x.ts === KNOWN.ts);
    const p = await slicePoint(s);
    const hit = await hook((p) => window.ringwatchViewer.sliceAt(p.x, p.y), p);
    assert(hit && hit.name === KNOWN.name && hit.dur === KNOWN.dur, 'sliceAt: ' + JSON.stringify(hit));
    const c = await canvasPoint(p.x, p.y);
    await page.mouse.move(c.x, c.y);
    await page.waitForSelector('#tooltip:not([hidden])', WAIT);
    await page.waitForFunction(() => /bytes/.test(document.querySelector('#tooltip').textContent), null, WAIT);
    const text = await page.textContent('#tooltip');
    assert(text.includes(KNOWN.name), 'tooltip lacks the name: ' + text);
    assert(text.includes('1.500 ms'), 'tooltip lacks the duration 1.500 ms: ' + text);
    assert(text.includes('51.600 ms'), 'tooltip lacks the start 51.600 ms (from the trace start): ' + text);
    assert(text.includes('25557032'), 'tooltip lacks the args: ' + text);
    await page.screenshot({ path: join(OUT_DIR, 'screenshot-hover.png') });
  });

  await check('thread states are drawn in their distinct colours, and hover names them', async () => {
    await page.mouse.move(5, 5);
    const expect = { running: '#2f9e44', runnable: '#f59f00', blocked: '#e03131', sleeping: '#adb5bd' };
    const seen = {};
    for (const [state, color] of Object.entries(expect)) {
      const pid = state === 'blocked' ? 4101 : 4101;
      const tid = state === 'blocked' ? 4101 : 4102;
      const all = await hook((a) => window.ringwatchViewer.findSlices(a.state, a.pid, a.tid), { state, pid, tid });
      const r = await range();
      const s = all.find((x) => x.ts > r.start && x.ts + x.dur < r.end && x.dur > 90);
      assert(s, 'no ' + state + ' state in view');
      const p = await slicePoint(s);
      const hit = await hook((p) => window.ringwatchViewer.sliceAt(p.x, p.y), p);
      assert(hit && hit.kind === 'state' && hit.name === state, state + ': sliceAt says ' + JSON.stringify(hit));
      const px = await hook((p) => window.ringwatchViewer.pixel(p.x, p.y), p);
      assert(px === color, `${state} is drawn ${px}, expected ${color}`);
      seen[state] = px;
    }
    assert(new Set(Object.values(seen)).size === 4, 'state colours are not distinct');
  });

  await check('hover on a counter shows its values', async () => {
    const t = (await hook(() => window.ringwatchViewer.tracks())).find((x) => x.name === 'tcp 127.0.0.1:29501');
    const x = await hook(() => window.ringwatchViewer.timeToX(1_053_000));
    const c = await canvasPoint(x, t.y + t.height / 2);
    await page.mouse.move(c.x, c.y);
    await page.waitForFunction(() => /tx_bytes_per_s/.test(document.querySelector('#tooltip').textContent), null, WAIT);
    const text = await page.textContent('#tooltip');
    assert(text.includes('rx_bytes_per_s') && text.includes('tcp 127.0.0.1:29501'), 'counter tooltip: ' + text);
  });

  await check('the time axis picks units that fit the zoom (ms, µs, ns)', async () => {
    await hook(() => window.ringwatchViewer.setRange(1_000_000, 1_100_000));
    let labels = await hook(() => window.ringwatchViewer.axisLabels());
    assert(labels.length >= 5 && labels.every((l) => / ms$/.test(l)), 'at 100 ms: ' + labels);
    assert(labels.includes('50 ms'), 'at 100 ms a tick at 50 ms: ' + labels);
    await hook(() => window.ringwatchViewer.setRange(1_050_000, 1_050_050));
    labels = await hook(() => window.ringwatchViewer.axisLabels());
    assert(labels.every((l) => / µs$/.test(l)) && labels.includes('50020 µs'), 'at 50 µs: ' + labels);
    await hook(() => window.ringwatchViewer.setRange(1_050_000, 1_050_000.2));
    labels = await hook(() => window.ringwatchViewer.axisLabels());
    assert(labels.every((l) => / ns$/.test(l)), 'at 200 ns: ' + labels);
    await hook(() => window.ringwatchViewer.setRange(0, 30e6));
    labels = await hook(() => window.ringwatchViewer.axisLabels());
    assert(labels.every((l) => / s$/.test(l)), 'at 30 s: ' + labels);
  });

  await check('wheel zooms in around the cursor', async () => {
    await page.click('#fit');
    await frame();
    const before = await range();
    const x = 800, y = 300;
    const tAt = await hook((x) => window.ringwatchViewer.xToTime(x), x);
    const c = await canvasPoint(x, y);
    await page.mouse.move(c.x, c.y);
    await page.mouse.wheel(0, -300);
    await page.waitForFunction((s) => { const r = window.ringwatchViewer.visibleRange(); return r.end - r.start < s; }, before.end - before.start);
    await frame();
    const after = await range();
    const span0 = before.end - before.start, span1 = after.end - after.start;
    assert(span1 < span0 * 0.8, `span ${span0} -> ${span1}`);
    const tAfter = await hook((x) => window.ringwatchViewer.xToTime(x), x);
    near(tAfter, tAt, span1 * 0.01, 'the time under the cursor moved');
    await page.mouse.wheel(0, 300);
    await page.waitForFunction((s) => { const r = window.ringwatchViewer.visibleRange(); return r.end - r.start > s; }, span1);
  });

  await check('drag pans the view by the distance dragged', async () => {
    const before = await range();
    const perPx = (before.end - before.start) / (1400 - 240);
    const a = await canvasPoint(900, 250);
    await page.mouse.move(a.x, a.y);
    await page.mouse.down();
    await page.mouse.move(a.x - 100, a.y, { steps: 5 });
    await page.mouse.move(a.x - 200, a.y, { steps: 5 });
    await page.mouse.up();
    await frame();
    const after = await range();
    near(after.end - after.start, before.end - before.start, 1e-6 * (before.end - before.start), 'span changed while panning');
    near(after.start - before.start, 200 * perPx, 2 * perPx, 'panned by the wrong amount');
  });

  await check('the selector shows one process', async () => {
    const options = await page.$$eval('#selector option', (os) => os.map((o) => o.value));
    assert(options.includes('job:resnet50') && options.includes('pid:4101') && options.includes('pid:4201'), 'options: ' + options);
    await page.selectOption('#selector', 'pid:4201');
    await frame();
    let tracks = (await hook(() => window.ringwatchViewer.tracks())).filter((t) => t.type === 'track');
    assert(tracks.length === 3 && tracks.every((t) => t.pid === 4201), 'pid filter: ' + JSON.stringify(tracks.map((t) => [t.pid, t.name])));
    await page.selectOption('#selector', 'job:resnet50');
    await frame();
    tracks = (await hook(() => window.ringwatchViewer.tracks())).filter((t) => t.type === 'track');
    assert(tracks.length === 6 && tracks.every((t) => t.job === 'resnet50'), 'job filter: ' + tracks.length);
    await page.selectOption('#selector', '');
    await frame();
  });

  await check('clicking a job header folds and unfolds its ranks', async () => {
    const before = await hook(() => window.ringwatchViewer.tracks());
    const g = before.find((t) => t.type === 'group' && t.name === 'resnet50');
    const c = await canvasPoint(40, g.y + g.height / 2);
    await page.mouse.click(c.x, c.y);
    await frame();
    const folded = await hook(() => window.ringwatchViewer.tracks());
    assert(!folded.some((t) => t.job === 'resnet50' && t.type !== 'group'), 'ranks still shown');
    assert(folded.some((t) => t.name === 'gpu0 utilization'), 'other groups folded too');
    await page.mouse.click(c.x, c.y);
    await frame();
    assert((await hook(() => window.ringwatchViewer.tracks())).length === before.length, 'not unfolded');
  });

  await check('screenshot of the recorded trace (target/ui-test/screenshot.png)', async () => {
    await hook(() => window.ringwatchViewer.setRange(1_028_000, 1_062_000));
    const [s] = (await hook((k) => window.ringwatchViewer.findSlices(k.name, k.pid, k.tid), KNOWN)).filter((x) => x.ts === KNOWN.ts);
    const p = await slicePoint(s);
    const c = await canvasPoint(p.x, p.y);
    await page.mouse.move(c.x, c.y);
    await page.waitForFunction(() => /bytes/.test(document.querySelector('#tooltip').textContent), null, WAIT);
    await page.screenshot({ path: join(OUT_DIR, 'screenshot.png') });
    await page.click('#fit');
    await page.mouse.move(5, 5);
    await frame();
    await page.screenshot({ path: join(OUT_DIR, 'screenshot-fit.png') });
  });

  await check('opens an unterminated Horovod timeline through the file picker', async () => {
    await page.setInputFiles('#file', join(FIXTURES, 'horovod-unterminated.json'));
    await page.waitForFunction(() => window.ringwatchViewer.state !== 'loading' && /horovod/.test(document.querySelector('#status').textContent));
    assert(await ready() === 'ready', 'state: ' + await hook(() => window.ringwatchViewer.error));
    const status = await page.textContent('#status');
    assert(/unterminated/.test(status), 'status does not say the file was unterminated: ' + status);
    const tracks = await hook(() => window.ringwatchViewer.tracks());
    const procs = tracks.filter((t) => t.type === 'process').map((t) => t.name);
    assert(procs.length === 3 && procs[0].startsWith('DistributedAdam.Allreduce.conv1/kernel_0'), 'tensors: ' + procs);
    assert(tracks[0].type === 'group' && tracks[0].name === 'horovod-unterminated.json', 'group: ' + tracks[0].name);
    const ar = await hook(() => window.ringwatchViewer.findSlices('ALLREDUCE'));
    assert(ar.length === 13 && ar.every((s) => s.depth === 0), 'ALLREDUCE slices (12 closed + 1 running): ' + ar.length);
    for (const n of ['QUEUE', 'MEMCPY_IN_FUSION_BUFFER', 'NCCL_ALLREDUCE', 'MEMCPY_OUT_FUSION_BUFFER']) {
      const s = await hook((n) => window.ringwatchViewer.findSlices(n), n);
      assert(s.length === 12 && s.every((x) => x.depth === 1), n + ' nesting: ' + JSON.stringify(s.slice(0, 2)));
    }
    const nccl = await hook(() => window.ringwatchViewer.findSlices('NCCL_ALLREDUCE'));
    assert(nccl[0].dur === 1480, 'NCCL_ALLREDUCE duration ' + nccl[0].dur);
    await page.screenshot({ path: join(OUT_DIR, 'screenshot-horovod.png') });
  });

  await check('opens a trace dropped onto the page', async () => {
    const text = readFileSync(join(FIXTURES, 'ringwatch-2ranks.json'), 'utf8');
    await page.evaluate((text) => {
      const dt = new DataTransfer();
      dt.items.add(new File([text], 'dropped.json', { type: 'application/json' }));
      window.dispatchEvent(new DragEvent('drop', { dataTransfer: dt, bubbles: true, cancelable: true }));
    }, text);
    await page.waitForFunction(() => /dropped\.json/.test(document.querySelector('#status').textContent));
    assert(await ready() === 'ready', 'state after drop');
    const tracks = await hook(() => window.ringwatchViewer.tracks());
    assert(tracks.filter((t) => t.type === 'track').length === 7, 'tracks after drop: ' + tracks.length);
  });

  await check('a trace that is not JSON gives a clear error, not a blank page', async () => {
    await page.goto(`${site.base}/index.html?trace=viewer.css`);
    assert(await ready() === 'error', 'state');
    const status = await page.textContent('#status');
    assert(/error: not JSON/.test(status), 'status: ' + status);
    await page.goto(`${site.base}/index.html?trace=missing.json`);
    assert(await ready() === 'error', 'state');
    assert(/HTTP 404/.test(await page.textContent('#status')), 'status for a 404');
  });

  await check('served by the agent: live mode polls /api/timeline and follows the present; zoom pauses it', async () => {
    pageErrors.length = 0;
    await page.goto(`${agent.base}/`);
    await page.waitForFunction(() => window.ringwatchViewer.live().polls >= 2, null, WAIT);
    assert(await ready() === 'ready', 'state');
    const live = await hook(() => window.ringwatchViewer.live());
    assert(live.enabled && !live.paused && /^\/api\/timeline\?from=now-10s&downsample=true&max_events=100000&width=\d+&view=overview$/.test(live.lastUrl), 'live: ' + JSON.stringify(live));
    await hook(() => window.ringwatchViewer.expandAll());
    const tracks = await hook(() => window.ringwatchViewer.tracks());
    assert(tracks.some((t) => t.rank === 1 && t.name === 'horovod background'), 'live tracks');
    const r1 = await range();
    near(r1.end - r1.start, 10e6, 1, 'live window');
    assert(r1.origin === r1.end, 'live times count from the present');
    const labels = await hook(() => window.ringwatchViewer.axisLabels());
    assert(labels.includes('-5 s') && labels[labels.length - 1] === '0 s', 'live axis: ' + labels);
    await page.waitForFunction((e) => window.ringwatchViewer.visibleRange().end > e + 500_000, r1.end, WAIT);
    // the user zooms: live pauses and the view stays where the user put it
    const c = await canvasPoint(1200, 200);
    await page.mouse.move(c.x, c.y);
    await page.mouse.wheel(0, -200);
    // a poll already on its way when the zoom paused may still land: count from when none is
    await page.waitForFunction(() => window.ringwatchViewer.live().paused && !window.ringwatchViewer.live().inflight);
    const polls = (await hook(() => window.ringwatchViewer.live())).polls;
    const r2 = await range();
    await page.waitForTimeout(2200);
    const r3 = await range();
    assert((await hook(() => window.ringwatchViewer.live())).polls === polls, 'still polling while paused');
    assert(r3.start === r2.start && r3.end === r2.end, 'view moved while paused');
    assert(/paused/.test(await page.textContent('#live')), 'live button does not say paused');
    await page.click('#live');
    await page.waitForFunction((p) => window.ringwatchViewer.live().polls > p && !window.ringwatchViewer.live().paused, polls, WAIT);
    await page.selectOption('#selector', 'pid:4201');
    await page.waitForFunction(() => /pid=4201/.test(window.ringwatchViewer.live().lastUrl || ''), null, WAIT);
    // lastUrl is set as the request leaves the page: give it time to reach the mock agent
    const pidQuery = /^\/api\/timeline\?from=now-10s&pid=4201&downsample=true&max_events=100000&width=\d+$/;
    for (let i = 0; i < 600 && !agent.requests.some((q) => pidQuery.test(q)); i++) await page.waitForTimeout(100);
    assert(agent.requests.some((q) => pidQuery.test(q)), 'the pid filter did not reach the API: ' + agent.requests.slice(-3));
    await page.screenshot({ path: join(OUT_DIR, 'screenshot-live.png') });
  });

  await check('a job\'s live view says whether its tensor events stream yet (--job-timeline on-demand)', async () => {
    const sinceRe = /the job's tensor events since \d/;
    await page.selectOption('#selector', 'job:resnet50');
    await page.waitForFunction(() => /tensor events are not streamed yet/.test(document.querySelector('#status').textContent), null, WAIT);
    await page.waitForFunction((re) => new RegExp(re).test(document.querySelector('#status').textContent), sinceRe.source, WAIT);
    assert(agent.requests.some((q) => /^\/api\/timeline\?from=now-10s&job=resnet50&scope=cluster&/.test(q)), 'the job filter did not reach the API: ' + agent.requests.slice(-3));
    await page.selectOption('#selector', '');
    await page.waitForFunction((re) => !new RegExp(re).test(document.querySelector('#status').textContent) && !/[?&]job=/.test(window.ringwatchViewer.live().lastUrl || ''), sinceRe.source, WAIT);
  });

  // The tuning panel against Contract C's endpoints, mocked with page.route
  // (GET/POST/DELETE /api/jobs/{id}/tuning, GET /api/reports): a session whose
  // samples arrive one per poll, a token the mock demands, reports with links.
  const K = (fusion, cycleUs, hier) => ({ fusion_threshold_bytes: fusion, cycle_time_us: cycleUs, hierarchical_allreduce: hier });
  const PLAN = [[K(64 << 20, 1000, false), 1.0e9], [K(0, 5000, true), 0.6e9], [K(16 << 20, 500, false), 1.5e9], [K(8 << 20, 2000, true), 1.2e9], [K(32 << 20, 800, false), 1.4e9]];
  const mock = { session: null, gets: 0, posts: [], deletes: [] };
  const report = (id, samples, speedup) => ({ id, job_id: 'resnet50', created_unix_ms: 1_700_000_000_000, samples, best: K(16 << 20, 500, false), speedup_over_start: speedup,
    html: '/api/reports/' + id, csv: `/api/reports/${id}?format=csv`, parquet: `/api/reports/${id}?format=parquet` });
  const reports = [report('r1', 12, 1.21)];
  const newSession = (budget) => ({ job_id: 'resnet50', state: 'running', error: null, started_unix_ms: Date.now(), config: { budget },
    start_knobs: PLAN[0][0], current_knobs: PLAN[0][0], samples: [], best: null, speedup_over_start: null, report_id: null });
  const addSample = (s) => {
    const i = s.samples.length;
    const [knobs, score] = PLAN[i % PLAN.length];
    s.samples.push({ index: i, knobs, score: score, noise_hint: null, disturbed: i === 1 ? 'run-queue wait 12% of the window' : null,
      remeasured_because: null, wall_time_s: 1.5 * (i + 1), window: { first_cycle: 10 * i, last_cycle: 10 * i + 9, cycles: 10, duration_s: 1.0 } });
    s.current_knobs = knobs;
    const best = s.samples.reduce((a, b) => (b.score > a.score ? b : a));
    s.best = { knobs: best.knobs, predicted_score: best.score, sample: best.index };
    s.objective = 'bytes_per_second';
    s.speedup_over_start = best.score / s.samples[0].score;
    if (s.samples.length >= s.config.budget) { s.state = 'done'; s.report_id = 'r2'; reports.push(report('r2', s.samples.length, s.speedup_over_start)); }
  };
  await page.route((url) => url.pathname.startsWith('/api/jobs/') || url.pathname === '/api/reports', async (route) => {
    const req = route.request();
    const url = new URL(req.url());
    const send = (status, body) => route.fulfill({ status, contentType: 'application/json', body: JSON.stringify(body) });
    if (url.pathname === '/api/reports') return send(200, { reports });
    if (url.pathname !== '/api/jobs/resnet50/tuning') return send(404, { error: 'no job ' + url.pathname });
    const auth = req.headers().authorization;
    if (req.method() === 'GET') {
      mock.gets++;
      if (!mock.session) return send(404, { error: 'job resnet50 never had a tuning session' });
      if (mock.session.state === 'running') addSample(mock.session);
      return send(200, mock.session);
    }
    if (auth !== 'Bearer s3cret') return send(401, { error: 'this endpoint needs Authorization: Bearer TOKEN' });
    if (req.method() === 'POST') {
      const body = JSON.parse(req.postData() || '{}');
      mock.posts.push({ auth, body });
      if (mock.session && mock.session.state === 'running') return send(409, { error: 'a session already runs' });
      mock.session = newSession(body.budget || 20);
      return send(201, mock.session);
    }
    if (req.method() === 'DELETE') {
      mock.deletes.push({ auth, search: url.search });
      if (!mock.session) return send(404, { error: 'no session' });
      mock.session.state = 'stopped';
      return send(200, mock.session);
    }
    return send(405, { error: 'method' });
  });
  const tuning = () => hook(() => window.ringwatchViewer.tuning());

  await check('tuning panel: only when served by an agent; lists the jobs, no session yet, reports with links', async () => {
    const plain = await context.newPage();
    await plain.goto(`${site.base}/index.html?trace=tests/fixtures/ringwatch-2ranks.json`);
    await plain.evaluate(() => window.ringwatchViewer.whenReady());
    assert(await plain.isHidden('#tuning-toggle'), 'the tuning button shows on a page no agent serves');
    await plain.close();
    assert(await page.isVisible('#tuning-toggle'), 'no tuning button on the agent page');
    await page.click('#tuning-toggle');
    await page.waitForFunction(() => document.querySelector('#tuning-job').value === 'resnet50', null, WAIT);
    await page.waitForFunction(() => /No tuning session for resnet50/.test(document.querySelector('#tuning-session').textContent), null, WAIT);
    await page.waitForSelector('#tuning-report-list tr[data-id="r1"]', WAIT);
    const links = await page.$$eval('#tuning-report-list tr[data-id="r1"] a', (as) => as.map((a) => [a.textContent, a.getAttribute('href')]));
    const hrefs = Object.fromEntries(links.filter(([t]) => t !== 'r1'));
    assert(hrefs.html === '/api/reports/r1' && hrefs.csv === '/api/reports/r1?format=csv' && hrefs.parquet === '/api/reports/r1?format=parquet', 'report links: ' + JSON.stringify(links));
    assert(/1\.21×/.test(await page.textContent('#tuning-report-list')), 'speedup of r1');
    assert(!(await page.isDisabled('#tuning-start')) && await page.isDisabled('#tuning-stop'), 'start enabled, stop disabled without a session');
  });

  await check('tuning panel: start needs the token; samples arrive by polling into the table and chart; best, state, report', async () => {
    await page.fill('#tuning-budget', '5');
    await page.click('#tuning-start');
    await page.waitForFunction(() => /401/.test(document.querySelector('#tuning-message').textContent), null, WAIT);
    assert(/Bearer/.test(await page.textContent('#tuning-message')), 'the 401 message is shown: ' + await page.textContent('#tuning-message'));
    await page.fill('#tuning-token', 's3cret');
    await page.click('#tuning-start');
    await page.waitForFunction(() => document.querySelectorAll('#tuning-samples tbody tr').length >= 2, null, WAIT);
    assert(/running/.test(await page.textContent('#tuning-state')), 'running state while samples arrive');
    assert(mock.posts.length === 1 && mock.posts[0].auth === 'Bearer s3cret' && mock.posts[0].body.budget === 5, 'POST: ' + JSON.stringify(mock.posts));
    await page.waitForFunction(() => document.querySelector('#tuning-state') && document.querySelector('#tuning-state').textContent === 'done', null, WAIT);
    const rows = await page.$$eval('#tuning-samples tbody tr', (trs) => trs.map((tr) => Array.from(tr.children, (td) => td.textContent)));
    assert(rows.length === 5, 'rows: ' + rows.length);
    assert(rows[2].join('|') === '2|16.0 MiB|0.50 ms|no|1.50 GB/s|1.50 GB/s|', 'row 2: ' + rows[2].join('|'));
    assert(rows[1][1] === 'off' && /disturbed/.test(rows[1][6]) && rows[1][5] === '1.00 GB/s', 'row 1: ' + rows[1].join('|'));
    assert(rows[4][4] === '1.40 GB/s' && rows[4][5] === '1.50 GB/s', 'best so far stays at 1.5 GB/s: ' + rows[4].join('|'));
    const dots = await page.$$eval('#tuning-chart circle', (cs) => cs.map((c) => Number(c.getAttribute('cy'))));
    assert(dots.length === 5 && dots[2] === Math.min(...dots) && dots[1] === Math.max(...dots), 'chart dots (cy): ' + dots);
    assert(await page.$$eval('#tuning-chart circle.disturbed', (cs) => cs.length) === 1, 'the disturbed sample is marked');
    const facts = await page.textContent('#tuning-session .facts');
    assert(/best so far.*fusion 16\.0 MiB · cycle 0\.50 ms · flat · 1\.50 GB\/s \(sample 2\)/.test(facts), 'best: ' + facts);
    assert(/1\.50×/.test(facts) && /5 of 5/.test(facts), 'speedup and samples: ' + facts);
    await page.waitForSelector('#tuning-report-list tr[data-id="r2"]', WAIT);
    // Done: polling slows to every 5 s.
    const gets = mock.gets;
    await page.waitForTimeout(2500);
    assert(mock.gets - gets <= 1, `still polling every second after done: ${mock.gets - gets} GETs in 2.5 s`);
    await page.screenshot({ path: join(OUT_DIR, 'screenshot-tuning.png') });
  });

  await check('tuning panel: stop sends DELETE with the token (keep=start) and shows the stopped session', async () => {
    await page.fill('#tuning-budget', '50');
    await page.click('#tuning-start');
    await page.waitForFunction(() => document.querySelector('#tuning-state').textContent === 'running' && !document.querySelector('#tuning-stop').disabled, null, WAIT);
    assert(await page.isDisabled('#tuning-start'), 'start is disabled while a session runs');
    await page.check('#tuning-keep-start');
    await page.click('#tuning-stop');
    await page.waitForFunction(() => document.querySelector('#tuning-state').textContent === 'stopped', null, WAIT);
    assert(mock.deletes.length === 1 && mock.deletes[0].auth === 'Bearer s3cret' && mock.deletes[0].search === '?keep=start', 'DELETE: ' + JSON.stringify(mock.deletes));
    assert(await page.isDisabled('#tuning-stop') && !(await page.isDisabled('#tuning-start')), 'buttons after stop');
    assert((await tuning()).state === 'stopped', 'hook state');
    await page.click('#tuning-close');
    assert(await page.isHidden('#tuning'), 'the panel closes');
    // The intended 404 (no session yet) and 401 (no token) are logged by the browser.
    for (let i = pageErrors.length - 1; i >= 0; i--) if (/status of (401|404)/.test(pageErrors[i])) pageErrors.splice(i, 1);
  });
  await page.unroute((url) => url.pathname.startsWith('/api/jobs/') || url.pathname === '/api/reports');

  // The real agent (cargo xtask test sets RINGWATCH_AGENT_BIN): the page and
  // the recorded trace both come from `ringwatch-agent serve --replay`.
  const agentBin = process.env.RINGWATCH_AGENT_BIN;
  if (agentBin) {
    await check('served by the real agent (serve --replay): tracks appear and hover shows the known slice', async () => {
      const { spawn } = await import('node:child_process');
      const proc = spawn(agentBin, ['serve', '--listen', '127.0.0.1:0', '--replay', join(FIXTURES, 'ringwatch-2ranks.json')], { stdio: ['ignore', 'ignore', 'pipe'] });
      try {
        const base = await new Promise((resolveP, reject) => {
          const timer = setTimeout(() => reject(new Error('the agent did not start serving within 120 s')), 120_000);
          let log = '';
          proc.stderr.on('data', (d) => {
            log += d;
            const m = /serving the API on (http:\/\/[0-9.:]+)\//.exec(log);
            if (m) { clearTimeout(timer); resolveP(m[1]); }
          });
          proc.on('exit', (code) => { clearTimeout(timer); reject(new Error('the agent exited (' + code + '): ' + log)); });
        });
        pageErrors.length = 0;
        await page.goto(`${base}/`);
        await page.waitForFunction(() => window.ringwatchViewer.live().polls >= 1, null, WAIT);
        assert(await ready() === 'ready', 'state');
        // First the overview: per rank, the agent's counters in place of threads and tensors.
        const first = await hook(() => window.ringwatchViewer.live());
        assert(/&view=overview$/.test(first.lastUrl), 'the first poll asks for the overview: ' + first.lastUrl);
        const lanes = (await hook(() => window.ringwatchViewer.tracks())).filter((r) => r.type === 'overview');
        assert(lanes.length === 2 && lanes.every((o) => o.running > 0 && o.share.coll > 0), 'overview lanes from the agent: ' + JSON.stringify(lanes));
        assert(!(await hook(() => window.ringwatchViewer.tracks())).some((r) => r.type === 'track' && r.kind === 'thread' && r.job === 'resnet50' && r.states > 0), 'thread states came with the overview');
        const verdict = await hook(() => window.ringwatchViewer.jobVerdict('resnet50'));
        assert(verdict && /^looks /.test(verdict.text), 'verdict from the agent overview: ' + JSON.stringify(verdict));
        await page.screenshot({ path: join(OUT_DIR, 'screenshot-agent-overview.png') });
        // Opened: every thread and tensor.
        const polls = first.polls;
        await hook(() => window.ringwatchViewer.expandAll());
        await page.waitForFunction(() => window.ringwatchViewer.tracks().some((t) => t.type === 'track' && t.kind === 'thread' && t.job === 'resnet50' && t.states > 0), null, WAIT);
        assert((await hook(() => window.ringwatchViewer.live())).polls > polls, 'no new poll');
        const tracks = await hook(() => window.ringwatchViewer.tracks());
        for (const [job, rank, name] of EXPECTED_TRACKS) {
          assert(tracks.some((t) => t.type === 'track' && t.job === job && t.rank === rank && t.name === name), `missing track ${job}/rank ${rank}/${name}`);
        }
        // Zoomed in (live pauses): the agent answers the window at the screen's pixels, every slice again.
        const details = (await hook(() => window.ringwatchViewer.live())).details;
        await hook(() => window.ringwatchViewer.setRange(1_049_000, 1_061_000));
        await page.waitForFunction((d) => window.ringwatchViewer.live().details > d, details, WAIT);
        assert(/from=1049000&to=1061000&.*width=\d+/.test((await hook(() => window.ringwatchViewer.live())).lastUrl), 'the zoomed window was asked for');
        const [s] = (await hook((k) => window.ringwatchViewer.findSlices(k.name, k.pid, k.tid), KNOWN)).filter((x) => x.ts === KNOWN.ts);
        assert(s, 'the known slice is not in the agent-served trace');
        const p = await slicePoint(s);
        const c = await canvasPoint(p.x, p.y);
        await page.mouse.move(c.x, c.y);
        await page.waitForSelector('#tooltip:not([hidden])', WAIT);
        const text = await page.textContent('#tooltip');
        assert(text.includes(KNOWN.name) && text.includes('1.500 ms'), 'tooltip: ' + text);
        await page.screenshot({ path: join(OUT_DIR, 'screenshot-agent.png') });
      } finally {
        proc.kill();
      }
    });
    // The tuning report a session writes, rendered afresh by the real
    // `ringwatch-report` (built beside the agent) from a real session's
    // Parquet table (the agent tuning a PyTorch job at 500 Mbit/s, 20
    // samples), as a person opens it: a page that fits, a plot with a point
    // per sample, the chosen knobs and every sample in the table.
    await check('tuning report: the HTML of a real session, rendered by ringwatch-report, in the browser', async () => {
      const { execFileSync } = await import('node:child_process');
      const { dirname } = await import('node:path');
      const bin = join(dirname(agentBin), 'ringwatch-report');
      assert(existsSync(bin), bin + ' is missing (it is built with the agent by cargo test --workspace)');
      const out = join(OUT_DIR, 'tuning-report.html');
      execFileSync(bin, [join(FIXTURES, 'tuning-session.parquet'), '--output', out, '--title', 'resnet18 on ringwatch.torch'], { stdio: 'inherit' });
      pageErrors.length = 0;
      await page.setViewportSize({ width: 1200, height: 900 });
      await page.goto('file://' + out);
      const facts = await page.evaluate(() => ({
        overflow: document.documentElement.scrollWidth - window.innerWidth,
        svgs: document.querySelectorAll('svg').length,
        marks: document.querySelectorAll('svg circle').length,
        rows: document.querySelectorAll('table tr').length,
        text: document.body.innerText,
      }));
      await page.screenshot({ path: join(OUT_DIR, 'screenshot-report.png'), fullPage: true });
      assert(facts.overflow <= 0, 'the page is wider than the window by ' + facts.overflow + ' px');
      assert(facts.svgs >= 1, 'no plot');
      assert(facts.marks >= 20, 'the plot marks ' + facts.marks + ' points for 20 samples');
      assert(facts.rows >= 21, 'the table has ' + facts.rows + ' rows for 20 samples');
      assert(/resnet18 on ringwatch\.torch/.test(facts.text), 'no title');
      assert(/hierarchical/i.test(facts.text) && /483/.test(facts.text), 'the chosen knobs (483 MiB, hierarchical) are not on the page');
      assert(pageErrors.length === 0, pageErrors.join('\n'));
      await page.setViewportSize({ width: 1400, height: 860 });
    });
  } else {
    console.log('note: RINGWATCH_AGENT_BIN is not set, so the check against the real agent did not run (cargo xtask test sets it)');
  }

  // The viewer is ES modules, which browsers do not run from a file: page; so
  // the empty page and its picker are checked over HTTP, a file: trace URL
  // stands in for ?trace= on a file: page, and the file: page itself must say
  // how to open it.
  await check('a page with no trace: the picker works; a file: trace, or the page opened as a file, says what to do', async () => {
    const errorsBefore = pageErrors.length;
    const url = `${site.base}/index.html`;
    await page.goto(url);
    assert(await ready() === 'empty', 'state of an empty page');
    assert(await hook(() => window.ringwatchViewer.usesWorker()), 'no Worker on an empty page');
    await page.setInputFiles('#file', join(FIXTURES, 'ringwatch-2ranks.json'));
    await page.waitForFunction(() => /ringwatch-2ranks/.test(document.querySelector('#status').textContent));
    assert(await ready() === 'ready', 'state after the picker');
    await page.goto(url + '?trace=' + encodeURIComponent('file://' + join(FIXTURES, 'ringwatch-2ranks.json')));
    assert(await ready() === 'error', 'state for a file: ?trace=');
    assert(/Open trace file/.test(await page.textContent('#status')), 'the message says what to do');
    await page.goto('file://' + join(UI_DIR, 'index.html'));
    const status = await page.textContent('#status');
    assert(/served over HTTP/.test(status) && /ringwatch-agent serve/.test(status), 'a file: page says to serve it over HTTP: ' + status);
    // The browser logs the intended 404 (no agent answers /api/jobs on a
    // plain HTTP page) and the module script it refused to load from file:.
    pageErrors.push(...pageErrors.splice(errorsBefore).filter((e) => !/status of 404|origin 'null' has been blocked by CORS|net::ERR_FAILED/.test(e)));
  });

  await check('no errors in the page console', async () => {
    assert(pageErrors.length === 0, pageErrors.join('\n'));
  });
} finally {
  await browser.close();
  await site.close();
  await agent.close();
}
console.log(`ui-test: screenshots in ${OUT_DIR}`);
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
