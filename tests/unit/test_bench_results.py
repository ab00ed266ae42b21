"""Benchmarks as data: a bench's results file holds what it printed, and bench/render.py
turns the results directory into the benchmarks page with its plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

A_BENCH = """
import sys
sys.path.insert(0, {bench!r})
from common import print_table, write_results
rows = [["next commit", "63 ms", "never"], ["steps lost", "0 lost, no gaps; in-flight step retried 2x, done 0x", "-"]]
print_table("Crash: 1 of 3 killed", ["measure", "unbroken", "DDP"], rows, caption="met")
write_results({{"commit_times": {{"unbroken kill": [-0.2, -0.1, 0.06, 0.1]}}}})
"""


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, **env}, cwd=cwd)


def test_a_bench_writes_the_tables_it_printed_its_command_machine_and_load(tmp_path: Path) -> None:
    script = tmp_path / "recovery.py"
    script.write_text(A_BENCH.format(bench=str(BENCH)))
    out = tmp_path / "results"
    r = _run([sys.executable, str(script), "--repeats", "2"], {"UB_BENCH_RESULTS": str(out)}, tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads((out / "recovery.json").read_text())
    assert data["command"] == "python bench/recovery.py --repeats 2"
    assert data["tables"] == [{"title": "Crash: 1 of 3 killed", "columns": ["measure", "unbroken", "DDP"],
                               "rows": [["next commit", "63 ms", "never"],
                                        ["steps lost", "0 lost, no gaps; in-flight step retried 2x, done 0x", "-"]],
                               "caption": "met"}]  # fmt: skip
    assert data["series"]["commit_times"]["unbroken kill"] == [-0.2, -0.1, 0.06, 0.1]
    assert data["machine"]["cores"] == os.cpu_count() and data["machine"]["memory_gb"] > 0
    assert len(data["load"]["start"]) == 3 and len(data["load"]["end"]) == 3
    assert data["date"].startswith("20")


def test_an_empty_results_setting_writes_nothing(tmp_path: Path) -> None:
    script = tmp_path / "recovery.py"
    script.write_text(A_BENCH.format(bench=str(BENCH)))
    r = _run([sys.executable, str(script)], {"UB_BENCH_RESULTS": ""}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.rglob("*.json"))


def test_the_page_has_each_bench_its_plots_the_hand_measured_figures_and_says_what_is_not_measured(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib", reason='bench/render.py needs the bench extra: pip install -e ".[bench]"')
    results = tmp_path / "results"
    script = tmp_path / "recovery.py"
    script.write_text(A_BENCH.format(bench=str(BENCH)))
    assert _run([sys.executable, str(script)], {"UB_BENCH_RESULTS": str(results)}, tmp_path).returncode == 0
    manual = {"setup": "2 cores:", "notes": [{"bench": "recovery", "text": "DDP stops."},
                                             {"bench": None, "text": "Most of a join is start-up."}], "entries": [
        {"what": "SIGKILL -> next commit", "unbroken": "63 ms (57–98)", "baseline": "DDP: never",
         "command": "`python bench/recovery.py`", "date": "2026-11-30", "bench": "recovery"},
        {"what": "lines an example changes", "unbroken": "+11 −8", "baseline": "—",
         "command": "`python scripts/example_diffs.py`", "date": "2026-11-30", "bench": None},
    ]}  # fmt: skip
    (results / "manual.json").write_text(json.dumps(manual))
    page, img = tmp_path / "docs" / "benchmarks.md", tmp_path / "docs" / "img" / "bench"
    render = [sys.executable, str(BENCH / "render.py"), "--results", str(results), "--out", str(page)]
    r = _run([*render, "--img", str(img)], {}, tmp_path)
    assert r.returncode == 0, r.stderr
    text = page.read_text()
    assert "Command: `python bench/recovery.py`" in text
    assert "| next commit | 63 ms | never |" in text
    # a sentence is no figure: it reads under the table, with the words the bench printed
    assert "| steps lost | note 1 | - |" in text
    assert "\n1. 0 lost, no gaps; in-flight step retried 2x, done 0x\n" in text
    assert "![Recovery from a crash and a freeze](img/bench/recovery.png)" in text
    assert (img / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "63 ms (57–98)" in text and "date: 2026-11-30" in text and "+11 −8" in text
    assert "Most of a join is start-up." in text.split("## Notes on the figures measured by hand")[1]
    assert "DDP stops." in text.split("## Recovery from a crash and a freeze")[1].split("\n## ")[0]
    assert "not measured yet" in text and not (img / "goodput.png").exists()

    goodput = {"rates": [30, 10, 5], "ours": [0.98, 0.95, 0.81],
               "baselines": {"torchft": [0.98, 0.9, None], "torchrun": "torch.distributed.run not found"}}  # fmt: skip
    (results / "goodput.json").write_text(json.dumps(goodput))
    assert _run([*render, "--img", str(img)], {}, tmp_path).returncode == 0
    text = page.read_text()
    assert "not measured yet" not in text and (img / "goodput.png").exists()
    assert "| seconds between faults | unbroken | torchft |" in text and "| 5 | 0.81 | - |" in text
    assert "- torchrun: not run (torch.distributed.run not found)" in text
    assert "same global batch" not in text  # no breakdown: no words about one

    # each fault's cost: the bench's own table, under a word on how the systems compare
    goodput["fault_costs"] = {"unbroken": {"10": {"lost_unowned_s": 0.1, "faults": []}}}
    goodput["tables"] = [{"title": "What each kind of fault cost", "columns": ["system", "fault", "lost s (all)"],
                          "rows": [["unbroken", "kill", "3.3"]]}]  # fmt: skip
    (results / "goodput.json").write_text(json.dumps(goodput))
    assert _run([*render, "--img", str(img)], {}, tmp_path).returncode == 0
    text = page.read_text().split("## Goodput against failure rate")[1].split("\n## ")[0]
    assert "same global batch B a step" in text and "**What each kind of fault cost**" in text
    assert "| unbroken | kill | 3.3 |" in text
    assert "Committed samples/s" not in text  # no absolute rates recorded: no table of them

    # with hot spares: the absolute rates beside goodput, and how many of ours trained
    goodput.update(nodes=3, spares=1, free_samples_per_s={"unbroken": [360.0, 368.0, 300.0]},
                   samples_per_s={"unbroken": [340.0, 201.0, 100.0], "torchft": [400.0, 213.0, 90.0]})  # fmt: skip
    (results / "goodput.json").write_text(json.dumps(goodput))
    assert _run([*render, "--img", str(img)], {}, tmp_path).returncode == 0
    text = page.read_text().split("## Goodput against failure rate")[1].split("\n## ")[0]
    assert "every system on 3 processes (unbroken's: 2 training, 1 hot spare)" in text
    assert "| 10 | 368 / 201 | - / 213 |" in text


def test_render_names_a_plot_directory_the_page_cannot_link_to(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    args = ["--results", str(tmp_path / "results"), "--out", str(tmp_path / "docs" / "b.md"), "--img", str(tmp_path)]
    r = _run([sys.executable, str(BENCH / "render.py"), *args], {}, tmp_path)
    assert r.returncode == 2 and "must lie under the page's directory" in r.stderr
