"""examples/k8s/pytorchjob.yaml: a well-formed PyTorchJob whose pods hand dptrain a command line and config it accepts.

No cluster and no kubectl: the manifest is parsed with PyYAML, its torchrun command line with torchrun's own
argument parser after the shell's expansion of the operator's variables, and what follows ``-m dptrain.run`` with
dptrain's own parser and config loader.
"""

from __future__ import annotations

import os
import shlex
import string
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from dptrain.batching import BatchPlan
from dptrain.config import load_config
from dptrain.run import parse_args

MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "k8s" / "pytorchjob.yaml"
OPERATOR_ENV = {"MASTER_ADDR": "dptrain-chargpt-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1"}


@pytest.fixture(scope="module")
def documents() -> dict[str, dict]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    return {doc["kind"]: doc for doc in docs}


def _container(replica: dict) -> dict:
    (container,) = replica["template"]["spec"]["containers"]
    return container


def _torchrun(container: dict):
    """The pod's command line as bash would run it, parsed by torchrun's own parser."""
    assert container["command"] == ["bash", "-c"]
    (script,) = container["args"]
    words = shlex.split(string.Template(script).substitute(OPERATOR_ENV))
    assert words[:2] == ["exec", "torchrun"], words
    return get_args_parser().parse_args(words[2:])


def test_the_job_is_a_master_and_a_worker_running_the_same_container(documents):
    job = documents["PyTorchJob"]
    assert (job["apiVersion"], job["metadata"]["name"]) == ("kubeflow.org/v1", "dptrain-chargpt")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert sorted(replicas) == ["Master", "Worker"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    assert _container(replicas["Master"])["name"] == "pytorch"  # the name the operator looks for


def test_torchrun_meets_at_the_operators_master_with_one_node_per_pod(documents):
    replicas = documents["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    args = _torchrun(_container(replicas["Master"]))
    assert args.nnodes == str(sum(r["replicas"] for r in replicas.values()))
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "dptrain-chargpt-master-0:23456")
    assert args.module and args.training_script == "dptrain.run"
    cpus = int(_container(replicas["Master"])["resources"]["limits"]["cpu"])
    assert int(args.nproc_per_node) <= cpus


def test_dptrain_accepts_the_command_line_and_the_config_it_gets(documents, tmp_path):
    replicas = documents["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]
    container = _container(replicas["Master"])
    dptrain_args = parse_args(_torchrun(container).training_script_args)
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in replicas["Master"]["template"]["spec"]["volumes"]}
    config_dir, key = os.path.split(dptrain_args.config)
    assert config_dir == mount["config"]
    config_map = documents["ConfigMap"]
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert dptrain_args.run_dir.startswith(mount["runs"] + "/")

    local = tmp_path / key
    local.write_text(config_map["data"][key])
    cfg = load_config(local, dptrain_args.overrides)
    torchrun = _torchrun(container)
    world = int(torchrun.nnodes) * int(torchrun.nproc_per_node)
    plan = BatchPlan.resolve(world, cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.grad_accum_steps)
    assert (world, plan.global_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (4, 64, 16, 1)
    assert cfg.task.name == "chargpt" and cfg.train.steps == 200
