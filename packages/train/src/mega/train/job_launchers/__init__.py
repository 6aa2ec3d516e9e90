"""``mega launch``: the files that run a mega job on a cluster's own engine (a SLURM batch script,
Kubernetes manifests), from the job's shape and `mega train`'s flags."""
