#!/usr/bin/env bash
# Renders deploy/ from the chart, the one source of truth (`make deploy`):
#   bash scripts/render-deploy.sh [OUTDIR]        (default: the repository's deploy/)
#
#   deploy/namespace.yaml                    templates/namespace.yaml (namespace.create=true)
#   deploy/rbac.yaml                         templates/rbac.yaml
#   deploy/daemonset.yaml                    templates/daemonset.yaml
#   deploy/endpointslice-guard.yaml          templates/endpointslice-guard.yaml
#   deploy/monitoring/podmonitor.yaml        templates/podmonitor.yaml (podMonitor.enabled)
#   deploy/monitoring/grafana-dashboard.json files/grafana-dashboard.json, copied
#
# each with the chart's default values, as release `cozyebpf` in namespace `cozy-system`.
# deploy/uninstall/ is not rendered (a one-shot DaemonSet for `cozyebpf detach`).
# tests/unit/test_chart.py renders into a temporary OUTDIR and fails when deploy/ differs.
#
# Environment: HELM (default: the repository's .venv/bin/helm, else helm on PATH;
# scripts/install-helm.sh puts it in the venv).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$REPO_ROOT/deploy}"
CHART="$REPO_ROOT/charts/cozyebpf"
RELEASE=cozyebpf
NAMESPACE=cozy-system

die() {
	printf 'render-deploy.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

HELM="${HELM:-}"
if [[ -z $HELM ]]; then
	if [[ -x $REPO_ROOT/.venv/bin/helm ]]; then
		HELM="$REPO_ROOT/.venv/bin/helm"
	else
		HELM="$(command -v helm)" || die "no helm: run scripts/setup.sh (or set HELM)"
	fi
fi

# render FILE TEMPLATE [helm args]: the template alone, with a header instead of Helm's
# `---` and `# Source:` lines (the documents of one file keep their separators).
render() {
	local file=$1 template=$2
	shift 2
	local body
	body="$("$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" \
		--show-only "templates/$template" "$@")" || die "helm template --show-only templates/$template failed"
	{
		printf '# Rendered from charts/cozyebpf/templates/%s by scripts/render-deploy.sh\n' "$template"
		printf '# (release %s, namespace %s, the chart'"'"'s default values%s).\n' \
			"$RELEASE" "$NAMESPACE" "${*:+; $*}"
		printf '# Edit the chart and run `make deploy`; tests/unit/test_chart.py fails when they differ.\n'
		printf '%s\n' "$body" | sed -e '1{/^---$/d}' -e '/^# Source: /d'
	} >"$OUT/$file"
}

mkdir -p "$OUT/monitoring"
render namespace.yaml namespace.yaml --set namespace.create=true
render rbac.yaml rbac.yaml
render daemonset.yaml daemonset.yaml
render endpointslice-guard.yaml endpointslice-guard.yaml
render monitoring/podmonitor.yaml podmonitor.yaml --set metrics.podMonitor.enabled=true
cp "$CHART/files/grafana-dashboard.json" "$OUT/monitoring/grafana-dashboard.json"
