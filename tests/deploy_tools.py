"""Where the deploy tests find their real tools (helm, promtool, prometheus, hadolint), and small runners for them.

`.ci/install-deploy-tools` installs them: helm, prometheus and promtool into $STRATA_TOOLS_DIR/bin (default
~/.cache/strata-tools/bin), hadolint into this Python's bin/. A missing tool fails the test that needs it, with
the command that installs it: these tests never skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[1]
CHART = REPO / "helm" / "strata"
INSTALL = ".ci/install-deploy-tools"


SERVER_ON = ["server.enabled=true"]
MONITORING_ON = ["serviceMonitor.enabled=true", "prometheusRule.enabled=true", "dashboards.enabled=true"]
# The combinations docs/DEPLOY.md documents, as --set arguments.
COMBINATIONS = {
    "default": [],
    "operator-only": ["dashboards.enabled=false"],
    "operator-namespaced": ["operator.watchNamespaces={team-a,team-b}"],
    "server-only": ["operator.enabled=false", "crds.install=false", *SERVER_ON, "dashboards.enabled=false"],
    "server-monitoring": ["operator.enabled=false", "crds.install=false", *SERVER_ON, *MONITORING_ON],
    "server-hostpath": [*SERVER_ON, "server.modelCache.type=hostPath", "server.runtimeClassName=nvidia",
                        "server.nodeSelector.nvidia\\.com/gpu\\.product=NVIDIA-H200", "server.gpus=2"],
    "server-existing-claim": [*SERVER_ON, "server.modelCache.pvc.existingClaim=models", "server.model=Qwen3-30B-A3B",
                              "server.apiKey.existingSecret=strata-key"],
    "server-cpu": [*SERVER_ON, "server.gpus=0", "server.device=cpu", "server.modelCache.type=emptyDir"],
    "everything": [*SERVER_ON, *MONITORING_ON],
    "server-client-ip": [*SERVER_ON, "server.service.sessionAffinity=ClientIP",
                         "server.service.sessionAffinityTimeoutSeconds=3600"],
    "server-ingress": [*SERVER_ON, "server.ingress.enabled=true"],
    "server-ingress-header": [*SERVER_ON, "server.ingress.enabled=true", "server.ingress.className=nginx",
                              "server.ingress.host=llm.example.com", "server.ingress.affinity=header",
                              "server.ingress.tls[0].secretName=strata-tls",
                              "server.ingress.tls[0].hosts[0]=llm.example.com"],
    "server-ingress-custom-header": [*SERVER_ON, "server.ingress.enabled=true", "server.ingress.affinity=header",
                                     "server.ingress.sessionHeader=X-Chat-Id", "server.service.port=80"],
    "monitoring-off": ["dashboards.enabled=false", "serviceMonitor.enabled=false", "prometheusRule.enabled=false"],
}

K8S_VERSIONS = ("1.28.0", "1.37.0")  # schemas of an older and the newest release (the chart also installs into a
# real v1.20 API server: tests/test_kube_chart.py)


def validate_k8s(obj: dict, where: str = "", versions: tuple[str, ...] = K8S_VERSIONS) -> None:
    """Fail the test unless `obj` validates (strictly) against the Kubernetes schemas of every version."""
    import kubernetes_validate  # installed by .ci/install-deploy-tools; the callers check that at import

    for version in versions:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.utils.ValidationError as e:
            pytest.fail(f"{where}{obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}: {e.message} at "
                        f"{'.'.join(map(str, e.absolute_path))}")


def tools_dir() -> Path:
    return Path(os.environ.get("STRATA_TOOLS_DIR", Path.home() / ".cache" / "strata-tools")) / "bin"


def tool(name: str) -> str:
    """The path of a tool: the tools folder first, then beside this Python, then PATH."""
    for folder in (tools_dir(), Path(sys.executable).parent):
        if (folder / name).is_file() and os.access(folder / name, os.X_OK):
            return str(folder / name)
    found = shutil.which(name)
    if found:
        return found
    pytest.fail(f"`{name}` is not installed: run `{INSTALL}` (looked in {tools_dir()}, "
                f"{Path(sys.executable).parent} and PATH)", pytrace=False)


def run(args: list[str], timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        pytest.fail(f"`{' '.join(args)}` exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    return proc


def helm_template(*set_args: str, values: dict | None = None, tmp_path: Path | None = None) -> list[dict]:
    """`helm template` of the chart with `--set` arguments (and a values file): the rendered objects."""
    args = [tool("helm"), "template", "strata", str(CHART), "--namespace", "strata"]
    if values is not None:
        assert tmp_path is not None
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    for s in set_args:
        args += ["--set", s]
    out = run(args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]
