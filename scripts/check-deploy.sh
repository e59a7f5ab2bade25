#!/usr/bin/env bash
# Validates the deployment files offline (no cluster, no Docker daemon needed):
#   - scripts/check_deploy.py: compose.yaml and kubernetes/ agree with each other and with the
#     settings of `mqstate serve` (ports, peers, probes, volumes, MQSTATE_* names);
#   - yamllint on both;
#   - kubernetes-validate (PyPI; ships the Kubernetes JSON schemas) on every manifest, strict, for
#     the oldest and newest Kubernetes versions it knows that we claim (1.27: the StatefulSet's
#     persistentVolumeClaimRetentionPolicy is beta and on by default from 1.27);
#   - `kubectl kustomize` of the kustomization, when kubectl is installed;
#   - `docker compose config` (or docker-compose), when one of them is installed.
# --install (CI) installs what is missing: yamllint and PyYAML from Debian, kubernetes-validate into
# a virtualenv under target/. Without it, missing validators are skipped with a note.
set -euo pipefail
cd "$(dirname "$0")/.."

install=false
[[ "${1:-}" == "--install" ]] && install=true
venv="${CARGO_TARGET_DIR:-target}/deploy-check-venv"
yamllint_config='{extends: default, rules: {line-length: {max: 120}, document-start: disable}}'
files=(packaging/compose.yaml packaging/kubernetes/*.yaml)
manifests=(packaging/kubernetes/services.yaml packaging/kubernetes/statefulset.yaml packaging/kubernetes/poddisruptionbudget.yaml)

if $install; then
  missing=()
  command -v yamllint >/dev/null || missing+=(yamllint)
  python3 -c 'import yaml' 2>/dev/null || missing+=(python3-yaml)
  python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
  if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # A venv moved or copied with its checkout keeps scripts whose interpreter path is gone:
  # rebuild it unless the validator runs.
  if ! "$venv/bin/kubernetes-validate" --version >/dev/null 2>&1; then
    python3 -m venv --clear "$venv"
    "$venv/bin/pip" install -q kubernetes-validate
  fi
fi

python3 scripts/check_deploy.py

if command -v yamllint >/dev/null; then
  yamllint -s -d "$yamllint_config" "${files[@]}"
  echo "check-deploy: yamllint passed"
else
  echo "check-deploy: yamllint not installed, skipped (--install installs it)"
fi

if [[ -x "$venv/bin/kubernetes-validate" ]]; then
  for version in 1.27.0 1.33.0; do
    "$venv/bin/kubernetes-validate" --strict --quiet -k "$version" "${manifests[@]}"
  done
  echo "check-deploy: kubernetes-validate --strict passed (1.27, 1.33)"
else
  echo "check-deploy: kubernetes-validate not installed, skipped (--install installs it)"
fi

if command -v kubectl >/dev/null; then
  kubectl kustomize packaging/kubernetes >/dev/null
  echo "check-deploy: kubectl kustomize passed"
fi

# Compose refuses a missing secret file; the real ones are made by the user (docs/cluster.md).
compose=()
if docker compose version >/dev/null 2>&1; then compose=(docker compose); elif command -v docker-compose >/dev/null; then compose=(docker-compose); fi
if ((${#compose[@]})); then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  cp packaging/compose.yaml "$tmp/"
  touch "$tmp/passwd" "$tmp/admin-password"
  (cd "$tmp" && "${compose[@]}" -f compose.yaml config -q)
  echo "check-deploy: ${compose[*]} config passed"
else
  echo "check-deploy: docker compose not installed, compose.yaml checked by check_deploy.py and yamllint only"
fi
