#!/usr/bin/env python3
"""Offline checks of deploy/ringwatch.yaml (run by `cargo xtask check-deploy`,
part of `cargo xtask test`).

1. Every document is valid against the Kubernetes OpenAPI schemas bundled in
   the pinned `kubernetes-validate` package (deploy/requirements.txt), in
   strict mode (an unknown or misspelt field fails), for the oldest and the
   newest Kubernetes version we claim (K8S_VERSIONS). No cluster, no network.
2. The invariants a schema cannot say: the four kinds are there; no container
   is privileged or may escalate, each drops ALL capabilities and adds only
   allowed ones (never SYS_ADMIN); hostPID; the agent's --listen port is the
   port its probes, the Service, --peers-dns and the prometheus.io/port
   annotation name; the kernel's BTF and tracefs are mounted read-only; the
   host's /run/ringwatch is mounted; the token comes from a Secret that the
   manifest does not ship; resources are set; updates roll; the Service is
   headless and is the one --peers-dns names.

Exit status 0 when all hold; otherwise 1, with one line per violation.

`--self-test` breaks the manifest in memory in several ways (privileged: true,
another probe port, no BTF mount, SYS_ADMIN added, ...) and fails unless
every breakage is reported, so the check cannot pass by checking nothing.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any, Callable

import kubernetes_validate
import yaml

MANIFEST = Path(__file__).resolve().parent / "ringwatch.yaml"

# The oldest Kubernetes we claim and the newest the pinned package bundles.
K8S_VERSIONS = ("1.30.0", "1.37.0")

# Capabilities the agent may be given (deploy/CAPABILITIES.md measures which
# it needs). SYS_ADMIN is never one of them: it is nearly root's all.
ALLOWED_CAPABILITIES = {"BPF", "PERFMON", "DAC_OVERRIDE", "SYS_RESOURCE", "SYS_PTRACE", "DAC_READ_SEARCH"}

AGENT_CONTAINER = "agent"
RUNTIME_DIR = "/run/ringwatch"
HEALTH_PATH = "/api/health"
CLUSTER_DOMAIN = "svc.cluster.local"

Doc = dict[str, Any]


def load(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def name_of(doc: Doc) -> str:
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind', '?')}/{meta.get('name', '?')}"


def schema_violations(docs: list[Doc]) -> list[str]:
    out = []
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.absolute_path) or "(top)"
                out.append(f"{name_of(doc)}: not valid for Kubernetes {version} at {where}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                out.append(f"{name_of(doc)}: {e.message}")
    return out


def find(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in a container's args."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of args from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def container_env(container: Doc, namespace: str) -> dict[str, str]:
    env = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        field = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if field == "metadata.namespace":
            env[var["name"]] = namespace
        elif field == "spec.nodeName":
            env[var["name"]] = "node-1"
    return env


def host_port(value: str | None) -> tuple[str, int] | None:
    if value is None or ":" not in value:
        return None
    host, port = value.rsplit(":", 1)
    return (host, int(port)) if port.isdigit() else None


def resolve_port(port: Any, container: Doc) -> int | None:
    """A probe's or Service's port (a number or a named container port)."""
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def invariant_violations(docs: list[Doc]) -> list[str]:
    out: list[str] = []
    for kind in ("Namespace", "ServiceAccount", "DaemonSet", "Service"):
        if len(find(docs, kind)) != 1:
            out.append(f"expected exactly one {kind}, found {len(find(docs, kind))}")
    # A shipped Secret would be a token every cluster knows.
    for secret in find(docs, "Secret"):
        out.append(f"{name_of(secret)}: the manifest must not ship a Secret (the token is made per cluster)")
    if len(find(docs, "DaemonSet")) != 1 or len(find(docs, "Service")) != 1:
        return out
    namespace = (find(docs, "Namespace") or [{}])[0].get("metadata", {}).get("name")
    for doc in docs:
        if doc.get("kind") != "Namespace" and doc.get("metadata", {}).get("namespace") != namespace:
            out.append(f"{name_of(doc)}: not in the manifest's namespace {namespace!r}")

    ds = find(docs, "DaemonSet")[0]
    svc = find(docs, "Service")[0]
    template = ds.get("spec", {}).get("template", {})
    pod = template.get("spec", {})
    where = name_of(ds)

    # The pod: the host's pid namespace, not its network; our ServiceAccount.
    if pod.get("hostPID") is not True:
        out.append(f"{where}: hostPID must be true (the eBPF programs, SO_PEERCRED and NVML report host pids)")
    if pod.get("hostNetwork") is True:
        out.append(f"{where}: hostNetwork must not be set (the TCP tracepoints see every namespace)")
    if pod.get("hostIPC") is True:
        out.append(f"{where}: hostIPC must not be set")
    accounts = [a.get("metadata", {}).get("name") for a in find(docs, "ServiceAccount")]
    if pod.get("serviceAccountName") not in accounts:
        out.append(f"{where}: serviceAccountName {pod.get('serviceAccountName')!r} is not the manifest's ServiceAccount")
    tolerations = pod.get("tolerations") or []
    if not any(
        (t.get("key") == "nvidia.com/gpu" and t.get("operator") == "Exists") or (t.get("operator") == "Exists" and not t.get("key"))
        for t in tolerations
    ):
        out.append(f"{where}: no toleration for GPU nodes' nvidia.com/gpu taint")

    # Updates.
    strategy = ds.get("spec", {}).get("updateStrategy") or {}
    if strategy.get("type") != "RollingUpdate" or "maxUnavailable" not in (strategy.get("rollingUpdate") or {}):
        out.append(f"{where}: updateStrategy must be RollingUpdate with rollingUpdate.maxUnavailable")

    # Every container, init containers included: not privileged, no
    # escalation, drop ALL, add only allowed capabilities.
    containers = pod.get("containers") or []
    for c in (pod.get("initContainers") or []) + containers:
        cw = f"{where} container {c.get('name')!r}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged") is True:
            out.append(f"{cw}: privileged: true (give it capabilities instead)")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{cw}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{cw}: capabilities.drop must contain ALL")
        for cap in caps.get("add") or []:
            bare = str(cap).upper().removeprefix("CAP_")
            if bare == "SYS_ADMIN" or bare not in ALLOWED_CAPABILITIES:
                out.append(
                    f"{cw}: capability {cap} is not allowed (allowed: {', '.join(sorted(ALLOWED_CAPABILITIES))}; "
                    "a new one needs its measurement in deploy/CAPABILITIES.md and ALLOWED_CAPABILITIES here)"
                )
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{cw}: readOnlyRootFilesystem must be true")
        for kind in ("requests", "limits"):
            if not (c.get("resources") or {}).get(kind, {}).get("memory"):
                out.append(f"{cw}: resources.{kind}.memory must be set")
        if not (c.get("resources") or {}).get("requests", {}).get("cpu"):
            out.append(f"{cw}: resources.requests.cpu must be set")

    agent = next((c for c in containers if c.get("name") == AGENT_CONTAINER), None)
    if agent is None:
        out.append(f"{where}: no container named {AGENT_CONTAINER!r}")
        return out
    aw = f"{where} container {AGENT_CONTAINER!r}"
    env = container_env(agent, ds.get("metadata", {}).get("namespace", ""))
    args = [expand(str(a), env) for a in agent.get("args") or []]
    if args[:1] != ["serve"] or "--jobs" not in args:
        out.append(f"{aw}: args must start with `serve` and include --jobs")

    # One port: --listen, the container port, the probes, the Service,
    # --peers-dns and the prometheus.io/port annotation.
    listen = host_port(flag(args, "--listen"))
    if listen is None:
        out.append(f"{aw}: --listen HOST:PORT missing")
        return out
    port = listen[1]
    if listen[0] in ("127.0.0.1", "localhost", "::1", "[::1]"):
        out.append(f"{aw}: --listen {listen[0]} is loopback only: probes, peers and Prometheus could not reach it")
    if port not in [p.get("containerPort") for p in agent.get("ports") or []]:
        out.append(f"{aw}: --listen port {port} is not one of the container's ports")
    for probe_name in ("livenessProbe", "readinessProbe"):
        probe = agent.get(probe_name)
        get = (probe or {}).get("httpGet")
        if not get:
            out.append(f"{aw}: {probe_name} must be an httpGet on {HEALTH_PATH}")
            continue
        if get.get("path") != HEALTH_PATH:
            out.append(f"{aw}: {probe_name} path {get.get('path')!r} is not {HEALTH_PATH}")
        if resolve_port(get.get("port"), agent) != port:
            out.append(f"{aw}: {probe_name} port {get.get('port')!r} is not the --listen port {port}")
    annotations = template.get("metadata", {}).get("annotations") or {}
    if annotations.get("prometheus.io/scrape") != "true":
        out.append(f"{where}: pod annotation prometheus.io/scrape must be \"true\"")
    if str(annotations.get("prometheus.io/port")) != str(port):
        out.append(f"{where}: pod annotation prometheus.io/port {annotations.get('prometheus.io/port')!r} is not the --listen port {port}")
    if annotations.get("prometheus.io/path", "/metrics") != "/metrics":
        out.append(f"{where}: pod annotation prometheus.io/path must be /metrics")

    # The Service: headless, publishes starting pods, selects the agents,
    # targets the agent's port, and is what --peers-dns names.
    sw = name_of(svc)
    spec = svc.get("spec") or {}
    if spec.get("clusterIP") != "None":
        out.append(f"{sw}: must be headless (clusterIP: None)")
    if spec.get("publishNotReadyAddresses") is not True:
        out.append(f"{sw}: publishNotReadyAddresses must be true (peers see each other while starting)")
    labels = template.get("metadata", {}).get("labels") or {}
    selector = spec.get("selector") or {}
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        out.append(f"{sw}: selector {selector} does not select the DaemonSet's pods")
    ports = spec.get("ports") or []
    if not any(resolve_port(p.get("targetPort", p.get("port")), agent) == port and p.get("port") == port for p in ports):
        out.append(f"{sw}: no port {port} targeting the agent's --listen port {port}")
    svc_dns = f"{svc.get('metadata', {}).get('name')}.{svc.get('metadata', {}).get('namespace')}.{CLUSTER_DOMAIN}"
    peers = host_port(flag(args, "--peers-dns"))
    if peers is None:
        out.append(f"{aw}: --peers-dns HOST:PORT missing")
    elif peers != (svc_dns, port):
        out.append(f"{aw}: --peers-dns {peers[0]}:{peers[1]} is not the Service {svc_dns}:{port}")
    node_name = flag(agent.get("args") or [], "--node-name")
    if node_name is None or "$(" not in node_name or env.get(node_name[2:-1]) != "node-1":
        out.append(f"{aw}: --node-name must come from the downward API (spec.nodeName)")

    # Mounts: the kernel's BTF and tracefs read-only from the host, the
    # runtime directory from the host, reports writable, the token file
    # from a Secret.
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    mounts = {m.get("mountPath"): m for m in agent.get("volumeMounts") or []}

    def host_path_of(mount: Doc) -> str | None:
        return ((volumes.get(mount.get("name")) or {}).get("hostPath") or {}).get("path")

    for path, hosts in (
        ("/sys/kernel/btf", ("/sys/kernel/btf",)),
        ("/sys/kernel/tracing", ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")),
    ):
        mount = mounts.get(path)
        if mount is None:
            out.append(f"{aw}: {path} is not mounted (the agent needs the host's)")
            continue
        if host_path_of(mount) not in hosts:
            out.append(f"{aw}: {path} must be a hostPath of {' or '.join(hosts)}")
        if mount.get("readOnly") is not True:
            out.append(f"{aw}: {path} must be mounted readOnly")
    for mount in mounts.values():
        if (host_path_of(mount) or "").rstrip("/") in ("", "/sys", "/proc", "/") and mount.get("name") in volumes and host_path_of(mount):
            out.append(f"{aw}: hostPath {host_path_of(mount)} is too wide a mount")
    runtime = mounts.get(RUNTIME_DIR)
    if runtime is None or host_path_of(runtime) != RUNTIME_DIR:
        out.append(f"{aw}: the host's {RUNTIME_DIR} is not mounted at {RUNTIME_DIR} (the agent finds jobs there)")
    reports_dir = flag(args, "--reports-dir")
    if reports_dir is None:
        out.append(f"{aw}: --reports-dir missing")
    elif reports_dir not in mounts or mounts[reports_dir].get("readOnly") is True:
        out.append(f"{aw}: --reports-dir {reports_dir} is not a writable volume (the root filesystem is read-only)")
    token_file = flag(args, "--token-file")
    token_from_secret = False
    if token_file is not None:
        directory, file = token_file.rsplit("/", 1)
        mount = mounts.get(directory)
        secret = (volumes.get((mount or {}).get("name")) or {}).get("secret")
        if secret and secret.get("secretName") and not secret.get("optional", False):
            items = secret.get("items")
            token_from_secret = items is None or any(i.get("path") == file for i in items)
    if not token_from_secret:
        out.append(f"{aw}: --token-file must be a file of a (non-optional) Secret volume")
    if any(e.get("name", "").startswith("RINGWATCH_API_TOKEN") and "value" in e for e in agent.get("env") or []):
        out.append(f"{aw}: the token must not be written into the manifest (RINGWATCH_API_TOKEN*)")
    return out


# --self-test: each breakage, and a word its report must contain.
Mutation = Callable[[list[Doc]], None]


def _ds(docs: list[Doc]) -> Doc:
    return find(docs, "DaemonSet")[0]


def _pod(docs: list[Doc]) -> Doc:
    return _ds(docs)["spec"]["template"]["spec"]


def _agent(docs: list[Doc]) -> Doc:
    return next(c for c in _pod(docs)["containers"] if c["name"] == AGENT_CONTAINER)


def _set_arg(docs: list[Doc], name: str, value: str) -> None:
    args = _agent(docs)["args"]
    args[args.index(name) + 1] = value


def _drop_mount(docs: list[Doc], path: str) -> None:
    agent = _agent(docs)
    agent["volumeMounts"] = [m for m in agent["volumeMounts"] if m["mountPath"] != path]


MUTATIONS: list[tuple[str, Mutation, str]] = [
    ("privileged: true", lambda d: _agent(d)["securityContext"].update(privileged=True), "privileged: true"),
    (
        "privileged init container",
        lambda d: _pod(d)["initContainers"][0]["securityContext"].update(privileged=True),
        "privileged: true",
    ),
    ("liveness probe on another port", lambda d: _agent(d)["livenessProbe"]["httpGet"].update(port=9478), "livenessProbe port"),
    ("readiness probe on an unknown port name", lambda d: _agent(d)["readinessProbe"]["httpGet"].update(port="metrics"), "readinessProbe port"),
    ("--listen on another port", lambda d: _set_arg(d, "--listen", "0.0.0.0:9000"), "is not one of the container's ports"),
    ("--listen on loopback", lambda d: _set_arg(d, "--listen", "127.0.0.1:9477"), "loopback"),
    ("no /sys/kernel/btf mount", lambda d: _drop_mount(d, "/sys/kernel/btf"), "/sys/kernel/btf is not mounted"),
    (
        "/sys/kernel/tracing writable",
        lambda d: next(m for m in _agent(d)["volumeMounts"] if m["mountPath"] == "/sys/kernel/tracing").pop("readOnly"),
        "/sys/kernel/tracing must be mounted readOnly",
    ),
    ("no /run/ringwatch mount", lambda d: _drop_mount(d, RUNTIME_DIR), "/run/ringwatch is not mounted"),
    ("SYS_ADMIN added", lambda d: _agent(d)["securityContext"]["capabilities"]["add"].append("SYS_ADMIN"), "capability SYS_ADMIN"),
    ("CAP_NET_RAW added", lambda d: _agent(d)["securityContext"]["capabilities"]["add"].append("CAP_NET_RAW"), "capability CAP_NET_RAW"),
    ("drop ALL removed", lambda d: _agent(d)["securityContext"]["capabilities"].pop("drop"), "drop must contain ALL"),
    ("escalation allowed", lambda d: _agent(d)["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    ("hostPID off", lambda d: _pod(d).pop("hostPID"), "hostPID"),
    ("hostNetwork on", lambda d: _pod(d).update(hostNetwork=True), "hostNetwork"),
    ("Service not headless", lambda d: find(d, "Service")[0]["spec"].pop("clusterIP"), "headless"),
    ("Service not publishing starting pods", lambda d: find(d, "Service")[0]["spec"].pop("publishNotReadyAddresses"), "publishNotReadyAddresses"),
    ("Service renamed", lambda d: find(d, "Service")[0]["metadata"].update(name="agents"), "--peers-dns"),
    ("Service on another port", lambda d: find(d, "Service")[0]["spec"]["ports"][0].update(port=80), "no port 9477"),
    (
        "prometheus.io/port elsewhere",
        lambda d: _ds(d)["spec"]["template"]["metadata"]["annotations"].update({"prometheus.io/port": "9100"}),
        "prometheus.io/port",
    ),
    ("token from an env literal", lambda d: _agent(d)["env"].append({"name": "RINGWATCH_API_TOKEN", "value": "x"}), "must not be written"),
    ("token file not from a Secret", lambda d: _set_arg(d, "--token-file", "/tmp/token"), "Secret volume"),
    (
        "a Secret shipped",
        lambda d: d.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "t", "namespace": "ringwatch"}, "stringData": {"token": "x"}}),
        "must not ship a Secret",
    ),
    ("no memory limit", lambda d: _agent(d)["resources"]["limits"].pop("memory"), "limits.memory"),
    ("OnDelete updates", lambda d: _ds(d)["spec"].update(updateStrategy={"type": "OnDelete"}), "RollingUpdate"),
    ("no GPU toleration", lambda d: _pod(d).update(tolerations=[]), "toleration"),
    ("no Namespace", lambda d: d.remove(find(d, "Namespace")[0]), "exactly one Namespace"),
    # Caught by the schema, not by an invariant: strict mode refuses typos.
    ("a misspelt field", lambda d: _agent(d).update(securityContxt={}), "securityContxt"),
    ("a wrong type", lambda d: _pod(d).update(hostPID="yes"), "hostPID"),
]


def violations(docs: list[Doc]) -> list[str]:
    return schema_violations(docs) + invariant_violations(docs)


def self_test(docs: list[Doc]) -> int:
    failures = []
    base = violations(docs)
    if base:
        failures.append(f"the manifest itself fails ({len(base)} violations); run without --self-test")
    for what, mutate, expected in MUTATIONS:
        broken = copy.deepcopy(docs)
        mutate(broken)
        found = violations(broken)
        if not any(expected in v for v in found):
            failures.append(f"{what}: not caught (wanted a violation mentioning {expected!r}; got {found})")
        else:
            print(f"  caught: {what}")
    if failures:
        for f in failures:
            print(f"check_manifest --self-test: FAIL: {f}", file=sys.stderr)
        return 1
    print(f"check_manifest --self-test: all {len(MUTATIONS)} breakages caught")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("manifest", nargs="?", type=Path, default=MANIFEST)
    parser.add_argument("--self-test", action="store_true", help="assert that breakages of the manifest are caught")
    opts = parser.parse_args()
    docs = load(opts.manifest)
    if opts.self_test:
        return self_test(docs)
    found = violations(docs)
    for v in found:
        print(f"{opts.manifest}: {v}", file=sys.stderr)
    if found:
        print(f"{opts.manifest}: {len(found)} violation(s)", file=sys.stderr)
        return 1
    kinds = ", ".join(name_of(d) for d in docs)
    print(
        f"{opts.manifest}: valid for Kubernetes {' and '.join(K8S_VERSIONS)} (strict schemas of "
        f"kubernetes-validate {kubernetes_validate.__version__}), invariants hold: {kinds}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
