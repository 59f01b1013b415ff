"""The launchers for several machines from a scheduler (deploy/): the Slurm script runs a real training
through its srun + torchrun line (srun and scontrol, which need a Slurm cluster, stand in as what they do on
one machine: run the command once, name the allocation's machine), and the Kubernetes manifest says one thing
in every place it is said (torchrun's own parser reads its arguments; the config and overrides load)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_run import tiny_run_values

from trainer.config import TrainConfig
from trainer.report.step_meter import TRAIN_LOG

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "deploy" / "train.sbatch"
MANIFEST = REPO / "deploy" / "kubernetes.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_slurm_script_trains_through_srun_and_torchrun(tiny_model_dir, sample_csv, tmp_path):
    """deploy/slurm's script, with srun and scontrol as one-machine stand-ins, trains through torchrun.
    Slow because torchrun starts two ranks that train."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun on a one-machine allocation: its options, then the command, run once. scontrol: the machine's name.
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node-a" ] && echo 127.0.0.1\n'
    )
    for shim in ("srun", "scontrol"):
        (bin_dir / shim).chmod(0o755)
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    values = tiny_run_values(
        tiny_model_dir, sample_csv, out, per_device_train_batch_size=8, eval_fraction=0.0
    )
    config.write_text(yaml.safe_dump(values | {"max_steps": 2, "save_steps": 2}))
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node-a",
        SLURM_NNODES="1",
        SLURM_GPUS_ON_NODE="2",
        SLURM_JOB_ID="4242",
        RDZV_PORT=str(_free_port()),
    )
    run = subprocess.run(
        ["bash", str(SBATCH), str(config), "--set", "logging_steps=1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "recipe-t5: 1 machines x 2 GPUs, rendezvous at 127.0.0.1:" in run.stdout
    assert "process group: 2 ranks" in run.stderr
    rows = [json.loads(line) for line in (out / TRAIN_LOG).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]  # the override after the config reached it
    assert (out / "final" / "config.json").is_file()

    usage = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: sbatch deploy/train.sbatch CONFIG" in usage.stderr


def test_the_kubernetes_job_says_one_thing_everywhere():
    from torch.distributed.run import get_args_parser

    service, job = yaml.safe_load_all(MANIFEST.read_text())
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    name = job["metadata"]["name"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert service["metadata"]["name"] == pod["subdomain"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": name}
    assert spec["completionMode"] == "Indexed"
    (container,) = pod["containers"]
    assert container["command"] == ["torchrun"]
    args = get_args_parser().parse_args(container["args"])  # torchrun reads them as written
    assert int(args.nnodes) == spec["completions"] == spec["parallelism"]
    assert int(args.nproc_per_node) == container["resources"]["limits"]["nvidia.com/gpu"]
    host, port = args.rdzv_endpoint.split(":")
    assert host == f"{name}-0.{name}"  # pod 0 of the Indexed Job, through the headless Service
    assert int(port) == service["spec"]["ports"][0]["port"] == container["ports"][0]["containerPort"]
    assert args.rdzv_backend == "c10d" and args.module and args.training_script == "trainer"

    # The image's command line: a preset the image holds (configs/), with overrides that load.
    command = args.training_script_args
    assert command[:2] == ["train", "--config"]
    preset = REPO / command[2]
    assert preset.is_file() and command[2].startswith("configs/")
    overrides = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    assert TrainConfig.load(preset, overrides).output_dir.startswith("/outputs/")

    # The image and the compose file's: its name, its user, its mounts, the secrets from a Secret only.
    compose = yaml.safe_load((REPO / "docker-compose.training.yml").read_text())["services"]["trainer"]
    assert container["image"] == compose["image"]
    uid = re.search(r"^USER (\d+):(\d+)$", (REPO / "Dockerfile.training").read_text(), re.M).groups()
    assert (str(pod["securityContext"]["runAsUser"]), str(pod["securityContext"]["runAsGroup"])) == uid
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    compose_targets = {v["target"] for v in compose["volumes"] if v["target"] != "/app/configs"}
    assert compose_targets | {"/dev/shm"} == mounts
    assert container["envFrom"] == [{"secretRef": {"name": f"{name}-env"}}]
    assert not {e["name"] for e in container["env"]} & {"WANDB_API_KEY", "HF_TOKEN", "DISCORD_WEBHOOK_URL"}
