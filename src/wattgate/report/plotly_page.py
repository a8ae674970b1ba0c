"""The Plotly figures on the self-contained page: plotly.js embedded once, gzip-compressed and base64-encoded,
unpacked in the browser with DecompressionStream; each figure a <div> and its JSON in a
<script type="application/json"> that the loader hands to Plotly.newPlot.

plotly.js is the one the installed plotly package ships (its package data; the Python package itself is not
imported). Compressing it takes about a tenth of a second, so the packed text is kept in the user's cache folder
for the next report, and run_report starts it on a worker thread before the analysis (zlib lets go of the GIL);
the page waits for it only when it has a figure.
"""

from __future__ import annotations

import base64
import gzip
import importlib.util
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from html import escape
from pathlib import Path

from wattgate.artifacts import write_bytes_atomic

GZIP_LEVEL = 4  # plotly.js 4.8 MB -> 2.04 MB of base64 in 0.09 s of CPU; level 9: 1.96 MB in 0.19 s
BUNDLE_ID = "plotly-js-gz"
GZIP_BASE64_HEAD = "H4sI"  # base64 of gzip's magic bytes and method (1f 8b 08)
CONFIG = {"displaylogo": False, "responsive": True}

# Unpacks plotly.js (base64 -> gzip -> text) and runs it as a script, then draws each figure from its JSON.
# <body data-figures-rendered="n/m">: of the m figures, the n that Plotly drew with a trace in a laid-out box.
LOADER = """(function(){
var figs=document.querySelectorAll('div.figure[data-figure]'),body=document.body;
function done(n){body.setAttribute('data-figures-rendered',n+'/'+figs.length);}
function drawn(div){var svg=div.querySelector('.main-svg'),r=svg&&svg.getBoundingClientRect();
return !!(r&&r.width>0&&r.height>0&&div.querySelector('.main-svg .trace'));}
function plot(div){var spec=JSON.parse(document.getElementById(div.id+'-data').textContent);
return Plotly.newPlot(div,spec.data,spec.layout,CONFIG).then(function(){return drawn(div)?1:0;},function(){return 0;});}
var packed=document.getElementById('BUNDLE_ID');
if(!figs.length||!packed){done(0);return;}
var bin=atob(packed.textContent),bytes=new Uint8Array(bin.length);
for(var i=0;i<bin.length;i++)bytes[i]=bin.charCodeAt(i);
new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text().then(function(js){
var s=document.createElement('script');s.textContent=js;document.head.appendChild(s);
return Promise.all(Array.prototype.map.call(figs,plot));
}).then(function(ok){done(ok.reduce(function(a,b){return a+b;},0));},
function(e){body.setAttribute('data-figures-error',String(e));done(0);});
})();""".replace("CONFIG", json.dumps(CONFIG, sort_keys=True)).replace("BUNDLE_ID", BUNDLE_ID)


def plotly_js_path() -> Path:
    """plotly.min.js as the installed plotly package ships it."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the report's figures need the plotly package: pip install 'plotly>=6,<8'")
    return Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"


def _packed(path: Path) -> str:
    """gzip (no name, mtime 0: the same bytes every time) then base64."""
    return base64.b64encode(gzip.compress(path.read_bytes(), compresslevel=GZIP_LEVEL, mtime=0)).decode("ascii")


def packed_cache_path(path: Path) -> Path:
    """Where the packed plotly.js of this installed file is kept between reports: the user's cache folder
    (XDG_CACHE_HOME, else ~/.cache), named by the file's size and modification time and the gzip level, so
    another plotly install or level is another file."""
    st = path.stat()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "wattgate" / f"plotly.min.js-{st.st_size}-{st.st_mtime_ns}-gz{GZIP_LEVEL}.b64"


def _packed_once(path: Path) -> str:
    """_packed, read from the cache when an earlier report packed this very file (packing is ~0.1 s of CPU per
    report; reading it back ~1 ms). The cache is only a shortcut: a cache that cannot be read or written is
    packed again, the page's bytes the same either way."""
    try:
        cached = packed_cache_path(path)
    except (OSError, RuntimeError):  # no home folder to find
        return _packed(path)
    try:
        text = cached.read_text("ascii")
        if text.startswith(GZIP_BASE64_HEAD) and len(text) % 4 == 0:  # whole, as written (atomically)
            return text
    except (OSError, ValueError):
        pass
    text = _packed(path)
    try:
        write_bytes_atomic(cached, text.encode("ascii"))
    except OSError:
        pass  # a read-only home: the next report packs it again
    return text


@lru_cache(maxsize=1)
def _packing() -> Future[str]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plotly-js")
    try:
        return pool.submit(_packed_once, plotly_js_path())
    finally:
        pool.shutdown(wait=False)


def start_packing_plotly_js() -> None:
    """Begin compressing plotly.js in the background (once per process), to overlap the report's analysis."""
    _packing()


def plotly_js_element() -> str:
    """plotly.js, compressed, in a script element the browser does not run (the loader unpacks it)."""
    return f'<script type="application/octet-stream" id="{BUNDLE_ID}">{_packing().result()}</script>'


def spec_json(spec: dict) -> str:
    """A figure's JSON for a <script> element: sorted keys, no NaN, and <, >, & escaped so that no text in it
    can close the element."""
    out = json.dumps(spec, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return out.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def figure_element(spec: dict, name: str, alt: str) -> str:
    """A figure's <div> (its id from its name, so the same data gives the same page) and its JSON."""
    fid = f"figure-{name}"
    return (
        f'<div class="figure" id="{fid}" data-figure="{escape(name)}" role="img" aria-label="{escape(alt)}"></div>'
        f'<script type="application/json" id="{fid}-data">{spec_json(spec)}</script>'
    )
