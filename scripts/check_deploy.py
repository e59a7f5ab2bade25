#!/usr/bin/env python3
"""Checks that the deployment files agree with each other and with mqstate's settings:
packaging/compose.yaml and packaging/kubernetes/*.yaml. Run by scripts/check-deploy.sh (which also
runs the schema validators); needs PyYAML. Prints one line per problem and exits 1 if there is any.
"""
import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBLEMS = []


def problem(where, text):
    PROBLEMS.append(f"{where}: {text}")


def documented_variables():
    """Every MQSTATE_* variable of `mqstate serve` (docs/configuration.md is generated from the schema)."""
    text = (ROOT / "docs/configuration.md").read_text()
    return set(re.findall(r"`(MQSTATE_[A-Z0-9_]+)`", text))


def port_of(addr):
    return int(addr.rsplit(":", 1)[1])


def peers_of(value):
    """`1=host:7001,2=...` as {id: (host, port)}."""
    peers = {}
    for entry in value.split(","):
        node_id, addr = entry.strip().split("=", 1)
        host, port = addr.rsplit(":", 1)
        peers[int(node_id)] = (host, int(port))
    return peers


def check_variables(where, names, known):
    for name in names:
        if name.startswith("MQSTATE_") and name not in known:
            problem(where, f"{name} is not a setting of `mqstate serve` (docs/configuration.md)")


def check_compose(known):
    where = "packaging/compose.yaml"
    compose = yaml.safe_load((ROOT / where).read_text())
    services = compose["services"]
    ids = {}
    for name, service in services.items():
        env = service["environment"]
        check_variables(f"{where} {name}", env, known)
        node_id = int(env["MQSTATE_NODE_ID"])
        if node_id in ids:
            problem(where, f"{name} and {ids[node_id]} both have node id {node_id}")
        ids[node_id] = name
        peers = peers_of(env["MQSTATE_PEERS"])
        listen = port_of(env["MQSTATE_CLUSTER_LISTEN"])
        if peers.get(node_id) != (name, listen):
            problem(where, f"{name}: MQSTATE_PEERS has {peers.get(node_id)} for node {node_id}, not ({name!r}, {listen})")
        if set(peers) != set(ids) and len(ids) == len(services):
            problem(where, f"MQSTATE_PEERS lists nodes {sorted(peers)}, the services are nodes {sorted(ids)}")
        for secret_path in (env.get("MQSTATE_PASSWORD_FILE"), env.get("AIO_MQTT_PASSWORD_FILE")):
            if secret_path and pathlib.PurePosixPath(secret_path).name not in compose.get("secrets", {}):
                problem(where, f"{name}: {secret_path} is not one of the secrets")
        if not any(v.endswith(":/data") for v in service["volumes"]):
            problem(where, f"{name}: no volume on /data (the image's data directory)")
    if len(ids) != 3:
        problem(where, f"{len(ids)} nodes, expected 3")


def check_kubernetes(known):
    docs = []
    for path in sorted((ROOT / "packaging/kubernetes").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            listed = yaml.safe_load(path.read_text())["resources"]
            files = {p.name for p in path.parent.glob("*.yaml")} - {"kustomization.yaml"}
            if set(listed) != files:
                problem("packaging/kubernetes/kustomization.yaml", f"resources {sorted(listed)}, files {sorted(files)}")
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    where = "packaging/kubernetes"
    (sts,) = by_kind["StatefulSet"]
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    check_variables(f"{where} StatefulSet", env, known)

    if spec.get("podManagementPolicy") != "Parallel":
        problem(where, "podManagementPolicy must be Parallel: no node is ready before a majority has formed the cluster")
    if spec["selector"]["matchLabels"].items() - labels.items():
        problem(where, "the StatefulSet's selector does not match its pods' labels")

    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    headless = services.get(spec["serviceName"])
    if headless is None:
        problem(where, f"serviceName {spec['serviceName']} is not one of the Services")
    else:
        if headless["spec"].get("clusterIP") != "None":
            problem(where, f"Service {spec['serviceName']} must be headless (clusterIP: None)")
        if not headless["spec"].get("publishNotReadyAddresses"):
            problem(where, f"Service {spec['serviceName']} must publish not-ready addresses: nodes dial each other before they are ready")
    for name, service in services.items():
        if service["spec"]["selector"].items() - labels.items():
            problem(where, f"Service {name} selects no pod of the StatefulSet")
        for port in service["spec"]["ports"]:
            if port["targetPort"] not in ports:
                problem(where, f"Service {name} targets port {port['targetPort']}, which the container does not name")

    # Node ids from the pod ordinal, the founders in MQSTATE_PEERS under the headless Service's names.
    if env.get("MQSTATE_NODE_ID_FROM_HOSTNAME") != "true" and "MQSTATE_NODE_ID" not in env:
        problem(where, "neither MQSTATE_NODE_ID_FROM_HOSTNAME nor MQSTATE_NODE_ID is set")
    cluster_port = port_of(env["MQSTATE_CLUSTER_LISTEN"])
    if ports.get("cluster") != cluster_port:
        problem(where, f"containerPort cluster is {ports.get('cluster')}, MQSTATE_CLUSTER_LISTEN says {cluster_port}")
    peers = peers_of(env["MQSTATE_PEERS"])
    sts_name = sts["metadata"]["name"]
    if sorted(peers) != list(range(1, spec["replicas"] + 1)):
        problem(where, f"MQSTATE_PEERS lists nodes {sorted(peers)} for {spec['replicas']} replicas")
    for node_id, (host, port) in peers.items():
        expected = f"{sts_name}-{node_id - 1}.{spec['serviceName']}.$(POD_NAMESPACE).svc.cluster.local"
        if (host, port) != (expected, cluster_port):
            problem(where, f"peer {node_id} is {host}:{port}, expected {expected}:{cluster_port} (pod ordinal {node_id - 1})")
    if "POD_NAMESPACE" not in env or list(env).index("POD_NAMESPACE") > list(env).index("MQSTATE_PEERS"):
        problem(where, "POD_NAMESPACE must be defined before MQSTATE_PEERS, which refers to it")

    # Probes on the metrics endpoint.
    metrics_port = port_of(env["MQSTATE_METRICS_LISTEN"])
    if ports.get("metrics") != metrics_port:
        problem(where, f"containerPort metrics is {ports.get('metrics')}, MQSTATE_METRICS_LISTEN says {metrics_port}")
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        get = container.get(probe, {}).get("httpGet", {})
        if get.get("path") != path or get.get("port") not in ("metrics", metrics_port):
            problem(where, f"{probe} must GET {path} on the metrics port, not {get}")

    # Files named by settings are in mounted volumes; the data directory is a claim.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    for name in ("MQSTATE_CLUSTER_TLS_CERT", "MQSTATE_CLUSTER_TLS_KEY", "MQSTATE_CLUSTER_TLS_CA",
                 "MQSTATE_PASSWORD_FILE", "AIO_MQTT_PASSWORD_FILE"):
        path = env.get(name)
        if path is None:
            problem(where, f"{name} is not set")
        elif str(pathlib.PurePosixPath(path).parent) not in mounts:
            problem(where, f"{name}={path} is not in a mounted volume")
    claims = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])}
    if mounts.get("/data") not in claims:
        problem(where, "/data (the image's data directory) is not on a volume claim")

    (pdb,) = by_kind["PodDisruptionBudget"]
    if pdb["spec"].get("maxUnavailable") != 1:
        problem(where, "the PodDisruptionBudget must allow at most one unavailable node")
    if pdb["spec"]["selector"]["matchLabels"].items() - labels.items():
        problem(where, "the PodDisruptionBudget selects no pod of the StatefulSet")


def main():
    known = documented_variables()
    if "MQSTATE_NODE_ID_FROM_HOSTNAME" not in known:
        problem("docs/configuration.md", "no MQSTATE_* variables found")
    check_compose(known)
    check_kubernetes(known)
    for line in PROBLEMS:
        print(f"check-deploy: {line}")
    if PROBLEMS:
        sys.exit(1)
    print("check-deploy: compose.yaml and kubernetes/ agree with each other and with the settings")


if __name__ == "__main__":
    main()
