#!/bin/sh
# Fairway's one image, one role per container: `entrypoint.sh <role> [extra args]`.
# Each role execs its process (PID 1 receives SIGTERM directly: the gateway drains, Celery
# finishes its tasks, the consumer stops after its batch).
set -eu
role="${1:-controlplane}"
[ "$#" -gt 0 ] && shift
export FAIRWAY_ROLE="${FAIRWAY_ROLE:-$role}"
# Health checks run as separate processes (docker exec, kubelet exec probes) that do not
# inherit this environment: they read the role from here (healthcheck.py).
echo "$FAIRWAY_ROLE" > /tmp/fairway-role 2>/dev/null || true
case "$role" in
  controlplane)
    # Sync workers: the control plane is CRUD on PostgreSQL; gunicorn's graceful timeout
    # matches the pod's termination grace. fairway.gunicorn_conf: its own lines (access
    # lines with the request id) as JSON under LOG_FORMAT=json, like the app's.
    exec gunicorn fairway.wsgi:application \
      --config python:fairway.gunicorn_conf \
      --bind "0.0.0.0:${PORT:-8000}" \
      --workers "${WEB_CONCURRENCY:-4}" \
      --graceful-timeout 25 --timeout 60 \
      --forwarded-allow-ips '*' "$@" ;;
  gateway)
    exec python -m gateway --host 0.0.0.0 --port "${PORT:-8080}" \
      --workers "${GATEWAY_WORKERS:-2}" "$@" ;;
  worker)
    exec celery -A fairway.celery worker --loglevel "${LOG_LEVEL:-INFO}" \
      --concurrency "${CELERY_CONCURRENCY:-2}" "$@" ;;
  beat)
    exec celery -A fairway.celery beat --loglevel "${LOG_LEVEL:-INFO}" "$@" ;;
  consumer)
    # A worker whose only job is the usage consumer (Kafka usage.v1 -> usage tables): it
    # listens on its own queue, which nothing is sent to; the solo pool never forks
    # (metering/README.md).
    exec celery -A fairway.celery worker --usage-consumer --pool solo --queues usage-consumer \
      --loglevel "${LOG_LEVEL:-INFO}" "$@" ;;
  emulator)
    exec python -m emulator "$@" ;;
  migrate)
    exec python manage.py migrate --noinput "$@" ;;
  manage)
    exec python manage.py "$@" ;;
  run)
    # A full command line as given (replicas: `manage.py replica_command` prints it).
    exec "$@" ;;
  *)
    echo "unknown role '$role' (controlplane, gateway, worker, beat, consumer, emulator, migrate, manage, run)" >&2
    exit 64 ;;
esac
