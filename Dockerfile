# The t5tpu command line in a container: `docker run IMAGE train --gin_file=...`, the image a
# Vertex AI custom job runs (t5tpu vertex-submit), and a Vertex AI prediction container, which
# serves with `t5tpu serve` when started with AIP_HTTP_PORT set (t5tpu vertex-deploy;
# docker-entrypoint.sh; docs/CLOUD.md).
#
#   docker build -t t5tpu .                                  # CPU (CI smoke runs)
#   docker build --build-arg JAX_EXTRA=tpu -t t5tpu:tpu .    # TPU VMs and Vertex AI TPUs
#   docker build --build-arg JAX_EXTRA=cuda12 -t t5tpu:gpu . # NVIDIA GPUs
FROM python:3.11-slim

# "" (CPU), "tpu" (jax[tpu] with libtpu) or "cuda12" (jax[cuda12]); same jax version as pinned.
ARG JAX_EXTRA=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    TF_CPP_MIN_LOG_LEVEL=2

WORKDIR /opt/t5tpu

# Dependencies first, from pyproject's list and the pinned set, so that a source change
# rebuilds only the small layers below. What running does not need goes in the same step, so
# that it never lands in a layer (docs/CLOUD.md has the sizes):
# - tensorflow's GPU build (~450 MB more than tensorflow-cpu): TensorFlow only runs t5tpu's
#   input pipelines, on the host's CPU (t5tpu hides every GPU from it), so tensorflow-cpu of the
#   same version replaces it, after the install, as tensorflow-text declares `tensorflow`.
# - TensorFlow's C++ headers (include/, 430 MB), for compiling custom ops, and libclang (62 MB),
#   which nothing imports.
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" > requirements.txt \
    && pip install -c constraints.txt -r requirements.txt \
    && if [ -n "$JAX_EXTRA" ]; then \
         pip install "jax[$JAX_EXTRA]==$(pip show jax | sed -n 's/^Version: //p')" \
           -f https://storage.googleapis.com/jax-releases/libtpu_releases.html; \
       fi \
    && tf_version=$(pip show tensorflow | sed -n 's/^Version: //p') \
    && pip uninstall -y -q tensorflow libclang \
    && pip install -q --no-deps "tensorflow-cpu==$tf_version" \
    && rm -rf "$(pip show tensorflow-cpu | sed -n 's/^Location: //p')/tensorflow/include" \
       requirements.txt

COPY README.md ./
COPY t5tpu ./t5tpu
COPY configs ./configs
COPY tasks ./tasks
RUN pip install --no-deps . && rm -rf build
COPY docker-entrypoint.sh /usr/local/bin/

# Runs as a user without root; MODEL_DIR is a mounted folder or a gs:// path.
RUN useradd --create-home --uid 1000 t5tpu
USER t5tpu
WORKDIR /home/t5tpu
# `t5tpu serve` listens here in a prediction container (Vertex AI's AIP_HTTP_PORT default).
EXPOSE 8080
ENTRYPOINT ["docker-entrypoint.sh"]
