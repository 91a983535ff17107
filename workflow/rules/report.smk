# The report stage, and what `snakemake --report` shows.
#
#   snakemake --config mesh=2,4,8 && snakemake --report results/report.html --config mesh=2,4,8
#   snakemake paper && snakemake --report results/report.html     # with the paper
#
# The report stage writes results/report/*.parquet (pipeline/report.py) and the runs table
# as an HTML page, runs.html (pipeline/report_html.py: a Snakemake report shows HTML and
# pictures in the page, Parquet and Markdown only as downloads). The outputs shown in the
# HTML report (report(...), captions in workflow/report/) are declared only when
# Snakemake makes a report (REPORT_MODE), so that ordinary runs plan the same jobs:
# runs.html; the paper's table page and figures when the paper of the --config
# experiment exists; each run's plan picture (plan.png) that the report stage drew.

report: "../report/workflow.rst"

#: Whether this Snakemake process writes an HTML report (--report FILE), not a run.
REPORT_MODE = any(a == "--report" or a.startswith("--report=") for a in sys.argv[1:])
REPORT_CAPTIONS = Path(workflow.basedir) / "report"


def runs_page():
    """results/report/runs.html, the runs table as a page (pipeline/report_html.py)."""
    return str(PLAN_DIRS.report / "runs.html")


def plan_pictures():
    """Every plan picture the report stage drew, <results_dir>/runs/**/plan.png."""
    return sorted(str(p) for p in Path(PLAN_CFG.results_dir, "runs").glob("**/plan.png"))


def report_rule_extra_outputs():
    """Outputs of rule report shown in the HTML report (none outside --report): the runs
    page and every plan picture, labelled by its run directory."""
    if not REPORT_MODE:
        return []
    runs_dir = Path(PLAN_CFG.results_dir, "runs")
    pictures = [report(p, caption=str(REPORT_CAPTIONS / "plan.rst"), category="Plans",
                       labels={"run": str(Path(p).parent.relative_to(runs_dir))})
                for p in plan_pictures()]
    return [report(runs_page(), caption=str(REPORT_CAPTIONS / "runs.rst"), category="Runs")] + pictures


def paper_page():
    """The eager-vs-lazy table of the paper as a page, beside its Markdown file."""
    return str(Path(paper_md()).with_suffix(".html"))


def paper_md():
    return next(p for p in paper_outputs() if p.endswith("eager_vs_lazy.md"))


def paper_rule_outputs():
    """The paper's files, figures flagged for the HTML report; under --report also the
    table page."""
    out = []
    for path in paper_outputs():
        name = Path(path).stem
        if path.endswith(".png"):
            out.append(report(path, caption=str(REPORT_CAPTIONS / f"{name}.rst"),
                              category="Paper"))
        else:
            out.append(path)
    if REPORT_MODE:
        out.append(report(paper_page(), caption=str(REPORT_CAPTIONS / "eager_vs_lazy.rst"),
                          category="Paper"))
    return out


def report_extra_targets():
    """Extra inputs of rule all under --report: the paper, when it has been made."""
    if not REPORT_MODE:
        return []
    paper = paper_outputs() + [paper_page()]
    return paper if all(Path(p).is_file() for p in paper) else []


rule report:
    input:
        stage_outputs("solve"),
    output:
        report_outputs(),
        report_rule_extra_outputs(),
    params:
        overrides=stage_params("report"),
        code=stage_code("report"),
        runs=str(PLAN_DIRS.report / SENTINELS["report"]),
        page=runs_page(),
    log:
        stage_log("report"),
    benchmark:
        stage_benchmark("report")
    shell:
        "python -m pipeline.cli report {params.overrides:q} > {log} 2>&1 && "
        "python -m pipeline.report_html runs {params.runs:q} {params.page:q} >> {log} 2>&1"
