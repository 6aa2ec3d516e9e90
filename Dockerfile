# mega on NVIDIA's NGC PyTorch image: its torch, CUDA, cuDNN, NCCL and driver stack are kept as
# they are, and mega's packages are installed on top. Build from the repository root:
#   docker build -t mega .
#   docker run --gpus all --ipc=host --rm mega                      # runs `mega doctor`
# See docker/README.md.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="mega" \
      org.opencontainers.image.description="Megatron-style training and serving as a small core plus plugins"

# Megatron's setting for overlapping tensor-parallel communication; pip without caches or nags.
ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/mega
COPY packages/ packages/
COPY plugins/ plugins/

# Pin torch to the image's own build so no dependency can replace it with a wheel from PyPI
# (the repository's constraints.txt pins the CPU wheel for development and is not used here).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /opt/mega/torch-constraint.txt \
    && PIP_CONSTRAINT=/opt/mega/torch-constraint.txt pip install --no-cache-dir \
        ./packages/core ./packages/train ./packages/models ./packages/data ./packages/ckpt-convert \
        ./packages/inference ./packages/rl ./packages/testing \
        ./plugins/flash-attn ./plugins/transformer-engine ./plugins/apex ./plugins/liger ./plugins/torchao ./plugins/muon \
    && mega plugins

WORKDIR /workspace
CMD ["mega", "doctor"]
