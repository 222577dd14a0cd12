"""The playground `zlm serve` answers at /: one self-contained page (inline CSS and JS, no
network but this server's own API, no external fonts).

Sample: a prime box, temperature, top-p, length and seed; the text streams in from
POST /v1/sample as it is made (Stop aborts the request, which frees its slot). Score:
pasted text goes to POST /v1/score and comes back as a heat map coloured the way
`zlm score --html` colours it - the same bins and colours (the `Palette` the command
hands over from zlm/cli/heatmap.py); hovering a character shows its bits and the model's
top-k. With `zlm serve --token` the page asks for the token and sends it as a bearer token.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Palette:
    """Bits per character -> colour: bin k holds bits below edges[k] (the last bin is open)."""

    edges: tuple[float, ...]
    colours: tuple[str, ...]  # one per bin: len(edges) + 1
    ink: tuple[str, ...]  # the text colour on each
    context: str  # a character that is context only (no bits)
    labels: tuple[str, ...]  # the legend's, one per bin


_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
header { display: flex; gap: 1em; align-items: baseline; padding: 0.7em 1.5em; background: #263238; color: #eee; }
header h1 { font-size: 1.2em; margin: 0; } header .meta { color: #b0bec5; }
main { display: grid; grid-template-columns: 1fr 1fr; gap: 1.2em; padding: 1em 1.5em; }
@media (max-width: 900px) { main { grid-template-columns: 1fr; } }
section { background: #fff; border: 1px solid #ddd; border-radius: 8px; padding: 0.8em 1em; min-width: 0; }
h2 { font-size: 1.05em; margin: 0 0 0.5em; }
textarea { width: 100%; box-sizing: border-box; min-height: 5em; font: 14px/1.4 ui-monospace, Menlo, Consolas, monospace; }
.controls { display: flex; flex-wrap: wrap; gap: 0.6em; align-items: center; margin: 0.5em 0; }
.controls input[type=number] { width: 5.5em; }
button { padding: 0.3em 1em; }
#output, #heatmap { font: 14px/1.6 ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap;
  word-break: break-all; border: 1px solid #ddd; border-radius: 6px; padding: 0.6em; min-height: 6em;
  margin: 0; max-height: 32em; overflow: auto; }
#out-prime { color: #888; }
#heatmap span { border-radius: 2px; cursor: default; }
#heatmap span.nl::before { content: "\\21b5"; opacity: 0.45; }
.legend span { display: inline-block; padding: 0 0.5em; margin-right: 0.2em; border-radius: 3px; font-size: 12px; }
.meta { color: #555; margin: 0.4em 0; min-height: 1.4em; }
.error { color: #b71c1c; }
#tip { position: absolute; display: none; background: #fff; border: 1px solid #888; border-radius: 6px;
  padding: 0.4em 0.6em; box-shadow: 0 2px 8px rgba(0,0,0,.25); pointer-events: none;
  font: 13px/1.4 ui-monospace, Menlo, Consolas, monospace; }
#tip table { border-collapse: collapse; } #tip td { padding: 0 0.5em 0 0; }
"""

_JS = """
const $ = id => document.getElementById(id);
function headers() {
  const h = {'Content-Type': 'application/json'};
  if ($('token').value) h['Authorization'] = 'Bearer ' + $('token').value;
  return h;
}
function status(id, text, bad) { $(id).textContent = text; $(id).classList.toggle('error', !!bad); }
async function problem(r) {
  try { return (await r.json()).error.message; } catch (e) { return r.status + ' ' + r.statusText; }
}
let ctrl = null;
async function sample() {
  const body = {prime: $('prime').value, temperature: Number($('temperature').value),
                top_p: Number($('top-p').value), length: Number($('length').value), stream: true};
  if ($('seed').value !== '') body.seed = Number($('seed').value);
  $('out-prime').textContent = body.prime; $('out-text').textContent = '';
  delete $('output').dataset.done;
  ctrl = new AbortController(); $('sample').disabled = true; $('stop').disabled = false;
  status('sample-status', 'sampling...');
  const t0 = performance.now(); let n = 0, seed = '';
  try {
    const r = await fetch('/v1/sample', {method: 'POST', headers: headers(), body: JSON.stringify(body),
                                         signal: ctrl.signal});
    if (!r.ok) { status('sample-status', 'error: ' + await problem(r), true); return; }
    seed = r.headers.get('X-Zlm-Seed');
    const reader = r.body.getReader(), dec = new TextDecoder();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      const piece = dec.decode(value, {stream: true});
      $('out-text').append(piece); n += [...piece].length;
      status('sample-status', n + ' characters...');
    }
    const s = (performance.now() - t0) / 1000;
    status('sample-status', n + ' characters in ' + s.toFixed(2) + ' s (' + Math.round(n / s) +
           ' characters/s), seed ' + seed);
    $('output').dataset.done = '1';
  } catch (e) {
    status('sample-status', e.name === 'AbortError' ? 'stopped after ' + n + ' characters' : 'error: ' + e, e.name !== 'AbortError');
  } finally { $('sample').disabled = false; $('stop').disabled = true; }
}
function bin(bits) {
  if (bits === null) return -1;
  let k = 0;
  while (k < PALETTE.edges.length && bits >= PALETTE.edges[k]) k++;
  return k;
}
function showTip(el, c) {
  const tip = $('tip'); tip.textContent = '';
  const head = document.createElement('div');
  const ch = c.char === '\\n' ? '\\u21b5' : c.char;
  head.textContent = JSON.stringify(ch) + ' ' + (c.bits === null ? 'context (not predicted)' : c.bits.toFixed(3) + ' bits');
  tip.append(head);
  if (c.top.length) {
    const t = document.createElement('table');
    for (const x of c.top) {
      const row = t.insertRow(); row.insertCell().textContent = JSON.stringify(x.token);
      row.insertCell().textContent = (100 * x.p).toFixed(1) + '%';
    }
    const lab = document.createElement('div'); lab.textContent = 'model expected:';
    tip.append(lab, t);
  }
  const r = el.getBoundingClientRect();
  tip.style.left = (window.scrollX + r.left) + 'px'; tip.style.top = (window.scrollY + r.bottom + 4) + 'px';
  tip.style.display = 'block';
}
async function score() {
  const text = $('score-text').value;
  $('score').disabled = true; status('score-status', 'scoring...');
  try {
    const r = await fetch('/v1/score', {method: 'POST', headers: headers(), body: JSON.stringify({text: text})});
    if (!r.ok) { status('score-status', 'error: ' + await problem(r), true); return; }
    const res = await r.json(), map = $('heatmap');
    map.textContent = '';
    for (const c of res.characters) {
      const k = bin(c.bits), span = document.createElement('span');
      span.style.background = k >= 0 ? PALETTE.colours[k] : PALETTE.context;
      span.style.color = k >= 0 ? PALETTE.ink[k] : '#000';
      span.dataset.bits = c.bits === null ? '' : c.bits.toFixed(4);
      if (c.char === '\\n') span.className = 'nl';
      span.textContent = c.char;
      span.addEventListener('mouseenter', () => showTip(span, c));
      span.addEventListener('mouseleave', () => { $('tip').style.display = 'none'; });
      map.append(span);
    }
    const s = res.summary;
    status('score-status', s.bpc.toFixed(4) + ' bits/character over ' + s.characters.toLocaleString() +
           ' characters (' + s.bits.toFixed(1) + ' bits in all)');
  } catch (e) { status('score-status', 'error: ' + e, true); }
  finally { $('score').disabled = false; }
}
async function start() {
  const h = await (await fetch('/healthz')).json();
  $('auth').hidden = !h.auth;
  const r = await fetch('/v1/model', {headers: headers()});
  if (r.ok) {
    const m = await r.json(), mo = m.model;
    $('model').textContent = m.name + ': ' + mo.layers + ' x ' + mo.hidden + ' zoneout LSTM, ' +
      m.tokenizer.kind + ' vocabulary ' + m.tokenizer.vocab_size + ', step ' + m.step +
      (m.best_valid_bpc ? ', valid BPC ' + m.best_valid_bpc.toFixed(3) : '');
  }
}
$('sample').addEventListener('click', sample);
$('stop').addEventListener('click', () => ctrl && ctrl.abort());
$('score').addEventListener('click', score);
$('token').addEventListener('change', start);
start();
"""


def render_page(name: str, palette: Palette) -> str:
    """The whole page as a string."""
    legend = "".join(f'<span style="background:{c};color:{ink}">{html.escape(lab)}</span>'
                     for lab, c, ink in zip(palette.labels, palette.colours, palette.ink, strict=True))
    data = json.dumps({"edges": list(palette.edges), "colours": list(palette.colours),
                       "ink": list(palette.ink), "context": palette.context})
    title = html.escape(name)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>zlm serve: {title}</title><link rel="icon" href="data:,"><style>{_CSS}</style></head><body>
<header><h1>zlm serve</h1><span id="model" class="meta">{title}</span>
<span id="auth" hidden><label>token <input id="token" type="password" autocomplete="off"></label></span></header>
<main>
<section id="sample-view"><h2>Sample</h2>
<textarea id="prime" placeholder="Prime: the text to continue (empty: start after a newline)"></textarea>
<div class="controls">
<label>temperature <input id="temperature" type="number" min="0" step="0.05" value="0.8"></label>
<label>top-p <input id="top-p" type="number" min="0.01" max="1" step="0.01" value="1"></label>
<label>length <input id="length" type="number" min="1" value="500"></label>
<label>seed <input id="seed" type="number" min="0" placeholder="random"></label>
<button id="sample">Sample</button><button id="stop" disabled>Stop</button></div>
<pre id="output"><span id="out-prime"></span><span id="out-text"></span></pre>
<div id="sample-status" class="meta"></div></section>
<section id="score-view"><h2>Score</h2>
<textarea id="score-text" placeholder="Paste text: each character is coloured by the bits the model spends on it"></textarea>
<div class="controls"><button id="score">Score</button>
<span class="legend">bits per character: {legend}</span></div>
<div id="heatmap"></div>
<div id="score-status" class="meta"></div></section>
</main><div id="tip"></div>
<script>const PALETTE = {data};{_JS}</script>
</body></html>
"""
