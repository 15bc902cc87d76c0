"""A real Prometheus (the Debian package) scrapes a real `tokenflow serve` under load and a
real vLLM's /metrics (a capture served as it was recorded); every PromQL expression of the
shipped dashboard and rules then returns data through Prometheus's HTTP API, and promtool
accepts the rules, the example configuration and the server's /metrics."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from engine.serve.prometheus import PREFIX
from tests.postgres import free_port, skip_or_fail
from tests.serving import killed_if_left, serve_on, stopped

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenflow.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
SCRAPE = ROOT / "deploy" / "prometheus" / "scrape.yml"
VLLM_METRICS = ROOT / "tests" / "data" / "vllm_capture" / "metrics_2.txt"
DATA_DEADLINE_S = 90.0  # for the last expression to return data, on a loaded machine
POLL_S = 0.25  # between rounds of queries: a scrape comes every second
# Grafana's variables as one dashboard view fills them: every job and instance.
GRAFANA_VARIABLES = {"$__rate_interval": "15s", "$job": ".*", "$instance": ".*"}
COMPARISON = re.compile(r"\s(>=|<=|==|!=|>|<)\s")


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} not found: apt-get install prometheus")
    assert path is not None
    return path


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    expressions = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    for name, value in GRAFANA_VARIABLES.items():
        expressions = [expr.replace(name, value) for expr in expressions]
    return expressions


def rule_expressions() -> list[str]:
    """Every rule's expression; an alert's comparison made `bool`, so that it returns its
    series (0 or 1) whether or not it fires now."""
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]]
    return [COMPARISON.sub(r" \1 bool ", rule["expr"], count=1) if "alert" in rule
            else rule["expr"] for rule in rules]


def test_promtool_accepts_the_rules_and_the_example_configuration() -> None:
    promtool = tool("promtool")
    subprocess.run([promtool, "check", "rules", str(RULES)], check=True, capture_output=True)
    subprocess.run([promtool, "check", "config", str(SCRAPE)], check=True, capture_output=True)
    assert len(dashboard_expressions()) >= 20 and len(rule_expressions()) == 7


@contextlib.contextmanager
def static_metrics(text: bytes) -> Iterator[str]:
    """A /metrics endpoint answering `text`: a vLLM as it was recorded."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def load(base_url: str) -> Iterator[None]:
    """Completions one after another until the block ends."""
    done = threading.Event()

    def send() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not done.is_set():
                client.post("/v1/completions", json={"model": "synthetic:tiny",
                                                     "prompt": "hello " * 40, "max_tokens": 8})

    threads = [threading.Thread(target=send, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=60)


@pytest.mark.slow  # starts serve and Prometheus
def test_prometheus_scrapes_serve_and_every_shipped_expression_returns_data(
        tmp_path: Path) -> None:
    prometheus, promtool = tool("prometheus"), tool("promtool")
    with killed_if_left(serve_on(tmp_path / "serve.db")) as server, \
            static_metrics(VLLM_METRICS.read_bytes()) as vllm:
        assert server.stdout is not None
        banner = server.stdout.readline()
        match = re.search(r"http://([^,\s]+)", banner)
        assert match, banner
        target, base_url = match.group(1), match.group(0)
        web = f"127.0.0.1:{free_port()}"
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "tokenflow", "static_configs": [{"targets": [target]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [vllm]}]}]}))
        with load(base_url), subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--web.listen-address={web}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as scraper:
            try:
                missing = until_every_expression_returns_data(
                    f"http://{web}", dashboard_expressions() + rule_expressions())
            finally:
                scraper.terminate()
        assert missing == []
        metrics = httpx.get(f"{base_url}/metrics").text
        check = subprocess.run([promtool, "check", "metrics"], input=metrics, text=True,
                               capture_output=True)
        # vLLM's name for a histogram ends in _total: kept so its dashboards read it
        findings = [line for line in (check.stdout + check.stderr).splitlines()
                    if line.strip() and line.split()[0] != f"{PREFIX}iteration_tokens_total"]
        assert check.returncode in (0, 3) and findings == [], check.stdout + check.stderr
        stopped(server)


def until_every_expression_returns_data(url: str, expressions: list[str]) -> list[str]:
    """Query each expression until it returns a sample (Prometheus needs a few scrapes for a
    rate); the ones still empty at the deadline."""
    pending = list(dict.fromkeys(expressions))
    deadline = time.monotonic() + DATA_DEADLINE_S
    with httpx.Client(base_url=url, timeout=10) as client:
        while pending and time.monotonic() < deadline:
            time.sleep(POLL_S)
            try:
                client.get("/-/ready").raise_for_status()
            except httpx.HTTPError:
                continue  # still starting
            answers = {expr: client.get("/api/v1/query", params={"query": expr}).json()
                       for expr in pending}
            for expr, answer in answers.items():
                assert answer["status"] == "success", (expr, answer)
            pending = [expr for expr, answer in answers.items() if not answer["data"]["result"]]
    return pending
