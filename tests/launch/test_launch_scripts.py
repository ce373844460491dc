"""Launch scripts and templates: they parse, take a config path and overrides only, and do what
their headers say. Slurm, Ray and the interpreter are stubbed on PATH, so nothing starts."""

from __future__ import annotations

import glob
import importlib.util
import inspect
import os
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(ROOT, "launch")
SCRIPTS = sorted(
    glob.glob(os.path.join(LAUNCH, "**", "*.sh"), recursive=True)
    + glob.glob(os.path.join(LAUNCH, "**", "*.sbatch"), recursive=True)
)
SBATCH = os.path.join(LAUNCH, "slurm", "ray_cluster.sbatch")
CONFIG = "configs/qwen3-8b-dapo.yaml"  # 1 node x 8 GPUs; cluster.nodes=2 still plans


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _load_render():
    spec = importlib.util.spec_from_file_location("rlsys_k8s_render", os.path.join(LAUNCH, "k8s", "render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_render()


# ----------------------------------------------------------------- shell scripts


def test_the_launchers_exist():
    want = {
        "launch/local.sh",
        "launch/torchrun.sh",
        "launch/slurm/ray_cluster.sbatch",
        "launch/slurm/torchrun.sbatch",
        "launch/k8s/rayjob.yaml",
        "launch/k8s/render.py",
    }
    have = {_rel(p) for p in glob.glob(os.path.join(LAUNCH, "**", "*"), recursive=True)}
    assert want <= have


@pytest.mark.parametrize("path", SCRIPTS, ids=_rel)
def test_shell_script_parses_and_is_strict(path):
    res = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    with open(path) as f:
        text = f.read()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.stat(path).st_mode & stat.S_IXUSR, f"{_rel(path)} is not executable"


def _stub(bin_dir, name: str, body: str) -> None:
    path = os.path.join(bin_dir, name)
    with open(path, "w") as f:
        f.write("#!/usr/bin/env bash\n" + textwrap.dedent(body))
    os.chmod(path, 0o755)


@pytest.fixture
def stubs(tmp_path):
    """A bin dir with fake srun/scontrol/hostname/ray and a PYTHON that logs `rlsys train`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    log.touch()
    # srun: log its options, drop them, run the command here.
    _stub(
        bin_dir,
        "srun",
        """
        opts=()
        while [[ $1 == -* ]]; do opts+=("$1"); shift; done
        echo "srun ${opts[*]} :: $*" >> "$LOG"
        exec "$@"
        """,
    )
    _stub(bin_dir, "scontrol", 'for n in $FAKE_NODES; do echo "$n"; done\n')
    _stub(bin_dir, "hostname", 'echo "10.0.0.1 fd00::1"\n')
    # ray: `start` blocks like --block; `status` lists the head, then all FAKE_JOIN nodes once workers start.
    _stub(
        bin_dir,
        "ray",
        """
        case $1 in
          start) echo "ray $*" >> "$LOG"; exec sleep 120 ;;
          stop) echo "ray $*" >> "$LOG" ;;
          status)
            n=$(grep -c '^ray start --head' "$LOG")
            if grep -q '^ray start --address' "$LOG"; then n=$FAKE_JOIN; fi
            echo "======== Autoscaler status ========"
            echo "Node status"
            echo "Active:"
            for ((i = 0; i < n; i++)); do echo " 1 node_$i"; done
            echo "Pending:"
            echo " 1 node_pending"
            ;;
        esac
        """,
    )
    # PYTHON: log `-m rlsys.cli train ...` and exit $TRAIN_RC; the config check runs for real
    # unless FAKE_SHAPE answers it.
    _stub(
        bin_dir,
        "python",
        f"""
        if [[ $1 == -m && $3 == train ]]; then echo "python $*" >> "$LOG"; exit "${{TRAIN_RC:-0}}"; fi
        if [[ $1 == -m && $2 == torch.distributed.run ]]; then echo "python $*" >> "$LOG"; exit 0; fi
        if [[ $1 == - && -n ${{FAKE_SHAPE:-}} ]]; then cat > /dev/null; echo "$FAKE_SHAPE"; exit 0; fi
        exec {shlex.quote(sys.executable)} "$@"
        """,
    )
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(bin_dir / "python"),
        LOG=str(log),
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_SUBMIT_DIR=ROOT,
        FAKE_NODES="n1 n2",
        FAKE_JOIN="2",
        RAY_POLL_S="0.1",
        RAY_WAIT_S="20",
    )
    return env, log


def _log(log) -> list[str]:
    return log.read_text().splitlines()


def test_local_sh_runs_rlsys_train_with_config_and_overrides(stubs):
    env, log = stubs
    res = subprocess.run(
        ["bash", "launch/local.sh", CONFIG, "trainer.steps=3", "rollout.sampling.stop=[a, b]"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert _log(log) == [f"python -m rlsys.cli train {CONFIG} trainer.steps=3 rollout.sampling.stop=[a, b]"]


TORCHRUN = (
    "-m torch.distributed.run --nnodes 1 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500"
)


@pytest.mark.parametrize(
    "args,program",
    [
        (["convert", "hf-to-mcore", "--tp", "2"], "-m rlsys.cli convert hf-to-mcore --tp 2"),
        (["benchmarks/x.py", "--steps", "3"], "benchmarks/x.py --steps 3"),
    ],
)
def test_torchrun_sh_runs_an_rlsys_command_or_a_script(stubs, args, program):
    env, log = stubs
    res = subprocess.run(["bash", "launch/torchrun.sh", "2", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert _log(log) == [f"python {TORCHRUN} {program}"]


def test_torchrun_sbatch_runs_one_torchrun_per_node(stubs):
    env, log = stubs
    env = {**env, "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4"}
    res = subprocess.run(
        ["bash", os.path.join(LAUNCH, "slurm", "torchrun.sbatch"), "check-parity", "--tp", "8"],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert _log(log)[1] == (
        "python -m torch.distributed.run --nnodes 2 --node_rank 1 --nproc_per_node 4 --master_addr n1 "
        "--master_port 29500 -m rlsys.cli check-parity --tp 8"
    )


@pytest.mark.parametrize("script", ["launch/local.sh", "launch/slurm/ray_cluster.sbatch"])
@pytest.mark.parametrize("args", [[], [CONFIG, "--steps", "3"], [CONFIG, "steps"]])
def test_scripts_take_only_a_config_and_overrides(stubs, script, args):
    env, log = stubs
    res = subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode != 0
    assert "usage:" in res.stderr
    assert _log(log) == []  # nothing started


def _sbatch(env, *args, **extra):
    return subprocess.run(
        ["bash", SBATCH, *args], cwd="/", env={**env, **extra}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # runs the real config check (imports rlsys in a subprocess)
def test_ray_cluster_sbatch_starts_head_and_workers_runs_the_driver_and_tears_down(stubs):
    env, log = stubs
    res = _sbatch(env, CONFIG, "cluster.nodes=2")  # the real config check: 2 nodes x 8 GPUs
    assert res.returncode == 0, res.stderr
    lines = [line for line in _log(log) if not line.startswith("srun --nodes=1 --ntasks=1 --nodelist=n1 :: hostname")]
    assert lines == [
        "srun --nodes=1 --ntasks=1 --nodelist=n1 :: ray start --head --node-ip-address=10.0.0.1 --port=6379 "
        "--num-gpus=8 --disable-usage-stats --block",
        "ray start --head --node-ip-address=10.0.0.1 --port=6379 --num-gpus=8 --disable-usage-stats --block",
        "srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --exclude=n1 :: ray start --address=10.0.0.1:6379 "
        "--num-gpus=8 --disable-usage-stats --block",
        "ray start --address=10.0.0.1:6379 --num-gpus=8 --disable-usage-stats --block",
        # run from the submit dir, so the relative config path resolves; auto attaches to the cluster
        f"python -m rlsys.cli train {CONFIG} cluster.nodes=2 cluster.ray_address=auto",
        "srun --overlap --nodes=2 --ntasks-per-node=1 :: ray stop --force",
        "ray stop --force",
    ]
    assert "Ray cluster up: 2 node(s) x 8 GPU(s)" in res.stdout


@pytest.mark.slow  # runs the real config check (imports rlsys in a subprocess)
def test_ray_cluster_sbatch_rejects_a_bad_config_before_starting_ray(stubs):
    env, log = stubs
    res = _sbatch(env, CONFIG, "actor.parallel.tp=3")
    assert res.returncode == 2
    assert "error: config error at 'actor.world_size'" in res.stderr
    assert _log(log) == []


def test_ray_cluster_sbatch_checks_the_allocation_matches_the_config(stubs):
    env, log = stubs
    res = _sbatch(env, CONFIG, FAKE_SHAPE="1 8")  # the config wants 1 node, slurm gave 2
    assert res.returncode == 2
    assert "cluster.nodes=1 but the allocation has 2 node(s)" in res.stderr
    assert _log(log) == []


def test_ray_cluster_sbatch_checks_the_gpus_per_node(stubs):
    env, log = stubs
    res = _sbatch(env, CONFIG, "cluster.nodes=2", FAKE_SHAPE="2 8", SLURM_GPUS_ON_NODE="4")
    assert res.returncode == 2
    assert "cluster.devices_per_node=8 but slurm gave 4 GPU(s) per node" in res.stderr
    assert _log(log) == []


def test_ray_cluster_sbatch_single_node_starts_no_workers(stubs):
    env, log = stubs
    res = _sbatch(env, CONFIG, FAKE_SHAPE="1 8", FAKE_NODES="n1", SLURM_JOB_NODELIST="n1")
    assert res.returncode == 0, res.stderr
    assert not any("--address" in line for line in _log(log))
    assert f"python -m rlsys.cli train {CONFIG} cluster.ray_address=auto" in _log(log)


def test_ray_cluster_sbatch_passes_the_driver_status_and_still_stops_ray(stubs):
    env, log = stubs
    res = _sbatch(env, CONFIG, "cluster.nodes=2", FAKE_SHAPE="2 8", TRAIN_RC="3")
    assert res.returncode == 3
    assert _log(log)[-1] == "ray stop --force"


def test_ray_cluster_sbatch_gives_up_when_nodes_do_not_join(stubs):
    env, log = stubs
    # The head's wait has its own RAY_WAIT_S: 1 s was too short for the stubbed head on a loaded CI host.
    res = _sbatch(env, CONFIG, "cluster.nodes=2", FAKE_SHAPE="2 8", FAKE_JOIN="1", RAY_WAIT_S="5")
    assert res.returncode == 1
    assert "only 1 of 2 Ray node(s) joined" in res.stderr
    assert not any(line.startswith("python") for line in _log(log))
    assert _log(log)[-1] == "ray stop --force"


# ------------------------------------------------------------------ k8s template


TEMPLATE_PLACEHOLDERS = {"JOB_NAME", "IMAGE", "CONFIG", "OVERRIDES", "NUM_WORKERS", "GPUS_PER_NODE"}


def _template() -> str:
    with open(render.TEMPLATE) as f:
        return f.read()


def test_rayjob_template_placeholders_are_known():
    assert render.placeholders(_template()) == TEMPLATE_PLACEHOLDERS


def test_rayjob_renderer_takes_only_a_config_and_overrides():
    # The experiment is (config, overrides); image and job name only name the deployment.
    assert list(inspect.signature(render.render).parameters) == ["config", "overrides", "image", "name"]
    assert render.IMAGE_ROOT in _template()  # the pods' workingDir is where the config path points


def _rayjob(text: str) -> dict:
    job = yaml.safe_load(text)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    return job


def test_rayjob_template_renders_with_sample_values():
    values = {
        "JOB_NAME": "sample",
        "IMAGE": "registry.example/rlsys:1",
        "CONFIG": "/opt/rlsys/configs/x.yaml",
        "OVERRIDES": shlex.join(["trainer.steps=5", "logging.wandb_project=a: b #c"]),
        "NUM_WORKERS": "3",
        "GPUS_PER_NODE": "8",
    }
    job = _rayjob(render.substitute(_template(), values))
    spec, cluster = job["spec"], job["spec"]["rayClusterSpec"]
    assert job["metadata"]["name"] == "sample"
    assert shlex.split(spec["entrypoint"]) == [
        "rlsys",
        "train",
        "/opt/rlsys/configs/x.yaml",
        "trainer.steps=5",
        "logging.wandb_project=a: b #c",
        "cluster.ray_address=auto",
    ]
    head = cluster["headGroupSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3
    for group in (head, workers):
        assert group["rayStartParams"]["num-gpus"] == "8"  # KubeRay wants strings here
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == "registry.example/rlsys:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    with pytest.raises(KeyError, match="NUM_WORKERS"):
        render.substitute(_template(), {k: v for k, v in values.items() if k != "NUM_WORKERS"})


@pytest.mark.parametrize(
    "config,overrides,workers,gpus,name",
    [
        ("configs/deepseek-v3-671b-grpo.yaml", ["trainer.steps=10"], 15, 8, "deepseek-v3-671b-grpo"),
        ("configs/qwen2.5-0.5b-gsm8k-grpo.yaml", [], 0, 8, "qwen2-5-0-5b-gsm8k-grpo"),
        ("configs/tiny-cpu-grpo.yaml", ["cluster.nodes=2"], 1, 0, "tiny-cpu-grpo"),
    ],
)
def test_rayjob_renders_from_a_config(config, overrides, workers, gpus, name):
    job = _rayjob(render.render(os.path.join(ROOT, config), overrides))
    assert job["metadata"]["name"] == name
    assert shlex.split(job["spec"]["entrypoint"]) == [
        "rlsys",
        "train",
        f"{render.IMAGE_ROOT}/{config}",
        *overrides,
        "cluster.ray_address=auto",
    ]
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == workers
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_rayjob_render_cli_reports_bad_input_on_one_line(capsys):
    assert render.main([]) == 2
    assert render.main([CONFIG, "--steps"]) == 2
    assert render.main([os.path.join(ROOT, CONFIG), "actor.parallel.tp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: config error at 'actor.world_size'")
