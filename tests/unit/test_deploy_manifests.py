"""``deploy/kubernetes/breezert-serve.yaml`` parsed and checked against the server it runs.

Owns: one GPU per pod; probes on ``/readyz`` and ``/healthz`` at the port the server binds;
the pod's termination grace covering the server's shutdown grace; the PodDisruptionBudget, the
Service and the Prometheus scrape all selecting the Deployment's pods; the container's command
line accepted by ``breezert serve``'s own parser and config (with the token from the Secret).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from breezert.cli import build_parser, serve_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kubernetes" / "breezert-serve.yaml"
IMAGE_ROOT = "/opt/breezert/"  # the Dockerfile's WORKDIR, where it copies configs/
DRAIN_MARGIN_S = 5  # closing the engine and exiting after the drain


@pytest.fixture(scope="module")
def docs() -> dict[str, dict[str, Any]]:
    parsed = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    by_kind = {doc["kind"]: doc for doc in parsed}
    assert len(by_kind) == len(parsed), "one object of each kind"
    return by_kind


def container(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    containers = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def serve_args(docs: dict[str, dict[str, Any]]) -> Any:
    spec = container(docs)
    assert spec["command"] == ["breezert", "serve"]
    argv = ["serve", *(a.replace(IMAGE_ROOT, f"{REPO}/") for a in spec["args"])]
    return build_parser().parse_args(argv)


def test_one_gpu_per_pod(docs: dict[str, dict[str, Any]]) -> None:
    resources = container(docs)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"].get("nvidia.com/gpu", 1) == 1


def test_the_command_line_is_a_server_that_may_bind_beyond_loopback(
        docs: dict[str, dict[str, Any]]) -> None:
    args = serve_args(docs)
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["BREEZERT_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "breezert-auth"
    cfg = serve_config(args, {"BREEZERT_AUTH_TOKEN": "from-the-secret"})
    assert cfg.serving.host == "0.0.0.0" and cfg.model.device == "cuda"
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert ports["http"] == cfg.serving.port


def test_probes_hit_readyz_and_healthz_on_the_served_port(
        docs: dict[str, dict[str, Any]]) -> None:
    spec = container(docs)
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    ready, live = spec["readinessProbe"]["httpGet"], spec["livenessProbe"]["httpGet"]
    assert ready["path"] == "/readyz" and live["path"] == "/healthz"
    assert ready["port"] in ports and live["port"] in ports
    # a full engine leaves the endpoints at its first 503 and comes back at its first 200
    assert spec["readinessProbe"]["failureThreshold"] == 1
    assert spec["readinessProbe"]["periodSeconds"] <= 5


def test_termination_grace_covers_the_drain(docs: dict[str, dict[str, Any]]) -> None:
    cfg = serve_config(serve_args(docs), {"BREEZERT_AUTH_TOKEN": "x"})
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    assert cfg.serving.shutdown_grace_s + DRAIN_MARGIN_S <= grace
    assert grace <= cfg.serving.shutdown_grace_s + 60  # not far beyond: a stuck pod goes


def test_budget_service_and_scrape_select_the_pods(docs: dict[str, dict[str, Any]]) -> None:
    deployment = docs["Deployment"]["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    selected = deployment["selector"]["matchLabels"]
    assert selected.items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selected
    budget = docs["PodDisruptionBudget"]["spec"]
    assert budget.get("maxUnavailable") == 1 and deployment["replicas"] >= 2
    service = docs["Service"]
    assert service["spec"]["selector"] == selected
    monitor = docs["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert all(e["port"] in service_ports and e["path"] == "/metrics"
               for e in monitor["endpoints"])
    annotations = deployment["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in container(docs)["ports"]}
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert annotations["prometheus.io/path"] == "/metrics"
