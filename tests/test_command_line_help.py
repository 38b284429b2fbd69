"""The command line helps where a newcomer slips (issue 56's papercuts): a misspelt command, an option misspelt where
argparse meets another error first, no command at all, a Prometheus address without its scheme, an ambiguous
variable, help that says a default twice."""

import os
import subprocess
import sys

import pytest

from shadow.launcher import cli, config
from shadow.launcher.commands import options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fails(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as ended:
        cli.main(list(argv))
    assert ended.value.code == 2
    return capsys.readouterr().err


def test_a_misspelt_command_is_answered_with_the_one_meant(capsys) -> None:
    assert "error: no command 'verdit'; did you mean 'verdict'?" in _fails(capsys, "verdit", "--journal", "j")


def test_no_command_prints_the_whole_help(capsys) -> None:
    said = _fails(capsys)
    assert "census" in said and "--version" in said and "error: no command given: one of replay, run," in said


def test_a_misspelt_option_is_named_even_where_a_required_one_is_missing(capsys) -> None:
    """``verdict --jornal J`` said "one of the arguments --journal ... is required"."""
    said = _fails(capsys, "verdict", "--jornal", "j.jsonl")
    assert "npu-shadow verdict: error: unrecognized argument --jornal; did you mean --journal?" in said
    said = _fails(capsys, "run", "--sampel-rate", "1", "--", "python", "--sampel-rate")
    assert "did you mean --sample-rate?" in said


def test_the_jobs_own_options_after_the_double_dash_are_never_taken_for_misspellings(capsys) -> None:
    said = _fails(capsys, "run", "--bogus-flag", "--", "python", "--journl")
    assert "--journl" not in said


@pytest.mark.parametrize(
    ("given", "url"),
    [("127.0.0.1:9090", "http://127.0.0.1:9090"), ("https://prom:443/x", "https://prom:443/x")],
)
def test_a_prometheus_address_without_its_scheme_is_taken_as_http(given, url) -> None:
    assert options.prometheus_url(given) == url


@pytest.mark.parametrize("given", ["ftp://x", "h:port", "://"])
def test_what_is_no_prometheus_url_is_refused_saying_what_one_is(capsys, given) -> None:
    said = _fails(capsys, "verdict", "--prometheus", given)
    assert "is not a Prometheus server's URL (e.g. http://127.0.0.1:9090)" in said


def test_a_variable_that_ends_several_settings_names_them_all() -> None:
    """NPU_SHADOW_RATE was answered with NPU_SHADOW_AA_RATE alone (the nearest spelling, the least likely meant)."""
    (found,) = config.misspelt_variables({"NPU_SHADOW_RATE": "0.1"})
    assert found[1] == (
        "one of NPU_SHADOW_AA_RATE, NPU_SHADOW_BACKWARD_RATE, NPU_SHADOW_SAMPLE_RATE, NPU_SHADOW_TRUTH_RATE"
    )
    assert config.misspelt_variables({"NPU_SHADOW_SAMPEL_RATE": "1"}) == [("NPU_SHADOW_SAMPEL_RATE",
                                                                         "NPU_SHADOW_SAMPLE_RATE")]  # fmt: skip


def test_help_says_each_default_once(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--help"])
    out = capsys.readouterr().out
    assert out.count("9464") == 1 and "(default: 9464)" in out
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "all the targets together" in capsys.readouterr().out


def test_the_linger_help_says_what_a_textfile_job_does() -> None:
    """``run --help`` said ``--linger`` is 0 with a textfile, where a job whose endpoint was scraped lingered."""
    help_text = " ".join(config.SETTINGS["linger"].accepts.split())
    assert "0 with a Pushgateway" not in help_text
    assert "with a Pushgateway or textfile, which hold the final counts too, only where something scraped" in help_text


@pytest.mark.slow
def test_the_command_line_is_read_without_the_verdicts_statistics() -> None:
    """Every command's options are known before the job starts, and reading them loads no statistics library: the
    launcher of each ``npu-shadow run`` imported SciPy (a quarter of a second) for two defaults of the verdict's."""
    probe = (
        "import sys; from shadow.launcher import cli; cli.build_parser(); "
        "print(sorted(m for m in ('scipy', 'torch', 'shadow.analysis.verdict') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
