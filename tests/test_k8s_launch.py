"""`mega launch k8s` (issue 50, item 4), on the CPU
(gloo; the jobs pinned with CUDA_VISIBLE_DEVICES="", the reference run on a gloo rank): the
PyTorchJob and JobSet manifests validate (jsonschema) against the schemas of the training operator's
and JobSet's CRDs (tests/k8s_schemas, made by from_crd.py: unknown fields are errors, as kubectl's
strict validation makes them), carry the image, the GPUs, the shared checkpoint volume and the
training flags; a PyTorchJob's pod command, with the variables the operator sets expanded as
Kubernetes expands them, trains two "pods" like one process; --save off the shared volume is
refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from mega.train.job_launchers.command import k8s_main
from mega.train.launch import free_port
from mega.train.testing.training_runs import assert_losses_close, logged_losses, train_losses

SCHEMAS = Path(__file__).parent / "k8s_schemas"
ARGV = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]


def write_manifests(tmp_path: Path, nodes: int, gpus: int, argv: list[str], *extra: str) -> dict[str, dict]:
    assert k8s_main(["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--job-name", "tiny", "--image",
                     "registry.example/mega:1", "--checkpoint-claim", "shared-ckpt", "--output-dir", str(tmp_path),
                     *extra, "--", *argv]) == 0
    return {kind: json.loads((tmp_path / f"tiny-{kind}.json").read_text()) for kind in ("pytorchjob", "jobset")}


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
def test_the_manifests_validate_against_the_crds_schemas(tmp_path, kind):
    schema = json.loads((SCHEMAS / f"{kind}.json").read_text())
    manifest = write_manifests(tmp_path, 4, 8, [*ARGV, "--save", "/checkpoints/run"], "--env",
                               "NCCL_SOCKET_IFNAME=ib0", "--max-restarts", "2")[kind]
    jsonschema.validate(manifest, schema)

    if kind == "pytorchjob":
        replicas = manifest["spec"]["pytorchReplicaSpecs"]
        assert {name: spec["replicas"] for name, spec in replicas.items()} == {"Master": 1, "Worker": 3}
        assert manifest["spec"]["nprocPerNode"] == "8"
        pod = replicas["Worker"]["template"]["spec"]
    else:
        job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
        assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 2}
        pod = job["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example/mega:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "ib0"} in container["env"]
    assert container["args"][-len(ARGV) - 2:] == [*ARGV, "--save", "/checkpoints/run"]
    assert "/checkpoints" in [mount["mountPath"] for mount in container["volumeMounts"]]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared-ckpt"}} in pod["volumes"]

    # The schema is strict: a misspelt field is an error (kubectl would refuse it too).
    container["volumeMount"] = container.pop("volumeMounts")
    with pytest.raises(jsonschema.ValidationError, match="'volumeMount' was unexpected"):
        jsonschema.validate(manifest, schema)


def test_the_pytorchjob_pods_train_like_one_process(worlds, tmp_path):
    manifest = write_manifests(tmp_path, 2, 1, [*ARGV, "--tensor-model-parallel-size", "2"])["pytorchjob"]
    port = free_port()
    pods = []
    for replica, node_rank in (("Master", 0), ("Worker", 1)):
        container = manifest["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]
        # What the operator sets (PET_*: torchrun's variables), expanded as Kubernetes expands $(NAME).
        variables = {"PET_NNODES": "2", "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": "127.0.0.1",
                     "PET_MASTER_PORT": str(port), **{env["name"]: env["value"] for env in container["env"]}}
        args = [re.sub(r"\$\((\w+)\)", lambda match, known=variables: known[match.group(1)], arg)
                for arg in container["args"]]
        command = [sys.executable, "-m", "mega.core.cli.main", *container["command"][1:], *args]
        pods.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **variables, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}))
    outputs = [pod.communicate(timeout=600) for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    losses = logged_losses(outputs[0][0] + outputs[1][0])
    assert_losses_close([losses[1], losses[2]], worlds.run(1, train_losses, ARGV)[0], "PyTorchJob, 2 pods, tp2")


def test_a_checkpoint_directory_off_the_shared_volume_is_refused(tmp_path, capsys):
    assert k8s_main(["--nodes", "2", "--gpus-per-node", "8", "--image", "mega", "--checkpoint-claim", "shared",
                     "--output-dir", str(tmp_path), "--", *ARGV, "--save", "/tmp/ckpt"]) == 2
    assert "--save /tmp/ckpt is not on the shared volume mounted at /checkpoints" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
