"""Render launch/k8s/rayjob.yaml for one experiment and print it.

    python launch/k8s/render.py CONFIG [key.path=value ...] | kubectl apply -f -

The experiment is the config plus overrides, nothing else: the template's sizes come from
them (worker pods = cluster.nodes - 1, GPUs per pod = cluster.devices_per_node), and only
the deployment names come from the environment: RLSYS_IMAGE (the container image, holding
the repository at /opt/rlsys; default rlsys:latest) and RLSYS_JOB_NAME (default: derived
from the config's file name). The config is checked as by ``rlsys plan`` before rendering.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
TEMPLATE = os.path.join(HERE, "rayjob.yaml")
IMAGE_ROOT = "/opt/rlsys"  # where the image holds the repository (the template's workingDir)
DEFAULT_IMAGE = "rlsys:latest"
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 40  # KubeRay appends suffixes to the RayJob name for its cluster and pods


def placeholders(template: str) -> set[str]:
    return set(PLACEHOLDER.findall(template))


def substitute(template: str, values: dict[str, str]) -> str:
    """envsubst for ``${NAME}``; a placeholder without a value is an error, not an empty string."""
    missing = placeholders(template) - set(values)
    if missing:
        raise KeyError(f"no value for placeholder(s) {', '.join(sorted(missing))}")
    return PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def job_name(config: str) -> str:
    stem = os.path.splitext(os.path.basename(config))[0].lower()
    name = re.sub(r"[^a-z0-9]+", "-", stem).strip("-")[:MAX_NAME].rstrip("-")
    return name or "rlsys"


def image_path(config: str) -> str:
    """The config's path inside the image: repository files map under IMAGE_ROOT."""
    rel = os.path.relpath(os.path.abspath(config), REPO_ROOT)
    if rel.startswith(".."):  # outside the repository: assume the same path is mounted in the pod
        return os.path.abspath(config)
    return f"{IMAGE_ROOT}/{rel.replace(os.sep, '/')}"


def values_for(config: str, overrides: list[str], image: str, name: str) -> dict[str, str]:
    """Placeholder values for one experiment; raises rlsys's UserError for a bad config or layout."""
    from rlsys.config import load_config
    from rlsys.plan import model_arch, validate_layout

    cfg = load_config(config, overrides)
    validate_layout(cfg, model_arch(cfg.model))
    if not (DNS_LABEL.match(name) and len(name) <= MAX_NAME):
        raise ValueError(f"job name '{name}' must be a DNS label of at most {MAX_NAME} characters")
    return {
        "JOB_NAME": name,
        "IMAGE": image,
        "CONFIG": shlex.quote(image_path(config)),
        "OVERRIDES": " ".join(shlex.quote(o) for o in overrides),
        "NUM_WORKERS": str(cfg.cluster.nodes - 1),
        "GPUS_PER_NODE": str(cfg.cluster.devices_per_node if cfg.cluster.device == "cuda" else 0),
    }


def render(config: str, overrides: list[str], image: str = DEFAULT_IMAGE, name: str | None = None) -> str:
    with open(TEMPLATE) as f:
        template = f.read()
    return substitute(template, values_for(config, overrides, image, name or job_name(config)))


def main(argv: list[str]) -> int:
    usage = "usage: python launch/k8s/render.py CONFIG [key.path=value ...]"
    if not argv or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2
    config, overrides = argv[0], argv[1:]
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        print(f"error: '{bad[0]}' is not a key.path=value override; {usage}", file=sys.stderr)
        return 2
    sys.path.insert(0, REPO_ROOT)  # run from a checkout without installing rlsys
    from rlsys.errors import UserError

    try:
        text = render(config, overrides, os.environ.get("RLSYS_IMAGE", DEFAULT_IMAGE), os.environ.get("RLSYS_JOB_NAME"))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
