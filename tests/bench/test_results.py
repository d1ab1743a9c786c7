"""bench/results.py writes records; bench/report.py renders them; the committed page is current."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def _module(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _module("results")
report = _module("report")


def test_record_fills_machine_date_commit_and_software(tmp_path):
    path = results.record("ops", [["p", "1.10x (±0.02)"]], columns=["problem", "speedup"], runs="7 rounds",
                          bench="ops", command="python bench/ops.py", results=tmp_path)
    assert path.name == "ops-ops.result.jsonl"
    entry = json.loads(path.read_text())
    assert entry["question"] == "ops" and entry["command"] == "python bench/ops.py"
    assert entry["runs"] == "7 rounds" and entry["rows"] == [["p", "1.10x (±0.02)"]]
    assert "core" in entry["machine"] and "Python" in entry["software"]
    assert entry["date"] and entry["commit"]


def test_record_appends_tables_and_keeps_given_fields(tmp_path):
    kw = dict(columns=["a"], runs="1", bench="service", results=tmp_path, machine="m", date="2026-12-01",
              commit="abc1234", software="s")
    results.record("service", [["1"]], title="first", **kw)
    results.record("service", [["2"]], title="second", append=True, **kw)
    entries = results.load(tmp_path)
    assert [e["title"] for e in entries] == ["first", "second"]
    assert entries[0]["machine"] == "m" and entries[0]["commit"] == "abc1234"


def test_record_refuses_unknown_questions_and_ragged_rows(tmp_path):
    with pytest.raises(ValueError, match="unknown question"):
        results.record("speed", [], columns=["a"], runs="1", results=tmp_path)
    with pytest.raises(ValueError, match="one cell per column"):
        results.record("ops", [["1", "2"]], columns=["a"], runs="1", results=tmp_path)


def test_report_renders_one_table_per_question_with_its_provenance(tmp_path):
    kw = dict(runs="3 rounds", results=tmp_path, machine="2-core VM", date="2026-12-02", commit="abc1234",
              software="jax 0.10.2", command="python bench/x.py")
    results.record("tpu_compile", [["v5e", "1.2 s"]], columns=["topology", "compile"], bench="tpu_compile", **kw)
    results.record("ops", [["a|b", "1.1x"]], columns=["problem", "speedup"], bench="ops", note="Why.", **kw)
    page = report.render(results.load(tmp_path))
    assert page.index("## Ops against the baseline") < page.index("## TPU compiles")
    assert "| a\\|b | 1.1x |" in page and "Why." in page
    assert "machine: 2-core VM" in page and "commit: abc1234" in page and "`python bench/x.py`" in page


def test_committed_page_is_the_generators_output():
    page = report.render(results.load())
    assert (ROOT / "docs" / "benchmarks.md").read_text() == page, "run: python bench/report.py"
    assert page.count("\n") < 300


def test_every_stored_record_states_its_provenance():
    for entry in results.load():
        for field in ("question", "command", "machine", "date", "commit", "software", "runs", "columns", "rows"):
            assert entry.get(field), (entry["bench"], field)


def test_a_bench_inside_recorded_writes_the_tables_it_prints(tmp_path, capsys):
    with results.recorded("short_programs", runs="10 runs", bench="short_programs", keep=["K", "invocation"],
                          results=tmp_path):
        print("intro\n| invocation | K | spread |\n|---|---|---|\n| 1 | 13 | 0.127 |\n| 2 | 20 | 0.146 |\ndone")
    assert "| 1 | 13 | 0.127 |" in capsys.readouterr().out
    (entry,) = results.load(tmp_path)
    assert entry["columns"] == ["K", "invocation"] and entry["rows"] == [["13", "1"], ["20", "2"]]
    assert entry["runs"] == "10 runs" and entry["question"] == "short_programs"


def test_nothing_is_recorded_when_the_bench_fails(tmp_path):
    with pytest.raises(RuntimeError), results.recorded("ops", runs="1", bench="ops", results=tmp_path):
        print("| a |\n|---|\n| 1 |")
        raise RuntimeError("boom")
    assert not list(tmp_path.glob("*.jsonl"))
