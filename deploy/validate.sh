#!/usr/bin/env bash
# Validates the deploy artifacts offline: helm lint --strict, every values file under
# helm/handoff/ci rendered with helm template and checked by kubernetes-validate --strict
# (and yamllint), the scheduler's placement (separate, or in each frontend), the cluster's
# TLS wiring (StatefulSets, each pod dialed by its name under a headless Service), value files
# the schema or the templates must refuse, the compose file against the
# compose-spec schema, and the Grafana dashboard as JSON. Fails on any error.
# Tools: scripts/fetch-deploy-tools (run here when they are not on PATH).
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v helm >/dev/null || ! command -v kubernetes-validate >/dev/null; then
    PATH="$(../scripts/fetch-deploy-tools):$PATH"
fi
KUBE=1.32.0
chart=helm/handoff
passed=0
failed=0
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

check() { # name, command...
    local name="$1"
    shift
    if "$@" >"$out/log" 2>&1; then
        passed=$((passed + 1))
        echo "ok    $name"
    else
        failed=$((failed + 1))
        echo "FAIL  $name"
        sed 's/^/      /' "$out/log"
    fi
}

refused() { # name, command...: passes when the command fails
    local name="$1"
    shift
    if "$@" >"$out/log" 2>&1; then
        failed=$((failed + 1))
        echo "FAIL  $name (accepted, must be refused)"
    else
        passed=$((passed + 1))
        echo "ok    $name (refused: $(grep -m1 -io 'error.*' "$out/log" | cut -c1-120))"
    fi
}

render() { # values file -> validated manifests
    helm template ci "$chart" -f "$1" --kube-version "$KUBE" >"$out/rendered.yaml"
    yamllint -d '{extends: relaxed, rules: {line-length: disable}}' "$out/rendered.yaml"
    kubernetes-validate --strict --quiet -k "$KUBE" "$out/rendered.yaml"
}

placement() { # values file, yes|no: whether its frontends run their scheduler replica
    helm template ci "$chart" -f "$1" --kube-version "$KUBE" >"$out/placed.yaml"
    local own=no workload=no
    grep -q -- '- --scheduler-in-frontend$' "$out/placed.yaml" && own=yes
    grep -q 'name: ci-handoff-scheduler$' "$out/placed.yaml" && workload=yes
    echo "frontends run their replica: $own; scheduler workload rendered: $workload"
    [ "$own" = "$2" ] && [ "$workload" != "$2" ]
}

ctl_listener() { # values file: its frontends serve their replica's API on loopback, for ctl
    helm template ci "$chart" -f "$1" --kube-version "$KUBE" >"$out/placed.yaml"
    grep -- '- --scheduler-listen=' "$out/placed.yaml"
    grep -q -- '- --scheduler-listen=127.0.0.1:50052$' "$out/placed.yaml"
}

tls_wiring() { # values file with tls and publicTls: each role's pods dialed by their names
    helm template ci "$chart" -f "$1" --kube-version "$KUBE" >"$out/tls.yaml"
    local svc count
    for svc in ci-handoff-prefill ci-handoff-frontend-pods ci-handoff-scheduler-pods; do
        grep -q -- "- --advertise-host=\$(POD_NAME).$svc.default.svc.cluster.local$" \
            "$out/tls.yaml" || { echo "$svc: its pods do not advertise their names"; return 1; }
        grep -q "^  serviceName: $svc$" "$out/tls.yaml" || { echo "$svc: no pods under it"; return 1; }
        grep -q "^  name: $svc$" "$out/tls.yaml" || { echo "$svc: no such Service"; return 1; }
    done
    for count in "3 - --tls-cert=/etc/handoff/tls/tls.crt" "3 - --tls-ca=/etc/handoff/tls/ca.crt" \
        "3 {name: cluster-tls, mountPath: /etc/handoff/tls, readOnly: true}" \
        "3 publishNotReadyAddresses: true" "3 fsGroup: 10001" "3 kind: StatefulSet" \
        "2 - --transfer-advertise=\$(POD_NAME)." \
        "1 - --public-tls-client-ca=/etc/handoff/public-tls/ca.crt" \
        "1 {name: public-tls, mountPath: /etc/handoff/public-tls, readOnly: true}" \
        "3 checksum/token:" "3 secretName: etcd-client-tls" "3 mountPath: /etc/etcd-client"; do
        local n="${count%% *}" text="${count#* }"
        [ "$(grep -cF -- "$text" "$out/tls.yaml")" = "$n" ] || { echo "not $n times: $text"; return 1; }
    done
}

plain_wiring() { # values file without tls: pods dialed by address, nothing mounted
    helm template ci "$chart" -f "$1" --kube-version "$KUBE" >"$out/plain.yaml"
    [ "$(grep -c -- '- --advertise-host=\$(POD_IP)$' "$out/plain.yaml")" = 3 ]
    local role
    for role in prefill frontend scheduler; do
        grep -A3 '^kind: Deployment$' "$out/plain.yaml" | grep -q "^  name: ci-handoff-$role$" ||
            { echo "$role: not a Deployment"; return 1; }
    done
    ! grep -qE -- '--tls-|volumes:|-pods$' "$out/plain.yaml"
}

for values in "$chart"/ci/*.yaml; do
    check "helm lint --strict ($values)" helm lint --strict "$chart" -f "$values"
    check "helm template + kubernetes-validate --strict ($values)" render "$values"
done
check "scheduler.inFrontend: each frontend runs its replica, no scheduler workload" \
    placement "$chart/ci/in-frontend-values.yaml" yes
check "scheduler.inFrontend: the replica's API for handoff ctl, on the pod's loopback" \
    ctl_listener "$chart/ci/in-frontend-values.yaml"
check "by default: a scheduler workload, and frontends that ask it" \
    placement "$chart/ci/default-values.yaml" no
refused "values.schema.json refuses broken/bad-values.yaml" \
    helm template ci "$chart" -f helm/broken/bad-values.yaml --kube-version "$KUBE"
refused "scheduler.extraArgs with scheduler.inFrontend" \
    helm template ci "$chart" -f helm/broken/in-frontend-scheduler-args.yaml --kube-version "$KUBE"
refused "a flag the chart sets, again in frontend.extraArgs, with scheduler.inFrontend" \
    helm template ci "$chart" -f helm/broken/in-frontend-policy-twice.yaml --kube-version "$KUBE"
refused "the ctl listener again in frontend.extraArgs, with scheduler.inFrontend" \
    helm template ci "$chart" -f helm/broken/in-frontend-listen-twice.yaml --kube-version "$KUBE"
refused "a scheduler address in frontend.extraArgs, with scheduler.inFrontend" \
    helm template ci "$chart" -f helm/broken/in-frontend-scheduler-elsewhere.yaml --kube-version "$KUBE"
refused "the KV budget again in frontend.extraArgs" \
    helm template ci "$chart" -f helm/broken/frontend-budget-twice.yaml --kube-version "$KUBE"
refused "a flag the chart sets, again in prefill.extraArgs" \
    helm template ci "$chart" -f helm/broken/prefill-flag-twice.yaml --kube-version "$KUBE"
refused "a release without a token" helm template ci "$chart" --kube-version "$KUBE"
check "tls: every role on the cluster's certificate, dialed by its pod's name" \
    tls_wiring "$chart/ci/tls-values.yaml"
check "without tls: pods dialed by address, no TLS flags or volumes" \
    plain_wiring "$chart/ci/default-values.yaml"
refused "a TLS flag the chart sets, again in extraArgs" \
    helm template ci "$chart" -f helm/broken/tls-flag-twice.yaml --kube-version "$KUBE"
refused "tls with transfer mooncake (its wire has no TLS)" \
    helm template ci "$chart" -f "$chart/ci/tls-values.yaml" --set transfer=mooncake --kube-version "$KUBE"
refused "tls with a release name too long for its pods' labels (35 characters)" \
    helm template a-release-name-of-35-characters-xyz "$chart" \
    -f "$chart/ci/tls-values.yaml" --kube-version "$KUBE"
check "tls with a release name of 34 characters" \
    helm template a-release-name-of-34-characters-xy "$chart" \
    -f "$chart/ci/tls-values.yaml" --kube-version "$KUBE"
check "compose.yaml against the compose-spec schema" \
    check-jsonschema --builtin-schema vendor.compose-spec compose.yaml
check "grafana/handoff.json is JSON" python3 -m json.tool grafana/handoff.json
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
