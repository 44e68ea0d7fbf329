"""A real Kubernetes control plane for the tests: etcd, kube-apiserver v1.20.2 and kube-controller-manager on
127.0.0.1, as `.ci/install-kube` builds them (docs/OPERATOR.md, "Tests against a real API server").

What runs: the API server with RBAC, its own schema validation, defaulting and pruning of custom resources, the
status and scale subresources, watches and resourceVersions; the controller manager's namespace,
garbage-collector and pvc-protection controllers (namespaces delete, owner references cascade, claims go). What does not: no scheduler, no
kubelet, no Deployment or ReplicaSet controller, so no Pod is ever made and a Deployment's status is only what a test
writes into it (as the Deployment controller would once its Pods were ready).

`ControlPlane.start()` takes about 5 s; one per test session (the `kube` fixture in tests/conftest.py), stopped at
the end. Clients authenticate with bearer tokens: the admin's static token (group system:masters) or a service
account's token from the TokenRequest API, so RBAC is the one the chart grants.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

INSTALL = ".ci/install-kube"
ADMIN_TOKEN = "strata-test-admin"
CONTROLLERS = "namespace,garbagecollector,pvc-protection"
# Every request a service account makes is logged (who, verb, resource, answer): RBAC tests read what was used.
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata", "userGroups": ["system:serviceaccounts"]}, {"level": "None"}]}


def kube_bin() -> Path:
    return Path(os.environ.get("STRATA_TOOLS_DIR", Path.home() / ".cache" / "strata-tools")) / "kube" / "bin"


def kube_tool(name: str) -> str:
    """A binary that `.ci/install-kube` installed; a missing one fails the test with the command that installs it
    (these tests never skip)."""
    path = kube_bin() / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"`{name}` is not installed: run `{INSTALL}` (looked in {kube_bin()})", pytrace=False)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager in `root` (data, keys, certificates, logs)."""

    def __init__(self, root: Path):
        self.root = root
        self.processes: dict[str, subprocess.Popen] = {}
        self.url = ""
        self.admin_kubeconfig = root / "admin.kubeconfig"
        self.audit_log = root / "audit.log"

    # ------------------------------------------------------------------------------------------ life

    def start(self, timeout: float = 90.0) -> None:
        etcd, apiserver, manager = (kube_tool(n) for n in ("etcd", "kube-apiserver", "kube-controller-manager"))
        root = self.root
        (root / "certs").mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "genrsa", "-out", str(root / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(root / "sa.key"), "-pubout", "-out", str(root / "sa.pub")],
                       check=True, capture_output=True)
        (root / "tokens.csv").write_text(f'{ADMIN_TOKEN},strata-test-admin,strata-test-admin,"system:masters"\n')
        (root / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
        client, peer, secure = free_port(), free_port(), free_port()
        self._spawn("etcd", [
            etcd, "--name", "strata-test", "--data-dir", str(root / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"strata-test=http://127.0.0.1:{peer}", "--log-level", "warn"])
        self.url = f"https://127.0.0.1:{secure}"
        self._spawn("kube-apiserver", [
            apiserver, f"--etcd-servers=http://127.0.0.1:{client}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={secure}", "--insecure-port=0",
            f"--cert-dir={root / 'certs'}", f"--token-auth-file={root / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={root / 'sa.pub'}", f"--service-account-signing-key-file={root / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--api-audiences=https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range=10.96.0.0/24", "--disable-admission-plugins=ServiceAccount",
            "--enable-priority-and-fairness=false", "--profiling=false", "-v=1",
            f"--audit-policy-file={root / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json", "--audit-log-mode=blocking"])
        self._write_kubeconfig(self.admin_kubeconfig, ADMIN_TOKEN, "strata-test-admin")
        self._wait_ready(timeout)
        self._spawn("kube-controller-manager", [
            manager, f"--kubeconfig={self.admin_kubeconfig}", f"--controllers={CONTROLLERS}",
            "--leader-elect=false", "--port=0", "--secure-port=0", "--use-service-account-credentials=false",
            "--concurrent-gc-syncs=5", "--namespace-sync-period=10s", "-v=1"])

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            p = self.processes.pop(name)
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - the process holds it
        self.processes[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _wait_ready(self, timeout: float) -> None:
        deadline, last = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            for name, p in self.processes.items():
                if p.poll() is not None:
                    pytest.fail(f"{name} exited {p.returncode} while starting:\n{self.log_tail(name)}", pytrace=False)
            try:
                if self.get("/readyz") == "ok":
                    return
            except OSError as e:
                last = str(e)
            time.sleep(0.25)
        pytest.fail(f"kube-apiserver not ready after {timeout} s ({last}):\n{self.log_tail('kube-apiserver')}",
                    pytrace=False)

    # ------------------------------------------------------------------------------------------ clients

    @property
    def ca_file(self) -> Path:
        """The API server's self-signed serving certificate, which carries the CA that signed it."""
        return self.root / "certs" / "apiserver.crt"

    def get(self, path: str, token: str = ADMIN_TOKEN) -> str:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {token}"})
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.read().decode()

    def _write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "strata-test", "cluster": {"server": self.url,
                                                              "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "strata-test", "user": user}}]}))
        return path

    def api_client(self, token: str = ADMIN_TOKEN):
        """A `kubernetes` ApiClient with this token."""
        from kubernetes import client

        configuration = client.Configuration(host=self.url)
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": f"Bearer {token}"}
        return client.ApiClient(configuration)

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token of that service account (TokenRequest), so a client gets exactly the RBAC granted to it."""
        from kubernetes import client

        core = client.CoreV1Api(self.api_client())
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds}}
        answer = core.create_namespaced_service_account_token(name, namespace, body, _preload_content=False)
        return json.loads(answer.data)["status"]["token"]

    def requests_of(self, username: str) -> list[dict]:
        """The audit log's events of that user's requests (verb, objectRef, responseStatus, ...): one per request
        once it has an answer (a watch's when it starts)."""
        if not self.audit_log.exists():
            return []
        events = (json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip())
        seen, out = set(), []
        for e in events:
            if e.get("user", {}).get("username") == username and e["auditID"] not in seen and e.get("stage") in (
                    "ResponseStarted", "ResponseComplete", "Panic"):
                seen.add(e["auditID"])
                out.append(e)
        return out

    def kubeconfig_for(self, token: str, path: Path, user: str) -> Path:
        return self._write_kubeconfig(path, token, user)

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                stdin: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([kube_tool("kubectl"), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args],
                              capture_output=True, text=True, timeout=60, input=stdin, check=False)
        if check and proc.returncode != 0:
            pytest.fail(f"`kubectl {' '.join(args)}` exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}",
                        pytrace=False)
        return proc

    def ensure_namespace(self, name: str) -> None:
        """Create it unless it is there (a namespace another test deleted may still be going: wait for that)."""
        def there() -> bool:
            got = self.kubectl("get", "namespace", name, "-o", "jsonpath={.status.phase}", check=False)
            if got.returncode != 0:
                made = self.kubectl("create", "namespace", name, check=False)
                return made.returncode == 0 or "AlreadyExists" in made.stderr and there()
            return got.stdout == "Active"

        wait_for(f"namespace {name}", there, timeout=60, every=0.5)

    def apply_objects(self, objects: list[dict]) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))


def wait_for(what: str, check, timeout: float = 20.0, every: float = 0.1):
    """Poll `check` until it returns something true; fail with the last value after `timeout` seconds."""
    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what}; last: {value!r}")
