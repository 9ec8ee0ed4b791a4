/*
 * ringwatch timeline viewer.
 *
 * What it is for: draw a Chrome-trace-format timeline (job activities, thread
 * scheduling states, counters) on one <canvas>, from the agent's API, a
 * `?trace=URL`, or a local file, and stay responsive with a million events.
 *
 * What it must never do: fetch anything but the agent's `/api/*`, the
 * `?trace=` URL and the files the user opens; create a DOM node per event;
 * parse a large trace on the main thread when a Worker can be had.
 *
 * Flow: bytes -> Worker (tolerant JSON.parse, then per-track sorted typed
 * arrays, see traceParserModule) -> main thread keeps the typed arrays ->
 * render() draws only the visible range, binary-searching each nesting level
 * and merging slices narrower than a pixel. The conventions the data must
 * follow (grouping by job, thread-state names, counters) are in ui/README.md.
 */
'use strict';

// ---------------------------------------------------------------------------
// Parsing and track building. This function is self-contained: its source is
// turned into a Worker through a Blob, so it may not touch anything outside.
// ---------------------------------------------------------------------------
function traceParserModule() {
  // Thread-state slice names (case-insensitive) -> state code. Code 0 = an activity.
  const STATE_CODE = {
    running: 1,
    runnable: 2, 'waiting on run queue': 2,
    blocked: 3, uninterruptible: 3, iowait: 3,
    sleeping: 4, sleep: 4,
  };
  function stateCode(name) {
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

  function parse(input, opts) {
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
  async function fetchParse(url, label, opts) {
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

  function args(gen, index) {
    if (gen !== generation || index < 0 || index >= argsStore.length) return null;
    return argsStore[index];
  }

  return { parse, fetchParse, args, stateCode };
}

// ---------------------------------------------------------------------------
// The parser, in a Worker when one can be had, on the main thread otherwise.
// ---------------------------------------------------------------------------
class TraceSource {
  constructor() {
    this.pending = new Map();
    this.nextId = 1;
    this.inline = null;
    try {
      const src = 'const M = (' + traceParserModule.toString() + ')();\n' +
        'self.onmessage = async (ev) => { const m = ev.data; try {\n' +
        '  if (m.type === "parse") { const r = M.parse(m.input, m.opts); self.postMessage({ id: m.id, ok: true, value: r.result }, r.transfer); }\n' +
        '  else if (m.type === "fetchParse") { const r = await M.fetchParse(m.url, m.label, m.opts); self.postMessage({ id: m.id, ok: true, value: r.result }, r.transfer); }\n' +
        '  else if (m.type === "args") self.postMessage({ id: m.id, ok: true, value: M.args(m.gen, m.index) });\n' +
        '} catch (err) { self.postMessage({ id: m.id, ok: false, error: String(err && err.message || err) }); } };';
      const url = URL.createObjectURL(new Blob([src], { type: 'text/javascript' }));
      this.worker = new Worker(url);
      this.worker.onmessage = (ev) => this.answer(ev.data);
      this.worker.onerror = (ev) => { this.failAll('worker error: ' + (ev.message || 'unknown')); };
    } catch (err) {
      this.worker = null;
      this.inline = traceParserModule();
    }
  }
  answer(m) {
    const p = this.pending.get(m.id);
    if (!p) return;
    this.pending.delete(m.id);
    if (m.ok) p.resolve(m.value); else p.reject(new Error(m.error));
  }
  failAll(msg) {
    for (const p of this.pending.values()) p.reject(new Error(msg));
    this.pending.clear();
  }
  call(msg, transfer) {
    if (!this.worker) {
      return new Promise((resolve) => setTimeout(resolve, 0)).then(() => {
        if (msg.type === 'parse') return this.inline.parse(msg.input, msg.opts).result;
        if (msg.type === 'fetchParse') return this.inline.fetchParse(msg.url, msg.label, msg.opts).then((r) => r.result);
        return this.inline.args(msg.gen, msg.index);
      });
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.worker.postMessage(Object.assign({ id }, msg), transfer || []);
    });
  }
  /** Parse an ArrayBuffer (transferred to the worker) or a string. */
  parse(input, opts) {
    return this.call({ type: 'parse', input, opts }, input instanceof ArrayBuffer ? [input] : []);
  }
  /** Fetch a URL (made absolute here: a Blob worker has no base URL) and parse it, off the page's thread. */
  fetchParse(url, opts) {
    return this.call({ type: 'fetchParse', url: new URL(url, location.href).href, label: url, opts });
  }
  args(gen, index) {
    return index < 0 ? Promise.resolve(null) : this.call({ type: 'args', gen, index });
  }
}

// ---------------------------------------------------------------------------
// Formatting and colours.
// ---------------------------------------------------------------------------
const UNITS = [
  { max: 1, scale: 1e-3, name: 'ns' },
  { max: 1e3, scale: 1, name: 'µs' },
  { max: 1e6, scale: 1e3, name: 'ms' },
  { max: Infinity, scale: 1e6, name: 's' },
];
function unitFor(us) {
  const a = Math.abs(us);
  for (const u of UNITS) if (a < u.max) return u;
  return UNITS[3];
}
/** A duration in µs, with three decimals in the unit that fits it. */
// A job's tensor events exist from when the agent asked for them (it asks
// while someone reads the timeline: --job-timeline on-demand).
function jobTimelineNote(metadata) {
  const jt = metadata && metadata.job_timeline;
  if (!jt) return '';
  const since = jt.streaming_since_unix_ms;
  if (typeof since !== 'number') return ' · the job\'s tensor events are not streamed yet (they start while the timeline is open)';
  return ' · the job\'s tensor events since ' + new Date(since).toLocaleTimeString();
}

// Scheduling intervals shorter than the agent's --min-interval stay in the
// kernel: counted in the figures, not drawn as thread states.
function threadStatesNote(metadata) {
  const ts = metadata && metadata.thread_states;
  if (!ts || typeof ts.min_interval_us !== 'number') return '';
  return ' · thread states shorter than ' + fmtDur(ts.min_interval_us) + ' are not drawn (agent --min-interval)';
}

function fmtDur(us) {
  if (us === 0) return '0 µs';
  const u = unitFor(us);
  return (us / u.scale).toFixed(3) + ' ' + u.name;
}
/** A point in time (µs since the origin), to the microsecond. */
function fmtTime(us) {
  const u = unitFor(us);
  const dec = Math.max(0, Math.round(Math.log10(u.scale)));
  return (us / u.scale).toFixed(u.name === 'ns' ? 0 : dec) + ' ' + u.name;
}
function fmtNum(v) {
  const a = Math.abs(v);
  if (a >= 1e12) return (v / 1e12).toFixed(2) + 'T';
  if (a >= 1e9) return (v / 1e9).toFixed(2) + 'G';
  if (a >= 1e6) return (v / 1e6).toFixed(2) + 'M';
  if (a >= 1e4) return (v / 1e3).toFixed(1) + 'k';
  if (Number.isInteger(v)) return String(v);
  return v.toPrecision(4);
}
const textColorCache = new Map();
/** Black or white, whichever reads better on a slice of this colour. */
function textOn(color) {
  let c = textColorCache.get(color);
  if (!c) {
    const n = parseInt(color.slice(1), 16);
    const lum = 0.2126 * ((n >> 16) & 255) + 0.7152 * ((n >> 8) & 255) + 0.0722 * (n & 255);
    c = lum < 140 ? '#ffffff' : '#1a1a1a';
    textColorCache.set(color, c);
  }
  return c;
}
/** Rectangles by colour; a rectangle touching the previous one of the same colour in the same lane extends it. */
class RectBatch {
  constructor() { this.byColor = new Map(); this.lastColor = null; this.last = null; }
  add(color, x, y, w, h) {
    const l = this.last;
    if (color === this.lastColor && l && y === l[l.length - 3] && h === l[l.length - 1] && x <= l[l.length - 4] + l[l.length - 2] + 0.5) {
      const end = Math.max(l[l.length - 4] + l[l.length - 2], x + w);
      l[l.length - 2] = end - l[l.length - 4];
      return;
    }
    let a = this.byColor.get(color);
    if (!a) { a = []; this.byColor.set(color, a); }
    a.push(x, y, w, h);
    this.lastColor = color;
    this.last = a;
  }
  endLane() { this.lastColor = null; this.last = null; }
  flush(ctx) {
    for (const [color, a] of this.byColor) {
      if (!a.length) continue;
      ctx.fillStyle = color;
      ctx.beginPath();
      for (let q = 0; q < a.length; q += 4) ctx.rect(a[q], a[q + 1], a[q + 2], a[q + 3]);
      ctx.fill();
      a.length = 0;
    }
    this.endLane();
  }
}
function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
}

const STATE_COLORS = { 1: '#2f9e44', 2: '#f59f00', 3: '#e03131', 4: '#adb5bd' };
const ACTIVITY_COLORS = {
  NEGOTIATE_ALLREDUCE: '#748ffc', NEGOTIATE_ALLGATHER: '#748ffc', NEGOTIATE_BROADCAST: '#748ffc',
  QUEUE: '#b197fc', WAIT_FOR_DATA: '#ced4da', WAIT_FOR_OTHER_TENSOR_DATA: '#ced4da',
  MEMCPY_IN_FUSION_BUFFER: '#3bc9db', MEMCPY_OUT_FUSION_BUFFER: '#1098ad',
  ALLREDUCE: '#4263eb', ALLGATHER: '#5c7cfa', BROADCAST: '#3b5bdb',
  RING_ALLREDUCE: '#1c7ed6', NCCL_ALLREDUCE: '#1c7ed6', MPI_ALLREDUCE: '#1c7ed6', TCP_ALLREDUCE: '#1c7ed6',
  HIERARCHICAL_ALLREDUCE: '#1864ab', CYCLE_START: '#495057',
};
const PALETTE = ['#e599f7', '#74c0fc', '#63e6be', '#ffa8a8', '#91a7ff', '#ffc078', '#a9e34b', '#66d9e8', '#faa2c1', '#b197fc', '#8ce99a', '#ffd43b'];
const SERIES_COLORS = ['#1c7ed6', '#e8590c', '#2f9e44', '#ae3ec9', '#0c8599', '#c2255c'];

// ---------------------------------------------------------------------------
// The viewer.
// ---------------------------------------------------------------------------
const LABEL_W = 240;
const AXIS_H = 30;
const GROUP_H = 24;
const PROC_H = 20;
const ROW_H = 18;
const STATE_H = 10;
const INST_H = 10;
const COUNTER_H = 52;
const OVERVIEW_H = 46;
const FOLD_H = 18;
// The agent's overview (view=overview): per process, counters in place of its threads and tensors.
const OVERVIEW_COUNTERS = new Set(['threads', 'activity']);
const OVERVIEW_ACTIVITY_KEYS = ['collective', 'fusion', 'negotiate', 'queued'];
// A rank's overview: what its job's tensors were doing (the class of the activity), in this order of precedence.
const ACTIVITY_CLASSES = [
  { key: 'coll', label: 'collective', color: '#1c7ed6', test: /^(ALLREDUCE|ALLGATHER|BROADCAST|ALLTOALL|REDUCESCATTER|NCCL|MPI_|GLOO)/i },
  { key: 'fuse', label: 'fusion copy', color: '#ae3ec9', test: /^MEMCPY/i },
  { key: 'nego', label: 'negotiate', color: '#868e96', test: /^NEGOTIATE/i },
  { key: 'queue', label: 'queued', color: '#ced4da', test: /^(QUEUE|WAIT)/i },
];
const PAD = 3;

class Viewer {
  constructor(root) {
    this.root = root;
    this.canvas = root.querySelector('#timeline');
    this.scroller = root.querySelector('#scroller');
    this.spacer = root.querySelector('#spacer');
    this.tooltip = root.querySelector('#tooltip');
    this.status = root.querySelector('#status');
    this.selector = root.querySelector('#selector');
    this.liveBtn = root.querySelector('#live');
    this.ctx = this.canvas.getContext('2d');
    this.source = new TraceSource();
    this.data = null;
    this.state = 'empty';
    this.error = null;
    this.view = { start: 0, end: 1 };
    this.origin = 0;
    this.rows = [];
    this.contentH = 0;
    this.collapsed = new Set();
    // A job rank's thread and tensor rows are folded under its overview until opened.
    this.expanded = new Set();
    this.nameClass = [];
    this.filter = '';
    this.hover = null;
    this.rendered = 0;
    this.frameWaiters = [];
    this.readyWaiters = [];
    this.nameColor = [];
    this.nameState = [];
    this.nameWidth = [];
    this.batch = new RectBatch();
    this.stats = { loadStart: 0, fetchMs: null, decodeMs: null, jsonMs: null, buildMs: null, firstRenderMs: null, lastFrameMs: null };
    this.live = { available: false, enabled: false, paused: false, polls: 0, windowUs: 10e6, inflight: false, timer: null, lastUrl: null, apiJobs: [], apiProcs: [] };
    this.sourceName = '';
    this.rafPending = false;
    this.bindEvents();
    this.resize();
  }

  // ---- loading ----
  async loadUrl(url) {
    this.beginLoad(url);
    try {
      if (new URL(url, location.href).protocol === 'file:') {
        throw new Error('browsers do not let a page read file: URLs (?trace=' + url + '); open the file with “Open trace file” or drop it here, or serve ui/ over HTTP');
      }
      const data = await this.source.fetchParse(url, { defaultGroup: 'other processes' });
      this.setTiming(data.timing);
      this.setData(data, true);
    } catch (err) { this.fail(err); }
  }
  async loadFile(file) {
    this.stopLive();
    this.beginLoad(file.name);
    try {
      const buf = await file.arrayBuffer();
      this.stats.fetchMs = 0;
      await this.ingest(buf, { defaultGroup: file.name, name: file.name }, true);
    } catch (err) { this.fail(err); }
  }
  beginLoad(name) {
    this.state = 'loading';
    this.sourceName = name;
    this.stats.loadStart = performance.now();
    this.stats.firstRenderMs = null;
    this.setStatus('loading ' + name + ' …');
    this.invalidate();
  }
  async ingest(buf, opts, fit) {
    const data = await this.source.parse(buf, { defaultGroup: opts.defaultGroup });
    this.setTiming(data.timing);
    this.setData(data, fit);
  }
  setTiming(t) {
    if (t.fetchMs !== undefined) this.stats.fetchMs = t.fetchMs;
    this.stats.decodeMs = t.decodeMs;
    this.stats.jsonMs = t.jsonMs;
    this.stats.buildMs = t.buildMs;
  }
  fail(err) {
    this.state = 'error';
    this.error = String(err && err.message || err);
    this.setStatus('error: ' + this.error, true);
    this.invalidate();
    this.wakeReady();
  }
  setData(data, fit) {
    this.data = data;
    this.nameColor = new Array(data.strings.length);
    this.nameClass = new Array(data.strings.length);
    this.nameState = new Array(data.strings.length);
    this.nameWidth = new Array(data.strings.length);
    if (!this.live.enabled) this.origin = data.t0;
    if (fit) this.fit();
    this.state = 'ready';
    this.error = null;
    this.hover = null;
    this.hideTooltip();
    this.refreshSelector();
    this.layout();
    const span = fmtDur(data.t1 - data.t0);
    this.setStatus(`${this.sourceName} · ${data.used.toLocaleString()} events` +
      (data.skipped ? ` (${data.skipped.toLocaleString()} skipped)` : '') + ` · ${span}` +
      (data.repaired ? ' · unterminated file, read up to its last complete event' : '') +
      (data.metadata && data.metadata.downsampled ? ' · downsampled by the agent' : '') +
      jobTimelineNote(data.metadata) + threadStatesNote(data.metadata));
    this.invalidate();
  }
  fit() {
    const d = this.data;
    if (!d) return;
    let span = d.t1 - d.t0;
    if (!(span > 0)) span = 1000;
    this.view = { start: d.t0 - span * 0.01, end: d.t0 + span * 1.01 };
    this.invalidate();
  }
  setStatus(text, isError) {
    this.status.textContent = text;
    this.status.classList.toggle('error', !!isError);
  }

  // ---- live mode (served by the agent) ----
  async detectAgent() {
    try {
      const res = await fetch('/api/jobs', { headers: { accept: 'application/json' } });
      if (!res.ok || !(res.headers.get('content-type') || '').includes('json')) return false;
      const jobs = await res.json();
      this.live.apiJobs = Array.isArray(jobs) ? jobs : Array.isArray(jobs && jobs.jobs) ? jobs.jobs : [];
      try {
        const pr = await fetch('/api/processes');
        if (pr.ok) {
          const procs = await pr.json();
          this.live.apiProcs = Array.isArray(procs) ? procs : Array.isArray(procs && procs.processes) ? procs.processes : [];
        }
      } catch (_) { /* the process list only feeds the selector */ }
      this.live.available = true;
      return true;
    } catch (_) {
      return false;
    }
  }
  startLive() {
    this.live.enabled = true;
    this.live.paused = false;
    this.liveBtn.hidden = false;
    this.updateLiveButton();
    if (!this.live.timer) this.live.timer = setInterval(() => this.liveTick(), 1000);
    this.liveTick();
  }
  stopLive() {
    this.live.enabled = false;
    if (this.live.timer) clearInterval(this.live.timer);
    this.live.timer = null;
    this.updateLiveButton();
  }
  pauseLive() {
    if (this.live.enabled && !this.live.paused) { this.live.paused = true; this.updateLiveButton(); }
  }
  resumeLive() {
    if (!this.live.available) return;
    if (!this.live.enabled) { this.startLive(); return; }
    this.live.paused = false;
    this.updateLiveButton();
    this.liveTick();
  }
  updateLiveButton() {
    const b = this.liveBtn;
    b.classList.toggle('on', this.live.enabled && !this.live.paused);
    b.textContent = this.live.enabled && !this.live.paused ? '● live' : '❚❚ paused — follow live';
  }
  liveUrl(range) {
    const q = new URLSearchParams();
    if (range) {
      // A paused view asks for its own window (absolute, on the answer's clock).
      q.set('from', String(Math.floor(range.start)));
      q.set('to', String(Math.ceil(range.end)));
    } else q.set('from', 'now-' + Math.round(this.live.windowUs / 1e6) + 's');
    if (this.filter.startsWith('job:')) {
      // A job's view is the whole job: every node's agent that has its ranks
      // (the agent merges them on its clock and names a node it misses).
      q.set('job', this.filter.slice(4));
      q.set('scope', 'cluster');
    }
    else if (this.filter.startsWith('pid:')) q.set('pid', this.filter.slice(4));
    // A busy job's last seconds can hold more thread states than one answer
    // may carry: ask the agent to keep the longest ones (it says so) rather
    // than refuse.
    // A screen cannot show more than ~100k slices; fewer also keeps the
    // agent's answer (and its CPU, shared with the job) small.
    q.set('downsample', 'true');
    q.set('max_events', '100000');
    // The agent merges what is shorter than one of our pixels into summary
    // slices (its level of detail): the answer follows the screen, not the job.
    q.set('width', String(Math.max(1, Math.floor(this.viewW - LABEL_W))));
    // Until a rank's threads or tensors are opened, the overview: per process,
    // its threads and tensors merged into two counters (a few kB per rank).
    if (!this.expanded.size) q.set('view', 'overview');
    return '/api/timeline?' + q.toString();
  }
  // Zoomed or panned while live is paused: the agent answers that window at
  // the screen's pixels, so zooming in brings every slice back (debounced).
  scheduleDetail() {
    if (!this.live.enabled || !this.live.paused) return;
    clearTimeout(this.detailTimer);
    this.detailTimer = setTimeout(() => this.fetchDetail(), 300);
  }
  async fetchDetail() {
    if (!this.live.enabled || !this.live.paused) return;
    if (this.detailInflight) { this.detailAgain = true; return; }
    this.detailInflight = true;
    const view = { start: this.view.start, end: this.view.end };
    const url = this.liveUrl(view);
    this.live.lastUrl = url;
    try {
      const data = await this.source.fetchParse(url, { defaultGroup: 'other processes' });
      if (!this.live.enabled || !this.live.paused) return;
      this.live.details = (this.live.details || 0) + 1;
      this.setData(data, false);
    } catch (err) {
      this.setStatus('detail: ' + String(err && err.message || err), true);
    } finally {
      this.detailInflight = false;
      if (this.detailAgain) { this.detailAgain = false; this.scheduleDetail(); }
    }
  }
  async liveTick() {
    if (!this.live.enabled || this.live.paused || this.live.inflight) return;
    this.live.inflight = true;
    const url = this.liveUrl();
    this.live.lastUrl = url;
    try {
      if (this.state !== 'ready') this.beginLoad('agent');
      const data = await this.source.fetchParse(url, { defaultGroup: 'other processes' });
      this.live.polls++;
      if (!this.live.enabled || this.live.paused) return;
      this.sourceName = 'agent (live)';
      this.setTiming(data.timing);
      this.setData(data, false);
      const md = data.metadata || {};
      const now = typeof md.now === 'number' ? md.now : data.t1;
      // In live mode times read as "seconds ago": the axis and tooltips count from the present.
      this.origin = now;
      this.view = { start: now - this.live.windowUs, end: now };
      this.invalidate();
    } catch (err) {
      this.setStatus('live: ' + String(err && err.message || err), true);
    } finally {
      this.live.inflight = false;
    }
  }

  // ---- selector ----
  refreshSelector() {
    const sel = this.selector;
    const keep = this.filter;
    const opts = [['', 'all jobs and processes']];
    const seen = new Set(['']);
    const add = (v, label) => { if (!seen.has(v)) { seen.add(v); opts.push([v, label]); } };
    for (const j of this.live.apiJobs) {
      const id = j && (j.id ?? j.job_id ?? j.name ?? j.job);
      if (id != null) add('job:' + id, 'job ' + id);
    }
    if (this.data) {
      for (const g of this.data.groups) {
        if (g.kind === 'job') add('job:' + g.name, 'job ' + g.name);
        for (const p of g.processes) {
          if (p.pid == null) continue;
          add('pid:' + p.pid, '\u2003' + this.processLabel(p));
        }
      }
    }
    for (const p of this.live.apiProcs) {
      if (p && p.pid != null) add('pid:' + p.pid, '\u2003pid ' + p.pid + (p.name || p.comm ? ' · ' + (p.name || p.comm) : ''));
    }
    // The view's own filter is always an option (a job named in the URL before the
    // agent lists it), so the picker never says "all" while one job is shown.
    if (keep && !seen.has(keep)) {
      const [kind, id] = keep.split(/:(.*)/s);
      add(keep, kind === 'pid' ? 'pid ' + id : 'job ' + id);
      const o = opts.pop();
      opts.splice(1, 0, o);
    }
    sel.innerHTML = '';
    for (const [v, label] of opts) {
      const o = document.createElement('option');
      o.value = v;
      o.textContent = label;
      sel.appendChild(o);
    }
    sel.value = keep;
  }
  setFilter(v) {
    this.filter = v || '';
    this.selector.value = this.filter;
    this.layout();
    this.invalidate();
    if (this.live.enabled && !this.live.paused) this.liveTick();
  }
  processLabel(p) {
    const parts = [];
    if (p.rank != null) parts.push('rank ' + p.rank);
    if (p.name) parts.push(p.name);
    if (p.pid != null && !(p.name && p.name === String(p.pid))) parts.push('pid ' + p.pid);
    return parts.join(' · ') || 'process';
  }
  passesFilter(g, p) {
    const f = this.filter;
    if (!f) return true;
    if (f.startsWith('job:')) return g.kind === 'job' && g.name === f.slice(4);
    if (f.startsWith('pid:')) return p.pid != null && String(p.pid) === f.slice(4);
    return true;
  }

  // ---- layout ----
  trackHeight(t) {
    if (t.kind === 'counter') return COUNTER_H;
    if (t.kind === 'instants') { t.instY = PAD; return INST_H + 2 * PAD; }
    let y = PAD;
    t.stateY = t.states ? y : -1;
    if (t.states) y += STATE_H + 2;
    t.instY = t.instants ? y : -1;
    if (t.instants) y += INST_H;
    t.sliceY = y;
    const levels = t.slices.levels;
    y += Math.max(levels, t.states || t.instants ? 0 : 1) * ROW_H;
    return y + PAD;
  }
  layout() {
    const rows = [];
    let y = 0;
    if (this.data) {
      for (const g of this.data.groups) {
        const procs = g.processes.filter((p) => this.passesFilter(g, p));
        if (!procs.length) continue;
        rows.push({ type: 'group', g, y, h: GROUP_H, label: (g.kind === 'job' ? 'job ' : '') + g.name + `  (${procs.length} ${g.kind === 'job' ? 'rank' : 'process'}${procs.length === 1 ? '' : 'es'.slice(g.kind === 'job' ? 1 : 0)})` });
        y += GROUP_H;
        if (this.collapsed.has(g.key)) continue;
        for (const p of procs) {
          rows.push({ type: 'process', g, p, y, h: PROC_H, label: this.processLabel(p) });
          y += PROC_H;
          if (this.collapsed.has(g.key + '/' + p.key)) continue;
          const push = (t) => {
            const h = this.trackHeight(t);
            rows.push({ type: 'track', g, p, t, y, h });
            y += h;
          };
          if (g.kind !== 'job') {
            p.tracks.forEach(push);
            // The agent's overview left this process's threads out: they open on demand.
            const n = (p.named && p.named.thread) || 0;
            if (n && !p.tracks.some((t) => t.kind === 'thread')) {
              const key = g.key + '/' + p.key + '/thread';
              const open = this.expanded.has(key);
              rows.push({ type: 'fold', g, p, key, y, h: FOLD_H, label: `${open ? '▾' : '▸'} ${n} thread${n === 1 ? '' : 's'}${open ? ' (loading …)' : ' (click to open)'}` });
              y += FOLD_H;
            }
            continue;
          }
          // A job's rank: overview first (activities, threads' states), its counters
          // and cycles, then its threads and its tensors, each folded until opened.
          rows.push({ type: 'overview', g, p, y, h: OVERVIEW_H });
          y += OVERVIEW_H;
          // (The agent's overview counters are drawn in the lane, not as rows.)
          p.tracks.filter((t) => (t.kind !== 'thread' || t.role === 'cycles') && !(t.kind === 'counter' && OVERVIEW_COUNTERS.has(t.name))).forEach(push);
          for (const [role, noun] of [['thread', 'thread'], ['tensor', 'tensor']]) {
            const list = p.tracks.filter((t) => t.kind === 'thread' && t.role === role);
            const n = Math.max(list.length, (p.named && p.named[role]) || 0);
            if (!n) continue;
            const key = g.key + '/' + p.key + '/' + role;
            const open = this.expanded.has(key);
            const more = open ? (list.length ? '' : ' (loading …)') : ' (click to open)';
            rows.push({ type: 'fold', g, p, key, y, h: FOLD_H, label: `${open ? '▾' : '▸'} ${n} ${noun}${n === 1 ? '' : 's'}${more}` });
            y += FOLD_H;
            if (open) list.forEach(push);
          }
        }
      }
    }
    this.rows = rows;
    this.contentH = y;
    this.spacer.style.height = Math.max(0, AXIS_H + y + 8 - this.viewH) + 'px';
  }
  resize() {
    const r = this.scroller.getBoundingClientRect();
    const dpr = window.devicePixelRatio || 1;
    this.viewW = Math.max(300, Math.floor(r.width));
    this.viewH = Math.max(150, Math.floor(r.height));
    this.canvas.style.width = this.viewW + 'px';
    this.canvas.style.height = this.viewH + 'px';
    this.canvas.width = Math.floor(this.viewW * dpr);
    this.canvas.height = Math.floor(this.viewH * dpr);
    this.dpr = dpr;
    this.layout();
    this.invalidate();
  }

  // ---- coordinates ----
  get plotX0() { return LABEL_W; }
  get plotX1() { return this.viewW; }
  timeToX(t) { return LABEL_W + (t - this.view.start) / (this.view.end - this.view.start) * (this.viewW - LABEL_W); }
  xToTime(x) { return this.view.start + (x - LABEL_W) / (this.viewW - LABEL_W) * (this.view.end - this.view.start); }
  rowTop(row) { return AXIS_H + row.y - this.scroller.scrollTop; }
  setRange(start, end) {
    if (!(end > start)) return;
    const minSpan = 0.01; // 10 ns
    if (end - start < minSpan) { const c = (start + end) / 2; start = c - minSpan / 2; end = c + minSpan / 2; }
    this.view = { start, end };
    this.invalidate();
    this.scheduleDetail();
  }
  zoomAt(x, factor) {
    const t = this.xToTime(x);
    const { start, end } = this.view;
    this.setRange(t - (t - start) * factor, t + (end - t) * factor);
  }
  panPx(dx) {
    const dt = dx / (this.viewW - LABEL_W) * (this.view.end - this.view.start);
    this.setRange(this.view.start - dt, this.view.end - dt);
  }

  // ---- events ----
  bindEvents() {
    const c = this.canvas;
    window.addEventListener('resize', () => this.resize());
    this.scroller.addEventListener('scroll', () => { this.hideTooltip(); this.invalidate(); });
    c.addEventListener('wheel', (e) => {
      e.preventDefault();
      const x = e.offsetX;
      const unit = e.deltaMode === 1 ? 33 : e.deltaMode === 2 ? 400 : 1;
      if (e.shiftKey) { this.scroller.scrollTop += e.deltaY * unit; return; }
      if (Math.abs(e.deltaX) > Math.abs(e.deltaY)) { this.pauseLive(); this.panPx(-e.deltaX * unit); return; }
      if (x < LABEL_W) { this.scroller.scrollTop += e.deltaY * unit; return; }
      this.pauseLive();
      this.zoomAt(x, Math.exp(Math.max(-400, Math.min(400, e.deltaY * unit)) * 0.002));
      this.updateHover(e.offsetX, e.offsetY, e.clientX, e.clientY);
    }, { passive: false });
    let drag = null;
    c.addEventListener('pointerdown', (e) => {
      if (e.button !== 0) return;
      if (e.offsetX < LABEL_W) { this.clickLabel(e.offsetY); return; }
      drag = { x: e.clientX, moved: false };
      c.setPointerCapture(e.pointerId);
      c.classList.add('dragging');
    });
    c.addEventListener('pointermove', (e) => {
      if (drag) {
        const dx = e.clientX - drag.x;
        if (dx !== 0) {
          drag.moved = true;
          this.pauseLive();
          this.panPx(dx);
          drag.x = e.clientX;
        }
        this.hideTooltip();
        return;
      }
      this.updateHover(e.offsetX, e.offsetY, e.clientX, e.clientY);
    });
    const end = (e) => {
      if (!drag) return;
      drag = null;
      c.classList.remove('dragging');
      try { c.releasePointerCapture(e.pointerId); } catch (_) { /* already released */ }
    };
    c.addEventListener('pointerup', end);
    c.addEventListener('pointercancel', end);
    c.addEventListener('pointerleave', () => { if (!drag) { this.hover = null; this.hideTooltip(); this.invalidate(); } });
    window.addEventListener('keydown', (e) => {
      if (e.target && (e.target.tagName === 'INPUT' || e.target.tagName === 'SELECT')) return;
      const mid = (LABEL_W + this.viewW) / 2;
      const k = e.key.toLowerCase();
      if (k === 'w') { this.pauseLive(); this.zoomAt(mid, 0.8); }
      else if (k === 's') { this.pauseLive(); this.zoomAt(mid, 1.25); }
      else if (k === 'a') { this.pauseLive(); this.panPx((this.viewW - LABEL_W) * 0.15); }
      else if (k === 'd') { this.pauseLive(); this.panPx(-(this.viewW - LABEL_W) * 0.15); }
      else if (k === '0' || k === 'f') { this.pauseLive(); this.fit(); }
    });
  }
  clickLabel(y) {
    const row = this.rowAtY(y);
    if (!row) return;
    let key = null;
    if (row.type === 'fold') {
      if (this.expanded.has(row.key)) this.expanded.delete(row.key); else this.expanded.add(row.key);
      this.layout();
      this.invalidate();
      // Live: an open fold needs every thread and tensor, not the overview.
      if (this.live.enabled && !this.live.paused) this.liveTick();
      return;
    }
    if (row.type === 'group') key = row.g.key;
    else if (row.type === 'process') key = row.g.key + '/' + row.p.key;
    if (!key) return;
    if (this.collapsed.has(key)) this.collapsed.delete(key); else this.collapsed.add(key);
    this.layout();
    this.invalidate();
  }
  rowAtY(y) {
    if (y < AXIS_H) return null;
    const cy = y - AXIS_H + this.scroller.scrollTop;
    const rows = this.rows;
    let lo = 0, hi = rows.length - 1;
    while (lo <= hi) {
      const m = (lo + hi) >> 1;
      const r = rows[m];
      if (cy < r.y) hi = m - 1; else if (cy >= r.y + r.h) lo = m + 1; else return r;
    }
    return null;
  }

  // ---- hit testing ----
  /** The slice, state, instant or counter sample under canvas point (x, y), or null. */
  sliceAt(x, y) {
    if (!this.data || x < LABEL_W || x > this.viewW) return null;
    const row = this.rowAtY(y);
    if (!row || row.type !== 'track') return null;
    const t = row.t;
    const ry = y - this.rowTop(row);
    const time = this.xToTime(x);
    const tol = 2 * (this.view.end - this.view.start) / (this.viewW - LABEL_W);
    const base = { track: t.id, trackName: t.name, pid: row.p.pid, tid: t.tid };
    if (t.kind === 'counter') {
      const i = upperBound(t.ts, 0, t.ts.length, time) - 1;
      if (i < 0) return null;
      const values = {};
      for (const s of t.series) values[s.name] = s.values[i];
      return Object.assign(base, { kind: 'counter', name: t.name, ts: t.ts[i], values });
    }
    if (t.instY >= 0 && ry >= t.instY && ry < t.instY + INST_H) {
      const f = t.instants;
      const i = nearest(f.st, time, tol);
      if (i >= 0) return Object.assign(base, { kind: 'instant', name: this.data.strings[f.nm[i]], ts: f.st[i], dur: 0, argsIndex: f.ar[i] });
      return null;
    }
    if (t.kind !== 'thread') return null;
    if (t.stateY >= 0 && ry >= t.stateY && ry < t.stateY + STATE_H) {
      const f = t.states;
      const i = hitFlat(f.st, f.du, 0, f.count, time, tol);
      if (i < 0) return null;
      return Object.assign(base, { kind: 'state', name: this.data.strings[f.nm[i]], ts: f.st[i], dur: f.du[i], argsIndex: f.ar[i] });
    }
    const depth = Math.floor((ry - t.sliceY) / ROW_H);
    const s = t.slices;
    if (ry < t.sliceY || depth >= s.levels) return null;
    const i = hitFlat(s.st, s.du, s.offsets[depth], s.offsets[depth + 1], time, tol);
    if (i < 0) return null;
    return Object.assign(base, { kind: 'slice', name: this.data.strings[s.nm[i]], ts: s.st[i], dur: s.du[i], depth, argsIndex: s.ar[i], index: i });
  }
  updateHover(x, y, clientX, clientY) {
    const hit = this.sliceAt(x, y);
    const same = hit && this.hover && hit.track === this.hover.track && hit.kind === this.hover.kind && hit.ts === this.hover.ts && hit.name === this.hover.name;
    this.hover = hit;
    if (!hit) { this.hideTooltip(); this.invalidate(); return; }
    this.showTooltip(hit, clientX, clientY, same);
    if (!same) this.invalidate();
  }
  showTooltip(hit, cx, cy, same) {
    const tip = this.tooltip;
    if (!same) {
      const rel = hit.ts - this.origin;
      let html = `<div class="tt-name">${escapeHtml(hit.name)}</div>`;
      if (hit.kind === 'counter') {
        html += `<div><span class="k">at</span> ${fmtTime(rel)}</div>`;
        for (const k in hit.values) html += `<div><span class="k">${escapeHtml(k)}</span> ${escapeHtml(fmtNum(hit.values[k]))} <span class="k">(${escapeHtml(hit.values[k])})</span></div>`;
      } else {
        html += `<div><span class="k">start</span> ${fmtTime(rel)}</div>`;
        if (hit.kind !== 'instant') html += `<div><span class="k">duration</span> ${fmtDur(hit.dur)}</div>`;
        html += `<div class="k">${escapeHtml(hit.trackName)}${hit.depth ? ' · depth ' + hit.depth : ''}</div>`;
        html += '<div class="tt-args"></div>';
      }
      tip.innerHTML = html;
      tip.dataset.kind = hit.kind;
      if (hit.argsIndex >= 0) {
        const gen = this.data.generation;
        const want = hit;
        this.source.args(gen, hit.argsIndex).then((a) => {
          if (this.hover !== want || !a) return;
          const box = tip.querySelector('.tt-args');
          if (!box) return;
          let h = '';
          if (a.cat) h += `<div><span class="k">category</span> ${escapeHtml(a.cat)}</div>`;
          if (a.extra && a.extra.unfinished) h += '<div class="k">not finished when the trace ends</div>';
          if (a.args) for (const k in a.args) {
            const v = a.args[k];
            h += `<div><span class="k">${escapeHtml(k)}</span> ${escapeHtml(typeof v === 'object' ? JSON.stringify(v) : v)}</div>`;
          }
          box.innerHTML = h;
        }).catch(() => { /* args are a nicety; the tooltip stands without them */ });
      }
    }
    tip.hidden = false;
    const w = tip.offsetWidth, h = tip.offsetHeight;
    let left = cx + 14, top = cy + 14;
    if (left + w > window.innerWidth - 4) left = cx - w - 14;
    if (top + h > window.innerHeight - 4) top = cy - h - 14;
    tip.style.left = Math.max(4, left) + 'px';
    tip.style.top = Math.max(4, top) + 'px';
  }
  hideTooltip() { this.tooltip.hidden = true; }

  // ---- rendering ----
  invalidate() {
    if (this.rafPending) return;
    this.rafPending = true;
    requestAnimationFrame(() => { this.rafPending = false; this.render(); });
  }
  colorOfName(idx) {
    let c = this.nameColor[idx];
    if (c) return c;
    const name = this.data.strings[idx];
    c = ACTIVITY_COLORS[name];
    if (!c) {
      let h = 0;
      for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) | 0;
      c = PALETTE[Math.abs(h) % PALETTE.length];
    }
    this.nameColor[idx] = c;
    return c;
  }
  stateColor(idx) {
    let c = this.nameState[idx];
    if (c) return c;
    const n = this.data.strings[idx].toLowerCase();
    const code = n === 'running' ? 1 : n === 'runnable' || n === 'waiting on run queue' ? 2 :
      n === 'blocked' || n === 'uninterruptible' || n === 'iowait' ? 3 : 4;
    c = STATE_COLORS[code];
    this.nameState[idx] = c;
    return c;
  }
  render() {
    const t0 = performance.now();
    const ctx = this.ctx;
    const W = this.viewW, H = this.viewH;
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, 0, W, H);
    ctx.font = '12px system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif';
    ctx.textBaseline = 'middle';
    const ticks = this.ticks();
    // grid
    ctx.fillStyle = '#f1f3f5';
    for (const tk of ticks) ctx.fillRect(Math.round(tk.x), AXIS_H, 1, H - AXIS_H);
    if (this.data) {
      const scrollTop = this.scroller.scrollTop;
      for (const row of this.rows) {
        const y = AXIS_H + row.y - scrollTop;
        if (y + row.h < AXIS_H || y > H) continue;
        ctx.save();
        ctx.beginPath();
        ctx.rect(0, Math.max(AXIS_H, y), W, Math.min(y + row.h, H) - Math.max(AXIS_H, y));
        ctx.clip();
        this.drawRow(ctx, row, y);
        ctx.restore();
      }
    }
    this.drawAxis(ctx, ticks);
    if (this.state !== 'ready') this.drawMessage(ctx);
    this.rendered++;
    this.stats.lastFrameMs = performance.now() - t0;
    if (this.state === 'ready' && this.stats.firstRenderMs === null && this.stats.loadStart) {
      this.stats.firstRenderMs = performance.now() - this.stats.loadStart;
    }
    const waiters = this.frameWaiters;
    this.frameWaiters = [];
    for (const w of waiters) w(this.rendered);
    if (this.state === 'ready' || this.state === 'error') this.wakeReady();
  }
  wakeReady() {
    const w = this.readyWaiters;
    this.readyWaiters = [];
    for (const f of w) f(this.state);
  }
  drawMessage(ctx) {
    const msg = this.state === 'loading' ? 'loading ' + this.sourceName + ' …' :
      this.state === 'error' ? 'could not read the trace: ' + this.error :
        'Drop a Chrome-trace or Horovod timeline JSON file here, or use “Open trace file”.';
    ctx.fillStyle = this.state === 'error' ? '#c92a2a' : '#495057';
    ctx.font = '15px system-ui, sans-serif';
    ctx.textAlign = 'center';
    ctx.fillText(msg, (LABEL_W + this.viewW) / 2, AXIS_H + 60);
    ctx.textAlign = 'left';
  }
  ticks() {
    const span = this.view.end - this.view.start;
    const plotW = this.viewW - LABEL_W;
    const raw = span * 110 / plotW;
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) || 10 * p;
    const u = unitFor(step);
    const dec = Math.max(0, -Math.floor(Math.log10(step / u.scale) + 1e-9));
    const out = [];
    const first = Math.ceil((this.view.start - this.origin) / step);
    for (let k = first; ; k++) {
      const rel = k * step;
      const t = this.origin + rel;
      if (t > this.view.end) break;
      const label = (Math.abs(rel) < step / 2 ? 0 : rel / u.scale).toFixed(dec) + ' ' + u.name;
      out.push({ x: this.timeToX(t), label });
      if (out.length > 200) break;
    }
    return out;
  }
  drawAxis(ctx, ticks) {
    const W = this.viewW;
    ctx.fillStyle = '#f8f9fa';
    ctx.fillRect(0, 0, W, AXIS_H);
    ctx.fillStyle = '#ced4da';
    ctx.fillRect(0, AXIS_H - 1, W, 1);
    ctx.fillRect(LABEL_W - 1, 0, 1, AXIS_H);
    if (AXIS_H + this.contentH - this.scroller.scrollTop < this.viewH) {
      // below the last track the label column's edge continues to the bottom
      const y0 = Math.max(AXIS_H, AXIS_H + this.contentH - this.scroller.scrollTop);
      ctx.fillRect(LABEL_W - 1, y0, 1, this.viewH - y0);
    }
    ctx.fillStyle = '#212529';
    ctx.font = '11px system-ui, sans-serif';
    ctx.save();
    ctx.beginPath();
    ctx.rect(LABEL_W, 0, W - LABEL_W, AXIS_H);
    ctx.clip();
    for (const tk of ticks) {
      ctx.fillStyle = '#868e96';
      ctx.fillRect(Math.round(tk.x), AXIS_H - 8, 1, 8);
      ctx.fillStyle = '#212529';
      if (tk.x + 3 + ctx.measureText(tk.label).width <= W) ctx.fillText(tk.label, Math.round(tk.x) + 3, AXIS_H / 2 - 2);
    }
    ctx.restore();
    ctx.fillStyle = '#495057';
    ctx.font = '11px system-ui, sans-serif';
    const span = this.view.end - this.view.start;
    ctx.fillText('view ' + fmtDur(span) + (this.live.enabled && !this.live.paused ? ' · live' : ''), 8, AXIS_H / 2 - 2);
  }
  drawRow(ctx, row, y) {
    const W = this.viewW;
    if (row.type === 'group') {
      ctx.fillStyle = row.g.kind === 'job' ? '#343a40' : '#495057';
      ctx.fillRect(0, y, W, row.h);
      ctx.fillStyle = '#ffffff';
      ctx.font = 'bold 12px system-ui, sans-serif';
      let text = (this.collapsed.has(row.g.key) ? '▸ ' : '▾ ') + row.label;
      if (row.g.kind === 'job') {
        const v = this.verdict(row.g);
        if (v) text += '  —  ' + v.text;
      }
      this.clippedText(ctx, text, 8, y + row.h / 2, W - 16);
      return;
    }
    if (row.type === 'fold') {
      this.drawHeader(ctx, row, y, '#f8f9fa', '#495057', '12px system-ui, sans-serif', row.label, 28);
      return;
    }
    if (row.type === 'overview') { this.drawOverview(ctx, row, y); return; }
    if (row.type === 'process') {
      const key = row.g.key + '/' + row.p.key;
      this.drawHeader(ctx, row, y, '#e9ecef', '#212529', 'bold 12px system-ui, sans-serif',
        (this.collapsed.has(key) ? '▸ ' : '▾ ') + row.label, 16);
      return;
    }
    const t = row.t;
    ctx.fillStyle = '#f1f3f5';
    ctx.fillRect(0, y + row.h - 1, W, 1);
    ctx.fillStyle = '#ced4da';
    ctx.fillRect(LABEL_W - 1, y, 1, row.h);
    ctx.font = '12px system-ui, sans-serif';
    ctx.fillStyle = '#343a40';
    if (t.kind === 'counter') {
      this.clippedText(ctx, t.name, 28, y + 13, LABEL_W - 34);
      ctx.fillStyle = '#868e96';
      ctx.font = '11px system-ui, sans-serif';
      let lx = 28;
      t.series.forEach((s, si) => {
        if (lx > LABEL_W - 40) return;
        ctx.fillStyle = SERIES_COLORS[si % SERIES_COLORS.length];
        ctx.fillRect(lx, y + 22, 8, 8);
        ctx.fillStyle = '#495057';
        const w = Math.min(ctx.measureText(s.name).width, LABEL_W - 14 - lx - 12);
        this.clippedText(ctx, s.name, lx + 11, y + 27, w);
        lx += 20 + w;
      });
      ctx.fillStyle = '#868e96';
      this.clippedText(ctx, `scale ${fmtNum(t.min)} … ${fmtNum(t.max)}`, 28, y + 42, LABEL_W - 34);
      this.drawCounter(ctx, t, y);
      return;
    }
    const label = t.label || t.name;
    this.clippedText(ctx, label, 28, y + (t.kind === 'thread' && t.states ? PAD + STATE_H / 2 + 1 : 12), LABEL_W - 34);
    ctx.save();
    ctx.beginPath();
    ctx.rect(LABEL_W, y, W - LABEL_W, row.h);
    ctx.clip();
    if (t.kind === 'thread') {
      const batch = this.batch;
      if (t.states && t.states.summaries) this.drawSummaryStates(batch, t.states, y + t.stateY, STATE_H);
      else if (t.states) this.drawLevel(batch, t.states.st, t.states.du, t.states.nm, 0, t.states.count, y + t.stateY, STATE_H, true, null);
      const s = t.slices;
      const texts = [], textRows = [];
      for (let d = 0; d < s.levels; d++) {
        const top = y + t.sliceY + d * ROW_H;
        if (top > this.viewH || top + ROW_H < AXIS_H) continue;
        const tx = [];
        this.drawLevel(batch, s.st, s.du, s.nm, s.offsets[d], s.offsets[d + 1], top + 1, ROW_H - 2, false, tx);
        texts.push(tx);
        textRows.push(top + 1);
      }
      batch.flush(ctx);
      for (let q = 0; q < texts.length; q++) this.drawTexts(ctx, texts[q], textRows[q], ROW_H - 2);
    }
    if (t.instants) this.drawInstants(ctx, t.instants, y + t.instY);
    const h = this.hover;
    if (h && h.track === t.id && h.kind !== 'counter') {
      const x0 = this.timeToX(h.ts), x1 = this.timeToX(h.ts + (h.dur || 0));
      let top, hh;
      if (h.kind === 'state') { top = y + t.stateY; hh = STATE_H; }
      else if (h.kind === 'instant') { top = y + t.instY; hh = INST_H; }
      else { top = y + t.sliceY + h.depth * ROW_H + 1; hh = ROW_H - 2; }
      ctx.strokeStyle = '#000000';
      ctx.lineWidth = 1.5;
      ctx.strokeRect(Math.max(x0, LABEL_W - 2) - 0.5, top - 0.5, Math.max(2, Math.min(x1, W + 2) - Math.max(x0, LABEL_W - 2)) + 1, hh + 1);
    }
    ctx.restore();
  }
  // A header row (a process, a fold): its band, a rule under it, its text.
  drawHeader(ctx, row, y, background, color, font, text, x) {
    const W = this.viewW;
    ctx.fillStyle = background;
    ctx.fillRect(0, y, W, row.h);
    ctx.fillStyle = '#dee2e6';
    ctx.fillRect(0, y + row.h - 1, W, 1);
    ctx.fillStyle = color;
    ctx.font = font;
    this.clippedText(ctx, text, x, y + row.h / 2, W - x - 8);
  }
  classOf(idx) {
    let c = this.nameClass[idx];
    if (c !== undefined) return c;
    const name = this.data.strings[idx];
    c = ACTIVITY_CLASSES.findIndex((k) => k.test.test(name));
    this.nameClass[idx] = c;
    return c;
  }
  // A rank's overview over the view, per pixel column (cached per view): the
  // threads running and waiting for a CPU (the average number of each), and for
  // each activity class the share of the column some tensor spent in it (the
  // most of any one tensor: fused tensors run side by side), plus their totals.
  overviewOf(p) {
    const vs = this.view.start, ve = this.view.end;
    const cols = Math.max(1, Math.floor(this.viewW - LABEL_W));
    const key = this.data.generation + ':' + vs + ':' + ve + ':' + cols;
    if (p.ov && p.ov.key === key) return p.ov;
    const k = cols / (ve - vs);
    const lane = () => ({ bins: new Float64Array(cols + 1), diff: new Float64Array(cols + 2) });
    // Adds weight w over [a, b] (µs) to a lane, in column units: whole columns through a difference array.
    const add = (l, a, b, w) => {
      let xa = (a - vs) * k, xb = (b - vs) * k;
      if (xb <= 0 || xa >= cols || !(w > 0)) return;
      xa = Math.max(0, xa); xb = Math.min(cols, xb);
      if (xb <= xa) return;
      const ia = Math.floor(xa), ib = Math.floor(xb);
      if (ia === ib) { l.bins[ia] += (xb - xa) * w; return; }
      l.bins[ia] += (ia + 1 - xa) * w;
      l.diff[ia + 1] += w; l.diff[ib] -= w;
      if (ib < cols) l.bins[ib] += (xb - ib) * w;
    };
    const settle = (l) => { let acc = 0; for (let c = 0; c < cols; c++) { acc += l.diff[c]; l.bins[c] += acc; l.diff[c] = 0; } l.diff[cols] = 0; return l.bins; };
    const run = lane(), rq = lane();
    let threads = 0;
    const classes = ACTIVITY_CLASSES.map(() => new Float64Array(cols));
    const tmp = ACTIVITY_CLASSES.map(lane);
    for (const t of p.tracks) {
      if (t.kind !== 'thread') continue;
      if (t.states) {
        threads++;
        const f = t.states;
        let i = lowerBound(f.st, 0, f.count, vs);
        if (i > 0) i--;
        for (; i < f.count && f.st[i] <= ve; i++) {
          const a = f.st[i], b = a + f.du[i];
          add(run, a, b, f.fr[3 * i]);
          add(rq, a, b, f.fr[3 * i + 1]);
        }
      }
      if (t.role !== 'cycles') {
        // Activities on any track: a tensor's, or a thread's own (a Horovod background thread).
        const s = t.slices;
        let any = false;
        for (let i = 0; i < s.count; i++) {
          const a = s.st[i], b = a + s.du[i];
          if (b < vs || a > ve) continue;
          const c = this.classOf(s.nm[i]);
          if (c < 0) continue;
          add(tmp[c], a, b, s.bz[i]);
          any = true;
        }
        if (!any) continue;
        for (let c = 0; c < tmp.length; c++) {
          const bins = settle(tmp[c]);
          const into = classes[c];
          for (let x = 0; x < cols; x++) { if (bins[x] > into[x]) into[x] = Math.min(1, bins[x]); bins[x] = 0; }
        }
      }
    }
    settle(run); settle(rq);
    // The agent's overview counters (view=overview) add to what the tracks hold
    // (a recorded trace's B/E activities stay as they are there).
    const fromAgent = this.overviewFromCounters(p, vs, ve, cols);
    if (fromAgent) {
      for (let c = 0; c < cols; c++) {
        run.bins[c] += fromAgent.run[c]; rq.bins[c] += fromAgent.rq[c];
        for (let i = 0; i < classes.length; i++) classes[i][c] = Math.max(classes[i][c], fromAgent.classes[i][c]);
      }
      threads = Math.max(threads, fromAgent.threads);
    }
    let runSum = 0, rqSum = 0, peak = 0;
    for (let c = 0; c < cols; c++) { runSum += run.bins[c]; rqSum += rq.bins[c]; peak = Math.max(peak, run.bins[c] + rq.bins[c]); }
    const share = classes.map((a) => { let x = 0; for (let c = 0; c < cols; c++) x += a[c]; return x / cols; });
    p.ov = { key, cols, run: run.bins, rq: rq.bins, classes, threads, peak, running: runSum / cols, waiting: rqSum / cols, share };
    return p.ov;
  }
  // The overview from the agent's counters (view=overview), sampled at each
  // column's middle; null when the process has none.
  overviewFromCounters(p, vs, ve, cols) {
    const threadsC = p.tracks.find((t) => t.kind === 'counter' && t.name === 'threads');
    const actC = p.tracks.find((t) => t.kind === 'counter' && t.name === 'activity');
    if (!threadsC && !actC) return null;
    const k = cols / (ve - vs);
    const series = (c, name) => c && (c.series.find((s) => s.name === name) || null);
    const at = (c, s, t) => {
      if (!c || !s) return 0;
      const i = upperBound(c.ts, 0, c.ts.length, t) - 1;
      return i >= 0 ? s.values[i] : 0;
    };
    const run = new Float64Array(cols), rq = new Float64Array(cols);
    const classes = ACTIVITY_CLASSES.map(() => new Float64Array(cols));
    const sRun = series(threadsC, 'running'), sRq = series(threadsC, 'runnable');
    const sAct = OVERVIEW_ACTIVITY_KEYS.map((n) => series(actC, n));
    let runSum = 0, rqSum = 0, peak = 0;
    for (let c = 0; c < cols; c++) {
      const t = vs + (c + 0.5) / k;
      run[c] = at(threadsC, sRun, t); rq[c] = at(threadsC, sRq, t);
      runSum += run[c]; rqSum += rq[c]; peak = Math.max(peak, run[c] + rq[c]);
      for (let i = 0; i < classes.length; i++) classes[i][c] = at(actC, sAct[i], t);
    }
    const share = classes.map((a) => { let x = 0; for (let c = 0; c < cols; c++) x += a[c]; return x / cols; });
    return { cols, run, rq, classes, threads: (p.named && p.named.thread) || (threadsC ? 1 : 0), peak, running: runSum / cols, waiting: rqSum / cols, share };
  }
  // Whether a job looks compute-, network- or scheduling-bound over the view, from its ranks' overviews.
  verdict(g) {
    const procs = g.processes.filter((p) => this.passesFilter(g, p));
    if (!procs.length) return null;
    let running = 0, waiting = 0, coll = 0, known = 0;
    for (const p of procs) {
      const o = this.overviewOf(p);
      if (!o.threads && !o.share.some((x) => x > 0)) continue;
      known++;
      running += o.running; waiting += o.waiting; coll += o.share[0] + o.share[1];
    }
    if (!known) return null;
    running /= known; waiting /= known; coll /= known;
    const wait = running + waiting > 0 ? waiting / (running + waiting) : 0;
    const pct = (x) => Math.round(100 * x) + '%';
    const figures = `per rank: ${running.toFixed(2)} threads running, ${waiting.toFixed(2)} waiting for a CPU; collectives ${pct(coll)} of the time`;
    let kind;
    if (wait > 0.2) kind = `scheduling-bound (ready threads wait for a CPU ${pct(wait)} of the time)`;
    else if (coll > 0.5) kind = 'network-bound (collectives run most of the time)';
    else kind = 'compute-bound';
    return { kind, text: 'looks ' + kind + ' · ' + figures };
  }
  drawOverview(ctx, row, y) {
    const W = this.viewW, x0 = LABEL_W;
    const o = this.overviewOf(row.p);
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, y, W, row.h);
    ctx.fillStyle = '#dee2e6';
    ctx.fillRect(0, y + row.h - 1, W, 1);
    ctx.fillStyle = '#ced4da';
    ctx.fillRect(LABEL_W - 1, y, 1, row.h);
    ctx.fillStyle = '#212529';
    ctx.font = 'bold 12px system-ui, sans-serif';
    this.clippedText(ctx, 'overview', 28, y + 10, LABEL_W - 34);
    ctx.font = '11px system-ui, sans-serif';
    ctx.fillStyle = '#495057';
    const scale = Math.max(1, o.peak);
    this.clippedText(ctx, `${o.running.toFixed(2)} run · ${o.waiting.toFixed(2)} wait for CPU (of ${fmtNum(scale)})`, 28, y + 24, LABEL_W - 34);
    const top = ACTIVITY_CLASSES.map((c, i) => [c, o.share[i]]).filter((x) => x[1] > 0.005).slice(0, 2)
      .map(([c, x]) => `${c.label} ${Math.round(100 * x)}%`).join(' · ');
    this.clippedText(ctx, top ? 'job: ' + top : 'job: no activity in view', 28, y + 37, LABEL_W - 34);
    // Threads: running (green) from the bottom, waiting for a CPU (orange) on top.
    const cpuTop = y + 3, cpuH = 28, base = cpuTop + cpuH;
    for (let c = 0; c < o.cols; c++) {
      const r = o.run[c], q = o.rq[c];
      if (r > 0.001) { const h = r / scale * cpuH; ctx.fillStyle = STATE_COLORS[1]; ctx.fillRect(x0 + c, base - h, 1, h); }
      if (q > 0.001) { const h0 = r / scale * cpuH, h = q / scale * cpuH; ctx.fillStyle = STATE_COLORS[2]; ctx.fillRect(x0 + c, base - h0 - h, 1, h); }
    }
    ctx.fillStyle = '#adb5bd';
    ctx.fillRect(x0, base, W - x0, 1);
    // Activities: per column the class with the most of it, shaded by how much.
    const actTop = base + 3, actH = row.h - (base - y) - 6;
    for (let c = 0; c < o.cols; c++) {
      let best = -1, bv = 0.02;
      for (let i = 0; i < o.classes.length; i++) if (o.classes[i][c] > bv) { bv = o.classes[i][c]; best = i; }
      if (best < 0) continue;
      ctx.globalAlpha = 0.35 + 0.65 * bv;
      ctx.fillStyle = ACTIVITY_CLASSES[best].color;
      ctx.fillRect(x0 + c, actTop, 1, actH);
    }
    ctx.globalAlpha = 1;
  }
  clippedText(ctx, text, x, y, maxW) {
    if (ctx.measureText(text).width <= maxW) { ctx.fillText(text, x, y); return; }
    let lo = 0, hi = text.length;
    while (lo < hi) {
      const m = (lo + hi + 1) >> 1;
      if (ctx.measureText(text.slice(0, m) + '…').width <= maxW) lo = m; else hi = m - 1;
    }
    ctx.fillText(text.slice(0, lo) + '…', x, y);
  }
  // One nesting level: slices never overlap, so binary-search the first one
  // in view and walk right; runs of slices narrower than a pixel collapse into
  // one pixel-wide mark, skipping ahead by binary search (level of detail).
  // Rectangles go to a per-colour batch (touching same-colour ones merge), so
  // a frame costs one fill per colour rather than one per slice.
  drawLevel(batch, st, du, nm, lo, hi, y, h, isState, texts) {
    const vs = this.view.start, ve = this.view.end;
    const x0 = LABEL_W, x1 = this.viewW;
    const k = (x1 - x0) / (ve - vs);
    let i = lowerBound(st, lo, hi, vs);
    if (i > lo && st[i - 1] + du[i - 1] > vs) i--;
    while (i < hi && st[i] <= ve) {
      const xs = x0 + (st[i] - vs) * k;
      const xe = x0 + (st[i] + du[i] - vs) * k;
      const color = isState ? this.stateColor(nm[i]) : this.colorOfName(nm[i]);
      if (xe - xs >= 1) {
        const a = Math.max(xs, x0 - 1), b = Math.min(xe, x1 + 1);
        batch.add(color, a, y, b - a, h);
        if (texts && b - a > 36) texts.push(nm[i], a, b, color);
        i++;
        continue;
      }
      const px = Math.floor(xs);
      const tNext = vs + (px + 1 - x0) / k;
      const j = lowerBound(st, i + 1, hi, tNext);
      batch.add(color, px, y, Math.max(1, Math.min(xe, x1) - px), h);
      i = j - 1 > i && x0 + (st[j - 1] + du[j - 1] - vs) * k > px + 1 ? j - 1 : j;
    }
    batch.endLane();
  }
  // Thread states with the agent's summaries: each slice split top to bottom
  // into running, runnable and off-CPU by its fractions.
  drawSummaryStates(batch, f, y, h) {
    const vs = this.view.start, ve = this.view.end;
    const x0 = LABEL_W, x1 = this.viewW;
    const k = (x1 - x0) / (ve - vs);
    let i = lowerBound(f.st, 0, f.count, vs);
    if (i > 0 && f.st[i - 1] + f.du[i - 1] > vs) i--;
    for (; i < f.count && f.st[i] <= ve; i++) {
      const a = Math.max(x0 + (f.st[i] - vs) * k, x0 - 1);
      const b = Math.min(x0 + (f.st[i] + f.du[i] - vs) * k, x1 + 1);
      const w = Math.max(1, b - a);
      let top = y;
      for (let q = 0; q < 3; q++) {
        const part = f.fr[3 * i + q] * h;
        if (part <= 0) continue;
        batch.add(STATE_COLORS[q + 1], a, top, w, part);
        top += part;
      }
    }
    batch.endLane();
  }
  drawTexts(ctx, texts, y, h) {
    for (let q = 0; q < texts.length; q += 4) {
      const a = texts[q + 1], b = texts[q + 2];
      ctx.fillStyle = textOn(texts[q + 3]);
      this.fastClippedText(ctx, texts[q], a + 4, y + h / 2 + 1, b - a - 8);
    }
  }
  // Slice names: widths measured once per name, then cut by proportion.
  fastClippedText(ctx, nameIdx, x, y, maxW) {
    const name = this.data.strings[nameIdx];
    let w = this.nameWidth[nameIdx];
    if (w === undefined) { w = ctx.measureText(name).width; this.nameWidth[nameIdx] = w; }
    if (w <= maxW) { ctx.fillText(name, x, y); return; }
    const chars = Math.floor(name.length * (maxW - 8) / w);
    if (chars < 2) return;
    ctx.fillText(name.slice(0, chars) + '…', x, y);
  }
  drawInstants(ctx, f, y) {
    const vs = this.view.start, ve = this.view.end;
    const k = (this.viewW - LABEL_W) / (ve - vs);
    let i = lowerBound(f.st, 0, f.count, vs);
    let lastPx = -1;
    ctx.fillStyle = '#495057';
    while (i < f.count && f.st[i] <= ve) {
      const x = Math.round(LABEL_W + (f.st[i] - vs) * k);
      if (x !== lastPx) {
        ctx.beginPath();
        ctx.moveTo(x, y + 1);
        ctx.lineTo(x + 4, y + INST_H - 1);
        ctx.lineTo(x - 4, y + INST_H - 1);
        ctx.closePath();
        ctx.fill();
        lastPx = x;
        // skip the instants that would land on the same pixel
        i = lowerBound(f.st, i + 1, f.count, vs + (x + 0.5 - LABEL_W) / k);
        continue;
      }
      i++;
    }
  }
  drawCounter(ctx, t, y) {
    const x0 = LABEL_W, x1 = this.viewW;
    const top = y + 4, bottom = y + COUNTER_H - 4;
    const lo = Math.min(0, t.min), hi = t.max > lo ? t.max : lo + 1;
    const vy = (v) => bottom - (v - lo) / (hi - lo) * (bottom - top);
    const vs = this.view.start, ve = this.view.end;
    const k = (x1 - x0) / (ve - vs);
    const n = t.ts.length;
    const i0 = Math.max(0, lowerBound(t.ts, 0, n, vs) - 1);
    const i1 = Math.min(n, lowerBound(t.ts, 0, n, ve) + 1);
    ctx.save();
    ctx.beginPath();
    ctx.rect(x0, y, x1 - x0, COUNTER_H);
    ctx.clip();
    t.series.forEach((s, si) => {
      const color = SERIES_COLORS[si % SERIES_COLORS.length];
      const v = s.values;
      // Collapse the samples that fall into one pixel column to their maximum.
      const xs = [], ys = [];
      let curPx = null, curMax = 0;
      for (let i = i0; i < i1; i++) {
        const px = Math.floor(x0 + (t.ts[i] - vs) * k);
        if (px !== curPx) {
          if (curPx !== null) { xs.push(curPx); ys.push(curMax); }
          curPx = px; curMax = v[i];
        } else if (v[i] > curMax) curMax = v[i];
      }
      if (curPx !== null) { xs.push(curPx); ys.push(curMax); }
      if (!xs.length) return;
      ctx.beginPath();
      ctx.moveTo(Math.max(xs[0], x0 - 1), vy(lo));
      for (let q = 0; q < xs.length; q++) {
        const xa = Math.max(xs[q], x0 - 1);
        const xb = q + 1 < xs.length ? xs[q + 1] : Math.min(x1 + 1, xs[q] + 1);
        ctx.lineTo(xa, vy(ys[q]));
        ctx.lineTo(xb, vy(ys[q]));
      }
      ctx.lineTo(xs.length ? Math.min(x1 + 1, xs[xs.length - 1] + 1) : x0, vy(lo));
      ctx.closePath();
      ctx.globalAlpha = 0.3;
      ctx.fillStyle = color;
      ctx.fill();
      ctx.globalAlpha = 1;
      ctx.strokeStyle = color;
      ctx.lineWidth = 1;
      ctx.stroke();
    });
    // scale: max at the top, legend of series
    ctx.fillStyle = '#495057';
    ctx.font = '10px system-ui, sans-serif';
    const label = fmtNum(t.max);
    ctx.fillStyle = 'rgba(255,255,255,0.8)';
    ctx.fillRect(x0 + 2, top - 1, ctx.measureText(label).width + 4, 12);
    ctx.fillStyle = '#495057';
    ctx.fillText(label, x0 + 4, top + 5);
    ctx.restore();
    const h = this.hover;
    if (h && h.kind === 'counter' && h.track === t.id) {
      const x = this.timeToX(h.ts);
      if (x >= x0) { ctx.fillStyle = '#000000'; ctx.fillRect(Math.round(x), y, 1, COUNTER_H); }
    }
  }

  // ---- the test hook ----
  nextFrame() { return new Promise((resolve) => { this.frameWaiters.push(resolve); this.invalidate(); }); }
  whenReady() {
    if ((this.state === 'ready' && this.rendered > 0 && this.stats.firstRenderMs !== null) || this.state === 'error' ||
      (this.state === 'empty' && this.startupDone)) return Promise.resolve(this.state);
    return new Promise((resolve) => this.readyWaiters.push(resolve));
  }
  trackInfo() {
    const out = [];
    for (const row of this.rows) {
      const base = { type: row.type, y: this.rowTop(row), height: row.h, job: row.g.kind === 'job' ? row.g.name : null, group: row.g.name };
      if (row.type === 'group') { out.push(Object.assign(base, { name: row.g.name })); continue; }
      base.pid = row.p.pid;
      base.rank = row.p.rank;
      base.process = row.label || this.processLabel(row.p);
      if (row.type === 'process') { out.push(Object.assign(base, { name: row.label })); continue; }
      if (row.type === 'fold') { out.push(Object.assign(base, { name: row.label, key: row.key })); continue; }
      if (row.type === 'overview') {
        const o = this.overviewOf(row.p);
        out.push(Object.assign(base, { name: 'overview', running: o.running, waiting: o.waiting, threads: o.threads,
          share: Object.fromEntries(ACTIVITY_CLASSES.map((c, i) => [c.key, o.share[i]])) }));
        continue;
      }
      const t = row.t;
      Object.assign(base, { id: t.id, kind: t.kind, name: t.name, process: this.processLabel(row.p) });
      if (t.kind === 'thread') {
        Object.assign(base, { tid: t.tid, levels: t.slices.levels, slices: t.slices.count, states: t.states ? t.states.count : 0,
          instants: t.instants ? t.instants.count : 0, sliceTop: t.sliceY, rowHeight: ROW_H, stateTop: t.stateY, stateHeight: STATE_H });
      } else if (t.kind === 'counter') {
        Object.assign(base, { series: t.series.map((s) => s.name), samples: t.ts.length, min: t.min, max: t.max });
      } else {
        Object.assign(base, { instants: t.instants.count });
      }
      out.push(base);
    }
    return out;
  }
  /** Opens every fold (a job rank's threads and tensors), or closes them all. */
  expandAll(open = true) {
    if (!this.data) return;
    for (const g of this.data.groups) {
      for (const p of g.processes) {
        for (const role of ['thread', 'tensor']) {
          const key = g.key + '/' + p.key + '/' + role;
          if (open) this.expanded.add(key); else this.expanded.delete(key);
        }
      }
    }
    this.layout();
    this.invalidate();
    if (this.live.enabled && !this.live.paused) this.liveTick();
  }
  /** The verdict on a job over the view (what its group row says), for tests. */
  jobVerdict(name) {
    const g = this.data && this.data.groups.find((x) => x.kind === 'job' && x.name === name);
    return g ? this.verdict(g) : null;
  }
  /** Find slices by name (and optionally pid/tid); returns [{ts, dur, depth, track}], for tests. */
  findSlices(name, pid, tid) {
    const out = [];
    if (!this.data) return out;
    const idx = this.data.strings.indexOf(name);
    if (idx < 0) return out;
    for (const g of this.data.groups) for (const p of g.processes) {
      if (pid != null && String(p.pid) !== String(pid)) continue;
      for (const t of p.tracks) {
        if (t.kind !== 'thread' || (tid != null && String(t.tid) !== String(tid))) continue;
        const s = t.slices;
        for (let d = 0; d < s.levels; d++) for (let i = s.offsets[d]; i < s.offsets[d + 1]; i++) {
          if (s.nm[i] === idx) out.push({ ts: s.st[i], dur: s.du[i], depth: d, track: t.id, pid: p.pid, tid: t.tid });
        }
        if (t.states) for (let i = 0; i < t.states.count; i++) {
          if (t.states.nm[i] === idx) out.push({ ts: t.states.st[i], dur: t.states.du[i], depth: -1, state: true, track: t.id, pid: p.pid, tid: t.tid });
        }
      }
    }
    return out;
  }
}

function lowerBound(a, lo, hi, v) {
  while (lo < hi) {
    const m = (lo + hi) >>> 1;
    if (a[m] < v) lo = m + 1; else hi = m;
  }
  return lo;
}
function upperBound(a, lo, hi, v) {
  while (lo < hi) {
    const m = (lo + hi) >>> 1;
    if (a[m] <= v) lo = m + 1; else hi = m;
  }
  return lo;
}
// The slice of a non-overlapping run [lo, hi) that contains time, or the
// nearest one within tol (so sub-pixel slices can be hovered).
function hitFlat(st, du, lo, hi, time, tol) {
  const i = upperBound(st, lo, hi, time) - 1;
  if (i >= lo && st[i] + du[i] >= time) return i;
  let best = -1, bestD = tol;
  for (const j of [i, i + 1]) {
    if (j < lo || j >= hi) continue;
    const d = time < st[j] ? st[j] - time : time - (st[j] + du[j]);
    if (d <= bestD) { best = j; bestD = d; }
  }
  return best;
}
function nearest(st, time, tol) {
  const i = lowerBound(st, 0, st.length, time);
  let best = -1, bestD = tol;
  for (const j of [i - 1, i]) {
    if (j < 0 || j >= st.length) continue;
    const d = Math.abs(st[j] - time);
    if (d <= bestD) { best = j; bestD = d; }
  }
  return best;
}


// ---------------------------------------------------------------------------
// The tuning panel (only when the page is served by an agent): the agent's
// jobs, the picked job's tuning session (polled while it runs: samples in a
// table and a convergence chart, best so far, state), start/stop with an
// optional bearer token, and the reports with links to their files. It talks
// to nothing but the agent (GET/POST/DELETE /api/jobs/{id}/tuning,
// GET /api/jobs, GET /api/reports).
// ---------------------------------------------------------------------------
function fmtBytes(n) {
  if (typeof n !== 'number' || !isFinite(n)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? String(n) : n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0)) + ' ' + units[i];
}
function fmtRate(bps) {
  if (typeof bps !== 'number' || !isFinite(bps)) return '–';
  const units = ['B/s', 'kB/s', 'MB/s', 'GB/s', 'TB/s'];
  let i = 0;
  while (Math.abs(bps) >= 1000 && i < units.length - 1) { bps /= 1000; i++; }
  return bps.toFixed(bps < 10 ? 2 : bps < 100 ? 1 : 0) + ' ' + units[i];
}
function fmtKnobs(k) {
  if (!k) return '–';
  const fusion = k.fusion_threshold_bytes === 0 ? 'fusion off' : 'fusion ' + fmtBytes(k.fusion_threshold_bytes);
  const cycle = typeof k.cycle_time_us === 'number' ? 'cycle ' + (k.cycle_time_us / 1000).toFixed(k.cycle_time_us < 10000 ? 2 : 1) + ' ms' : 'cycle –';
  return fusion + ' · ' + cycle + ' · ' + (k.hierarchical_allreduce ? 'hierarchical' : 'flat');
}
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}
const SVG_NS = 'http://www.w3.org/2000/svg';
function svgEl(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}
/** The message of an agent's JSON error (`{"error": "..."}` or `{"error": {"message": ...}}`). */
async function errorOf(res) {
  let text = '';
  try { text = await res.text(); } catch (_) { /* no body */ }
  let msg = text;
  try {
    const j = JSON.parse(text);
    const e = j && j.error;
    msg = typeof e === 'string' ? e : e && e.message ? e.message : text;
  } catch (_) { /* not JSON: the text itself */ }
  return `HTTP ${res.status}` + (msg ? ': ' + msg : '');
}

class TuningPanel {
  constructor(root) {
    this.root = root;
    this.toggle = document.getElementById('tuning-toggle');
    this.jobSel = root.querySelector('#tuning-job');
    this.token = root.querySelector('#tuning-token');
    this.budget = root.querySelector('#tuning-budget');
    this.keepStart = root.querySelector('#tuning-keep-start');
    this.startBtn = root.querySelector('#tuning-start');
    this.stopBtn = root.querySelector('#tuning-stop');
    this.msg = root.querySelector('#tuning-message');
    this.sessionBox = root.querySelector('#tuning-session');
    this.reportsBox = root.querySelector('#tuning-reports');
    this.job = '';
    this.session = null;
    this.timer = null;
    this.polls = 0;
    this.open = false;
    this.lastState = null;
    this.toggle.addEventListener('click', () => this.setOpen(!this.open));
    this.jobSel.addEventListener('change', () => this.pick(this.jobSel.value));
    this.startBtn.addEventListener('click', () => this.start());
    this.stopBtn.addEventListener('click', () => this.stop());
    root.querySelector('#tuning-close').addEventListener('click', () => this.setOpen(false));
  }
  /** Shown only when an agent serves the page. */
  enable() { this.toggle.hidden = false; }
  setOpen(open) {
    this.open = open;
    this.root.hidden = !open;
    this.toggle.classList.toggle('on', open);
    if (open) { this.refreshJobs(); this.refreshReports(); this.schedule(0); } else this.schedule(null);
  }
  headers(json) {
    const h = { accept: 'application/json' };
    if (json) h['content-type'] = 'application/json';
    const t = this.token.value.trim();
    if (t) h.authorization = 'Bearer ' + t;
    return h;
  }
  say(text, isError) {
    this.msg.textContent = text || '';
    this.msg.classList.toggle('error', !!isError);
  }
  async refreshJobs() {
    try {
      const res = await fetch('/api/jobs', { headers: { accept: 'application/json' } });
      if (!res.ok) { this.say('jobs: ' + await errorOf(res), true); return; }
      const body = await res.json();
      const jobs = Array.isArray(body) ? body : Array.isArray(body && body.jobs) ? body.jobs : [];
      const ids = jobs.map((j) => j && (j.id ?? j.job_id ?? j.name)).filter((id) => id != null).map(String);
      const keep = this.job;
      this.jobSel.replaceChildren(el('option', { value: '', text: ids.length ? 'pick a job' : 'no jobs found' }),
        ...ids.map((id) => el('option', { value: id, text: id })));
      if (ids.includes(keep)) this.jobSel.value = keep;
      else if (ids.length === 1 && !keep) { this.jobSel.value = ids[0]; this.pick(ids[0]); }
    } catch (err) {
      this.say('jobs: ' + String(err && err.message || err), true);
    }
  }
  pick(id) {
    this.job = id;
    this.session = null;
    this.lastState = null;
    this.render();
    this.say('');
    this.schedule(0);
  }
  url() { return '/api/jobs/' + encodeURIComponent(this.job) + '/tuning'; }
  /** Next poll in `ms` (null: none): every second while a session runs, every 5 s otherwise. */
  schedule(ms) {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    if (ms == null || !this.open) return;
    this.timer = setTimeout(() => this.poll(), ms);
  }
  async poll() {
    this.timer = null;
    if (!this.open) return;
    if (this.job) {
      const job = this.job;
      try {
        const res = await fetch(this.url(), { headers: { accept: 'application/json' } });
        this.polls++;
        if (job !== this.job) return;
        if (res.status === 404) { this.session = null; this.render(); }
        else if (!res.ok) this.say('tuning: ' + await errorOf(res), true);
        else this.show(await res.json());
      } catch (err) {
        this.say('tuning: ' + String(err && err.message || err), true);
      }
    }
    this.schedule(this.session && this.session.state === 'running' ? 1000 : 5000);
  }
  show(session) {
    const was = this.lastState;
    this.session = session;
    this.lastState = session.state;
    // A session that just ended has (or will have) a report.
    if (was === 'running' && session.state !== 'running') this.refreshReports();
    this.render();
  }
  async start() {
    if (!this.job) { this.say('pick a job first', true); return; }
    const body = {};
    const b = Number(this.budget.value);
    if (this.budget.value !== '' && Number.isInteger(b) && b > 0) body.budget = b;
    this.say('starting…');
    try {
      const res = await fetch(this.url(), { method: 'POST', headers: this.headers(true), body: JSON.stringify(body) });
      if (!res.ok) { this.say('start: ' + await errorOf(res), true); return; }
      this.show(await res.json());
      this.say('tuning session started');
      this.schedule(1000);
    } catch (err) {
      this.say('start: ' + String(err && err.message || err), true);
    }
  }
  async stop() {
    if (!this.job) return;
    const url = this.url() + (this.keepStart.checked ? '?keep=start' : '');
    try {
      const res = await fetch(url, { method: 'DELETE', headers: this.headers(false) });
      if (!res.ok) { this.say('stop: ' + await errorOf(res), true); return; }
      this.show(await res.json());
      this.say('tuning session stopped');
      this.refreshReports();
    } catch (err) {
      this.say('stop: ' + String(err && err.message || err), true);
    }
  }
  render() {
    const s = this.session;
    const box = this.sessionBox;
    this.stopBtn.disabled = !(s && s.state === 'running');
    this.startBtn.disabled = !this.job || !!(s && s.state === 'running');
    if (!this.job) { box.replaceChildren(el('p', { class: 'muted', text: 'Pick a job to see its tuning session.' })); return; }
    if (!s) { box.replaceChildren(el('p', { class: 'muted', text: `No tuning session for ${this.job} yet.` })); return; }
    const samples = Array.isArray(s.samples) ? s.samples : [];
    const facts = el('dl', { class: 'facts' });
    const fact = (k, v) => facts.append(el('dt', { text: k }), el('dd', { text: v }));
    const state = el('span', { class: 'badge state-' + s.state, id: 'tuning-state', text: s.state });
    facts.append(el('dt', { text: 'state' }), el('dd', {}, state));
    if (s.error) fact('error', s.error);
    fact('samples', String(samples.length) + (s.config && s.config.budget ? ' of ' + s.config.budget : ''));
    fact('start knobs', fmtKnobs(s.start_knobs));
    fact('current knobs', fmtKnobs(s.current_knobs));
    const best = s.best;
    fact('best so far', best ? `${fmtKnobs(best.knobs)} · ${fmtRate(best.predicted_score_bytes_per_s)} (sample ${best.sample})` : '–');
    if (typeof s.speedup_over_start === 'number') fact('speedup over start', s.speedup_over_start.toFixed(2) + '×');
    if (s.report_id) {
      const a = el('a', { href: '/api/reports/' + encodeURIComponent(s.report_id), target: '_blank', text: s.report_id });
      facts.append(el('dt', { text: 'report' }), el('dd', {}, a));
    }
    const table = el('table', { id: 'tuning-samples' },
      el('thead', {}, el('tr', {}, ...['#', 'fusion', 'cycle', 'hier.', 'score', 'best', 'note'].map((h) => el('th', { text: h })))));
    const tbody = el('tbody');
    let bestSoFar = -Infinity;
    for (const x of samples) {
      const k = x.knobs || {};
      bestSoFar = Math.max(bestSoFar, x.score_bytes_per_s);
      const note = [x.disturbed && 'disturbed: ' + x.disturbed, x.remeasured_because && 're-measured: ' + x.remeasured_because].filter(Boolean).join('; ');
      tbody.append(el('tr', { 'data-index': String(x.index) },
        el('td', { text: String(x.index) }),
        el('td', { text: k.fusion_threshold_bytes === 0 ? 'off' : fmtBytes(k.fusion_threshold_bytes) }),
        el('td', { text: typeof k.cycle_time_us === 'number' ? (k.cycle_time_us / 1000).toFixed(2) + ' ms' : '–' }),
        el('td', { text: k.hierarchical_allreduce ? 'yes' : 'no' }),
        el('td', { text: fmtRate(x.score_bytes_per_s) }),
        el('td', { text: fmtRate(bestSoFar) }),
        el('td', { text: note })));
    }
    table.append(tbody);
    box.replaceChildren(facts, this.chart(samples), table);
  }
  /** Score per sample (dots) and the best so far (a step line), as SVG. */
  chart(samples) {
    const W = 400, H = 120, L = 62, R = 8, T = 8, B = 18;
    const svg = svgEl('svg', { id: 'tuning-chart', width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'convergence: score per sample and best so far' });
    svg.append(svgEl('rect', { x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot' }));
    const scores = samples.map((x) => x.score_bytes_per_s).filter((v) => typeof v === 'number' && isFinite(v));
    if (!scores.length) {
      const t = svgEl('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'muted' });
      t.textContent = 'no samples yet';
      svg.append(t);
      return svg;
    }
    const max = Math.max(...scores) * 1.05 || 1;
    const n = Math.max(samples.length - 1, 1);
    const x = (i) => L + (W - L - R) * (samples.length === 1 ? 0.5 : i / n);
    const y = (v) => T + (H - T - B) * (1 - v / max);
    let best = -Infinity;
    const pts = [];
    samples.forEach((s, i) => {
      if (pts.length) pts.push(`${x(i)},${y(best)}`);
      best = Math.max(best, s.score_bytes_per_s);
      pts.push(`${x(i)},${y(best)}`);
    });
    svg.append(svgEl('polyline', { points: pts.join(' '), class: 'best' }));
    samples.forEach((s, i) => svg.append(svgEl('circle', { cx: x(i), cy: y(s.score_bytes_per_s), r: 3, class: s.disturbed ? 'sample disturbed' : 'sample' })));
    const label = (text, px, py, anchor) => { const t = svgEl('text', { x: px, y: py, 'text-anchor': anchor }); t.textContent = text; svg.append(t); };
    label(fmtRate(max), L - 4, T + 8, 'end');
    label('0', L - 4, H - B, 'end');
    label('sample', (L + W - R) / 2, H - 4, 'middle');
    return svg;
  }
  async refreshReports() {
    const box = this.reportsBox;
    try {
      const res = await fetch('/api/reports', { headers: { accept: 'application/json' } });
      if (!res.ok) { box.replaceChildren(el('p', { class: 'muted', text: 'reports: ' + await errorOf(res) })); return; }
      const body = await res.json();
      const reports = Array.isArray(body && body.reports) ? body.reports : [];
      if (!reports.length) { box.replaceChildren(el('p', { class: 'muted', text: 'No reports yet.' })); return; }
      const table = el('table', { id: 'tuning-report-list' },
        el('thead', {}, el('tr', {}, ...['report', 'job', 'created', 'samples', 'speedup', 'files'].map((h) => el('th', { text: h })))));
      const tbody = el('tbody');
      for (const r of reports) {
        const link = (href, text) => (href ? el('a', { href, target: '_blank', text }) : null);
        const files = el('td', {}, link(r.html, 'html'), ' ', link(r.csv, 'csv'), ' ', link(r.parquet, 'parquet'));
        tbody.append(el('tr', { 'data-id': String(r.id) },
          el('td', {}, link(r.html, String(r.id)) || String(r.id)),
          el('td', { text: String(r.job_id ?? '') }),
          el('td', { text: typeof r.created_unix_ms === 'number' ? new Date(r.created_unix_ms).toISOString().slice(0, 16).replace('T', ' ') + 'Z' : '–' }),
          el('td', { text: String(r.samples ?? '–') }),
          el('td', { text: typeof r.speedup_over_start === 'number' ? r.speedup_over_start.toFixed(2) + '×' : '–' }),
          files));
      }
      table.append(tbody);
      box.replaceChildren(table);
    } catch (err) {
      box.replaceChildren(el('p', { class: 'muted', text: 'reports: ' + String(err && err.message || err) }));
    }
  }
}

// ---------------------------------------------------------------------------
// Start-up: ?trace=URL, else the agent's API, else wait for a file.
// ---------------------------------------------------------------------------
async function main() {
  const viewer = new Viewer(document.body);
  const hook = {
    get state() { return viewer.state; },
    get error() { return viewer.error; },
    get rendered() { return viewer.rendered; },
    nextFrame: () => viewer.nextFrame(),
    whenReady: () => viewer.whenReady(),
    visibleRange: () => ({ start: viewer.view.start, end: viewer.view.end, origin: viewer.origin }),
    setRange: (start, end) => { viewer.pauseLive(); viewer.setRange(start, end); return viewer.nextFrame(); },
    tracks: () => viewer.trackInfo(),
    expandAll: (open) => { viewer.expandAll(open); return viewer.nextFrame(); },
    jobVerdict: (name) => viewer.jobVerdict(name),
    sliceAt: (x, y) => viewer.sliceAt(x, y),
    findSlices: (name, pid, tid) => viewer.findSlices(name, pid, tid),
    timeToX: (t) => viewer.timeToX(t),
    xToTime: (x) => viewer.xToTime(x),
    canvasRect: () => { const r = viewer.canvas.getBoundingClientRect(); return { x: r.x, y: r.y, width: r.width, height: r.height }; },
    setFilter: (v) => { viewer.setFilter(v); return viewer.nextFrame(); },
    stats: () => Object.assign({}, viewer.stats),
    live: () => ({ available: viewer.live.available, enabled: viewer.live.enabled, paused: viewer.live.paused, polls: viewer.live.polls, lastUrl: viewer.live.lastUrl, details: viewer.live.details || 0 }),
    loadUrl: (url) => viewer.loadUrl(url),
    axisLabels: () => viewer.ticks().filter((t) => t.x >= LABEL_W).map((t) => t.label),
    pixel: (x, y) => {
      const d = viewer.dpr;
      viewer.render();
      const p = viewer.ctx.getImageData(Math.round(x * d), Math.round(y * d), 1, 1).data;
      return '#' + [p[0], p[1], p[2]].map((v) => v.toString(16).padStart(2, '0')).join('');
    },
    renderNow: () => { const t = performance.now(); viewer.render(); return performance.now() - t; },
    usesWorker: () => !!viewer.source.worker,
  };
  window.ringwatchViewer = hook;
  const tuning = new TuningPanel(document.getElementById('tuning'));
  hook.tuning = () => ({ open: tuning.open, job: tuning.job, state: tuning.session && tuning.session.state, samples: tuning.session && Array.isArray(tuning.session.samples) ? tuning.session.samples.length : 0, polls: tuning.polls });

  const fileInput = document.getElementById('file');
  document.getElementById('open').addEventListener('click', () => fileInput.click());
  fileInput.addEventListener('change', () => { if (fileInput.files && fileInput.files[0]) viewer.loadFile(fileInput.files[0]); fileInput.value = ''; });
  document.getElementById('fit').addEventListener('click', () => { viewer.pauseLive(); viewer.fit(); });
  viewer.selector.addEventListener('change', () => viewer.setFilter(viewer.selector.value));
  viewer.liveBtn.addEventListener('click', () => { if (viewer.live.enabled && !viewer.live.paused) viewer.pauseLive(); else viewer.resumeLive(); });
  const drop = document.getElementById('drop');
  let depth = 0;
  window.addEventListener('dragenter', (e) => { e.preventDefault(); depth++; drop.hidden = false; });
  window.addEventListener('dragleave', () => { if (--depth <= 0) { depth = 0; drop.hidden = true; } });
  window.addEventListener('dragover', (e) => e.preventDefault());
  window.addEventListener('drop', (e) => {
    e.preventDefault();
    depth = 0;
    drop.hidden = true;
    const f = e.dataTransfer && e.dataTransfer.files && e.dataTransfer.files[0];
    if (f) viewer.loadFile(f);
  });

  const params = new URLSearchParams(location.search);
  const trace = params.get('trace');
  if (trace) {
    await viewer.loadUrl(trace);
  } else if (location.protocol.startsWith('http') && await viewer.detectAgent()) {
    const w = Number(params.get('window'));
    if (w > 0) viewer.live.windowUs = w * 1e6;
    viewer.refreshSelector();
    viewer.startLive();
    tuning.enable();
  } else {
    viewer.startupDone = true;
    viewer.invalidate();
    viewer.wakeReady();
  }
}

if (typeof document !== 'undefined') {
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', main);
  else main();
}
