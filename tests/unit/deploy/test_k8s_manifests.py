"""deploy/k8s holds together without a cluster: every manifest validates against the
Kubernetes schemas (offline, bundled by kubernetes-validate), kustomize renders it when
kubectl is here, every container runs a real ``overture`` command whose environment is
made of real options, probes and scrape annotations name declared ports, and the node
pods share /dev/shm in memory and keep the SSD tier on a claim of their own."""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.cli import _parser
from services.engine.config import EngineConfig
from services.kvstore.config import KVStoreConfig
from services.nodemgr.config import NodeManagerConfig
from services.scheduler.config import SchedulerConfig
from shared.cluster_config import ClusterConfig
from shared.config import load
from tests.deploy_files import REPO

K8S = REPO / "deploy" / "k8s"
CONFIGS = {"scheduler": SchedulerConfig, "engine": EngineConfig, "kvstore": KVStoreConfig,
           "nodemgr": NodeManagerConfig}


def _docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for name in kustomization["resources"]
            for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _pods() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in _docs()
            if d["kind"] in ("Deployment", "StatefulSet")}


def test_every_manifest_is_valid_kubernetes() -> None:
    version = kubernetes_validate.latest_version()
    docs = _docs()
    assert {d["kind"] for d in docs} == {"Deployment", "StatefulSet", "Service",
                                         "ServiceAccount", "Role", "RoleBinding",
                                         "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):  # (the check can fail)
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders_it() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert sorted(kinds) == ["Deployment", "NetworkPolicy", "Role", "RoleBinding", "Service",
                             "Service", "Service", "ServiceAccount", "StatefulSet",
                             "StatefulSet"]


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables, ``$(POD_NAME)`` as Kubernetes expands it."""
    out = {}
    for item in container.get("env", []):
        value = item.get("value", "")
        out[item["name"]] = value.replace("$(POD_NAME)", "overture-node-0")
    return out


def test_containers_run_real_commands_with_real_options() -> None:
    seen = set()
    for name, pod in _pods().items():
        spec = pod["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            args, env = c["args"], _env(c)
            if args[0] in CONFIGS:
                overture = {k: v for k, v in env.items() if k.startswith("OVERTURE_")}
                for key in overture:
                    assert key.startswith((f"OVERTURE_{args[0].upper()}__",
                                           "OVERTURE_CLUSTER__")), (name, key)
                load(ClusterConfig, "cluster", env=overture)
                cfg = load(CONFIGS[args[0]], args[0], env=overture)
                assert overture["OVERTURE_CLUSTER__SECRET_FILE"].startswith(
                    next(m["mountPath"] for m in c["volumeMounts"]
                         if m["name"] == "cluster-secret"))
                ports = {p["containerPort"] for p in c["ports"]}
                assert cfg.port in ports, (name, c["name"])
                if args[0] != "scheduler":
                    assert cfg.metrics_port in ports, (name, c["name"])
                seen.add(args[0])
            else:
                _parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in args])
    assert seen == set(CONFIGS)


def test_probes_annotations_and_volumes() -> None:
    pods = _pods()
    for name, pod in pods.items():
        scrape = pod["metadata"]["annotations"]["prometheus.io/scrape"]
        assert scrape == ("false" if name == "overture-s3" else "true"), name
        for c in pod["spec"]["containers"]:
            declared = {p["containerPort"] for p in c["ports"]} | {
                p["name"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                spec = c[probe]
                if "exec" in spec:  # (the S3 server's signed probe names its URL)
                    url = spec["exec"]["command"][-1]
                    assert any(f":{p}" in url for p in declared), (name, probe, url)
                    continue
                port = next(v["port"] for v in spec.values() if isinstance(v, dict)
                            and "port" in v)
                assert port in declared, (name, c["name"], probe)
            assert c["resources"]["requests"]["memory"], (name, c["name"])
    node = pods["overture-node"]["spec"]
    shm = next(v for v in node["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in node["containers"]}
    assert mounts["engine"]["shm"] == mounts["kvstore"]["shm"] == "/dev/shm"
    assert mounts["kvstore"]["data"] == "/var/lib/overture"
    engine_env = _env(next(c for c in node["containers"] if c["name"] == "engine"))
    budget = load(EngineConfig, "engine", env={k: v for k, v in engine_env.items()
                                               if k.startswith("OVERTURE_ENGINE")})
    limit = shm["emptyDir"]["sizeLimit"]
    assert int(limit.removesuffix("Mi")) << 20 > budget.device_memory_bytes


def test_two_schedulers_one_serving_through_a_lease_they_may_write() -> None:
    docs = _docs()
    deployment = next(d for d in docs if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == "overture-scheduler")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    cfg = load(SchedulerConfig, "scheduler", env={k: v for k, v in _env(container).items()
                                                  if k.startswith("OVERTURE_SCHEDULER")})
    assert cfg.lease_name and cfg.s3.bucket  # elected; responses in the shared bucket
    assert container["readinessProbe"]["httpGet"]["path"] == "/leaderz"
    account = pod["serviceAccountName"]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account
               for d in docs)
    binding = next(d for d in docs if d["kind"] == "RoleBinding"
                   and {"kind": "ServiceAccount", "name": account} in d["subjects"])
    role = next(d for d in docs if d["kind"] == "Role"
                and d["metadata"]["name"] == binding["roleRef"]["name"])
    allowed = {verb for rule in role["rules"] if rule["apiGroups"] == ["coordination.k8s.io"]
               and rule["resources"] == ["leases"]
               and cfg.lease_name in rule.get("resourceNames", [cfg.lease_name])
               for verb in rule["verbs"]}
    assert {"get", "create", "update"} <= allowed
