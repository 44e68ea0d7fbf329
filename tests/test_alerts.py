"""The alerts: `promtool check rules` and `promtool test rules` on helm/strata/alerts/, every alert of the
issue present with a severity, a summary and a runbook_url whose anchor exists in docs/RUNBOOK.md, each
alert both fired and kept silent by the unit tests, and the chart's PrometheusRule shipping that same file."""

from __future__ import annotations

import re

import yaml

from tests.deploy_tools import CHART, REPO, by_kind, helm_template, run, tool

RULES = CHART / "alerts" / "strata-alerts.yaml"
RULE_TESTS = CHART / "alerts" / "strata-alerts.test.yaml"
RUNBOOK = REPO / "docs" / "RUNBOOK.md"
SEVERITIES = {"critical", "warning", "info"}
# The alerts the issue asks for: high p99 TTFT, high p99 inter-token latency, requests waiting, K/V usage above
# 95%, preemptions, the engine restarting, a replica down.
ISSUE_ALERTS = {"StrataHighTimeToFirstToken", "StrataHighInterTokenLatency", "StrataRequestsWaiting",
                "StrataKVCacheNearlyFull", "StrataPreemptions", "StrataEngineRestarted", "StrataReplicaDown"}


def alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", markdown, flags=re.MULTILINE):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


def test_promtool_check_rules():
    out = run([tool("promtool"), "check", "rules", str(RULES)]).stdout
    assert f"SUCCESS: {len(alerts())} rules found" in out, out


def test_promtool_unit_tests_pass():
    out = run([tool("promtool"), "test", "rules", str(RULE_TESTS)], cwd=RULE_TESTS.parent)
    assert "SUCCESS" in out.stdout and "FAILED" not in out.stdout, out.stdout


def test_the_issue_alerts_with_severity_summary_and_runbook():
    rules = alerts()
    assert {r["alert"] for r in rules} == ISSUE_ALERTS
    anchors = github_anchors(RUNBOOK.read_text())
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        url = rule["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/RUNBOOK.md", url
        assert anchor == name.lower() and anchor in anchors, f"{name}: no section #{anchor} in docs/RUNBOOK.md"
    section = RUNBOOK.read_text().split("\n## ")
    for rule in rules:
        (body,) = [s for s in section if s.startswith(rule["alert"] + "\n")]
        assert "**Meaning**" in body and "**Act**" in body, rule["alert"]


def test_every_alert_both_fires_and_stays_silent_in_the_unit_tests():
    spec = yaml.safe_load(RULE_TESTS.read_text())
    assert spec["rule_files"] == [RULES.name]
    fired, silent = set(), set()
    for case in spec["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
            for alert in check.get("exp_alerts") or []:
                assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}
    assert fired == silent == ISSUE_ALERTS, (ISSUE_ALERTS - fired, ISSUE_ALERTS - silent)


def test_the_prometheus_rule_ships_the_tested_file(tmp_path):
    groups = yaml.safe_load(RULES.read_text())["groups"]
    (rule,) = by_kind(helm_template("prometheusRule.enabled=true"), "PrometheusRule")
    assert rule["spec"]["groups"] == groups

    base = "https://git.example.com/strata/blob/v0.1.0/"
    (linked,) = by_kind(helm_template("prometheusRule.enabled=true", f"prometheusRule.runbookBaseUrl={base}"),
                        "PrometheusRule")
    for shipped, source in zip(linked["spec"]["groups"], groups):
        for got, want in zip(shipped["rules"], source["rules"]):
            assert got["annotations"]["runbook_url"] == base + want["annotations"]["runbook_url"]
            assert {**got, "annotations": {**got["annotations"], "runbook_url": want["annotations"]["runbook_url"]}} == want
    rendered = tmp_path / "rendered-rules.yaml"
    rendered.write_text(yaml.safe_dump({"groups": linked["spec"]["groups"]}))
    out = run([tool("promtool"), "check", "rules", str(rendered)]).stdout
    assert f"SUCCESS: {len(alerts())} rules found" in out
