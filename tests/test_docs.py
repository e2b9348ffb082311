"""The documentation site: it builds with ``mkdocs build --strict``, the API page documents the public
names, the code on the pages runs, and the figure script works without benchmark results at hand."""
from __future__ import annotations

import html as htmllib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
SNIPPET_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 300

# Pages whose ```python blocks run as they are, in order, in one interpreter. serving.md is left
# out: its examples need the optional server dependencies.
RUNNABLE_PAGES = ["quickstart.md", "how-it-runs.md", "readback.md", "backends.md", "errors.md", "security.md",
                  "profiling.md"]

API_NAMES = [
    "load_model", "Model", "TensorInfo", "Worker", "Execution", "BackendType", "Placement", "Tensor", "TensorData",
    "schedule", "schedule_iterable", "peek_output", "take_output", "run_blocking", "placement",
    "readback_request", "is_readback_request_done", "readback_and_clone", "readback_and_clone_async",
    "download_to_array", "data_on_backend", "from_numpy", "dispose",
    "AsyncInferError", "ModelLoadError", "UnsupportedOperatorError", "InputError", "InputShapeWarning", "ExecutionError",
    "BackendUnavailableError", "DisposedError", "Limits", "LimitExceededError", "ModelTooLargeError",
    "RequestTooLargeError", "quantize_weights", "CompressedModel", "Profile", "StepRecord", "RunRecord", "OpTotal", "write_trace", "warmup",
    "generate", "generate_blocking", "generation_stats", "TokenStream", "FinishReason", "GenerationStats",
    "collect", "collect_blocking",
]

# A Sphinx role (``:meth:`Worker.run```): mkdocstrings shows it raw. Docstrings link with
# ``[`Worker.run`][asyncinfer.Worker.run]`` (autorefs) or use plain backticks.
ROLES = r":(?:py:)?(?:meth|class|func|mod|attr|data|exc|obj|const):"
RAW_ROLE = re.compile(ROLES + "`")
RAW_ROLE_RENDERED = re.compile(ROLES + r"\S")  # on the page the backticks have become <code>


def python_blocks(page: str) -> list[str]:
    text = (DOCS / page).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_site_builds_every_page(site):
    nav_pages = re.findall(r":\s*([\w-]+)\.md\s*$", (REPO / "mkdocs.yml").read_text(), flags=re.M)
    assert "index" in nav_pages and "api" in nav_pages and "operators" in nav_pages
    for page in nav_pages:
        html = site / ("index.html" if page == "index" else f"{page}/index.html")
        assert html.is_file(), f"{page}.md was not built"
    assert not list(site.rglob("*.py")), "scripts under docs/ must not be published"


def test_api_page_documents_the_public_names(site):
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [name for name in API_NAMES if name not in html]
    assert not missing, f"API page lacks {missing}"
    assert 'id="asyncinfer.Tensor.readback_and_clone_async"' in html


def test_api_page_shows_no_raw_roles_or_unresolved_links(site):
    """Cross-references render as links: no Sphinx role and no ``[text][asyncinfer.x]`` left as text."""
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    text = htmllib.unescape(re.sub(r"<[^>]+>", "", page))
    roles = sorted({match.group(0) for match in RAW_ROLE_RENDERED.finditer(text)})
    assert not roles, f"the API page shows raw roles {roles}"
    unresolved = re.findall(r"\]\[asyncinfer\.[\w.]*\]", text)
    assert not unresolved, f"cross-references left unresolved: {unresolved[:5]}"
    # The docstrings' links resolved to anchors on the page (Worker.run_blocking links Worker.run).
    for target in ("Worker.run", "Worker.dispose_async", "Limits", "load_model"):
        assert re.search(rf'<a class="autorefs[^"]*"[^>]*href="#asyncinfer\.{re.escape(target)}"', page), target


def test_source_docstrings_use_no_sphinx_roles():
    """One docstring style in the package, rendered or not (roles show raw in mkdocstrings)."""
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "asyncinfer").rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if RAW_ROLE.search(line)]
    assert not found, f"Sphinx roles in {found[:10]}"


def test_site_fetches_nothing_from_the_network(site):
    for html in site.rglob("*.html"):
        text = html.read_text(encoding="utf-8")
        remote = re.findall(r"""<(?:script|link|img)\b[^>]*(?:src|href)=["'](?:https?:)?//[^"']+""", text)
        assert not remote, f"{html.relative_to(site)} loads {remote[:3]}"


def test_images_exist_and_stay_small():
    referenced = set()
    for page in DOCS.glob("*.md"):
        referenced |= set(re.findall(r"!\[[^\]]*\]\((img/[^)\s]+)\)", page.read_text(encoding="utf-8")))
    assert referenced, "the pages show no figures"
    for rel in sorted(referenced):
        path = DOCS / rel
        assert path.is_file(), f"{rel} is referenced but missing (python3 docs/gen_plots.py)"
        assert path.stat().st_size < 200 * 1024, f"{rel} is {path.stat().st_size // 1024} KiB"


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_page_snippets_run(page, tmp_path):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python snippets"
    # One script, blocks in order, each announced so a failure names its block.
    script = "\n".join(f"print('--- block {i}', flush=True)\n{block}" for i, block in enumerate(blocks, 1))
    path = tmp_path / f"{Path(page).stem}_snippets.py"
    path.write_text(script, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SNIPPET_TIMEOUT_S)
    assert proc.returncode == 0, f"a snippet of {page} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_quickstart_output_matches_its_comments(tmp_path):
    """The quick start's printed input/output signatures are the ones its comments show."""
    script = "\n".join(python_blocks("quickstart.md")[:1])
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SNIPPET_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "[TensorInfo('image', float32, (N, 1, 8, 8))]" in proc.stdout


def _timing(ms: float) -> dict:
    return {"median_ms": ms, "p10_ms": ms * 0.9, "p90_ms": ms * 1.1, "min_ms": ms * 0.8, "max_ms": ms * 1.2, "n": 3}


def test_gen_plots_draws_every_figure(tmp_path):
    """docs/gen_plots.py on small synthetic results (bench/results/*.json are machine-specific, not committed)."""
    pytest.importorskip("matplotlib")
    env = {"cpu_count": 2, "platform": "test", "python": "3", "numpy": "x", "onnxruntime": "y", "timestamp": "now"}
    latency = {"benchmark": "latency", "environment": env, "results": {
        "repeats": 3, "threads": 2, "geomean_ratio_await": 2.0, "geomean_ratio_blocking": 2.0, "measured": 1,
        "models": {"tiny": {"layers": 3, "ratio_await": 2.0, "ratio_blocking": 2.0,
                            "timings": {"asyncinfer_await": _timing(2), "asyncinfer_blocking": _timing(2),
                                        "ort": _timing(1)}},
                   "broken": {"error": "UnsupportedOperatorError: nope"}}}}
    overhead = {"benchmark": "overhead", "environment": env, "results": {
        "per_layer": {"layers": 10, "us_per_layer": {"asyncinfer_await": 20.0, "asyncinfer_blocking": 18.0, "ort": 1.0}},
        "schedule": {"chain": {"layers": 10, "schedule": _timing(0.1), "run": _timing(1.0), "ratio": 0.1}},
        "loop_lag": {"baseline": {"ticks": 10, "model_runs": 0, "p50_ms": 0.1, "p99_ms": 0.5, "max_ms": 1.0},
                     "tiny": {"ticks": 10, "model_runs": 3, "p50_ms": 0.1, "p99_ms": 1.5, "max_ms": 2.0}}}}
    results = tmp_path / "results"
    results.mkdir()
    (results / "latency.json").write_text(json.dumps(latency))
    (results / "overhead.json").write_text(json.dumps(overhead))
    out = tmp_path / "img"
    proc = subprocess.run([sys.executable, str(DOCS / "gen_plots.py"), "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    for name in ("task_graph.png", "latency.png", "overhead.png", "loop_lag.png"):
        assert (out / name).stat().st_size > 1000, name
    assert "| **geometric mean** |" in proc.stdout and "skipped: UnsupportedOperatorError" in proc.stdout
