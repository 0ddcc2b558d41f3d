"""gunicorn's settings for the control plane (``gunicorn -c python:fairway.gunicorn_conf``,
docker/entrypoint.sh). No Django import: gunicorn reads this before loading the app.

Under ``LOG_FORMAT=json`` (set in the image) gunicorn's own lines — start-up, workers, and one
access line per request with the request id — are JSON like every other line of the control
plane (fairway.logs); otherwise its plain access log goes to stdout.
"""

from __future__ import annotations

from fairway.logs import gunicorn_logconfig, json_enabled

if json_enabled():
    logconfig_dict = gunicorn_logconfig()
else:
    accesslog = "-"

# No control socket (gunicorn ≥ 25 opens one under $HOME by default): the pods' root file
# system is read-only (deploy/k8s) and nothing here uses `gunicornc`.
control_socket_disable = True
