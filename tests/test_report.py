"""`npu-shadow report`: the Markdown of a known journal, bounded memory on long journals, HTML seen in Chromium."""

import json
import os
import re
import shutil
import subprocess
import tracemalloc

import numpy as np
import png
import pytest
from commands import npu_shadow

from shadow.analysis import report
from shadow.launcher import cli


def record(target, outcome, signature, reasons=(), detail="", test=None, shared=None):
    line = {
        "target": target, "outcome": outcome, "signature": signature, "reasons": list(reasons), "detail": detail,
        "torch": "2.13.0+cpu", "torch_npu": "none", "device": "npu x2 (emulated)", "legacy": "torch_npu 2.12.0 source",
        "host": "node1", "pid": 7, "stream": "s7", "shared_divergence": shared,
    }  # fmt: skip
    if test is not None:
        line.update(test=test, phase="call")
    return json.dumps(line)


HEADER = json.dumps({"event": "journal", "all_outcomes": True, "host": "node1", "pid": 7, "stream": "s7"})


def known_journal(path):
    lines = [HEADER]
    lines += [record("tensor_type", "match", "npu_name/noncurrent/blocking", test="t.py::test_ok")] * 40
    lines += [record("tensor_type", "match", "dtype/cpu/blocking", test="t.py::test_ok")] * 3000
    lines += [
        record("tensor_type", "mismatch", "npu_name/noncurrent/blocking", ["device"], f"device npu:0 vs npu:1 #{i}",
               test="t.py::test_cross_device")
        for i in range(7)
    ]  # fmt: skip
    lines += [record("parallel_apply", "match", "replicas=2+/grad=on/autocast=on", shared="dtype")] * 35
    lines += [record("parallel_apply", "error", "replicas=2+/grad=on/autocast=off", ["exception"], "legacy raised")]
    path.write_text("\n".join(lines) + "\n")
    return path


EXPECTED = """# npu-shadow report: legacy (torch_npu patches) vs upstream PyTorch

**Overall: rollback**

## Environment

Written TIME.

| item | value |
|---|---|
| sources | journals JOURNAL |
| run | not in these sources |
| npu-shadow | not in these sources |
| torch | 2.13.0+cpu |
| torch_npu | none |
| legacy | torch_npu 2.12.0 source |
| returned to the caller (primary) | not in these sources |
| device | npu x2 (emulated) |
| journal lines read | 3,084 |

## Verdict

Overall: **rollback** (max divergence rate 0.001; 95% bounds valid however often they are read: a beta-binomial \
confidence sequence over signatures weighted by their share of calls, calls never compared counted as unknown, each \
process's time block one comparison where journals say which).

| target | decision | compared | divergent | 95% bounds | why / evidence still missing |
|---|---|---|---|---|---|
| parallel_apply | rollback | 36 | 1 | [3.1e-59, 0.963] | hard mismatches: 1 exception |
| tensor_type | rollback | 3,047 | 7 | [1.43e-63, 0.951] | hard mismatches: 7 device |
| data_parallel | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| foreach_devices | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| lstm_forward | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| module_npu | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| module_to | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| storage_cpu | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| storage_deepcopy | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| tensor_repr | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| torch_load | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |
| torch_save | not exercised | 0 | 0 | - | no call of this target is in the sources (not installed or never \
called) |

## Phases

Calls whose result came from legacy (shadowing) and from upstream (a canary) are judged apart, never pooled; a \
target gets the worst of its phases. Uncovered: the share of calls of a kind never compared, added whole to the \
upper bound.

| target | primary | decision | compared | divergent | 95% bounds | effective n | uncovered |
|---|---|---|---|---|---|---|---|
| parallel_apply | legacy | inconclusive | 36 | 1 | [3.1e-59, 0.963] | 1.0 (1 clusters) | 0 |
| tensor_type | legacy | inconclusive | 3,047 | 7 | [1.43e-63, 0.951] | 1.0 (1 clusters) | 0 |

## Risky signatures

| target | signature | compared |
|---|---|---|
| parallel_apply | replicas=1/* | 0 |
| parallel_apply | */autocast=on | 35 |
| tensor_type | npu_name/noncurrent/* | 47 |
| tensor_type | npu_class/noncurrent/* | 0 |
| tensor_type | torch_npu_name/* | 0 |
| tensor_type | npu_name_elsewhere/* | 0 |
| tensor_type | npu_class_elsewhere/* | 0 |

## Shared divergences

Legacy and upstream agree, but both depart from replica 0 run alone on its device (the single-device oracle): \
removing the patch changes nothing there; an upstream issue to file, not a reason to keep it.

| target | reason | comparisons |
|---|---|---|
| parallel_apply | dtype | 35 |

## Divergences

Grouped by target, signature, outcome and reasons, with the first details of each.
Rows marked (fire drill) hold divergence a fire drill injected.

| target | signature | outcome | reasons | count | first details |
|---|---|---|---|---|---|
| tensor_type | npu_name/noncurrent/blocking | mismatch | device | 7 | t.py::test_cross_device (call): device npu:0 \
vs npu:1 #0 (+56 characters more in the HTML report) |
| parallel_apply | replicas=2+/grad=on/autocast=off | error | exception | 1 | legacy raised |

## Canary A/B

No canary A/B is in these sources.

| target | upstream's iterator |
|---|---|
| dataloader_init | not in these sources: it runs only in a canary (npu-shadow run --primary upstream), never while \
legacy's result is returned |

## Tests that diverged

| test | divergent comparisons |
|---|---|
| t.py::test_cross_device | 7 |
"""


def test_the_markdown_of_a_known_journal(tmp_path):
    journal = known_journal(tmp_path / "j.jsonl")
    out = tmp_path / "report.md"
    assert cli.main(["report", "--journal", str(journal), "--details", "2", "--markdown", str(out)]) == 0
    text = re.sub(r"Written \S+ \S+ UTC", "Written TIME", out.read_text()).replace(str(journal), "JOURNAL")
    assert text == EXPECTED


def test_a_journals_control_characters_reach_the_report_escaped(tmp_path):
    journal = tmp_path / "j.jsonl"
    hostile = record("tensor_type", "mismatch", "npu_name/noncurrent/blocking", ["device"], "\x1b[2J\x1b]0;owned\x07",
                     test="t.py::test_\x1b[31mred")  # fmt: skip
    journal.write_text("\n".join([HEADER, hostile]) + "\n")
    markdown, page = tmp_path / "report.md", tmp_path / "report.html"
    assert cli.main(["report", "--journal", str(journal), "--markdown", str(markdown), "--html", str(page)]) == 0
    for written in (markdown.read_text(), page.read_text()):
        assert "\x1b" not in written and "\x07" not in written
        assert "\\x1b[2J" in written and "test_\\x1b[31mred" in written


def test_counts_from_a_metrics_file_with_details_from_journals(tmp_path, capsys):
    journal = known_journal(tmp_path / "j.jsonl")
    scrape = tmp_path / "scrape.prom"
    scrape.write_text(
        "# TYPE npu_shadow_comparisons_total counter\n"
        'npu_shadow_comparisons_total{target="tensor_type",outcome="match",signature="dtype/cpu/blocking"} 9000\n'
    )
    assert cli.main(["report", "--metrics-file", str(scrape), "--journal", str(journal)]) == 0
    out = capsys.readouterr().out
    assert "| tensor_type | promote | 9,000 | 0 |" not in out  # the risky signatures were never compared
    assert "| tensor_type | inconclusive | 9,000 | 0 |" in out
    assert "device npu:0 vs npu:1 #0" in out  # details still come from the journal


@pytest.mark.slow
def test_millions_of_lines_need_bounded_memory(tmp_path):
    """Memory depends on the number of groups and tests, not lines: 20x the lines, about the same peak."""

    def peak(lines):
        path = tmp_path / f"j{lines}.jsonl"
        with open(path, "w") as handle:
            handle.write(HEADER + "\n")
            for i in range(lines):
                handle.write(record("tensor_type", "mismatch", f"sig{i % 5}", ["value"], "d" * 100,
                                    test=f"t.py::test_{i % 50}") + "\n")  # fmt: skip
        tracemalloc.start()
        evidence = report.collect([str(path)])
        _, high = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert evidence.lines == lines + 1 and sum(g.count for g in evidence.groups.values()) == lines
        return high

    small, large = peak(1_000), peak(20_000)
    assert large < 2 * small + (1 << 20), (small, large)


def test_bad_sources_and_no_source_exit_2(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_bytes(b"\x00\xff\n")
    assert cli.main(["report", "--journal", str(tmp_path / "bad.jsonl")]) == 2
    assert cli.main(["report"]) == 2
    assert "give --journal" in capsys.readouterr().err


def charted_journal(path):
    """The known journal, plus an hour of timestamped comparisons with errors and A/A runs: every chart has data."""
    known_journal(path)
    lines = []
    for minute in range(60):
        for i in range(20):
            line = json.loads(
                record(
                    "tensor_type",
                    "mismatch" if (minute % 7 == 0 and i == 0) else "match",
                    "dtype/current/blocking",
                    ["value"] if (minute % 7 == 0 and i == 0) else [],
                )
            )
            line.update(timestamp=1_700_000_000 + 60 * minute + i, numel=4, max_abs_error=10.0 ** -(i % 9),
                        aa=i == 5, aa_abs_error=1e-6 if i == 5 else 0.0)  # fmt: skip
            lines.append(json.dumps(line))
    with open(path, "a") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def test_the_html_holds_the_charts_as_inline_svg(tmp_path):
    journal = charted_journal(tmp_path / "j.jsonl")
    page = tmp_path / "report.html"
    assert (
        cli.main(["report", "--journal", str(journal), "--markdown", str(tmp_path / "r.md"), "--html", str(page)]) == 0
    )
    text = page.read_text()
    charts = text.split('<h2 id="charts">')[1].split("<h2")[0]
    assert charts.count("<svg") == 4
    for title in ("Divergence rate over time", "Risky signatures", "Greatest absolute error", "Noise floor"):
        assert title in charts
    assert "fast burn 0.0144" in charts and "slow burn 0.006" in charts and "max rate 0.001" in charts
    assert "## Charts" not in (tmp_path / "r.md").read_text()  # (Markdown: no room for pictures)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (the test command installs it)")
def test_the_html_renders_in_chromium_with_the_verdict_table(tmp_path):
    from shadow.analysis import charts

    journal = charted_journal(tmp_path / "j.jsonl")
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    assert (
        cli.main(["report", "--journal", str(journal), "--markdown", str(tmp_path / "r.md"), "--html", str(page)]) == 0
    )
    assert "<script" not in page.read_text() and "http" not in page.read_text()  # self-contained
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
         "--window-size=1000,3000", page.as_uri()],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)},
    )  # fmt: skip
    assert shot.exists(), done.stderr[-2000:]
    image = png.pixels(shot).astype(int)
    rollback_cells = (np.abs(image - [255, 201, 201]).sum(-1) < 6).sum()  # the verdict table's rollback cells
    header_cells = (np.abs(image - [241, 243, 245]).sum(-1) < 4).sum()
    assert rollback_cells > 2 * 500, rollback_cells  # two targets, each a cell of some 80 x 25 pixels
    assert header_cells > 1000

    def painted(colour: str) -> int:
        rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
        return int((np.abs(image - rgb).sum(-1) < 6).sum())

    # every chart drew something: rate bars, coverage bars, error histogram, noise floor bars
    drawn = {c: painted(c) for c in (charts.RATE, charts.COVERED, charts.ERRORS, charts.NOISE)}
    assert all(count > 300 for count in drawn.values()), drawn


@pytest.mark.slow
def test_the_command_runs_as_a_process(tmp_path):
    journal = known_journal(tmp_path / "j.jsonl")
    done = npu_shadow("report", "--journal", str(journal), timeout=120)
    assert done.returncode == 0 and "**Overall: rollback**" in done.stdout
