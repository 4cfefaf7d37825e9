# One image for every process of the fleet: edge, replica, control plane, sandbox simulator,
# model server and the scenario driver.
#
#   docker build -t beyond-fleet .                    # the runtime image (default target)
#   docker build -t beyond-fleet-driver --target driver .   # plus the AWS CLI, for the EFS proof
#
#   docker run IMAGE fleet-edge serve --config /etc/fleet/edge.toml --listen 0.0.0.0:8080
#   docker run IMAGE fleet-replica serve --service --listen 0.0.0.0:9101 ...
#   docker run IMAGE python -m fleet_sim.sandbox --listen 0.0.0.0:7700 --root /home/fleet/sb
#   docker run IMAGE fleet-sim matrix --substrate attached --state STATE --fault-cmd CMD
#   docker run -e FLEET_REPLICA_NAME=a07-r1 ... IMAGE fleet-role replica   # env-driven roles
#
# tini is PID 1 and the fleet process its child: PID 1 in a container ignores signals it has no
# handler for, so a `kill -9` of the replica from `docker exec` or ECS Exec would otherwise do
# nothing. With tini the replica dies, tini exits with its status, and the orchestrator sees a
# lost replica, which is the takeover the fault scripts exist to cause. `-g` forwards SIGTERM to
# the child's whole process group, so a drain reaches the process however it was started.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The runtime dependencies at the versions the suite passed with, every file checked against its
# hash (requirements/lock.txt, written by scripts/lock). No dev extras: the image runs the fleet,
# it does not test it. In a layer of its own, so a change to the code alone reuses it.
COPY requirements/lock.txt ./requirements/lock.txt
RUN python -m venv /opt/fleet \
    && /opt/fleet/bin/pip install --no-cache-dir --require-hashes -r requirements/lock.txt
COPY pyproject.toml README.md ./
COPY edge ./edge
COPY replica ./replica
COPY fleet_sim ./fleet_sim
COPY wire ./wire
# The project over the lock: --no-deps, so nothing unpinned is installed beside it.
RUN /opt/fleet/bin/pip install --no-cache-dir --no-deps . \
    && /opt/fleet/bin/pip check \
    && /opt/fleet/bin/fleet-replica --help >/dev/null \
    && /opt/fleet/bin/fleet-edge --help >/dev/null

FROM ${PYTHON_IMAGE} AS base
# Debian's tini as init; procps so an operator (or fault.sh through ECS Exec) can find the
# fleet process by name with pgrep/pkill. Versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini procps \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 fleet \
    && useradd --system --uid 10001 --gid fleet --create-home --home-dir /home/fleet \
       --shell /usr/sbin/nologin fleet \
    && install -d -o fleet -g fleet -m 0700 /keys /shards /home/fleet/results
COPY --from=build /opt/fleet /opt/fleet
COPY --chmod=0755 deploy/image/fleet-role.sh /usr/local/bin/fleet-role
ENV PATH=/opt/fleet/bin:$PATH \
    HOME=/home/fleet \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/fleet
# edge, replica, sandbox simulator, control plane, model server
EXPOSE 8080 9101 7700 7800 8400
ENTRYPOINT ["/usr/bin/tini", "-g", "--"]
CMD ["fleet-sim", "--help"]

# The EFS proof's driver: the fleet plus the AWS CLI and the Session Manager plugin, which
# `aws ecs execute-command` needs to deliver a kill -9 inside a replica's task (fault.sh).
FROM base AS driver
USER 0
ARG TARGETARCH=amd64
ARG SSM_PLUGIN_BASE=https://s3.amazonaws.com/session-manager-downloads/plugin/latest
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && case "$TARGETARCH" in \
         amd64) plugin=ubuntu_64bit ;; \
         arm64) plugin=ubuntu_arm64 ;; \
         *) echo "no Session Manager plugin for $TARGETARCH" >&2; exit 1 ;; \
       esac \
    && curl -fsSL -o /tmp/session-manager-plugin.deb \
       "$SSM_PLUGIN_BASE/$plugin/session-manager-plugin.deb" \
    && dpkg -i /tmp/session-manager-plugin.deb \
    && rm -f /tmp/session-manager-plugin.deb \
    && apt-get purge -y curl && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/awscli \
    && /opt/awscli/bin/pip install --no-cache-dir 'awscli>=1.33,<2' \
    && ln -s /opt/awscli/bin/aws /usr/local/bin/aws
COPY --chmod=0755 deploy/efs-proof/fault.sh /usr/local/bin/efs-fault
USER 10001:10001
ENV FLEET_FAULT_CMD=/usr/local/bin/efs-fault
CMD ["fleet-role", "driver"]

# The default target: what every fleet process runs.
FROM base AS runtime
USER 10001:10001
