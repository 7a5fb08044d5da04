# The env-server image: K copies of one gymnasium env behind gRPC (envfleet.v1). No torch.
#
#   docker build -t envfleet-env-server .
#   docker run --rm -p 127.0.0.1:50051:50051 -e ENVFLEET_ENV=CartPole-v1 -e ENVFLEET_NUM_ENVS=4 envfleet-env-server
#
# Configure it with ENVFLEET_* variables (every `env-server` option has one: ENVFLEET_ENV, ENVFLEET_NUM_ENVS,
# ENVFLEET_PORT, ENVFLEET_ENV_KWARGS, ENVFLEET_WRAPPERS, ...). Your own env: install its package at build time
# and name its class, e.g.
#   docker build --build-arg EXTRA_PIP_PACKAGES="ale-py" -t my-env-server .     (anything `pip install` takes)
#   docker run -e ENVFLEET_ENV=mypkg.envs:MyEnv my-env-server
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/opt/envfleet
WORKDIR /opt/envfleet

# Dependencies first, read from pyproject.toml, so that editing the source reuses this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
        > requirements.txt \
    && pip install -r requirements.txt

# Users' own envs and their dependencies (pip requirement specifiers, space-separated).
ARG EXTRA_PIP_PACKAGES=""
RUN if [ -n "$EXTRA_PIP_PACKAGES" ]; then pip install $EXTRA_PIP_PACKAGES; fi

COPY env_server ./env_server
RUN python -m compileall -q env_server \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin envfleet

USER 10001:10001
ENV ENVFLEET_ENV=CartPole-v1 \
    ENVFLEET_NUM_ENVS=4 \
    ENVFLEET_HOST=0.0.0.0 \
    ENVFLEET_PORT=50051
EXPOSE 50051
# Healthy once the envs exist and the server answers (NOT_SERVING while it drains on SIGTERM). The probe runs
# by path, skipping the package's imports, and reads the port from ENVFLEET_PORT.
HEALTHCHECK --interval=5s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-I", "/opt/envfleet/env_server/health.py"]
# SIGTERM (docker stop, compose down/scale) drains calls in flight for ENVFLEET_GRACE s (default 5), then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "env_server"]
