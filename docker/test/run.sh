#!/usr/bin/env bash
# `make container-test`: the image built by a real Docker engine and used as the README says, on the CPU
# (tests/test_container_engine.py). Starts an engine if none answers (docker/test/engine.sh), builds the
# stand-in base images where no registry is reachable (docker/test/standins.sh), runs the tests, prints their
# report (build and rebuild times, the image's size by layer), and stops the engine it started.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
own_report=0
if [[ -z ${CONTAINER_TEST_REPORT:-} ]]; then
  CONTAINER_TEST_REPORT=$(mktemp /tmp/recipe-t5-container-report.XXXXXX.md)
  own_report=1
fi
export CONTAINER_TEST_REPORT
started=0
docker info >/dev/null 2>&1 || started=1
docker/test/engine.sh start
cleanup() {
  # Containers and volumes of the test's projects; the images stay for the next run (`make container-clean`).
  for project in $(docker compose ls -a -q 2>/dev/null | grep '^recipe-t5-test-' || true); do
    docker compose -p "$project" down --volumes --remove-orphans >/dev/null 2>&1 || true
  done
  if ((started)); then docker/test/engine.sh stop; fi
  if ((own_report)); then rm -f "$CONTAINER_TEST_REPORT"; fi  # printed above
}
trap cleanup EXIT
docker/test/standins.sh
status=0
"$PY" -m pytest -q -m container -p no:cacheprovider tests/test_container_engine.py "$@" || status=$?
echo
cat "$CONTAINER_TEST_REPORT"
exit $status
