"""``mega launch k8s``: Kubernetes manifests for a mega job, one pod per node, for Kubeflow's
PyTorchJob (kubeflow.org/v1, the training operator) and for JobSet (jobset.x-k8s.io/v1alpha2).

Each pod runs `mega train` as one node of a multi-node job (mega.train.nodes): torch's elastic
agent starts the node's ranks, one per GPU, and the agents meet at node 0. What differs is who says
which node a pod is and where node 0 is:

* PyTorchJob: the operator sets torchrun's variables in the container named ``pytorch``
  (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``; the port is the
  one named ``pytorchjob-port``); the Master replica is node 0.
* JobSet: one Indexed Job of N pods; the pod's completion index is its node, and node 0 is
  reachable by its DNS name ``<jobset>-<job>-0-0.<jobset>`` (``network.enableDNSHostnames``).

Kubernetes expands ``$(NAME)`` in a container's args from its environment, so the args name the
variables rather than a shell.
"""

from __future__ import annotations

import dataclasses

from mega.train.job_launchers.job import CUDA_SETTINGS, Job

# The training operator's names: the container it sets the variables in, the port it reads.
PYTORCH_CONTAINER = "pytorch"
PYTORCHJOB_PORT_NAME = "pytorchjob-port"
# The JobSet's one replicated job: its pods are the nodes.
JOBSET_JOB = "node"
CHECKPOINT_VOLUME = "checkpoints"


@dataclasses.dataclass(frozen=True)
class PodOptions:
    checkpoint_claim: str  # a PersistentVolumeClaim every pod mounts (ReadWriteMany): --save lives there
    checkpoint_path: str = "/checkpoints"
    namespace: str | None = None
    cpu: str | None = None  # per pod, Kubernetes' quantities ("32", "500Gi")
    memory: str | None = None
    shm_size: str = "64Gi"  # /dev/shm: the container's default 64 MB starves NCCL and data loaders
    env: tuple[tuple[str, str], ...] = ()
    max_restarts: int = 0  # the whole job restarted after a failure, from the newest checkpoint


def pytorchjob(job: Job, pod: PodOptions) -> dict:
    node_args = ["--nnodes", "$(PET_NNODES)", "--node-rank", "$(PET_NODE_RANK)",
                 "--master-addr", "$(PET_MASTER_ADDR)", "--master-port", "$(PET_MASTER_PORT)"]
    template = _pod(job, pod, node_args, env=[], restart_policy="OnFailure")
    template["spec"]["containers"][0]["ports"] = [{"name": PYTORCHJOB_PORT_NAME, "containerPort": job.master_port}]
    replicas = {"Master": 1, **({"Worker": job.nodes - 1} if job.nodes > 1 else {})}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job, pod),
        "spec": {
            "nprocPerNode": str(job.gpus_per_node),
            "runPolicy": {"backoffLimit": pod.max_restarts, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": {
                kind: {"replicas": count, "restartPolicy": "OnFailure", "template": template}
                for kind, count in replicas.items()
            },
        },
    }


def jobset(job: Job, pod: PodOptions) -> dict:
    first_node = f"{job.name}-{JOBSET_JOB}-0-0.{job.name}"
    node_args = ["--nnodes", str(job.nodes), "--node-rank", "$(NODE_RANK)",
                 "--master-addr", first_node, "--master-port", str(job.master_port)]
    index = {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job, pod),
        "spec": {
            "failurePolicy": {"maxRestarts": pod.max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": job.name},
            "replicatedJobs": [{
                "name": JOBSET_JOB,
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed",
                    # A failed pod fails the JobSet, which restarts every pod (failurePolicy).
                    "backoffLimit": 0,
                    "template": _pod(job, pod, node_args, env=[index], restart_policy="Never"),
                }},
            }],
        },
    }


def _metadata(job: Job, pod: PodOptions) -> dict:
    return {"name": job.name, **({"namespace": pod.namespace} if pod.namespace else {})}


def _pod(job: Job, pod: PodOptions, node_args: list[str], env: list[dict], restart_policy: str) -> dict:
    limits = {"nvidia.com/gpu": job.gpus_per_node, **({"cpu": pod.cpu} if pod.cpu else {}),
              **({"memory": pod.memory} if pod.memory else {})}
    settings = {**{name: value for name, (value, _) in CUDA_SETTINGS.items()}, **dict(pod.env)}
    return {
        "spec": {
            "restartPolicy": restart_policy,
            "containers": [{
                "name": PYTORCH_CONTAINER,
                "image": job.image,
                "command": ["mega", "train"],
                "args": [*node_args, "--nproc-per-node", str(job.gpus_per_node), *job.train_argv],
                "env": [*env, *({"name": name, "value": value} for name, value in settings.items())],
                "resources": {"limits": limits},
                "volumeMounts": [{"name": CHECKPOINT_VOLUME, "mountPath": pod.checkpoint_path},
                                 {"name": "shm", "mountPath": "/dev/shm"}],
            }],
            "volumes": [
                {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": pod.checkpoint_claim}},
                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": pod.shm_size}},
            ],
        },
    }


def check_save_on_the_volume(job: Job, pod: PodOptions) -> None:
    """ValueError when --save (or --load) is not on the shared volume: every node's ranks write one
    checkpoint into one directory, which must therefore be the same one on every pod."""
    argv = list(job.train_argv)
    for flag, path in zip(argv, [*argv[1:], None], strict=True):
        flag, _, inline = flag.partition("=")
        path = inline or path
        if flag in ("--save", "--load") and path:
            if not (path + "/").startswith(pod.checkpoint_path.rstrip("/") + "/"):
                raise ValueError(f"{flag} {path} is not on the shared volume mounted at {pod.checkpoint_path} "
                                 "(--checkpoint-path): each pod would write its own part of the checkpoint")
