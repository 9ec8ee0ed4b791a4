/*
 * The parser's Worker (started by source.js as a module Worker): answers the
 * page's messages — parse bytes, fetch and parse a URL, look up one slice's
 * args — with the parser of parse.js, transferring the typed arrays.
 *
 * It must never hold the page's state: each message is answered on its own,
 * by id, and an error is answered as `{ok: false, error}`, never thrown.
 */
import { args, fetchParse, parse } from './parse.js';

self.onmessage = async (ev) => {
  const m = ev.data;
  try {
    if (m.type === 'parse') {
      const r = parse(m.input, m.opts);
      self.postMessage({ id: m.id, ok: true, value: r.result }, r.transfer);
    } else if (m.type === 'fetchParse') {
      const r = await fetchParse(m.url, m.label, m.opts);
      self.postMessage({ id: m.id, ok: true, value: r.result }, r.transfer);
    } else if (m.type === 'args') {
      self.postMessage({ id: m.id, ok: true, value: args(m.gen, m.index) });
    }
  } catch (err) {
    self.postMessage({ id: m.id, ok: false, error: String(err && err.message || err) });
  }
};
