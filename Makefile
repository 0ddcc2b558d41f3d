# Fairway. Quick start: `make up` runs the platform, `make test` runs the suite.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: up test bench lint typecheck clean system-tools screenshots

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	@rm -f $(VENV)/.installed-*; touch $(STAMP)

up: $(STAMP)
	$(PY) -m fairway.devstack

test: $(STAMP) system-tools
	$(PY) -m pytest

# Debian packages the suite drives: chromium (the console's browser tests; Playwright's own
# browser download cannot be used), docker-compose, promtool and nginx (tests/deploy check
# the deployment files offline: `docker-compose config` needs no daemon, `nginx -t` starts
# no server). kubectl is used when present. Servers the packages may start are disabled.
SYSTEM_TOOLS := chromium docker-compose promtool nginx
system-tools:
	@missing=0; for t in $(SYSTEM_TOOLS); do PATH="$$PATH:/usr/sbin" command -v $$t >/dev/null || missing=1; done; \
	[ $$missing = 0 ] || { \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium docker-compose prometheus nginx; \
	  $$SUDO sh -c 'command -v systemctl >/dev/null && systemctl disable --now prometheus prometheus-node-exporter nginx 2>/dev/null || true'; }

# Regenerate docs/screenshots/ (the console's main pages at desktop and phone width).
screenshots: $(STAMP) system-tools
	$(PY) -m console.screenshots

bench: $(STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
