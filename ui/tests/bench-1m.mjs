// Benchmark (not a test): time to first render of a generated 1-million-event
// trace in headless Chromium, and the cost of a frame afterwards.
//
//   node ui/tests/bench-1m.mjs [events]      (default 1000000)
//
// Needs what e2e.mjs needs (Debian chromium, playwright-core via npm ci). Writes
// the trace to target/ui-test/bench-<n>.json, serves it on loopback, loads
// index.html?trace=…, and prints a table. The longest main-thread stall while
// loading is measured with a 10 ms timer in the page: it says whether the tab
// stayed responsive (a frozen tab would show the whole parse there).
import { createWriteStream, mkdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { CHROMIUM, REPO_DIR, UI_DIR, launch, loadPlaywright, startServer } from './harness.mjs';

const N = Number(process.argv[2] || 1_000_000);
const OUT_DIR = join(REPO_DIR, 'target', 'ui-test');
mkdirSync(OUT_DIR, { recursive: true });
const tracePath = join(OUT_DIR, `bench-${N}.json`);

// 8 ranks of one job; per rank a background thread with Horovod cycles (6
// nested slices), a main thread with states, and a TCP counter.
async function generate() {
  const out = createWriteStream(tracePath);
  const write = (s) => (out.write(s) ? null : new Promise((r) => out.once('drain', r)));
  let n = 0, first = true;
  const emit = async (e) => {
    const p = write((first ? '' : ',\n') + JSON.stringify(e));
    first = false;
    n++;
    if (p) await p;
  };
  await write('{"traceEvents":[\n');
  const RANKS = 8;
  for (let r = 0; r < RANKS; r++) {
    const pid = 1000 + r;
    await emit({ name: 'process_name', ph: 'M', pid, args: { name: 'python train.py', job: 'bench', rank: r } });
    await emit({ name: 'thread_name', ph: 'M', pid, tid: pid, args: { name: 'main' } });
    await emit({ name: 'thread_name', ph: 'M', pid, tid: pid + 1, args: { name: 'horovod background' } });
  }
  // Per rank per cycle: 6 activities + 4 states + 4 counter samples = 14 events.
  const perCycle = 14 * RANKS;
  const cycles = Math.ceil((N - n) / perCycle);
  const CYCLE = 1000; // µs: a busy job with a 1 ms cycle
  let seed = 7;
  const rnd = () => ((seed = (seed * 1103515245 + 12345) % 2147483648) / 2147483648);
  for (let c = 0; c < cycles && n < N; c++) {
    for (let r = 0; r < RANKS && n < N; r++) {
      const pid = 1000 + r, bg = pid + 1;
      const c0 = 1e6 + c * CYCLE;
      const neg = 50 + Math.round(rnd() * 40);
      const ar0 = c0 + 100;
      const mi = 60 + Math.round(rnd() * 40), ring = 400 + Math.round(rnd() * 200), mo = 60;
      await emit({ name: 'NEGOTIATE_ALLREDUCE', ph: 'X', pid, tid: bg, ts: c0, dur: neg });
      await emit({ name: 'ALLREDUCE', ph: 'X', pid, tid: bg, ts: ar0, dur: 20 + mi + ring + mo, args: { bytes: 1 << 24 } });
      await emit({ name: 'QUEUE', ph: 'X', pid, tid: bg, ts: ar0, dur: 20 });
      await emit({ name: 'MEMCPY_IN_FUSION_BUFFER', ph: 'X', pid, tid: bg, ts: ar0 + 20, dur: mi });
      await emit({ name: 'RING_ALLREDUCE', ph: 'X', pid, tid: bg, ts: ar0 + 20 + mi, dur: ring });
      await emit({ name: 'MEMCPY_OUT_FUSION_BUFFER', ph: 'X', pid, tid: bg, ts: ar0 + 20 + mi + ring, dur: mo });
      const run = 500 + Math.round(rnd() * 200);
      await emit({ name: 'runnable', ph: 'X', pid, tid: pid, ts: c0, dur: 20 });
      await emit({ name: 'running', ph: 'X', pid, tid: pid, ts: c0 + 20, dur: run });
      await emit({ name: 'blocked', ph: 'X', pid, tid: pid, ts: c0 + 20 + run, dur: CYCLE - 40 - run });
      await emit({ name: 'sleeping', ph: 'X', pid, tid: pid, ts: c0 + CYCLE - 20, dur: 20 });
      for (let k = 0; k < 4; k++) {
        await emit({ name: 'tcp', ph: 'C', pid, ts: c0 + k * 250, args: { tx: Math.round(rnd() * 2e9), rx: Math.round(rnd() * 2e9) } });
      }
    }
  }
  await write('\n],"displayTimeUnit":"ms"}\n');
  await new Promise((r) => out.end(r));
  return n;
}

const tGen = performance.now();
const events = await generate();
const bytes = statSync(tracePath).size;
console.log(`bench: generated ${events.toLocaleString()} events, ${(bytes / 1e6).toFixed(1)} MB in ${((performance.now() - tGen) / 1000).toFixed(1)} s -> ${tracePath}`);

const { chromium } = await loadPlaywright();
const site = await startServer({ root: UI_DIR, mounts: { '/bench/': OUT_DIR } });
const browser = await launch(chromium);
try {
  const page = await (await browser.newContext({ viewport: { width: 1400, height: 860 }, deviceScaleFactor: 1 })).newPage();
  await page.addInitScript(() => {
    // Longest gap between 10 ms timer ticks = longest time the main thread was busy.
    window.__stall = { max: 0, last: performance.now() };
    setInterval(() => {
      const now = performance.now();
      window.__stall.max = Math.max(window.__stall.max, now - window.__stall.last);
      window.__stall.last = now;
    }, 10);
  });
  const t0 = performance.now();
  await page.goto(`${site.base}/index.html?trace=/bench/${encodeURIComponent(`bench-${N}.json`)}`);
  const state = await page.evaluate(() => window.ringwatchViewer.whenReady());
  const wall = performance.now() - t0;
  if (state !== 'ready') throw new Error('viewer state ' + state + ': ' + await page.evaluate(() => window.ringwatchViewer.error));
  const stats = await page.evaluate(() => window.ringwatchViewer.stats());
  const stall = await page.evaluate(() => window.__stall.max);
  const info = await page.evaluate(() => {
    const t = window.ringwatchViewer.tracks().filter((x) => x.type === 'track');
    return { tracks: t.length, slices: t.reduce((a, x) => a + (x.slices || 0) + (x.states || 0) + (x.samples || 0), 0) };
  });
  // Frames: the whole trace, then zoomed in steps around the middle, then a pan.
  const frames = await page.evaluate(() => {
    const v = window.ringwatchViewer;
    const r = v.visibleRange();
    const out = { fit: [], zoom: [], pan: [] };
    for (let i = 0; i < 5; i++) out.fit.push(v.renderNow());
    const mid = (r.start + r.end) / 2;
    let span = r.end - r.start;
    for (let i = 0; i < 12; i++) {
      span *= 0.5;
      v.setRange(mid - span / 2, mid + span / 2);
      out.zoom.push(v.renderNow());
    }
    span = (r.end - r.start) * 0.1;
    for (let i = 0; i < 10; i++) {
      v.setRange(mid + i * span * 0.05 - span / 2, mid + i * span * 0.05 + span / 2);
      out.pan.push(v.renderNow());
    }
    v.setRange(r.start, r.end);
    return out;
  });
  await page.screenshot({ path: join(OUT_DIR, 'bench-1m.png') });
  const median = (a) => a.slice().sort((x, y) => x - y)[Math.floor(a.length / 2)];
  const max = (a) => Math.max(...a);
  const rows = [
    ['events in file', events.toLocaleString()],
    ['file size', (bytes / 1e6).toFixed(1) + ' MB'],
    ['tracks / items drawn from', `${info.tracks} / ${info.slices.toLocaleString()}`],
    ['fetch in the Worker ms', stats.fetchMs.toFixed(0)],
    ['parse: JSON.parse in Worker ms', String(stats.jsonMs)],
    ['parse: build sorted typed arrays in Worker ms', String(stats.buildMs)],
    ['first render (load start → first frame) ms', stats.firstRenderMs.toFixed(0)],
    ['page load → ready, measured outside ms', wall.toFixed(0)],
    ['longest main-thread stall while loading ms', stall.toFixed(0)],
    ['frame, whole trace (median of 5) ms', median(frames.fit).toFixed(1)],
    ['zoom frame (median / max of 12 zoom steps) ms', `${median(frames.zoom).toFixed(1)} / ${max(frames.zoom).toFixed(1)}`],
    ['pan frame at 10% zoom (median of 10) ms', median(frames.pan).toFixed(1)],
  ];
  const w = Math.max(...rows.map((r) => r[0].length));
  console.log(`\nringwatch UI benchmark, Chromium ${browser.version()}, ${CHROMIUM}`);
  console.log('| ' + 'measure'.padEnd(w) + ' | value |');
  console.log('|' + '-'.repeat(w + 2) + '|-------|');
  for (const [k, v] of rows) console.log('| ' + k.padEnd(w) + ' | ' + v + ' |');
} finally {
  await browser.close();
  await site.close();
}
