"""The pipeline-search page (pipeline/tools/results/pipeline_search.py): a small table in
the format ``benchmarks/pipeline_search.py`` writes, built here (no benchmark run),
rendered, and its header and rows checked against values worked out by hand; a source
that is not such a table is refused in one line."""

from __future__ import annotations

import pyarrow as pa

from pipeline.core import runtime
from pipeline.tools.results import main
from pipeline.tools.results.page import GENERATED_MARK
from pipeline.tools.results.sources import discover

GIB = 2**30
REV = "0123456789abcdef0123456789abcdef01234567"


def _row(**kw):
    base = {"case": "llama70b", "model": "llama70b", "world": 256, "pp": 2,
            "mesh": "2x16x8", "microbatch_size": 1, "microbatches": 16,
            "stage_plan": "solved", "schedule": None, "virtual_stages": None, "fits": None,
            "why": None, "split": None, "bubble": None, "closed_form_bubble": None,
            "step_time_us": None, "tokens_per_s_per_device": None,
            "peak_bytes_per_rank": None, "peak_bytes_max": None, "stage_solve_s": 17.25,
            "stage_solve_ran": True, "case_stage_solves": 3, "case_stage_solves_run": 2,
            "case_search_s": 61.456, "revision": REV, "dirty": False}
    return {**base, **kw}


ROWS = [
    _row(pp=1, mesh="32x8", microbatch_size=16, microbatches=1, fits=True,
         step_time_us=16_766_612.0, tokens_per_s_per_device=977.2,
         peak_bytes_per_rank=[int(47.1 * GIB)], peak_bytes_max=int(47.1 * GIB),
         stage_solve_s=27.0),
    _row(schedule="1f1b", virtual_stages=1, fits=False,
         why="no split fits the device memory"),
    _row(stage_plan="fsdp_tp", schedule="interleaved_1f1b", virtual_stages=2, fits=True,
         split="0,20,40,60,80", bubble=0.07261, closed_form_bubble=1 / 33,
         step_time_us=13_807_049.0, tokens_per_s_per_device=593.4,
         peak_bytes_per_rank=[int(31.6 * GIB), int(31.72 * GIB)],
         peak_bytes_max=int(31.72 * GIB), stage_solve_ran=False),
]
META = {"command": "python benchmarks/pipeline_search.py --results-dir /tmp/x --cases llama70b",
        "cases": ["llama70b"], "started": "2026-12-03 17:00:00 UTC",
        "finished": "2026-12-03 17:01:01 UTC", "load_start": 1.5, "load_end": 2.25,
        "complete": True,
        "machine": {"cpu_model": "Test CPU", "cpu_count": 2, "usable_cores": 2,
                    "memory_bytes": 8 * GIB, "platform": "Linux", "python": "3.11",
                    "torch": "2.13.0", "highspy": "1.16.0",
                    "git": {"revision": REV, "dirty": False}}}

HEADER = ("| case | pp | mesh | microbatches | microbatch size | stage plan | schedule | v "
          "| fits | split (layer boundaries) | bubble (simulated) | bubble (closed form) "
          "| step ms | tokens/s/GPU | peak GiB per pp rank | stage solve s "
          "| stage solve run now | why none fits |")
EXPECTED = [
    "| llama70b | 1 | 32x8 | 1 | 16 | solved | - | - | True | - | - | - | 16,766.6 | 977 "
    "| 47.1 | 27.00 | True | - |",
    "| llama70b | 2 | 2x16x8 | 16 | 1 | solved | 1f1b | 1 | False | - | - | - | - | - | - "
    "| 17.25 | True | no split fits the device memory |",
    "| llama70b | 2 | 2x16x8 | 16 | 1 | fsdp_tp | interleaved_1f1b | 2 | True "
    "| 0,20,40,60,80 | 0.0726 | 0.0303 | 13,807.0 | 593 | 31.6, 31.7 | 17.25 | False | - |",
]


def _write(path, rows=ROWS, meta=META):
    runtime.write_parquet(path, pa.Table.from_pylist(rows), metadata=meta)


def test_page_rows_and_header_by_hand(tmp_path):
    source = tmp_path / "results" / "bench" / "pipeline_search.parquet"
    _write(source)
    assert discover(tmp_path / "results") == [("pipeline", source)]
    out = tmp_path / "pages"
    assert main(["--results", str(tmp_path / "results"), "--out", str(out)]) == 0
    lines = (out / "pipeline-search.md").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "# Pipeline search (benchmarks/pipeline_search.py)"
    assert lines[2] == GENERATED_MARK
    assert lines[4].startswith("- page: `python -m pipeline.tools.results pipeline "
                               "<pipeline_search.parquet: outside this checkout>`, at git ")
    assert lines[5] == ("- numbers: `python benchmarks/pipeline_search.py --results-dir "
                        "<x: outside this checkout> --cases llama70b`; source "
                        "`pipeline_search.parquet (outside this checkout)`")
    assert lines[6] == "- git revision of the numbers: 0123456789"
    assert lines[7] == ("- machine: Test CPU, 2 logical CPUs (2 usable), 8.0 GiB RAM; Linux; "
                        "python 3.11, torch 2.13.0, highspy 1.16.0")
    assert lines[8] == ("- complete; started 2026-12-03 17:00:00 UTC, finished 2026-12-03 "
                        "17:01:01 UTC; 1-minute load average 1.50 at start, 2.25 at end")
    start = lines.index(HEADER)
    assert lines[start + 2:start + 5] == EXPECTED
    assert lines[start + 5] == ""
    assert "- `llama70b`: search 61.46 s, 3 stage solves (2 run now, the others reused)" \
        in lines
    index = (out / "README.md").read_text(encoding="utf-8")
    assert "| [pipeline-search](pipeline-search.md) | Pipeline search" in index


def test_a_bad_source_is_one_line(tmp_path, capsys):
    wrong = tmp_path / "wrong.parquet"
    _write(wrong, rows=[{"case_index": 1, "model": "toy"}], meta={})
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet\n")
    out = tmp_path / "pages"
    assert main(["pipeline", str(wrong), "--out", str(out)]) == 2
    assert main(["pipeline", str(garbage), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0] == (f"pipeline {wrong}: not a pipeline_search table: no column case, pp, "
                        "mesh, stage_plan, schedule, fits, step_time_us, peak_bytes_per_rank "
                        "(benchmarks/pipeline_search.py writes them)")
    assert lines[1].startswith(f"pipeline {garbage}: ")
    assert not out.exists()
