"""The HTML report: ``snakemake --report`` on the toy sweep (runs copied from the session's
toy results, then rule report and rule paper), opened in headless Chromium, every table
and figure clicked in the report's own menu and seen in its content pane.

Chromium is the Debian package (``.ci/run`` installs it); without it the test fails
with the reason, ``PLANNER_SKIP_BROWSER=1`` skips it. The runs page and the paper's table
page are also checked by themselves (:mod:`pipeline.report_html`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toy_sweep import CONFIGS, NAME, checkout_with_sweep

from pipeline.report_html import PageError, main, markdown_page, runs_page

SKIP_ENV = "PLANNER_SKIP_BROWSER"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
#: By hand: the paper's figures and table (pipeline/paper/experiment.py, ARTIFACTS).
PAPER_FIGURES = ("fig_phases.png", "fig_peak_rss.png", "fig_depth.png", "fig_solvers.png")
PAPER_TABLE = "eager_vs_lazy.html"

#: Appended to a copy of the report: once the app has rendered, open each category and
#: subcategory through the app, click each result's view button (the first link of its
#: row) and record what the content pane shows; the record goes into <pre id=check>.
DRIVER = """
<script>
(async function () {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  while (typeof app === "undefined") { await sleep(50); }
  await sleep(300);
  const seen = [];
  for (const cat of Object.keys(categories)) {
    for (const sub of Object.keys(categories[cat])) {
      app.setView({navbarMode: "subcategory", category: cat, subcategory: sub});
      await sleep(300);
      const rows = Array.from(document.querySelectorAll("nav tr")).filter(
        (tr) => tr.querySelector("a"));
      for (const tr of rows) {
        tr.querySelector("a").click();
        await sleep(300);
        const shown = Array.from(document.querySelectorAll("img, iframe")).filter(
          (el) => !el.closest("nav") && el.src.startsWith("data:"));
        seen.push({category: cat, label: tr.innerText.trim().split(/\\s+/)[0],
                   shown: shown.map((el) => el.tagName.toLowerCase() + " " + el.src)});
      }
    }
  }
  const pre = document.createElement("pre");
  pre.id = "check";
  pre.textContent = JSON.stringify(seen);
  document.body.appendChild(pre);
})();
</script>
"""


def _browser() -> str:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: headless-browser test skipped")
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"HTML report test: no headless browser ({', '.join(BROWSERS)}) on PATH; "
                f"install the Debian package (apt-get install chromium) or set {SKIP_ENV}=1 "
                "to skip", pytrace=False)


def _smk(checkout: Path, workdir: Path, *args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile",
                           str(checkout / "workflow" / "Snakefile"), *args],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _shown(check: list[dict], label: str) -> list[str]:
    entries = [c for c in check if c["label"] == label]
    assert len(entries) == 1, (label, [c["label"] for c in check])
    return entries[0]["shown"]


def _page_text(shown: list[str]) -> str:
    """The HTML of the one page (iframe with a base64 data URI) the pane shows."""
    assert len(shown) == 1 and shown[0].startswith("iframe data:text/html"), shown
    return base64.b64decode(shown[0].split("base64,", 1)[1]).decode()


@pytest.mark.slow
@pytest.mark.toy_runs(*CONFIGS)
def test_html_report_shows_every_table_and_figure(tmp_path, toy_results):
    browser = _browser()
    checkout = checkout_with_sweep(tmp_path / "checkout")
    work = tmp_path / "work"
    results = work / "results"
    work.mkdir()
    hashes = {}
    for config in CONFIGS:
        dirs = toy_results.copy_run(results, *config)
        hashes[config] = json.loads((Path(dirs.solve) / "run.json").read_text())[
            "placement_hash"]
    # a plan picture where none was drawn: the report lists every runs/**/plan.png
    solve_dirs = sorted(p.parent for p in results.glob("runs/**/run.json"))
    if not list(results.glob("runs/**/plan.png")):
        shutil.copy(Path(__file__).parent.parent / "docs" / "figures" / "fig_depth.png",
                    solve_dirs[0] / "plan.png")
    config = ["--config", "model=toy", "mesh=2,4", f"experiment={NAME}",
              f"results_dir={results}"]
    out = _smk(checkout, work, "--cores", "2", "all", "paper", *config)
    assert not re.search(r"^rule (trace|topology|costs_\w+|solve):", out, re.M), out[-3000:]
    report = results / "report.html"
    _smk(checkout, work, "--report", str(report), *config)
    assert report.is_file()

    page = tmp_path / "driven.html"
    page.write_text(report.read_text().replace("</body>", DRIVER + "</body>"))
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'browser'}",
         "--virtual-time-budget=60000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r'<pre id="check">(.*?)</pre>', proc.stdout, re.S)
    assert found, "the report did not render (no check record)"
    import html

    check = json.loads(html.unescape(found.group(1)))

    # the workflow description and the categories
    assert "Plans how to shard a PyTorch model" in proc.stdout
    assert {c["category"] for c in check} == {"Runs", "Paper", "Plans"}
    # every paper figure is shown as a PNG picture
    for name in PAPER_FIGURES:
        shown = _shown(check, name)
        assert len(shown) == 1 and shown[0].startswith("img data:image/png"), (name, shown)
    # the tables are shown as pages; the runs table lists the four runs' plans
    runs = _page_text(_shown(check, "runs.html"))
    assert runs.count("<tr><td>toy</td>") == 4
    for h in hashes.values():
        assert f"<td>{h[:16]}</td>" in runs
    table = _page_text(_shown(check, PAPER_TABLE))
    assert "Eager vs lazy costs, mesh 2x4" in table and "<td class=\"\">lazy</td>" in table
    # every plan picture under runs/, labelled by its run directory
    pictures = sorted(str(p.parent.relative_to(results / "runs"))
                      for p in results.glob("runs/**/plan.png"))
    assert pictures
    plans = sorted(c["label"] for c in check if c["category"] == "Plans")
    assert plans == pictures
    for c in check:
        if c["category"] == "Plans":
            assert len(c["shown"]) == 1 and c["shown"][0].startswith("img data:image/png")


# --------------------------------------------------------------------------- the pages


def test_runs_page_columns_order_and_values():
    rows = [
        {"model": "toy", "mesh": "2x4", "mesh_names": '["dp", "tp"]', "solver": "ilp",
         "cost_mode": "eager", "objective": 1234.5, "gap": 0.0, "placement_hash": "ab" * 32,
         "peak_rss_bytes.max": 3 * 2**20},
        {"model": "toy", "mesh": "8", "mesh_names": ["dp"], "solver": "approx",
         "cost_mode": "lazy", "objective": 10.0, "gap": None, "placement_hash": "cd" * 32,
         "peak_rss_bytes.max": 2**30},
    ]
    page = runs_page(rows)
    # columns no row has are left out; by device count: 2x4 (8 devices, rank 2) after 8
    assert "<th>lower bound (µs)</th>" not in page
    head = re.findall(r"<th>(.*?)</th>", page)
    assert head == ["model", "mesh", "mesh dims", "solver", "costs", "objective (µs)", "gap",
                    "peak RSS (MiB)", "placement hash"]
    body = re.findall(r"<tr>(.*?)</tr>", page.split("<tbody>")[1])
    assert body[0] == ('<td>toy</td><td>8</td><td>dp</td><td>approx</td><td>lazy</td>'
                       '<td class="r">10.000</td><td></td><td class="r">1,024</td>'
                       f'<td>{"cd" * 8}</td>')
    assert body[1] == ('<td>toy</td><td>2x4</td><td>dp,tp</td><td>ilp</td><td>eager</td>'
                       '<td class="r">1,234.500</td><td class="r">0</td><td class="r">3</td>'
                       f'<td>{"ab" * 8}</td>')
    assert "<caption>Runs (2)</caption>" in page


def test_markdown_page_keeps_alignment_bold_and_sub_and_escapes_the_rest():
    text = ("**Title <b>x</b>**\n\n| Mode | t (s) |\n| --- | ---: |\n| eager | 1.5 |\n"
            "| a<b | 2 |\n\n<sub>note & more</sub>\n")
    page = markdown_page(text, "t")
    assert "<p><strong>Title &lt;b&gt;x&lt;/b&gt;</strong></p>" in page
    assert "<thead><tr><th>Mode</th><th>t (s)</th></tr></thead>" in page
    assert '<tr><td class="">eager</td><td class="r">1.5</td></tr>' in page
    assert '<tr><td class="">a&lt;b</td><td class="r">2</td></tr>' in page
    assert "<p><sub>note &amp; more</sub></p>" in page
    with pytest.raises(PageError, match="no Markdown table"):
        markdown_page("just text\n", "t")


def test_pages_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "x.html"
    assert main(["runs", str(tmp_path / "missing.parquet"), str(out)]) == 2
    assert main(["table", str(tmp_path / "missing.md"), str(out)]) == 2
    assert main(["pictures", "a", "b"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"runs={tmp_path / 'missing.parquet'}: not a readable")
    assert lines[1] == f"table={tmp_path / 'missing.md'}: not readable (No such file or directory)"
    assert lines[2].endswith("allowed 'runs RUNS.parquet OUT.html' or 'table TABLE.md OUT.html'")
    assert not out.exists()
