"""The HTML report: ``snakemake --report`` on the toy sweep (runs copied from the session's
toy results, then rule report and rule paper), opened in headless Chromium: the app
renders its menu (Runs, Paper, Plans) and the workflow description, and the results it
renders from hold every table page and figure with its caption.

Chromium is the Debian package (``.ci/run`` installs it); without it the test fails
with the reason, ``PLANNER_SKIP_BROWSER=1`` skips it. The runs page and the paper's table
page are also checked by themselves (:mod:`pipeline.stages.report.html`).
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

from pipeline.stages.report.html import PageError, main, markdown_page, runs_page
from pipeline.stages.report.picture import write_plan_picture

SKIP_ENV = "PLANNER_SKIP_BROWSER"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
#: By hand: the paper's figures and table (pipeline/tools/paper/experiment.py, ARTIFACTS).
PAPER_FIGURES = ("fig_phases.png", "fig_peak_rss.png", "fig_depth.png", "fig_solvers.png",
                 "fig_plans.png", "fig_scale.png")
PAPER_TABLES = ("eager_vs_lazy.html", "plans.html", "scale.html")

#: Appended to a copy of the report: once the app has rendered, record the results it
#: renders its menu from (each with name, labels, category, caption, MIME type; the data
#: URI in full for pages, its start for pictures) into <pre id="check">.
DRIVER = """
<script>
(async function () {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  while (typeof app === "undefined") { await sleep(50); }
  await sleep(300);
  const seen = Object.entries(results).map(([path, r]) => {
    const o = {path: path};
    for (const [k, v] of Object.entries(r)) {
      o[k] = (k === "data_uri" && r.mime_type !== "text/html") ? String(v).slice(0, 40) : v;
    }
    return o;
  });
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


def _entry(check: list[dict], name: str, mime: str) -> dict:
    entries = [c for c in check if c["name"] == name]
    assert len(entries) == 1, (name, [c["name"] for c in check])
    entry = entries[0]
    assert entry["mime_type"] == mime and entry["data_uri"].startswith(f"data:{mime}"), entry
    assert entry["caption"].strip(), name  # every result has its caption
    return entry


def _page_text(entry: dict) -> str:
    """The HTML of a page result (its base64 data URI)."""
    return base64.b64decode(entry["data_uri"].split("base64,", 1)[1]).decode()


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
    # the toy runs are made without the report stage, so no plan picture is drawn yet:
    # draw one (the report lists every runs/**/plan.png)
    solve_dirs = sorted(p.parent for p in results.glob("runs/**/run.json"))
    if not list(results.glob("runs/**/plan.png")):
        write_plan_picture(solve_dirs[0])
    config = ["--config", "model=toy", "mesh=2,4", f"experiment={NAME}",
              f"results_dir={results}"]
    out = _smk(checkout, work, "--cores", "2", "all", "paper", *config)
    assert not re.search(r"^rule (trace|topology|costs_\w+|solve):", out, re.M), out[-3000:]
    report = results / "report.html"
    _smk(checkout, work, "--report", str(report), *config)
    assert report.is_file()

    page = tmp_path / "driven.html"
    head, body_end, tail = report.read_text().rpartition("</body>")
    page.write_text(head + DRIVER + body_end + tail)
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'browser'}",
         "--virtual-time-budget=30000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r'<pre id="check">(.*?)</pre>', proc.stdout, re.S)
    assert found, "the report did not render (no check record)"
    import html

    check = json.loads(html.unescape(found.group(1)))
    # what the app rendered (scripts left out): the description and the three categories
    shown = re.sub(r"<script.*?</script>|<style.*?</style>|<[^>]+>", " ", proc.stdout,
                   flags=re.S)
    assert "Plans how to shard a PyTorch model" in shown
    menu = re.search(r"Results (.*?) Sharding planner", " ".join(shown.split()))
    assert menu and set(menu.group(1).split()) == {"Runs", "Paper", "Plans"}, menu

    for name in PAPER_FIGURES:  # every paper figure, a PNG picture
        _entry(check, name, "image/png")
    runs = _page_text(_entry(check, "runs.html", "text/html"))
    assert runs.count("<tr><td>toy</td>") == 4  # the four runs, each with its plan's hash
    for h in hashes.values():
        assert f"<td>{h[:16]}</td>" in runs
    table = _page_text(_entry(check, PAPER_TABLES[0], "text/html"))
    assert "Eager vs lazy costs, mesh 2x4" in table and '<td class="">lazy</td>' in table
    plans_table = _page_text(_entry(check, PAPER_TABLES[1], "text/html"))
    assert plans_table.count("<tr>") >= 1 + 4  # the header and a row per plan
    scale_table = _page_text(_entry(check, PAPER_TABLES[2], "text/html"))
    assert "Scale: the planner" in scale_table and '">planner</td>' in scale_table
    # every plan picture under runs/, labelled by its run directory
    pictures = sorted(str(p.parent.relative_to(results / "runs"))
                      for p in results.glob("runs/**/plan.png"))
    plans = [c for c in check if c["name"] == "plan.png"]
    assert pictures and sorted(c["labels"]["run"] for c in plans) == pictures
    assert all(c["mime_type"] == "image/png" for c in plans)
    assert len(check) == len(PAPER_FIGURES) + len(PAPER_TABLES) + 1 + len(pictures)


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
    assert main(["table", str(tmp_path / "missing.md")]) == 2
    assert main(["pictures", "a", "b"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"runs={tmp_path / 'missing.parquet'}: not a readable")
    assert lines[1] == f"table={tmp_path / 'missing.md'}: not readable (No such file or directory)"
    assert lines[2].endswith("allowed 'runs RUNS.parquet OUT.html' or "
                             "'table TABLE.md [TABLE.md ...]'")
    assert not out.exists() and not (tmp_path / "missing.html").exists()
