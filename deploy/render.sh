#!/bin/sh
# Render the plain manifests in deploy/ from charts/sdcguard, and copy the CRDs into the chart and
# into the sandbox package (its API emulator prints them as the API server does, also when installed).
# `make manifests` runs it; tests/test_chart.py runs it into a temporary directory and fails
# when the committed files differ (drift).
#   deploy/render.sh [OUTPUT_DIR]    (default: the repository itself)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root}
mkdir -p "$out/deploy" "$out/charts/sdcguard/crds" "$out/agent/sandbox/crds"
for crd in "$root"/deploy/crds/*.yaml; do
  cp "$crd" "$out/charts/sdcguard/crds/$(basename "$crd")"
  cp "$crd" "$out/agent/sandbox/crds/$(basename "$crd")"
done
{
  echo "# Generated from charts/sdcguard by 'make manifests' (deploy/render.sh); do not edit."
  echo "# Install: kubectl create namespace sdcguard"
  echo "#          kubectl apply -f deploy/crds/ && kubectl apply -f deploy/sdcguard.yaml"
  echo "# The webhook certificate comes from cert-manager (deploy/manifests-values.yaml); without"
  echo "# cert-manager, install with Helm, which signs its own."
  helm template sdcguard "$root/charts/sdcguard" --namespace sdcguard --values "$root/deploy/manifests-values.yaml"
} > "$out/deploy/sdcguard.yaml"
