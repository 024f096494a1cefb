"""deploy/k8s: valid against the Kubernetes schemas (kubernetes-validate, strict), and consistent with the server."""

import re

import kubernetes_validate
import pytest
import yaml

from server.config import Settings
from tests.conftest import REPO

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33"


def manifests() -> dict[str, dict]:
    return {doc["kind"]: doc for f in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(f.read_text())}


@pytest.mark.parametrize("kind", ["Deployment", "Service", "HorizontalPodAutoscaler"])
def test_manifest_is_valid_kubernetes(kind):
    kubernetes_validate.validate(manifests()[kind], KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest():
    deployment = manifests()["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_deployment_matches_the_server():
    m = manifests()
    pod = m["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    grace = float(env.get("TINYSERVE_SHUTDOWN_GRACE_S", Settings().shutdown_grace_s))
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = 5  # server/__main__.py: uvicorn's drain limit is the grace + 5 s
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + grace + drain
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] in Settings().auth_exempt  # alive even with a token
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"EXPOSE {container['ports'][0]['containerPort']}" in dockerfile
    assert "args" not in container and "command" not in container  # the image's own entry point runs
    labels = pod["metadata"]["labels"]
    assert m["Service"]["spec"]["selector"].items() <= labels.items()
    assert m["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == m["Deployment"]["metadata"]["name"]
    assert all(re.fullmatch(r"TINYSERVE_[A-Z_]+", name) and name[10:].lower() in Settings.model_fields for name in env)
    Settings(**{name[10:].lower(): value for name, value in env.items()})  # and their values are valid
