/* The run dashboard (authorizer/dashboard.py): plain ES2017, no framework, nothing loaded from
 * elsewhere. It polls the JSON API under /v1/monitor (and /v1/run for admissions) and redraws in
 * place; the page is never reloaded. Every value from the API is hostile input (a peer id is
 * whatever a node announced): it reaches the page only as textContent or an encoded URL part,
 * never as markup. Charts are small SVG line charts drawn here. */
'use strict';

(function () {
  const POLL_MS = 2000;
  const RUN_POLL_MS = 10000;
  const MAX_POINTS = 3000;
  const PROGRESS_LIMIT = 500;
  const SVG_NS = 'http://www.w3.org/2000/svg';
  const PHASES = ['active', 'weight_sync', 'optimizer_sync', 'leaving'];
  const ROUND_STATUSES = ['complete', 'partial', 'failed', 'skipped'];

  // Everything lives under whatever prefix a reverse proxy put before /dashboard.
  const BASE = location.pathname.slice(0, Math.max(0, location.pathname.indexOf('/dashboard')));
  const NODE_PREFIX = '/dashboard/node/';

  const state = {
    refreshes: 0,
    progress: [],
    progressSince: null,
    nodes: null,
    runFetchedAt: 0,
    lastOkAt: null,
    failingSince: null,
  };
  window.agoraDashboard = { loadedAt: Date.now(), state: state };

  // ---- the API ----

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function api(path) {
    let response;
    try {
      response = await fetch(BASE + path, { headers: { Accept: 'application/json' }, cache: 'no-store' });
    } catch (exc) {
      throw new ApiError(0, 'unreachable', 'the authorizer is unreachable');
    }
    let body = null;
    try {
      body = await response.json();
    } catch (exc) {
      throw new ApiError(response.status, 'bad_response', 'the authorizer answered ' + response.status + ' without JSON');
    }
    if (!response.ok) {
      const error = body && body.error ? body.error : {};
      throw new ApiError(response.status, String(error.code || 'http_' + response.status),
        String(error.message || 'the authorizer answered ' + response.status));
    }
    return body;
  }

  // ---- formatting ----

  function isNum(v) { return typeof v === 'number' && isFinite(v); }
  function reached(n) {
    // a worker behind NAT announces only addresses through the run's relays
    if (n.relayed === true) { return 'via relay'; }
    return n.relayed === false ? 'direct' : '–';
  }
  function fmtInt(v) { return isNum(v) ? Math.round(v).toLocaleString('en-US') : '–'; }
  function fmtFixed(v, digits) { return isNum(v) ? v.toFixed(digits) : '–'; }
  function fmtRate(v) {
    if (!isNum(v)) return '–';
    return v >= 100 ? Math.round(v).toLocaleString('en-US') : v.toFixed(v >= 10 ? 1 : 2);
  }
  function fmtPercent(v) { return isNum(v) ? Math.round(v * 100) + '%' : '–'; }
  function pad2(n) { return (n < 10 ? '0' : '') + n; }
  function fmtClock(unixS) {
    if (!isNum(unixS)) return '–';
    const d = new Date(unixS * 1000);
    return pad2(d.getHours()) + ':' + pad2(d.getMinutes()) + ':' + pad2(d.getSeconds());
  }
  function fmtAgo(unixS) {
    if (!isNum(unixS)) return '–';
    const s = Math.max(0, Date.now() / 1000 - unixS);
    if (s < 90) return Math.round(s) + ' s ago';
    if (s < 5400) return Math.round(s / 60) + ' min ago';
    if (s < 172800) return Math.round(s / 3600) + ' h ago';
    return Math.round(s / 86400) + ' d ago';
  }
  function fmtBytes(v) {
    if (!isNum(v)) return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return v.toFixed(i === 0 ? 0 : 1) + ' ' + units[i];
  }
  function shortTick(v) {
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + 'G';
    if (a >= 1e6) return (v / 1e6).toFixed(1) + 'M';
    if (a >= 1e4) return (v / 1e3).toFixed(0) + 'k';
    if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
    if (a >= 1) return String(parseFloat(v.toFixed(2)));
    return String(parseFloat(v.toPrecision(2)));
  }

  // ---- DOM helpers (text only, never markup) ----

  function $(id) { return document.getElementById(id); }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function setText(id, text) {
    const node = $(id);
    if (node && node.textContent !== text) node.textContent = text;
  }
  function cell(spec) {
    const td = document.createElement('td');
    if (spec === null || typeof spec !== 'object') {
      td.textContent = spec === null || spec === undefined ? '–' : String(spec);
      return td;
    }
    if (spec.cls) td.className = spec.cls;
    if (spec.href) {
      const a = document.createElement('a');
      a.href = spec.href;
      a.textContent = spec.text;
      td.appendChild(a);
    } else {
      td.textContent = spec.text;
    }
    if (spec.title) td.title = spec.title;
    return td;
  }
  function fillTable(tableId, rows, emptyText) {
    const body = $(tableId).tBodies[0];
    const fresh = document.createDocumentFragment();
    if (!rows.length) {
      const tr = document.createElement('tr');
      const td = cell({ text: emptyText, cls: 'muted' });
      td.colSpan = $(tableId).tHead.rows[0].cells.length;
      tr.appendChild(td);
      fresh.appendChild(tr);
    }
    rows.forEach(function (r) {
      const tr = document.createElement('tr');
      if (r.cls) tr.className = r.cls;
      if (r.key !== undefined) tr.dataset.key = r.key;
      r.cells.forEach(function (c) { tr.appendChild(cell(c)); });
      fresh.appendChild(tr);
    });
    clear(body);
    body.appendChild(fresh);
  }
  function knownClass(prefix, value, known) { return known.indexOf(value) >= 0 ? prefix + value : ''; }
  function nodeHref(peerId) { return BASE + NODE_PREFIX + encodeURIComponent(peerId); }

  function showBanner(text, isError) {
    const banner = $('banner');
    if (!text) { banner.hidden = true; return; }
    banner.textContent = text;
    banner.className = isError ? 'banner error' : 'banner';
    banner.hidden = false;
  }

  // ---- charts: SVG line charts, time on x ----

  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    Object.keys(attrs).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* series: [{points: [[t, v], ...]}] (t in unix seconds, oldest first). The svg gets
   * data-points (points drawn) so tests and people can tell an empty chart from a drawn one. */
  function drawChart(svg, series, emptyText) {
    const width = Math.max(200, Math.round(svg.clientWidth || 600));
    const height = Math.max(120, Math.round(svg.clientHeight || 200));
    const left = 48, right = 10, top = 10, bottom = 22;
    svg.setAttribute('viewBox', '0 0 ' + width + ' ' + height);
    clear(svg);
    const all = [];
    series.forEach(function (s) { s.points.forEach(function (p) { if (isNum(p[0]) && isNum(p[1])) all.push(p); }); });
    const bandPoints = [];  // [t, lo, hi]: drawn under its series, and kept inside the axes
    series.forEach(function (s) {
      (s.band || []).forEach(function (b) { if (isNum(b[0]) && isNum(b[1]) && isNum(b[2])) bandPoints.push(b); });
    });
    svg.dataset.points = String(all.length);
    if (!all.length) {
      svg.appendChild(svgEl('text', { x: width / 2, y: height / 2, 'text-anchor': 'middle', class: 'empty' },
        emptyText || 'no data yet'));
      return;
    }
    let t0 = Infinity, t1 = -Infinity, v0 = Infinity, v1 = -Infinity;
    all.forEach(function (p) {
      t0 = Math.min(t0, p[0]); t1 = Math.max(t1, p[0]);
      v0 = Math.min(v0, p[1]); v1 = Math.max(v1, p[1]);
    });
    bandPoints.forEach(function (b) { v0 = Math.min(v0, b[1]); v1 = Math.max(v1, b[2]); });
    if (t1 - t0 < 1) { t0 -= 1; t1 += 1; }
    if (v1 - v0 < 1e-9) { const m = Math.abs(v0) * 0.1 || 1; v0 -= m; v1 += m; }
    if (v0 < 0 && all.every(function (p) { return p[1] >= 0; })) v0 = 0;  // counts never go below zero
    const ticks = niceTicks(v0, v1, 4);
    v0 = ticks[0]; v1 = ticks[ticks.length - 1];
    const x = function (t) { return left + (t - t0) / (t1 - t0) * (width - left - right); };
    const y = function (v) { return top + (1 - (v - v0) / (v1 - v0)) * (height - top - bottom); };

    svg.appendChild(svgEl('line', { x1: left, y1: top, x2: left, y2: height - bottom, class: 'axis' }));
    svg.appendChild(svgEl('line', { x1: left, y1: height - bottom, x2: width - right, y2: height - bottom, class: 'axis' }));
    ticks.forEach(function (v) {
      svg.appendChild(svgEl('line', { x1: left - 3, y1: y(v), x2: width - right, y2: y(v), class: 'axis' }));
      svg.appendChild(svgEl('text', { x: left - 5, y: y(v) + 3, 'text-anchor': 'end', class: 'tick' }, shortTick(v)));
    });
    [t0, (t0 + t1) / 2, t1].forEach(function (t, i) {
      const anchor = i === 0 ? 'start' : i === 2 ? 'end' : 'middle';
      svg.appendChild(svgEl('text', { x: x(t), y: height - 6, 'text-anchor': anchor, class: 'tick' }, fmtClock(t)));
    });
    series.forEach(function (s, i) {
      const band = (s.band || []).filter(function (b) { return isNum(b[0]) && isNum(b[1]) && isNum(b[2]); });
      if (band.length) {
        const upper = band.map(function (b, j) { return (j ? 'L' : 'M') + x(b[0]).toFixed(1) + ' ' + y(b[2]).toFixed(1); });
        const lower = band.slice().reverse().map(function (b) { return 'L' + x(b[0]).toFixed(1) + ' ' + y(b[1]).toFixed(1); });
        svg.appendChild(svgEl('path', { d: upper.concat(lower).join(' ') + ' Z', class: 'band band' + (i % 2) }));
      }
    });
    series.forEach(function (s, i) {
      const pts = s.points.filter(function (p) { return isNum(p[0]) && isNum(p[1]); });
      if (!pts.length) return;
      const d = pts.map(function (p, j) { return (j ? 'L' : 'M') + x(p[0]).toFixed(1) + ' ' + y(p[1]).toFixed(1); });
      svg.appendChild(svgEl('path', { d: d.join(' '), class: 'line series' + (i % 2) }));
      const last = pts[pts.length - 1];
      svg.appendChild(svgEl('circle', { cx: x(last[0]), cy: y(last[1]), r: 3, class: 'dot' + (i % 2) }));
    });
    if (series.length > 1) {  // a legend, right-aligned at the top
      let at = width - right;
      series.slice().reverse().forEach(function (s, k) {
        const i = series.length - 1 - k;
        const label = svgEl('text', { x: at, y: top + 8, 'text-anchor': 'end', class: 'tick' }, s.label || '');
        svg.appendChild(label);
        at -= 6 * String(s.label || '').length + 8;
        svg.appendChild(svgEl('circle', { cx: at + 4, cy: top + 5, r: 3, class: 'dot' + (i % 2) }));
        at -= 12;
      });
    }
  }

  /* Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi] in about `count` steps. */
  function niceTicks(lo, hi, count) {
    const raw = (hi - lo) / Math.max(1, count - 1);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(function (m) { return m * power; }).filter(function (st) { return st >= raw; })[0];
    const start = Math.floor(lo / step) * step;
    const ticks = [];
    for (let v = start; v < hi + step * 0.5 && ticks.length < 12; v += step) ticks.push(Math.round(v / step) * step);
    if (ticks[ticks.length - 1] < hi) ticks.push(ticks[ticks.length - 1] + step);
    return ticks;
  }

  // ---- connection status ----

  function markOk(updatedAt, intervalS) {
    state.lastOkAt = Date.now() / 1000;
    state.failingSince = null;
    state.refreshes += 1;
    document.body.dataset.refreshes = String(state.refreshes);
    const node = $('connection');
    let text = 'updated ' + fmtClock(state.lastOkAt);
    let cls = 'connection ok';
    if (isNum(updatedAt)) {
      text += ' · monitor snapshot ' + fmtClock(updatedAt);
      if (state.lastOkAt - updatedAt > Math.max(3 * (intervalS || 10), 30)) {
        text += ' (' + fmtAgo(updatedAt) + ': the monitor is behind)';
        cls = 'connection stale';
      }
    } else {
      text += ' · waiting for the monitor\'s first snapshot';
      cls = 'connection stale';
    }
    node.textContent = text;
    node.className = cls;
  }

  function markFailed(error) {
    const now = Date.now() / 1000;
    if (state.failingSince === null) state.failingSince = now;
    const node = $('connection');
    node.className = 'connection down';
    if (error.code === 'monitor_off') {
      node.textContent = 'monitor off';
      showBanner('The health monitor is off on this authorizer (started with --no-monitor), so there is no run ' +
        'history to show. The operator can run it here or as agora-node --role monitor.', true);
      return;
    }
    const since = fmtClock(state.failingSince);
    const last = state.lastOkAt ? '; showing data from ' + fmtClock(state.lastOkAt) : '';
    node.textContent = (error.code === 'unreachable' ? 'authorizer unreachable' : 'error: ' + error.message) +
      ' since ' + since + ', retrying' + last;
    showBanner(error.code === 'unreachable'
      ? 'Cannot reach the authorizer since ' + since + '; retrying every few seconds.'
      : 'The API answered with an error: ' + error.message, true);
  }

  // ---- the overview ----

  function renderOverview(o) {
    setText('run-id', 'run ' + String(o.run_id));
    document.title = 'agora run ' + String(o.run_id);
    const t = o.training || {};
    setText('total-loss', fmtFixed(t.loss, 3));
    setText('total-eval-loss', fmtFixed(t.eval_loss, 3));
    setText('total-eval-step', isNum(t.eval_step) ? 'at step ' + fmtInt(t.eval_step) : '');
    setText('total-eval-stderr', isNum(t.eval_stderr) && isNum(t.eval_loss) ? '± ' + fmtFixed(t.eval_stderr, 3) : '');
    setText('total-tps', fmtRate(t.tokens_per_s));
    setText('total-samples', fmtInt(t.samples));
    setText('total-tokens', fmtInt(t.tokens));
    setText('total-trainers', fmtInt(t.trainers));
    const n = o.nodes || {};
    setText('total-nodes', fmtInt(n.present) + ' / ' + fmtInt(n.gone));
    setText('total-admissions', fmtInt(n.admitted) + ' / ' + fmtInt(n.queued));

    const rows = (o.stages || []).map(function (s) {
      const p = s.phases || {};
      const a = s.averaging || {};
      const short = isNum(s.replicas) && isNum(s.min_replicas) && s.replicas < s.min_replicas;
      return {
        key: String(s.stage),
        cls: short ? 'short' : '',
        cells: [String(s.stage), { text: fmtInt(s.replicas) + ' / ' + fmtInt(s.min_replicas), cls: short ? 'status-failed' : '' },
          fmtInt(p.active), fmtInt(p.weight_sync), fmtInt(p.optimizer_sync), fmtInt(p.leaving),
          fmtInt(s.step), fmtRate(s.throughput),
          (a.method === 'sparseloco' ? 'sparseloco: ' : '') + [a.complete, a.partial, a.failed, a.skipped].map(fmtInt).join(' / '),
          fmtPercent(a.success_rate), fmtAgo(a.last_round_at)],
      };
    });
    fillTable('stages-table', rows, 'no stages');

    const alerts = $('alerts');
    const items = document.createDocumentFragment();
    (o.alerts || []).forEach(function (al) {
      const li = document.createElement('li');
      li.className = al.severity === 'critical' ? 'critical' : 'warning';
      li.textContent = String(al.severity) + ' · ' + String(al.kind) + ' · ' + String(al.subject) + ': ' +
        String(al.message) + ' (since ' + fmtClock(al.first_at) + ')';
      items.appendChild(li);
    });
    if (!(o.alerts || []).length) {
      const li = document.createElement('li');
      li.className = 'none';
      li.textContent = 'no active alerts';
      items.appendChild(li);
    }
    clear(alerts);
    alerts.appendChild(items);
  }

  function renderRun(run) {
    const rows = (run.stages || []).map(function (s) {
      return { cells: ['stage ' + s.index, fmtInt(s.admitted), fmtInt(s.queued), fmtInt(s.target), fmtInt(s.capacity)] };
    });
    if (run.trainers) {
      rows.push({ cells: ['trainers', fmtInt(run.trainers.admitted), fmtInt(run.trainers.queued), '–',
        fmtInt(run.trainers.capacity)] });
    }
    fillTable('admissions-table', rows, 'no admissions yet');
  }

  function renderNodes(nodes) {
    const showGone = $('show-gone').checked;
    const order = { present: 0, gone: 1 };
    const shown = nodes.filter(function (n) { return showGone || n.state !== 'gone'; }).slice().sort(function (a, b) {
      return (order[a.state] - order[b.state]) || String(a.role).localeCompare(String(b.role)) ||
        ((a.stage === null ? 1e9 : a.stage) - (b.stage === null ? 1e9 : b.stage)) ||
        String(a.peer_id).localeCompare(String(b.peer_id));
    });
    const rows = shown.map(function (n) {
      return {
        key: String(n.peer_id),
        cls: n.state === 'gone' ? 'gone' : '',
        cells: [{ text: String(n.peer_id), href: nodeHref(String(n.peer_id)), cls: 'peer' }, String(n.role),
          n.stage === null || n.stage === undefined ? '–' : String(n.stage),
          { text: String(n.state), cls: knownClass('state-', n.state, ['present', 'gone']) },
          { text: n.phase === null || n.phase === undefined ? '–' : String(n.phase), cls: knownClass('phase-', n.phase, PHASES) },
          fmtInt(n.step), fmtRate(n.throughput), reached(n), n.admitted ? 'yes' : 'no', fmtAgo(n.last_seen)],
      };
    });
    const hidden = nodes.length - shown.length;
    fillTable('nodes-table', rows, hidden ? hidden + ' node(s) gone; tick the box to show them' : 'no nodes seen yet');
  }

  async function pollProgress() {
    // Incremental: only points after the last one we hold; a full page means more are waiting.
    for (let pages = 0; pages < 10; pages += 1) {
      let path = '/v1/monitor/progress?limit=' + PROGRESS_LIMIT;
      if (state.progressSince !== null) path += '&since=' + encodeURIComponent(String(state.progressSince));
      const body = await api(path);
      const points = (body.points || []).filter(function (p) {
        return isNum(p.t) && (state.progressSince === null || p.t > state.progressSince);
      });
      if (points.length) {
        state.progress = state.progress.concat(points).slice(-MAX_POINTS);
        state.progressSince = points[points.length - 1].t;
      }
      if ((body.points || []).length < PROGRESS_LIMIT || !points.length) break;
    }
    drawCharts();
  }

  function drawCharts() {
    const loss = state.progress.filter(function (p) { return isNum(p.loss); }).map(function (p) { return [p.t, p.loss]; });
    // The latest held-out loss at each snapshot: flat between two evaluations.
    const heldOut = state.progress.filter(function (p) { return isNum(p.eval_loss); }).map(function (p) { return [p.t, p.eval_loss]; });
    // Two standard errors either side: where about 95% of draws of as many held-out samples would put it.
    const heldOutBand = state.progress.filter(function (p) { return isNum(p.eval_loss) && isNum(p.eval_stderr); })
      .map(function (p) { return [p.t, p.eval_loss - 2 * p.eval_stderr, p.eval_loss + 2 * p.eval_stderr]; });
    const tps = state.progress.filter(function (p) { return isNum(p.tokens_per_s); }).map(function (p) { return [p.t, p.tokens_per_s]; });
    drawChart($('loss-chart'), heldOut.length
      ? [{ points: loss, label: 'training' }, { points: heldOut, band: heldOutBand, label: 'held-out' }]
      : [{ points: loss }], 'no loss reported yet');
    drawChart($('tps-chart'), [{ points: tps }], 'no throughput yet');
  }

  async function pollOverview() {
    const overview = await api('/v1/monitor/overview');
    const results = await Promise.all([api('/v1/monitor/nodes'), pollProgress()]);
    state.nodes = results[0].nodes || [];
    if (Date.now() - state.runFetchedAt > RUN_POLL_MS) {
      try {
        renderRun(await api('/v1/run'));
        state.runFetchedAt = Date.now();
      } catch (exc) {
        fillTable('admissions-table', [], 'admissions unavailable: ' + exc.message);
      }
    }
    renderOverview(overview);
    renderNodes(state.nodes);
    showBanner(null);
    markOk(overview.updated_at, overview.interval_s);
  }

  // ---- find my node ----

  async function findNode(event) {
    event.preventDefault();
    const wanted = $('find-peer').value.trim();
    const out = $('find-result');
    if (!wanted) { out.textContent = 'paste your node\'s peer id (its readiness line says peer=...)'; return; }
    try {
      if (state.nodes === null) state.nodes = (await api('/v1/monitor/nodes')).nodes || [];
    } catch (exc) {
      out.textContent = 'cannot look it up now: ' + exc.message;
      return;
    }
    const ids = state.nodes.map(function (n) { return String(n.peer_id); });
    let match = ids.indexOf(wanted) >= 0 ? wanted : null;
    if (match === null && wanted.length >= 6) {  // a pasted tail or head of the id
      const partial = ids.filter(function (id) { return id.indexOf(wanted) >= 0; });
      if (partial.length === 1) match = partial[0];
      else if (partial.length > 1) { out.textContent = partial.length + ' nodes match; paste more of the id'; return; }
    }
    if (match === null) {
      out.textContent = 'the monitor has not seen that peer id; a node shows up here within a minute or so ' +
        'of being admitted and announcing itself';
      return;
    }
    location.assign(nodeHref(match));
  }

  // ---- a node's page ----

  function renderNode(body) {
    const n = body.node;
    const history = body.history || [];
    setText('node-peer-id', String(n.peer_id));
    document.title = 'agora node ' + String(n.peer_id).slice(-8);
    setText('node-role', String(n.role));
    setText('node-stage', n.stage === null || n.stage === undefined ? '–' : String(n.stage));
    setText('node-state', String(n.state));
    setText('node-phase', n.phase === null || n.phase === undefined ? '–' : String(n.phase));
    setText('node-step', fmtInt(n.step));
    setText('node-throughput', fmtRate(n.throughput));
    setText('node-admitted', n.admitted ? 'yes' : 'no');
    setText('node-reached', reached(n) + (isNum(n.relayed_bytes) && n.relayed_bytes > 0
      ? ' (' + fmtBytes(n.relayed_bytes) + ' through relays)' : ''));
    setText('node-seen', fmtClock(n.first_seen) + ' / ' + fmtClock(n.last_seen) + ' (' + fmtAgo(n.last_seen) + ')');
    let rss = null;
    for (let i = history.length - 1; i >= 0; i -= 1) { if (isNum(history[i].rss_bytes)) { rss = history[i].rss_bytes; break; } }
    setText('node-rss', fmtBytes(rss));

    const pts = function (key, scale) {
      return history.filter(function (h) { return isNum(h[key]); }).map(function (h) { return [h.t, h[key] / (scale || 1)]; });
    };
    drawChart($('node-throughput-chart'), [{ points: pts('throughput') }], 'no throughput reported');
    drawChart($('node-step-chart'), [{ points: pts('step') }], 'no steps reported');
    drawChart($('node-rss-chart'), [{ points: pts('rss_bytes', 1048576) }], 'no memory reported');
    drawChart($('node-rounds-chart'), [{ points: pts('rounds_complete'), label: 'complete' },
      { points: pts('rounds_failed'), label: 'failed' }],
      'no averaging rounds reported');

    const phases = [];
    let previous;
    history.forEach(function (h) {
      if (h.phase !== previous) { phases.push({ cells: [fmtClock(h.t), h.phase === null ? '–' : String(h.phase)] }); previous = h.phase; }
    });
    fillTable('node-phases-table', phases.reverse().slice(0, 30), 'no phases reported (trainers have none)');

    const rounds = (body.rounds || []).slice().sort(function (a, b) { return (b.finished_at || 0) - (a.finished_at || 0); });
    fillTable('node-rounds-table', rounds.map(function (r) {
      return {
        cells: [fmtClock(r.finished_at), String(r.kind), fmtInt(r.round),
          { text: String(r.status), cls: knownClass('status-', r.status, ROUND_STATUSES) },
          fmtInt(r.group_size) + ' / ' + fmtInt(r.expected_group_size), fmtPercent(r.averaging_success),
          isNum(r.duration_s) ? r.duration_s.toFixed(1) + ' s' : '–', r.failure_reason ? String(r.failure_reason) : ''],
      };
    }), 'no averaging rounds reported');
  }

  function nodePeerId() {
    const path = location.pathname;
    const at = path.indexOf(NODE_PREFIX);
    if (at < 0) return null;
    try {
      return decodeURIComponent(path.slice(at + NODE_PREFIX.length));
    } catch (exc) {
      return path.slice(at + NODE_PREFIX.length);
    }
  }

  async function pollNode(peerId) {
    const results = await Promise.all([api('/v1/monitor/overview'), api('/v1/monitor/nodes/' + encodeURIComponent(peerId))
      .catch(function (exc) { if (exc.status === 404) return null; throw exc; })]);
    const overview = results[0];
    setText('run-id', 'run ' + String(overview.run_id));
    if (results[1] === null) {
      setText('node-peer-id', peerId);
      showBanner('The monitor has not seen a node with this peer id. A node shows up within a minute or so of ' +
        'being admitted and announcing itself; this page keeps looking.', false);
    } else {
      renderNode(results[1]);
      showBanner(null);
    }
    markOk(overview.updated_at, overview.interval_s);
  }

  // ---- the loop ----

  function loop(poll) {
    const tick = async function () {
      try {
        await poll();
      } catch (exc) {
        if (!(exc instanceof ApiError)) {  // a bug of ours: say so in the console, keep polling
          console.error(exc);
          exc = new ApiError(0, 'bug', 'the dashboard failed to draw (' + exc.message + '); reload the page');
        }
        markFailed(exc);
      }
      setTimeout(tick, POLL_MS);
    };
    tick();
  }

  function start() {
    const peerId = nodePeerId();
    if (peerId !== null) {
      $('node-view').hidden = false;
      setText('node-peer-id', peerId);
      loop(function () { return pollNode(peerId); });
      return;
    }
    $('overview-view').hidden = false;
    $('find-form').addEventListener('submit', findNode);
    $('show-gone').addEventListener('change', function () { if (state.nodes) renderNodes(state.nodes); });
    window.addEventListener('resize', drawCharts);
    loop(pollOverview);
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
}());
