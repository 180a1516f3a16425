"""The HTML side of a report: sections of headings, notes, tables and figures, one page.

Everything is inlined (styles, plotly.js once, each figure's data as JSON), so the file opens
with no network. A small script draws every figure and stamps what happened on `<body>`
(`data-figures`, `data-drawn`, `data-errors`; `data-open-ms`, from the start of navigation
until the first screen's figures are drawn, and `data-all-ms`, until all are), and each
figure's box gets `data-marks` (the SVG elements its traces drew), so a headless browser (and
a test) can tell that the plots drew; a figure that fails says so in its own box. Figures
below the first screen draw one at a time after it, so a long report opens at once.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Cell", "Page", "Section", "fmt", "plotly_js"]

#: A table cell: text, or (text, css class) for status colours.
Cell = str | tuple[str, str]


def fmt(value: Any, digits: int = 1) -> str:
    """A number for a table: thousands with separators, small values with `digits` decimals."""
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "–"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.2g}"
        return f"{value:.{digits}f}"
    return str(value)


def plotly_js() -> tuple[str, str]:
    """(plotly.js source, its version), from the installed `plotly` package."""
    try:
        import plotly
        from plotly.offline import get_plotlyjs
    except ImportError as exc:
        from infermux.errors import UsageError

        raise UsageError("infermux report draws with plotly, which is not installed: "
                         "pip install 'infermux[report]'") from exc
    return get_plotlyjs(), str(plotly.__version__)


def _json_for_script(data: Any) -> str:
    """JSON safe inside a <script> element."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str, ensure_ascii=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


@dataclass
class Section:
    """One block of the page (a run, the overview, a study's table): HTML parts in order."""

    page: Page
    anchor: str
    parts: list[str] = field(default_factory=list)

    def heading(self, text: str, level: int = 3) -> None:
        """A heading inside the section."""
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def text(self, text: str, css: str = "") -> None:
        """A paragraph (escaped)."""
        cls = f' class="{css}"' if css else ""
        self.parts.append(f"<p{cls}>{html.escape(text)}</p>")

    def note(self, text: str, level: str = "info") -> None:
        """A banner: `info`, `warn` (something did not go as asked) or `bad` (failures)."""
        self.parts.append(f'<div class="banner {level}">{html.escape(text)}</div>')

    def raw(self, markup: str) -> None:
        """Markup built by the caller (already escaped)."""
        self.parts.append(markup)

    def kv(self, pairs: Iterable[tuple[str, Any]]) -> None:
        """A two-column definition table of labels and values."""
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(fmt(v))}</td></tr>"
                       for k, v in pairs if v not in (None, "", [], {}))
        if rows:
            self.parts.append(f'<table class="kv">{rows}</table>')

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[Cell]], *,
              caption: str = "", numeric: Sequence[str] = (), limit: int = 500) -> None:
        """A data table; columns named in `numeric` align right. Rows past `limit` are counted."""
        head = "".join(f'<th class="{"num" if c in numeric else ""}">{html.escape(c)}</th>'
                       for c in columns)
        body, shown, total = [], 0, 0
        num = [c in numeric for c in columns]
        for row in rows:
            total += 1
            if shown >= limit:
                continue
            shown += 1
            cells = []
            for i, cell in enumerate(row):
                text, css = (cell, "") if isinstance(cell, str) else cell
                classes = " ".join(c for c in (css, "num" if i < len(num) and num[i] else "") if c)
                cls = f' class="{classes}"' if classes else ""
                cells.append(f"<td{cls}>{html.escape(text)}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
        more = (f'<p class="dim">{total - shown} more rows not shown (of {total}); '
                "`infermux results export` has them all.</p>") if total > shown else ""
        self.parts.append(f'<div class="scroll"><table class="data">{cap}<thead><tr>{head}</tr>'
                          f'</thead><tbody>{"".join(body)}</tbody></table></div>{more}')

    def figure(self, spec: dict[str, Any] | None) -> None:
        """A plotly figure (`{"data": [...], "layout": {...}}`); None adds nothing."""
        if spec is None:
            return
        fig_id = self.page.add_figure(spec)
        self.parts.append(f'<div class="fig" id="{fig_id}"></div>')

    def details(self, summary: str, data: Any) -> None:
        """Folded raw JSON (configuration, environment)."""
        text = json.dumps(data, indent=1, default=str, sort_keys=True)
        self.parts.append(f"<details><summary>{html.escape(summary)}</summary>"
                          f"<pre>{html.escape(text)}</pre></details>")

    def html(self) -> str:
        """The section's markup."""
        return f'<section id="{self.anchor}">' + "".join(self.parts) + "</section>"


@dataclass
class Page:
    """The whole report: a header, sections, every figure's data and the drawing script."""

    title: str
    subtitle: str = ""
    sections: list[Section] = field(default_factory=list)
    figures: list[dict[str, Any]] = field(default_factory=list)
    toc: list[tuple[str, str]] = field(default_factory=list)

    def section(self, anchor: str, title: str | None = None, *, toc: bool = True) -> Section:
        """A new section, listed in the table of contents under `title`."""
        sec = Section(self, anchor)
        if title is not None:
            sec.parts.append(f"<h2>{html.escape(title)}</h2>")
            if toc:
                self.toc.append((anchor, title))
        self.sections.append(sec)
        return sec

    def add_figure(self, spec: dict[str, Any]) -> str:
        """Register a figure's data; returns the id of the element it draws into."""
        fig_id = f"fig-{len(self.figures) + 1}"
        self.figures.append({"id": fig_id, "data": spec["data"], "layout": spec["layout"]})
        return fig_id

    def render(self, *, footer: str = "") -> str:
        """The self-contained HTML document."""
        js, version = plotly_js()
        toc = "".join(f'<li><a href="#{a}">{html.escape(t)}</a></li>' for a, t in self.toc)
        nav = f"<nav><ol>{toc}</ol></nav>" if len(self.toc) > 1 else ""
        body = "".join(s.html() for s in self.sections)
        return (
            "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(self.title)}</title><style>{_CSS}</style>"
            f"<script>{_WATCH_JS}</script>"
            f"<script>/* plotly.js {html.escape(version)} (MIT) */\n{js}</script></head>"
            f"<body><header><h1>{html.escape(self.title)}</h1>"
            f'<p class="dim">{html.escape(self.subtitle)}</p>'
            '<p id="infermux-status" class="dim"></p></header>'
            f"{nav}<main>{body}</main>"
            f'<footer class="dim">{html.escape(footer)}</footer>'
            f'<script type="application/json" id="infermux-figures">'
            f"{_json_for_script(self.figures)}</script>"
            f"<script>{_DRAW_JS}</script></body></html>\n"
        )


_CSS = """
:root{--fg:#1d2330;--dim:#5b6475;--line:#d9dee7;--bg:#fff;--alt:#f6f8fb;--ok:#1a7f37;
--warn:#9a6700;--bad:#cf222e}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
background:var(--bg);margin:0 auto;max-width:1280px;padding:0 24px 48px}
header{border-bottom:2px solid var(--line);margin-bottom:12px}
h1{font-size:24px;margin:20px 0 4px}h2{font-size:20px;margin:32px 0 8px;
border-bottom:1px solid var(--line);padding-bottom:4px}h3{font-size:16px;margin:20px 0 6px}
.dim{color:var(--dim)}nav ol{columns:3;font-size:13px;margin:8px 0;padding-left:20px}
a{color:#0a58ca;text-decoration:none}a:hover{text-decoration:underline}
.banner{border-left:4px solid #0a58ca;background:#eef4ff;padding:6px 10px;margin:8px 0}
.banner.warn{border-color:var(--warn);background:#fff8e5}
.banner.bad{border-color:var(--bad);background:#ffeef0}
.scroll{overflow-x:auto}
table.data{border-collapse:collapse;margin:6px 0 10px;font-size:13px;
font-variant-numeric:tabular-nums}
table.data caption{text-align:left;color:var(--dim);caption-side:bottom;padding-top:4px}
table.data th,table.data td{border-bottom:1px solid var(--line);padding:3px 8px;
text-align:left;vertical-align:top}
table.data th{background:var(--alt);position:sticky;top:0}
table.data tr:hover td{background:var(--alt)}
.num{text-align:right!important;white-space:nowrap}
table.kv{border-collapse:collapse;font-size:13px;margin:6px 0}
table.kv th{text-align:left;color:var(--dim);font-weight:normal;padding:1px 12px 1px 0}
.ok{color:var(--ok)}.warn{color:var(--warn)}.bad{color:var(--bad);font-weight:600}
.best{font-weight:700}
.fig{width:100%;min-height:340px;margin:6px 0 14px;border:1px solid var(--line);
border-radius:4px}
.fig .fig-error{color:var(--bad);padding:12px}
details{margin:6px 0}summary{cursor:pointer;color:var(--dim)}
pre{background:var(--alt);padding:8px;overflow:auto;max-height:360px;font-size:12px}
.paper{border:1px dashed var(--warn);padding:4px 12px;margin:10px 0;background:#fffdf5}
footer{margin-top:40px;border-top:1px solid var(--line);padding-top:8px;font-size:12px}
"""

# Installed before plotly.js: collects uncaught errors and console.error calls for the stamp.
_WATCH_JS = """
window.__infermuxErrors=[];
(function(){var e=console.error;console.error=function(){
window.__infermuxErrors.push(Array.prototype.join.call(arguments,' '));return e.apply(console,arguments);};
window.addEventListener('error',function(ev){window.__infermuxErrors.push(String(ev.message));});})();
"""

# Draws the figures of the first screen, stamps `data-open-ms`, then draws the rest one at a
# time (those scrolled to first), yielding between them so the page answers while it draws;
# then stamps the outcome on <body>, and each figure's marks on its box.
_DRAW_JS = """
(function(){
var errors=window.__infermuxErrors||[],drawn=0,b=document.body;
var specs=JSON.parse(document.getElementById('infermux-figures').textContent);
var config={displaylogo:false,responsive:true,
  modeBarButtonsToRemove:['select2d','lasso2d','autoScale2d']};
function fail(spec,err){
  errors.push(spec.id+': '+err);var el=document.getElementById(spec.id);
  if(el){el.innerHTML='';var p=document.createElement('p');p.className='fig-error';
    p.textContent='this figure could not be drawn: '+err;el.appendChild(p);}
}
function finish(){
  b.dataset.figures=specs.length;b.dataset.drawn=drawn;b.dataset.errors=errors.length;
  b.dataset.allMs=Math.round(performance.now());
  var s=document.getElementById('infermux-status');
  if(s&&errors.length){s.textContent='figures: '+drawn+' of '+specs.length+' drawn; '+
    errors.join('; ');}
}
function draw(spec){
  try{return Plotly.newPlot(spec.id,spec.data,spec.layout,config).then(function(el){
    drawn++;el.dataset.marks=el.querySelectorAll(
      '.main-svg .overplot .trace *, .main-svg .overplot .hm *').length;},
    function(e){fail(spec,e);});}
  catch(e){fail(spec,e&&e.message||e);return Promise.resolve();}
}
function near(spec){
  var el=document.getElementById(spec.id);if(!el){return false;}
  var r=el.getBoundingClientRect();return r.bottom>-innerHeight&&r.top<2*innerHeight;
}
if(typeof Plotly==='undefined'){errors.push('plotly.js did not load');finish();return;}
var first=specs.filter(near),queue=specs.filter(function(s){return first.indexOf(s)<0;});
function next(){
  if(!queue.length){finish();return;}
  var i=-1;for(var k=0;k<queue.length;k++){if(near(queue[k])){i=k;break;}}
  draw(queue.splice(i<0?0:i,1)[0]).then(function(){setTimeout(next,0);});
}
Promise.all(first.map(draw)).then(function(){
  b.dataset.openMs=Math.round(performance.now());next();});
})();
"""
