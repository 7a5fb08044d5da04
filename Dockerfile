# The env-server image: K copies of one gymnasium env behind gRPC (envfleet.v1). No torch.
#
#   docker build -t envfleet-env-server .
#   docker run --rm -p 127.0.0.1:50051:50051 -e ENVFLEET_ENV=CartPole-v1 -e ENVFLEET_NUM_ENVS=4 envfleet-env-server
#
# Configure it with ENVFLEET_* variables (every `env-server` option has one: ENVFLEET_ENV, ENVFLEET_NUM_ENVS,
# ENVFLEET_PORT, ENVFLEET_ENV_KWARGS, ENVFLEET_WRAPPERS, ...). The port and TLS by these only, not by arguments
# after the image: `... envfleet-env-server --port 6000` serves, but the health check, which reads ENVFLEET_PORT
# and the TLS variables, probes 50051 and calls it unhealthy. Your own env: install its package at build time
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
# (and the build backend, for the install of envfleet itself below)
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print(*p['project']['dependencies'], *p['build-system']['requires'], sep='\n')" > requirements.txt \
    && pip install -r requirements.txt

# Users' own envs and their dependencies (pip requirement specifiers, space-separated), within envfleet's
# requirements (-c): a package that needs another gymnasium, numpy or protobuf than envfleet takes fails
# here, saying which, not at run time (envfleet itself is installed below without a dependency check).
ARG EXTRA_PIP_PACKAGES=""
RUN if [ -n "$EXTRA_PIP_PACKAGES" ]; then pip install -c requirements.txt $EXTRA_PIP_PACKAGES; fi

COPY env_server ./env_server
# envfleet installed in place (editable: its metadata, for the version `--version` and the metrics report,
# and the env-server command; the code stays here), after the source so that a .py edit reruns only this.
COPY LICENSE ./
# (The learner command goes too: this image has no learner package, and it would only fail.)
RUN pip install --no-deps --no-build-isolation --editable . && rm -rf envfleet.egg-info \
    && rm -f "$(command -v learner)" \
    && python -m compileall -q env_server \
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
