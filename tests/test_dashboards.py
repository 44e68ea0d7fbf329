"""The dashboards and alerts against real data: a real Prometheus on loopback scrapes a live `strata serve` (the
embedded default) the way the chart's ServiceMonitor would, a few requests go through, and then every PromQL
expression of every panel (Strata's dashboards and the vLLM dashboards users already run) and of every alert is
evaluated through Prometheus' HTTP API: each must parse, and each panel query must return data, except the
explicit exceptions below."""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy_tools import CHART, REPO, by_kind, helm_template, tool
from tests.server_process import Server, free_port

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
PEER_DASHBOARDS = REPO.parent / "shared" / "peer" / "vllm-dashboards"
ALERTS = CHART / "alerts" / "strata-alerts.yaml"
DEADLINE_S = 90
# Grafana's built-in variables, as a 1 s scrape interval makes them
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "30s", "interval": "30s", "__interval_ms": "30000",
                     "__range": "5m", "__range_s": "300", "__range_ms": "300000"}

# Panels that only have to parse: the production-stack router's own metrics, which no engine exports.
ROUTER_METRICS = {"vllm:current_qps", "vllm:healthy_pods_total", "router_cpu_usage_percent",
                  "router_memory_usage_percent", "router_disk_usage_percent"}
# Strata facts the engine dashboard shows under the names they will have; Strata does not export them yet.
# Once one is exported its panels are checked like the others: take it off this list (the test says so).
NOT_YET_EXPORTED: set[str] = set()
# NVML's utilisation per GPU: no series on a machine without a GPU (CI), checked where there is one.
GPU_ONLY = {"strata:gpu_util", "strata:gpu_memory_used_bytes", "strata:gpu_memory_total_bytes"}
# Ratios whose denominator is legitimately zero here, so they answer NaN (the series must still be there): the
# live server has no CPU expert pool, so no pooled pair to take a hit rate of. Not the drafts' or the prefix
# cache's: the server drafts (`--spec ngram:2`) and its follow-up request looks its prompt up in the prefix cache.
ZERO_DENOMINATORS = {"strata:expert_pairs_total"}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:vllm|strata):[A-Za-z0-9_:]+|router_[a-z_]+)", expr))


def panels(node) -> list[dict]:
    """Every panel of a dashboard, rows' nested panels included."""
    found = []
    for panel in node.get("panels", []):
        found.append(panel)
        found += panels(panel)
    return found


def queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    board = json.loads(path.read_text())
    return [(p.get("title", ""), t["expr"]) for p in panels(board) for t in p.get("targets", []) if t.get("expr")]


def substitute(expr: str, model: str) -> str:
    values = {**GRAFANA_VARIABLES, "model_name": model}

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            pytest.fail(f"unknown Grafana variable {m.group(0)} in {expr}", pytrace=False)
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", value, expr)


# static checks of Strata's own dashboards

@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_has_datasource_and_model_variables_on_every_panel(path):
    board = json.loads(path.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query" and "model_name" in variables["model_name"]["definition"]
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels(board):
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'model_name=~"$model_name"' in target["expr"], (panel["title"], target["expr"])
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))


def test_dashboards_show_what_the_issue_lists():
    vllm = " ".join(e for _, e in queries(CHART / "dashboards" / "strata-vllm.json"))
    engine = " ".join(e for _, e in queries(CHART / "dashboards" / "strata-engine.json"))
    assert not metric_names(vllm) - {n for n in metric_names(vllm) if n.startswith("vllm:")}, \
        "the vLLM dashboard uses vLLM's names only, so it reads vLLM too"
    for name in ("request_success_total", "num_requests_running", "num_requests_waiting",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "generation_tokens_total", "kv_cache_usage_perc",
                 "prefix_cache_hits_total", "spec_decode_num_accepted_tokens_total"):
        assert f"vllm:{name}" in vllm, name
    assert "by (finished_reason)" in vllm
    for name in ("gpu_util", "gpu_memory_used_bytes", "expert_residency", "expert_pairs_total",
                 "expert_pool_seconds_total", "expert_pool_read_bytes_total", "expert_upload_bytes_total",
                 "slots_in_use", "slots_total",
                 "parked_conversations", "parked_bytes",
                 "parked_restore_seconds_bucket", "pipeline_groups"):
        assert f"strata:{name}" in engine, name
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"vllm:{name}" in engine, name  # draft acceptance: rate, tokens per draft, by position
    assert "by (model_name, position)" in engine
    assert 'strata:expert_pairs_total{model_name=~"$model_name", where="device"}' in engine  # the hit rate
    for tier in ("ram", "disk", "vram"):
        assert f'strata:parked_bytes{{model_name=~"$model_name", tier="{tier}"}}' in engine, tier


def test_peer_dashboards_are_there():
    found = sorted(PEER_DASHBOARDS.glob("*.json"))
    assert found, f"the vLLM dashboards users run are expected in {PEER_DASHBOARDS}"


# a live server scraped by a real Prometheus

class Prometheus:
    def __init__(self, workdir: Path, target: str, labels: dict[str, str], job: str, rule_file: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rule_file)],
            "scrape_configs": [{"job_name": job, "metrics_path": labels.pop("__metrics_path__"),
                                "static_configs": [{"targets": [target], "labels": labels}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: httpx.get(self.url + "/-/ready", timeout=2).status_code == 200, "Prometheus ready")

    def wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}: "
                            f"{Path(self.log.name).read_text()[-2000:]}", pytrace=False)
            try:
                if condition():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}", pytrace=False)

    def query(self, promql: str) -> dict:
        return httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10).json()

    def vector(self, promql: str) -> list:
        reply = self.query(promql)
        assert reply["status"] == "success", (promql, reply)
        return reply["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def scrape_identity() -> tuple[str, dict[str, str]]:
    """The job and target labels the Prometheus Operator gives the chart's ServiceMonitor targets."""
    objects = helm_template("operator.enabled=false", "crds.install=false", "server.enabled=true",
                            "serviceMonitor.enabled=true")
    (monitor,) = by_kind(objects, "ServiceMonitor")
    (service,) = by_kind(objects, "Service")
    (endpoint,) = monitor["spec"]["endpoints"]
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    labels = {"endpoint": endpoint["port"], "namespace": service["metadata"]["namespace"],
              "service": service["metadata"]["name"], "__metrics_path__": endpoint["path"]}
    return job, labels


def send_requests(url: str) -> int:
    """Chat and completions, streamed and not, two at a time (the server has two batch slots); the last one's text
    repeats, so that its slot drafts (`--spec ngram:2`) and keeps drafts. Then a follow-up of the first completion,
    which the second pair parked: it is restored (the parking panels)."""
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0}
    completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    repeating = {"prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,", "max_tokens": 8, "temperature": 0}
    requests = [("/v1/chat/completions", chat, False), ("/v1/completions", completion, True),
                ("/v1/chat/completions", chat, True), ("/v1/completions", repeating, False)]
    errors = []

    def one(path, body, stream):
        try:
            body = {**body, "stream": stream}
            with httpx.Client(timeout=120) as client:
                if stream:
                    with client.stream("POST", url + path, json=body) as reply:
                        reply.raise_for_status()
                        assert any(line == "data: [DONE]" for line in reply.iter_lines())
                else:
                    reply = client.post(url + path, json=body)
                    reply.raise_for_status()
                    assert reply.json()["usage"]["completion_tokens"] >= 2
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{path} stream={stream}: {e!r}")

    follow_up = {"prompt": "The capital of France is Paris. The capital of Italy is", "max_tokens": 4,
                 "temperature": 0}
    for pair in (requests[:2], requests[2:], [("/v1/completions", follow_up, False)]):
        threads = [threading.Thread(target=one, args=r) for r in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    return len(requests) + 1


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    job, labels = scrape_identity()
    # drafts on, so the draft acceptance panels have series to read (greedy answers are the same with them)
    server = Server("--batch", "2", "--max-cells", "256", "--spec", "ngram:2")
    prometheus = None
    try:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"), f"127.0.0.1:{server.port}", dict(labels),
                                job, ALERTS)
        prometheus.wait(lambda: [s["value"][1] for s in prometheus.vector(f'up{{job="{job}"}}')] == ["1"],
                        "the first scrape")
        num_requests = send_requests(server.url)
        prometheus.wait(lambda: sum(float(s["value"][1]) for s in prometheus.vector(
            f'vllm:request_success_total{{job="{job}"}}')) >= num_requests and all(
            float(s["value"][1]) == 0 for s in prometheus.vector(f'vllm:num_requests_running{{job="{job}"}}'))
            and prometheus.vector(f'vllm:spec_decode_num_accepted_tokens_total{{job="{job}"}} > 0'),
            "Prometheus to scrape every finished request, and accepted drafts")
        yield prometheus, model, job, labels
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()


def exported(prometheus: Prometheus, name: str) -> bool:
    return bool(prometheus.vector(f'count({{__name__="{name}"}})'))


def check_panel_query(prometheus: Prometheus, source: str, title: str, expr: str, promql: str) -> str | None:
    """None when the query is fine, else what is wrong with it."""
    reply = prometheus.query(promql)
    if reply["status"] != "success":
        return f"{source} / {title}: does not parse: {reply.get('error')}\n  {promql}"
    names = metric_names(expr)
    if names & ROUTER_METRICS:
        return None
    if names & NOT_YET_EXPORTED:
        now = {n for n in names & NOT_YET_EXPORTED if exported(prometheus, n)}
        return f"{sorted(now)} are exported now: take them off NOT_YET_EXPORTED" if now else None
    if names & GPU_ONLY and not any(exported(prometheus, n) for n in names & GPU_ONLY):
        return None
    result = reply["data"]["result"]
    if not result:
        return f"{source} / {title}: no data\n  {promql}"
    values = [float(s["value"][1]) for s in result]
    if not names & ZERO_DENOMINATORS and all(math.isnan(v) for v in values):
        return f"{source} / {title}: only NaN\n  {promql}"
    return None


def test_every_panel_query_of_strata_and_vllm_dashboards_returns_data(live):
    prometheus, model, _, _ = live
    problems, checked = [], 0
    for path in [*DASHBOARDS, *sorted(PEER_DASHBOARDS.glob("*.json"))]:
        for title, expr in queries(path):
            problem = check_panel_query(prometheus, path.name, title, expr, substitute(expr, model))
            checked += 1
            if problem:
                problems.append(problem)
    assert checked >= 60
    assert not problems, "\n".join(problems)


def test_draft_acceptance_panels_agree_with_each_other(live):
    """The engine dashboard's draft panels on the live drafts, at one instant: a rate in (0, 1], and the positions'
    shares add up to the accepted tokens per draft (so each position's series counted its first drafts too)."""
    prometheus, model, _, _ = live
    board = queries(CHART / "dashboards" / "strata-engine.json")
    at = time.time()

    def values(title: str, start: str = "") -> list[float]:
        (expr,) = [e for t, e in board if t == title and e.startswith(start)]
        reply = httpx.get(prometheus.url + "/api/v1/query", params={"query": substitute(expr, model), "time": at},
                          timeout=10).json()
        assert reply["status"] == "success", (expr, reply)
        return [float(s["value"][1]) for s in reply["data"]["result"]]

    (rate,) = values("Draft acceptance rate")
    (per_draft,) = values("Accepted tokens per draft", "sum")
    (per_window,) = values("Accepted tokens per draft", "1 + ")
    by_position = values("Draft acceptance by position")
    assert 0 < rate <= 1 and 0 < per_draft <= 2 and per_window == pytest.approx(1 + per_draft)
    assert len(by_position) == 2 and sum(by_position) == pytest.approx(per_draft), by_position


def test_model_name_variables_list_the_served_model(live):
    prometheus, model, _, _ = live
    for path in [*DASHBOARDS, *sorted(PEER_DASHBOARDS.glob("*.json"))]:
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable.get("name") != "model_name":
                continue
            m = re.fullmatch(r"label_values\((?:(.+),\s*)?(\w+)\)", variable["definition"])
            assert m, variable["definition"]
            params = {"match[]": m.group(1)} if m.group(1) else {}
            values = httpx.get(f"{prometheus.url}/api/v1/label/{m.group(2)}/values", params=params, timeout=10).json()
            assert model in values["data"], (path.name, variable["definition"], values)


def test_every_alert_parses_reads_live_series_and_stays_silent(live):
    prometheus, _, job, _ = live
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    for rule in rules:
        reply = prometheus.query(rule["expr"])
        assert reply["status"] == "success", (rule["alert"], reply)
        for name in sorted(metric_names(rule["expr"]) - NOT_YET_EXPORTED):
            assert prometheus.vector(f'{name}{{job="{job}"}}'), f"{rule['alert']}: no series {name}{{job={job!r}}}"
    assert prometheus.vector(f'up{{job="{job}"}}'), "StrataReplicaDown reads up{job=...}"

    def evaluated():
        loaded = httpx.get(prometheus.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        states = [r for g in loaded for r in g["rules"]]
        return len(states) == len(rules) and all(r["health"] == "ok" for r in states)

    prometheus.wait(evaluated, "Prometheus to load and evaluate every alert rule without error")
    firing = [a for a in httpx.get(prometheus.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]
              if a["state"] == "firing"]
    assert firing == [], "a healthy server fires no alert"
