#!/usr/bin/env python3
"""What the schemas cannot check in a rendered overlay (deploy/k8s/test.sh):

- every container has readiness and liveness probes on a port it declares, and every
  prefill/decode node a startup probe on /health;
- prefill and decode nodes drain on preStop (`kvmesh node drain`), with a grace period
  longer than their drain timeout (from the ConfigMap's TOML) plus the drain's own time;
- resource requests on every container, a PodDisruptionBudget per Deployment of nodes;
- the certificate Secret is mounted, without the CA's private key;
- in the gpu overlay, prefill and decode nodes limit nvidia.com/gpu;
- the planner runs as a ServiceAccount bound to a Role that may get and patch the prefill
  and decode Deployments' scale subresource (its `kubernetes` actuator).
Usage: check.py OVERLAY RENDERED.yaml
"""

import re
import sys

import yaml


def seconds(text):
    m = re.fullmatch(r"(\d+)s", text)
    assert m, f"a duration in seconds: {text!r}"
    return int(m.group(1))


def main(overlay, path):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    config = next(c for c in by_kind["ConfigMap"] if c["metadata"]["name"].startswith("kvmesh-config"))
    secret = next(s for s in by_kind["Secret"] if s["metadata"]["name"].startswith("kvmesh-certs"))
    assert set(secret["data"]) == {"ca.pem", "node.pem", "node.key"}, sorted(secret["data"])
    budgets = {p["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component")
               for p in by_kind["PodDisruptionBudget"]}
    problems = []
    for w in by_kind["Deployment"] + by_kind["StatefulSet"]:
        name = w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"]:
            ports = {p["name"] for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe") if name != "planner" else ("livenessProbe",):
                p = c.get(probe)
                if not p:
                    problems.append(f"{name}: no {probe}")
                    continue
                port = (p.get("httpGet") or p.get("tcpSocket"))["port"]
                if port not in ports:
                    problems.append(f"{name}: {probe} on undeclared port {port}")
            if not c.get("resources", {}).get("requests"):
                problems.append(f"{name}: no resource requests")
            if name in ("prefill", "decode"):
                if c.get("startupProbe", {}).get("httpGet", {}).get("path") != "/health":
                    problems.append(f"{name}: no startup probe on /health")
                stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                if stop[:3] != ["kvmesh", "node", "drain"]:
                    problems.append(f"{name}: preStop does not drain: {stop}")
                toml = config["data"][f"{name}.toml"]
                drain = seconds(re.search(r'drain_timeout\s*=\s*"([^"]+)"', toml).group(1))
                grace = pod.get("terminationGracePeriodSeconds", 30)
                if grace <= drain + 10:
                    problems.append(f"{name}: grace period {grace} s not past drain {drain} s")
                if name not in budgets:
                    problems.append(f"{name}: no PodDisruptionBudget")
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                if "certs" not in mounts:
                    problems.append(f"{name}: certificates not mounted")
                gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
                if overlay == "gpu" and gpus != 1:
                    problems.append(f"{name}: no nvidia.com/gpu limit in the gpu overlay")
                if overlay != "gpu" and gpus:
                    problems.append(f"{name}: a GPU limit outside the gpu overlay")
    problems += planner_rbac(by_kind)
    assert not problems, f"{overlay}:\n  " + "\n  ".join(problems)
    print(f"deploy/k8s/check.py: {overlay}: {len(docs)} objects, "
          f"{len(by_kind['Deployment'])} Deployments checked")


def planner_rbac(by_kind):
    """What keeps the planner's PATCH .../deployments/{prefill,decode}/scale from a 403."""
    planner = next(d for d in by_kind["Deployment"] if d["metadata"]["name"] == "planner")
    namespace = planner["metadata"].get("namespace")
    account = planner["spec"]["template"]["spec"].get("serviceAccountName")
    if not account or account not in {a["metadata"]["name"] for a in by_kind.get("ServiceAccount", [])}:
        return [f"planner: no ServiceAccount of its own ({account})"]
    roles = {r["metadata"]["name"]: r for r in by_kind.get("Role", [])}
    granted = set()
    for b in by_kind.get("RoleBinding", []):
        bound = any(s["kind"] == "ServiceAccount" and s["name"] == account
                    and s.get("namespace", b["metadata"].get("namespace")) == namespace
                    for s in b.get("subjects", []))
        role = roles.get(b["roleRef"]["name"]) if b["roleRef"]["kind"] == "Role" else None
        if not bound or role is None:
            continue
        for rule in role["rules"]:
            if "apps" in rule["apiGroups"] and "deployments/scale" in rule["resources"]:
                for name in rule.get("resourceNames") or ["prefill", "decode"]:
                    granted |= {(name, verb) for verb in rule["verbs"]}
    needed = {(name, verb) for name in ("prefill", "decode") for verb in ("get", "patch")}
    missing = sorted(needed - granted)
    return [f"planner: may not {verb} deployments/{name}/scale" for name, verb in missing]


if __name__ == "__main__":
    main(*sys.argv[1:])
