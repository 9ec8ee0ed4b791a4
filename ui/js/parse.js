/*
 * The trace parser: bytes -> tolerant JSON.parse -> per-track sorted typed
 * arrays (slices by nesting depth and start, thread states, instants,
 * counters), grouped job -> rank -> thread. See ui/README.md for the
 * conventions the data follows.
 *
 * It runs in the Worker (worker.js), on the page's thread only when no Worker
 * can be had, and in Node for the parser's edge cases (tests/e2e.mjs). So it
 * must never touch the DOM, `window` or anything of the page: only fetch,
 * TextDecoder and plain JavaScript. Args stay here, fetched for the tooltip.
 */

// Thread-state slice names (case-insensitive) -> state code. Code 0 = an activity.
const STATE_CODE = {
  running: 1,
  runnable: 2, 'waiting on run queue': 2,
  blocked: 3, uninterruptible: 3, iowait: 3,
  sleeping: 4, sleep: 4,
};
export function stateCode(name) {
  if (typeof name !== 'string' || name.length > 24) return 0;
  return STATE_CODE[name.toLowerCase()] || 0;
}

let argsStore = [];
let generation = 0;

// JSON.parse, and when that fails on an array (or a traceEvents object) that
// was cut off — Horovod writes `[` then `{...},` lines and closes the array
// only at exit — cut back to the last complete event and close it.
function parseJsonTolerant(text) {
  const s = text.charCodeAt(0) === 0xfeff ? text.slice(1) : text;
  let i = 0;
  while (i < s.length && s.charCodeAt(i) <= 32) i++;
  const first = s[i];
  try {
    return { value: JSON.parse(s), repaired: false };
  } catch (err) {
    if (first !== '[' && first !== '{') throw new Error('not JSON: ' + err.message);
    const closer = first === '[' ? ']' : ']}';
    let end = s.length;
    for (let tries = 0; tries < 32; tries++) {
      const j = s.lastIndexOf('}', end - 1);
      if (j < 0) break;
      try {
        return { value: JSON.parse(s.slice(0, j + 1) + closer), repaired: true };
      } catch (_) {
        end = j;
      }
    }
    throw new Error('not JSON, nor an unterminated trace array: ' + err.message);
  }
}

function num(v) {
  const n = +v;
  return n === n ? n : null;
}

function sortedIndex(n, ts, du) {
  const idx = new Uint32Array(n);
  for (let i = 0; i < n; i++) idx[i] = i;
  // Start ascending; at equal starts the longer slice first so it is the parent.
  if (du) idx.sort((a, b) => ts[a] - ts[b] || du[b] - du[a] || a - b);
  else idx.sort((a, b) => ts[a] - ts[b] || a - b);
  return idx;
}

// Slices of one thread -> arrays sorted by (depth, start) with level offsets.
// Within a level slices never overlap, so the renderer can binary-search starts.
function finishSlices(acc, transfer) {
  const n = acc.ts.length;
  const idx = sortedIndex(n, acc.ts, acc.du);
  const depth = new Uint16Array(n);
  const stackEnds = [];
  let levels = 0;
  for (let k = 0; k < n; k++) {
    const i = idx[k];
    const start = acc.ts[i];
    while (stackEnds.length && stackEnds[stackEnds.length - 1] <= start) stackEnds.pop();
    const d = Math.min(stackEnds.length, 65535);
    depth[k] = d;
    if (d + 1 > levels) levels = d + 1;
    stackEnds.push(start + acc.du[i]);
  }
  const offsets = new Int32Array(levels + 1);
  for (let k = 0; k < n; k++) offsets[depth[k] + 1]++;
  for (let l = 0; l < levels; l++) offsets[l + 1] += offsets[l];
  const fill = offsets.slice(0, levels);
  const st = new Float64Array(n), du = new Float64Array(n);
  const nm = new Int32Array(n), ar = new Int32Array(n);
  const bz = new Float32Array(n);
  for (let k = 0; k < n; k++) {
    const i = idx[k];
    const o = fill[depth[k]]++;
    st[o] = acc.ts[i]; du[o] = acc.du[i]; nm[o] = acc.nm[i]; ar[o] = acc.ar[i];
    bz[o] = acc.busy ? acc.busy[i] : 1;
  }
  transfer.push(st.buffer, du.buffer, nm.buffer, ar.buffer, offsets.buffer, bz.buffer);
  return { st, du, nm, ar, bz, offsets, levels, count: n };
}

function finishFlat(acc, transfer, withDur) {
  const n = acc.ts.length;
  const idx = sortedIndex(n, acc.ts, null);
  const st = new Float64Array(n), nm = new Int32Array(n), ar = new Int32Array(n);
  const du = withDur ? new Float64Array(n) : null;
  // Thread states: the fraction of each slice running / runnable / off-CPU
  // (a state is all one; a summary slice of the agent's level of detail splits).
  const fr = acc.fr ? new Float32Array(3 * n) : null;
  for (let k = 0; k < n; k++) {
    const i = idx[k];
    st[k] = acc.ts[i]; nm[k] = acc.nm[i]; ar[k] = acc.ar[i];
    if (du) du[k] = acc.du[i];
    if (fr) { fr[3 * k] = acc.fr[3 * i]; fr[3 * k + 1] = acc.fr[3 * i + 1]; fr[3 * k + 2] = acc.fr[3 * i + 2]; }
  }
  transfer.push(st.buffer, nm.buffer, ar.buffer);
  if (du) transfer.push(du.buffer);
  if (fr) transfer.push(fr.buffer);
  return { st, du, nm, ar, fr, summaries: !!acc.summaries, count: n };
}

function finishCounter(c, transfer) {
  const n = c.ts.length;
  const idx = sortedIndex(n, c.ts, null);
  const ts = new Float64Array(n);
  for (let k = 0; k < n; k++) ts[k] = c.ts[idx[k]];
  transfer.push(ts.buffer);
  const series = [];
  let min = 0, max = 0;
  for (const [name, raw] of c.series) {
    const v = new Float64Array(n);
    let prev = 0;
    for (let k = 0; k < n; k++) {
      const x = raw[idx[k]];
      // An event that leaves a series out keeps its previous value (as chrome://tracing does).
      prev = x === undefined || x !== x ? prev : x;
      v[k] = prev;
      if (prev > max) max = prev;
      if (prev < min) min = prev;
    }
    transfer.push(v.buffer);
    series.push({ name, values: v });
  }
  return { ts, series, min, max, count: n };
}

// A process is a job's rank when its process_name metadata carries
// args.job (and args.rank), or, failing that, when its name reads
// "<job> rank <n>" (also "<job>/rank<n>", "<job>:rank=<n>").
const RANK_NAME = /^(.+?)[\s/:#,]*\brank\s*[:=#]?\s*(\d+)\s*$/i;

function build(root, opts) {
  let events;
  let metadata = {};
  if (Array.isArray(root)) events = root;
  else if (root && typeof root === 'object' && Array.isArray(root.traceEvents)) {
    events = root.traceEvents;
    if (root.metadata && typeof root.metadata === 'object') metadata = root.metadata;
  } else throw new Error('no trace events: expected a JSON array or an object with "traceEvents"');

  generation++;
  argsStore = [];
  const strings = [];
  const stringIdx = new Map();
  const intern = (s) => {
    s = s == null ? '' : String(s);
    let i = stringIdx.get(s);
    if (i === undefined) { i = strings.length; strings.push(s); stringIdx.set(s, i); }
    return i;
  };
  const addArgs = (cat, args, extra) => {
    const hasArgs = args && typeof args === 'object' && Object.keys(args).length > 0;
    if (!hasArgs && !cat && !extra) return -1;
    argsStore.push({ cat: cat || undefined, args: hasArgs ? args : undefined, extra });
    return argsStore.length - 1;
  };
  const acc = () => ({ ts: [], du: [], nm: [], ar: [] });
  const stateAcc = () => ({ ts: [], du: [], nm: [], ar: [], fr: [], summaries: false });

  const procs = new Map();
  const proc = (pid) => {
    const key = pid == null ? '' : String(pid);
    let p = procs.get(key);
    if (!p) {
      p = { key, pid: pid == null ? null : pid, name: null, job: null, rank: null, sortIndex: null,
        labels: null, threads: new Map(), counters: new Map(), inst: null };
      procs.set(key, p);
    }
    return p;
  };
  const thread = (p, tid) => {
    const key = tid == null ? '0' : String(tid);
    let t = p.threads.get(key);
    if (!t) {
      t = { key, tid: tid == null ? 0 : tid, name: null, sortIndex: null, sl: acc(), states: stateAcc(), inst: null, stack: [] };
      p.threads.set(key, t);
    }
    return t;
  };
  const globalInst = acc();
  let minTs = Infinity, maxTs = -Infinity, used = 0, skipped = 0;
  const seen = (a, b) => { if (a < minTs) minTs = a; if (b > maxTs) maxTs = b; };
  // A summary slice (the agent's level of detail: args.summary slices merged,
  // args.<name> each one's fraction) splits its time; any other slice is whole.
  const isSummary = (args) => args && typeof args === 'object' && num(args.summary) > 0;
  const addSlice = (th, ts, dur, name, cat, args, extra) => {
    const code = stateCode(name);
    const a = code ? th.states : th.sl;
    a.ts.push(ts); a.du.push(dur); a.nm.push(intern(name)); a.ar.push(addArgs(cat, args, extra));
    if (code) {
      if (isSummary(args)) {
        a.summaries = true;
        a.fr.push(num(args.running) || 0, (num(args.runnable) || 0) + (num(args['waiting on run queue']) || 0),
          (num(args.blocked) || 0) + (num(args.sleeping) || 0) + (num(args.uninterruptible) || 0) + (num(args.iowait) || 0));
      } else a.fr.push(code === 1 ? 1 : 0, code === 2 ? 1 : 0, code >= 3 ? 1 : 0);
    } else {
      // How much of a slice is busy: all of it, or a summary's fractions added up.
      let busy = 1;
      if (isSummary(args)) {
        busy = 0;
        for (const k in args) if (k !== 'summary' && k !== 'bytes') busy += num(args[k]) || 0;
        busy = Math.min(1, busy);
      }
      (a.busy || (a.busy = [])).push(busy);
    }
  };

  // A job's cycles (the agent's "cycles" track on the rank serving its node) also become two
  // counters: each cycle's work and its fused bytes, what the tuner changes.
  // A summary of n cycles gives their means.
  const counterOf = (p, name) => {
    let c = p.counters.get(name);
    if (!c) { c = { name, ts: [], series: new Map() }; p.counters.set(name, c); }
    return c;
  };
  const addCycle = (p, ts, dur, args) => {
    const a = args && typeof args === 'object' ? args : {};
    const n = isSummary(a) ? num(a.summary) : 1;
    const work = isSummary(a) ? (num(a.cycle) || 0) * dur / n : dur;
    const bytes = (num(a.bytes) || 0) / n;
    for (const [name, key, v] of [['cycle work', 'ms', work / 1e3], ['fused bytes per cycle', 'MiB', bytes / 1048576]]) {
      const c = counterOf(p, name);
      const k = c.ts.length;
      c.ts.push(ts);
      let s = c.series.get(key);
      if (!s) { s = []; c.series.set(key, s); }
      s[k] = v;
    }
  };
  for (let i = 0; i < events.length; i++) {
    const e = events[i];
    if (!e || typeof e !== 'object') { skipped++; continue; }
    const ph = e.ph;
    if (ph === 'M') {
      const a = e.args || {};
      if (e.name === 'process_name') {
        const p = proc(e.pid);
        if (a.name != null) p.name = String(a.name);
        if (a.job != null) p.job = String(a.job);
        if (a.rank != null && num(a.rank) !== null) p.rank = num(a.rank);
      } else if (e.name === 'process_sort_index') proc(e.pid).sortIndex = num(a.sort_index);
      else if (e.name === 'process_labels') proc(e.pid).labels = a.labels != null ? String(a.labels) : null;
      else if (e.name === 'thread_name') { if (a.name != null) thread(proc(e.pid), e.tid).name = String(a.name); }
      else if (e.name === 'thread_sort_index') thread(proc(e.pid), e.tid).sortIndex = num(a.sort_index);
      used++;
      continue;
    }
    const ts = num(e.ts);
    if (ts === null) { skipped++; continue; }
    switch (ph) {
      case 'X': {
        const dur = Math.max(0, num(e.dur) || 0);
        addSlice(thread(proc(e.pid), e.tid), ts, dur, e.name, e.cat, e.args);
        if (e.tid === 'cycles') addCycle(proc(e.pid), ts, dur, e.args);
        seen(ts, ts + dur);
        used++;
        break;
      }
      case 'B': case 'E': {
        // Paired per thread after the loop, in time order: merged sources need not be sorted.
        const th = thread(proc(e.pid), e.tid);
        (th.be || (th.be = [])).push(i);
        seen(ts, ts);
        break;
      }
      case 'C': {
        const p = proc(e.pid);
        const name = (e.name != null ? String(e.name) : 'counter') + (e.id != null ? ' ' + e.id : '');
        let c = p.counters.get(name);
        if (!c) { c = { name, ts: [], series: new Map() }; p.counters.set(name, c); }
        const k = c.ts.length;
        c.ts.push(ts);
        const a = e.args || {};
        for (const key in a) {
          const v = num(a[key]);
          if (v === null) continue;
          let s = c.series.get(key);
          if (!s) { s = []; c.series.set(key, s); }
          s[k] = v;
        }
        seen(ts, ts);
        used++;
        break;
      }
      case 'i': case 'I': case 'R': {
        const scope = e.s || 't';
        let a;
        if (scope === 'g') a = globalInst;
        else if (scope === 'p') { const p = proc(e.pid); a = p.inst || (p.inst = acc()); }
        else { const t = thread(proc(e.pid), e.tid); a = t.inst || (t.inst = acc()); }
        a.ts.push(ts); a.du.push(0); a.nm.push(intern(e.name)); a.ar.push(addArgs(e.cat, e.args));
        seen(ts, ts);
        used++;
        break;
      }
      default:
        skipped++;
    }
  }
  if (minTs === Infinity) { minTs = 0; maxTs = 0; }
  for (const p of procs.values()) {
    for (const t of p.threads.values()) {
      if (!t.be) continue;
      // Stable by time: at equal times the file's order decides (an E before the next B).
      const be = t.be.sort((a, b) => events[a].ts - events[b].ts || a - b);
      for (const k of be) {
        const e = events[k];
        if (e.ph === 'B') { t.stack.push(e); used++; continue; }
        const b = t.stack.pop();
        if (!b) { skipped++; continue; }
        const bts = +b.ts, ts = +e.ts;
        let args = b.args;
        if (e.args && typeof e.args === 'object' && Object.keys(e.args).length) args = Object.assign({}, b.args || {}, e.args);
        addSlice(t, bts, Math.max(0, ts - bts), b.name != null ? b.name : e.name, b.cat || e.cat, args);
        used++;
      }
      t.be = null;
      // A B without its E (a trace cut off while running) lasts until the end of the trace.
      while (t.stack.length) {
        const b = t.stack.pop();
        addSlice(t, +b.ts, Math.max(0, maxTs - b.ts), b.name, b.cat, b.args, { unfinished: true });
      }
    }
  }

  const transfer = [];
  let nextId = 0;
  const groups = new Map();
  const defaultGroup = opts && opts.defaultGroup ? String(opts.defaultGroup) : 'other processes';
  for (const p of procs.values()) {
    const tracks = [];
    const threads = Array.from(p.threads.values()).sort((a, b) =>
      // Threads (numeric tids) first, then named tracks (a job's tensors) in natural
      // order: grad.2 before grad.10.
      (a.sortIndex ?? 0) - (b.sortIndex ?? 0) || (num(a.tid) ?? Infinity) - (num(b.tid) ?? Infinity) ||
      String(a.tid).localeCompare(String(b.tid), undefined, { numeric: true }));
    for (const t of threads) {
      if (!t.sl.ts.length && !t.states.ts.length && !t.inst) continue;
      const name = t.name != null ? t.name : 'tid ' + t.tid;
      const tidText = String(t.tid);
      tracks.push({
        id: nextId++, kind: 'thread', tid: t.tid, name,
        // A job's cycles track; a per-tensor track (the agent names it "tensor <name>"; a named
        // track with no thread states is one too); else a thread.
        role: tidText === 'cycles' ? 'cycles'
          : tidText.startsWith('tensor ') || (num(t.tid) === null && !t.states.ts.length) ? 'tensor' : 'thread',
        // A thread's id beside its name; a tensor track ("tensor grad.0") is its name alone.
        label: t.name != null && num(t.tid) != null ? name + '  ' + t.tid : name,
        slices: finishSlices(t.sl, transfer),
        states: t.states.ts.length ? finishFlat(t.states, transfer, true) : null,
        instants: t.inst ? finishFlat(t.inst, transfer, false) : null,
      });
    }
    if (p.inst) {
      tracks.push({ id: nextId++, kind: 'instants', name: 'process events', instants: finishFlat(p.inst, transfer, false) });
    }
    for (const c of p.counters.values()) {
      tracks.push(Object.assign({ id: nextId++, kind: 'counter', name: c.name }, finishCounter(c, transfer)));
    }
    if (!tracks.length && !p.threads.size) continue;
    let job = p.job, rank = p.rank;
    if (job == null && p.name) {
      const m = RANK_NAME.exec(p.name);
      if (m) { job = m[1]; rank = +m[2]; }
    }
    const gkey = job != null ? 'job:' + job : 'other';
    let g = groups.get(gkey);
    if (!g) { g = { key: gkey, kind: job != null ? 'job' : 'other', name: job != null ? job : defaultGroup, processes: [] }; groups.set(gkey, g); }
    // Every thread and tensor the trace names, with data or not (the agent's
    // overview sends their names only): what a rank's folds count.
    const named = { thread: 0, tensor: 0 };
    for (const t of p.threads.values()) {
      const tid = String(t.tid);
      if (tid === 'cycles') continue;
      named[tid.startsWith('tensor ') || (num(t.tid) === null && !t.states.ts.length) ? 'tensor' : 'thread']++;
    }
    g.processes.push({ key: 'p:' + p.key, pid: p.pid, name: p.name, rank, labels: p.labels, sortIndex: p.sortIndex, tracks, named });
  }
  for (const g of groups.values()) {
    g.processes.sort((a, b) => (a.rank ?? 1e9) - (b.rank ?? 1e9) || (a.sortIndex ?? 0) - (b.sortIndex ?? 0) ||
      (num(a.pid) ?? 0) - (num(b.pid) ?? 0) || String(a.pid).localeCompare(String(b.pid)));
  }
  const groupList = Array.from(groups.values()).sort((a, b) =>
    (a.kind === 'other') - (b.kind === 'other') || a.name.localeCompare(b.name));
  if (globalInst.ts.length) {
    groupList.unshift({ key: 'global', kind: 'other', name: 'global events', processes: [{
      key: 'p:global', pid: null, name: 'global', rank: null, tracks: [{ id: nextId++, kind: 'instants', name: 'global instants', instants: finishFlat(globalInst, transfer, false) }],
    }] });
  }
  return {
    result: { generation, strings, groups: groupList, t0: minTs, t1: maxTs, events: events.length, used, skipped, metadata },
    transfer,
  };
}

export function parse(input, opts) {
  const t0 = Date.now();
  const text = typeof input === 'string' ? input : new TextDecoder('utf-8').decode(input);
  const t1 = Date.now();
  const parsed = parseJsonTolerant(text);
  const t2 = Date.now();
  const out = build(parsed.value, opts);
  const t3 = Date.now();
  out.result.repaired = parsed.repaired;
  out.result.timing = { decodeMs: t1 - t0, jsonMs: t2 - t1, buildMs: t3 - t2 };
  return out;
}

// Fetch and parse in one step, so a large body never passes through the page's thread.
export async function fetchParse(url, label, opts) {
  const t = Date.now();
  const res = await fetch(url);
  if (!res.ok) {
    let msg = 'HTTP ' + res.status + ' for ' + label;
    try { const j = await res.json(); if (j && j.error) msg += ': ' + j.error; } catch (_) { /* not JSON */ }
    throw new Error(msg);
  }
  const buf = await res.arrayBuffer();
  const fetchMs = Date.now() - t;
  const out = parse(buf, opts);
  out.result.timing.fetchMs = fetchMs;
  return out;
}

export function args(gen, index) {
  if (gen !== generation || index < 0 || index >= argsStore.length) return null;
  return argsStore[index];
}
