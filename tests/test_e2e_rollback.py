"""Alert-driven rollback, end to end with real processes: two canary jobs (upstream returned, torch_npu 2.12.0's
legacy compared) under `npu-shadow run`, Prometheus with the shipped rules, Debian's Alertmanager with the shipped
route, and `npu-shadow receiver`. The job that diverges (a cast on a non-current npu, and a fire drill) flips to
legacy within seconds of the alert; the healthy one does not. And a short job's push through a real Pushgateway."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from commands import npu_shadow
from prometheus_server import PrometheusServer, free_port, process, prometheus
from torch_npu_wheels import wheel

from dashboards import rules

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "dashboards")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PUSHGATEWAY = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
TOKEN = "canary-token-0123456789abcdef"
RECEIVER_TOKEN = "alertmanager-token-0123456789abcdef"  # (what Alertmanager sends the receiver)


def test_the_shipped_alertmanager_and_prometheus_configs_are_valid():
    amtool, promtool = shutil.which("amtool"), shutil.which("promtool")
    if amtool is None or promtool is None:
        pytest.skip("amtool/promtool not installed (the test command installs them)")
    checked = subprocess.run(
        [amtool, "check-config", "alertmanager/alertmanager.yml"], cwd=SHIPPED, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    checked = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=os.path.join(SHIPPED, "prometheus"),
                             capture_output=True, text=True)  # fmt: skip
    assert checked.returncode == 0 and "1 rule files found" in checked.stdout, checked.stdout + checked.stderr


def _alertmanager_config(tmp_path, receiver_port: int) -> str:
    """The shipped route and receiver, pointed at this test's receiver, with this test's short intervals."""
    with open(os.path.join(SHIPPED, "alertmanager", "alertmanager.yml")) as handle:
        config = yaml.safe_load(handle)
    config["route"]["group_wait"] = "1s"
    config["route"]["group_interval"] = "1s"
    (hook,) = [r for r in config["receivers"] if r["name"] == "npu-shadow-rollback"]
    hook["webhook_configs"][0]["url"] = f"http://127.0.0.1:{receiver_port}/alerts"
    credentials = tmp_path / "receiver.token"
    credentials.write_text(RECEIVER_TOKEN)
    hook["webhook_configs"][0]["http_config"]["authorization"]["credentials_file"] = str(credentials)
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _job(tmp_path, name: str, metrics_port: int, switch_port: int, device: str, *extra: str) -> subprocess.Popen:
    legacy = wheel("2.12.0")
    env = {**os.environ, "NPU_SHADOW_ROLLBACK_TOKEN": TOKEN, "NPU_SHADOW_JOURNAL": str(tmp_path / f"{name}.jsonl")}
    return subprocess.Popen(
        [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", legacy, "--primary", "upstream",
         "--sample-rate", "1", "--budget", "off", "--port", str(metrics_port), "--rollback-port", str(switch_port),
         "--linger", "0", *extra, "--",
         sys.executable, os.path.join(ROOT, "tests", "canary_job.py"), "--device", device,
         "--out", str(tmp_path / f"{name}.out"), "--stop", str(tmp_path / "stop")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.err", "w"),
    )  # fmt: skip


def _devices(tmp_path, name: str) -> list[tuple[float, str]]:
    path = tmp_path / f"{name}.out"
    if not path.exists():
        return []
    return [(float(t), d) for t, d in (line.split() for line in path.read_text().splitlines() if " " in line)]


@pytest.mark.skipif(
    ALERTMANAGER is None, reason="needs Debian's prometheus-alertmanager (the test command installs it)"
)
def test_an_alert_rolls_the_diverging_canary_back_to_legacy_and_leaves_the_healthy_one(tmp_path):
    ports = {name: (free_port(), free_port()) for name in ("drilled", "healthy")}
    receiver_port, alertmanager_port = free_port(), free_port()
    switches = [f"--switch=canary_{name}=http://127.0.0.1:{switch}" for name, (_, switch) in ports.items()]
    env = {**os.environ, "NPU_SHADOW_ROLLBACK_TOKEN": TOKEN, "NPU_SHADOW_RECEIVER_TOKEN": RECEIVER_TOKEN}
    jobs = {
        # a cast on a non-current npu (legacy: onto npu:0; upstream: stays on npu:1), and a fire drill
        "drilled": _job(tmp_path, "drilled", *ports["drilled"], "npu:1", "--drill", "dtype:0.5"),
        "healthy": _job(tmp_path, "healthy", *ports["healthy"], "npu:0"),  # legacy and upstream agree
    }
    try:
        receiver = [sys.executable, "-m", "shadow", "receiver", f"--listen=127.0.0.1:{receiver_port}", *switches]
        alertmanager = [
            ALERTMANAGER, f"--config.file={_alertmanager_config(tmp_path, receiver_port)}",
            f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{alertmanager_port}",
            "--cluster.listen-address=",
        ]  # fmt: skip
        scraped = {f"canary_{n}": metrics for n, (metrics, _) in ports.items()}
        with (
            process(tmp_path, "receiver", receiver, f"http://127.0.0.1:{receiver_port}/-/ready", env=env),
            process(tmp_path, "alertmanager", alertmanager, f"http://127.0.0.1:{alertmanager_port}/-/ready"),
            prometheus(
                tmp_path, scraped, [str(rules.RULES_PATH)], alertmanager=f"127.0.0.1:{alertmanager_port}"
            ) as server,
        ):
            waiter = PrometheusServer(server.url)
            # the canary returns upstream's result: the cast stays on npu:1
            waiter.wait_for(lambda: any(d == "npu:1" for _, d in _devices(tmp_path, "drilled")), "upstream's results",
                            timeout=120)  # fmt: skip

            def firing():
                return [
                    a for a in server.alerts()
                    if a["labels"].get("job") == "canary_drilled" and a["labels"].get("action") == "rollback"
                    and a["state"] == "firing"
                ]  # fmt: skip

            alert = waiter.wait_for(firing, "a rollback alert for the diverging job")[0]
            flipped = waiter.wait_for(
                lambda: [t for t, d in _devices(tmp_path, "drilled") if d == "npu:0"],
                "the diverging job to return legacy's",
            )[0]
            # from then on every call returns legacy's result
            waiter.wait_for(
                lambda: len([1 for t, _ in _devices(tmp_path, "drilled") if t > flipped]) >= 20, "later calls"
            )
            assert all(d == "npu:0" for t, d in _devices(tmp_path, "drilled") if t >= flipped)
            active_at = _seconds(alert["activeAt"])
            print(f"alert active at {active_at:.3f}, job returned legacy's result at {flipped:.3f}: "
                  f"{flipped - active_at:.2f} s")  # fmt: skip
            assert flipped - active_at < 30
            # the healthy canary was never flipped: its switch untouched, no rollback in its metrics
            time.sleep(0)  # (nothing to wait for: the drilled job's flip came after its own alert)
            assert not [
                a for a in server.alerts() if a["labels"].get("job") == "canary_healthy" and a["state"] == "firing"
            ]
            rollbacks = server.query("sum by (job) (npu_shadow_rollbacks_total)")
            # (the healthy job rolled nothing back: it has no rollback series)
            assert rollbacks[(("job", "canary_drilled"),)] >= 1 and (("job", "canary_healthy"),) not in rollbacks
            status = json.load(urlopen(f"http://127.0.0.1:{ports['healthy'][1]}/status"))
            assert status == {"thrown": False, "thrown_at": None, "source": None}
            flips = [json.loads(x) for x in (tmp_path / "receiver.log").read_text().splitlines() if x[:1] == "{"]
            assert {f["job"] for f in flips} == {"canary_drilled"} and {f["status"] for f in flips} == {200}
    finally:
        (tmp_path / "stop").write_text("done")
        for job in jobs.values():
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                job.kill()
    # the journal records the flip and who threw it
    records = [json.loads(line) for line in (tmp_path / "drilled.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "rollback"]
    assert events and all(e["by"].startswith("http:alertmanager:Npu") for e in events)
    # and the verdict reads it: rolled back, not reset, whatever the clean legacy phase after it shows
    done = npu_shadow("verdict", "--journal", str(tmp_path / "drilled.jsonl"), timeout=120)
    assert done.returncode == 1 and "rollbacks not reset: http:alertmanager:Npu" in done.stdout, done.stdout


def urlopen(url: str):
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)


def _seconds(stamp: str) -> float:
    """Prometheus's RFC 3339 time (nanoseconds and all) as a Unix time."""
    import datetime

    head, _, rest = stamp.partition(".")
    fraction = rest.rstrip("Z").split("+")[0][:6] if rest else "0"
    moment = datetime.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + float(f"0.{fraction}")


@pytest.mark.skipif(PUSHGATEWAY is None, reason="needs Debian's prometheus-pushgateway (the test command installs it)")
def test_a_short_job_pushes_at_exit_and_the_verdict_reads_it_through_prometheus(tmp_path):
    gateway = free_port()
    with (
        process(tmp_path, "pushgateway", [PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{gateway}"],
                f"http://127.0.0.1:{gateway}/-/ready"),
        prometheus(tmp_path, {"pushgateway": gateway}, [], honor_labels=("pushgateway",)) as server,
    ):  # fmt: skip
        env = {**os.environ, "NPU_SHADOW_JOB": "short-job"}
        script = (
            "import torch; from shadow.npu import reference; reference.patch_torch(); "
            "[torch.ones(2).type(torch.float16) for _ in range(40)]"
        )
        done = npu_shadow(
            "run",
            "--sample-rate",
            "1",
            "--budget",
            "off",
            "--pushgateway",
            f"127.0.0.1:{gateway}",
            "--",
            sys.executable,
            "-c",
            script,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        query = 'sum by (job, instance) (npu_shadow_comparisons_total{job="short-job"})'
        pushed = server.wait_for(lambda: server.query(query), "the pushed series")
        ((labels, value),) = pushed.items()
        assert dict(labels)["instance"].endswith(":rank0") and value == 40  # grouped by job and instance
        # (decided on the job's own run, as a pull request's verdict is: it once met a second run of the same job
        # name, an earlier session's, in the servers it was given)
        (run,) = re.findall(r"^npu-shadow: run (\S+)$", done.stderr, flags=re.M)
        verdict = npu_shadow(
            "verdict", "--prometheus", server.url, "--selector", 'job="short-job"', "--run", run, timeout=120
        )
        assert verdict.returncode == 3 and "tensor_type" in verdict.stdout and "40" in verdict.stdout
    # a gateway that never answers costs the job at most the push timeout, and never its exit code
    silent = __import__("socket").socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        done = npu_shadow(
            "run",
            "--pushgateway",
            f"127.0.0.1:{silent.getsockname()[1]}",
            "--",
            sys.executable,
            "-c",
            "import torch, sys; sys.exit(7)",
            timeout=120,
        )
        assert done.returncode == 7, done.stderr
        # (given up at its deadline or its socket's timeout, both the documented 3 s: what the job itself says it did)
        assert re.search(
            r"push to \S+ failed after [0-9.]+ s: (not finished within its 3 s deadline|.*timed out)",
            done.stderr,
        ), done.stderr
    finally:
        silent.close()


def test_a_fleet_of_two_torchrun_jobs_adds_up_per_job_and_fleet_wide(tmp_path):
    """Two jobs of four ranks each (gloo on the CPU, the emulated npu in every rank, DataParallel in one), each rank
    serving its own endpoint, one Prometheus: the recording rules and the verdict with --selector give per-job and
    fleet-wide counts equal to the sums of the ranks' own (their exposition written at exit)."""
    from prometheus_server import consecutive_free_ports

    ranks = 4
    bases = {"fleet_a": consecutive_free_ports(ranks), "fleet_b": consecutive_free_ports(ranks)}
    stop = tmp_path / "stop"
    jobs = {}
    for name, base in bases.items():
        textfile = str(tmp_path / f"{name}-rank{{rank}}.prom")
        jobs[name] = subprocess.Popen(
            [sys.executable, "-m", "shadow", "run", "--emulate-npu", "2", "--legacy-from", wheel("2.12.0"),
             "--sample-rate", "1", "--budget", "off", "--port", str(base), "--textfile", textfile,
             "--linger", "0", "--",  # (its Prometheus is gone when the jobs end: the textfiles hold the final counts)
             sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
             str(free_port()), os.path.join(ROOT, "tests", "fleet_rank.py"), "--stop", str(stop),
             "--done", str(tmp_path / f"{name}.done-"),
             *(["--dp"] if name == "fleet_a" else [])],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.err", "w"),  # noqa: SIM115
        )  # fmt: skip
    scrape = {f"{name}-rank{r}": base + r for name, base in bases.items() for r in range(ranks)}
    seen: list[dict[str, float]] = []
    try:
        with prometheus(tmp_path, scrape, [str(rules.RULES_PATH)]) as server:
            # (each endpoint is a scrape job of its own here: a rank's job is its name's prefix)
            def per_job(record: str) -> dict[str, float]:
                found: dict[str, float] = {}
                for labels, value in server.query(f'{record}{{target="tensor_type"}}').items():
                    job = dict(labels)["job"].split("-rank")[0]
                    found[job] = found.get(job, 0) + value
                return found

            def settled() -> bool:
                """Every rank done with its calls (it then waits for the stop file), all scraped, and the per-job
                calls and comparisons the same over the last six polls, every rank up at each (a rank whose scrape
                failed at load leaves the rules for a while: stability alone let the rules miss its counts)."""
                if len(list(tmp_path.glob("fleet_*.done-*"))) < 2 * ranks:
                    return False
                up = server.query('sum(up{job=~"fleet_.*"})').get((), 0)
                calls, compared = per_job("npu_shadow:calls:total"), per_job("npu_shadow:comparisons:total")
                seen.append((up, calls, compared))
                return len(seen) > 6 and len(calls) == 2 and all(s == (2 * ranks, calls, compared) for s in seen[-6:])

            server.wait_for(settled, "every rank scraped and done", timeout=240)
            _, calls, compared = seen[-1]
            fleet = server.query('sum(npu_shadow:comparisons:total{target="tensor_type"})')[()]
            assert fleet == sum(compared.values())  # fleet-wide: the sum over the jobs
            dp = server.query('sum by (job) (npu_shadow:comparisons:total{target="parallel_apply"})')
            assert {dict(k)["job"].split("-rank")[0] for k, v in dp.items() if v > 0} == {"fleet_a"}
            verdict = npu_shadow(
                "verdict", "--prometheus", server.url, "--selector", 'job=~"fleet_b-rank.*"', timeout=120
            )
            row = next(line.split() for line in verdict.stdout.splitlines() if line.startswith("tensor_type"))
            assert int(row[2]) == compared["fleet_b"], verdict.stdout
    finally:
        stop.write_text("done")
        for job in jobs.values():
            try:
                job.wait(120)
            except subprocess.TimeoutExpired:
                job.kill()
    for name in bases:  # each rank's own count, written at its exit, is what was scraped
        assert jobs[name].returncode == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
        own = 0.0
        for r in range(ranks):
            for line in (tmp_path / f"{name}-rank{r}.prom").read_text().splitlines():
                if line.startswith("npu_shadow_calls_total{") and 'target="tensor_type"' in line:
                    own += float(line.split()[-1])
        assert own == calls[name] > 0, (name, own, calls)
