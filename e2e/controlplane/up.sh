#!/usr/bin/env bash
# Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler on free loopback
# ports with fresh certificates, under STATE_DIR (default: a new temp dir).
# Writes STATE_DIR/env (KUBECONFIG, BATCHLEASE_CP_DIR, PATH with kubectl and
# helm first) for callers to source. Stop with down.sh STATE_DIR.
#
# BATCHLEASE_CP_BIND=host: the API server also listens on this host's
# address (all interfaces) and its certificate names that address, so pods
# on a node's pod network (e2e/node/up.sh) reach it; the default is
# loopback only. Either way it authenticates every request (client
# certificates and service-account tokens).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=controlplane
. "$here/../lib/common.sh"

state=${1:-$(mktemp -d /tmp/batchlease-cp.XXXXXX)}
mkdir -p "$state"/{pki,etcd,logs,run}
state=$(cd "$state" && pwd)
bin=$("$here/build.sh")
pki=$state/pki

etcd_port=$(free_port); peer_port=$(free_port); api_port=$(free_port)
while [ "$peer_port" = "$etcd_port" ]; do peer_port=$(free_port); done
while [ "$api_port" = "$etcd_port" ] || [ "$api_port" = "$peer_port" ]; do api_port=$(free_port); done

# --- certificates: one CA, a serving cert, an admin client cert, SA keys ---
# Valid from a day ago for three days: a process whose clock runs behind
# (e2e/tests/clock_skew.rs runs workers minutes behind the server) must
# still trust the server's certificate.
command -v faketime >/dev/null || die "faketime is required (Debian package faketime; hack/deps.sh installs it)"
gen genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/ca.key"
gen req -x509 -new -key "$pki/ca.key" -subj "/CN=batchlease-e2e-ca" -days 3 -out "$pki/ca.crt" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
leaf() { # name subject extensions...
  local name=$1 subj=$2; shift 2
  gen genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/$name.key"
  gen req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr"
  printf '%s\n' "$@" > "$pki/$name.ext"
  gen x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3 -extfile "$pki/$name.ext" -out "$pki/$name.crt"
}
api_bind=127.0.0.1 api_sans=IP:127.0.0.1,DNS:localhost
case ${BATCHLEASE_CP_BIND:-loopback} in
  loopback) ;;
  host)
    host_ip=$(hostname -I 2>/dev/null | awk '{print $1}')
    [ -n "$host_ip" ] || die "BATCHLEASE_CP_BIND=host: this host has no non-loopback IPv4 address"
    api_bind=0.0.0.0 api_sans="$api_sans,IP:$host_ip" ;;
  *) die "BATCHLEASE_CP_BIND must be loopback or host, not '$BATCHLEASE_CP_BIND'" ;;
esac
leaf serving "/CN=kube-apiserver" "subjectAltName=$api_sans" \
  "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth"
leaf admin "/O=system:masters/CN=admin" \
  "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=clientAuth"
gen genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key"
gen pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"

# launch NAME CMD...: starts a component logging to logs/NAME.log and
# records its command line, so restart.sh can start it again identically.
launch() {
  local name=$1; shift
  printf '%q ' "$@" > "$state/run/$name.cmd"
  "$@" >>"$state/logs/$name.log" 2>&1 &
  echo $! > "$state/run/$name.pid"
}

# --- etcd ---
launch etcd "$bin/etcd" --name=e2e --data-dir="$state/etcd" \
  --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
  --listen-peer-urls="http://127.0.0.1:$peer_port" --initial-advertise-peer-urls="http://127.0.0.1:$peer_port" \
  --initial-cluster="e2e=http://127.0.0.1:$peer_port" \
  --unsafe-no-fsync=true --quota-backend-bytes=4294967296 --log-level=warn
etcd_ready() { curl -sf "http://127.0.0.1:$etcd_port/health"; }
wait_until etcd 60 "$state/logs/etcd.log" etcd_ready

# --- kube-apiserver ---
# Ready for a node (e2e/node/up.sh): the Node authorizer and NodeRestriction
# for the kubelet's identity (system:node:<name>), the ServiceAccount
# admission plugin (on by default) so pods get their token volume, and the
# kubelet's serving certificate checked against the CA (node/up.sh signs
# it) when the server fetches logs; it authenticates to the kubelet as admin.
# The audit log is the ground truth of who wrote what: every write to
# batchlease objects, Leases and Events, by user, with the time it was
# applied. The history checker reads it (BATCHLEASE_AUDIT_LOG).
mkdir -p "$state/audit"
cat > "$state/audit/policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
  - level: Metadata
    verbs: ["create", "update", "patch", "delete", "deletecollection"]
    resources:
      - group: batchlease.dev
      - group: coordination.k8s.io
  - level: None
POLICY
launch kube-apiserver "$bin/kube-apiserver" \
  --audit-policy-file="$state/audit/policy.yaml" --audit-log-path="$state/audit/audit.log" \
  --audit-log-format=json --audit-log-mode=blocking --audit-log-maxsize=0 \
  --etcd-servers="http://127.0.0.1:$etcd_port" --bind-address="$api_bind" \
  --advertise-address=127.0.0.1 --secure-port="$api_port" --cert-dir="$pki" \
  --tls-cert-file="$pki/serving.crt" --tls-private-key-file="$pki/serving.key" \
  --client-ca-file="$pki/ca.crt" --authorization-mode=Node,RBAC \
  --service-account-issuer="https://127.0.0.1:$api_port/" \
  --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 --allow-privileged=true \
  --enable-admission-plugins=NodeRestriction --endpoint-reconciler-type=none \
  --kubelet-certificate-authority="$pki/ca.crt" --kubelet-preferred-address-types=InternalIP \
  --kubelet-client-certificate="$pki/admin.crt" --kubelet-client-key="$pki/admin.key"
readyz() {
  curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://127.0.0.1:$api_port/readyz"
}
wait_until kube-apiserver 180 "$state/logs/kube-apiserver.log" readyz
# How restart.sh knows each component is back.
cat > "$state/run/ready.sh" <<READY
etcd_ready() { curl -sf "http://127.0.0.1:$etcd_port/health"; }
kube-apiserver_ready() {
  curl -sf --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \\
    "https://127.0.0.1:$api_port/readyz"
}
READY

# --- kubeconfig with absolute paths, used by kubectl, helm and the tests ---
cat > "$state/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority: $pki/ca.crt
users:
- name: admin
  user:
    client-certificate: $pki/admin.crt
    client-key: $pki/admin.key
contexts:
- name: e2e
  context: {cluster: e2e, user: admin, namespace: default}
current-context: e2e
KC

# --- kube-controller-manager: garbage collection, namespace deletion,
# ServiceAccounts, the type-checking of ValidatingAdmissionPolicies (the
# chart's holder-only policy reports its CEL warnings in its status), and
# for pods on the node (e2e/node/): Deployments and ReplicaSets, the
# kube-root-ca.crt ConfigMap a pod's service-account volume projects, and
# node lifecycle (it lifts the not-ready taint a kubelet registers with) ---
kcm_port=$(free_port)
launch kube-controller-manager "$bin/kube-controller-manager" --kubeconfig="$state/kubeconfig" \
  --authentication-kubeconfig="$state/kubeconfig" --authorization-kubeconfig="$state/kubeconfig" \
  --leader-elect=false --bind-address=127.0.0.1 --secure-port="$kcm_port" --cert-dir="$state/kcm-certs" \
  --controllers=garbage-collector-controller,namespace-controller,serviceaccount-controller,validatingadmissionpolicy-status-controller,deployment-controller,replicaset-controller,root-ca-certificate-publisher-controller,node-lifecycle-controller \
  --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt"
# Healthy, and its controllers act: the serviceaccount controller has
# created the `default` ServiceAccount of the `default` namespace.
kcm_ready() {
  curl -sfk "https://127.0.0.1:$kcm_port/healthz" &&
    KUBECONFIG="$state/kubeconfig" "$bin/kubectl" get serviceaccount default -n default
}
wait_until kube-controller-manager 120 "$state/logs/kube-controller-manager.log" kcm_ready
cat >> "$state/run/ready.sh" <<READY
kube-controller-manager_ready() { curl -sfk "https://127.0.0.1:$kcm_port/healthz"; }
READY

# --- kube-scheduler: binds pods to the node (e2e/node/); the oldest
# supported version runs no node, so no scheduler (nor is one built) ---
if [ "${BATCHLEASE_KUBE:-}" != oldest ]; then
  sched_port=$(free_port)
  launch kube-scheduler "$bin/kube-scheduler" --kubeconfig="$state/kubeconfig" \
    --authentication-kubeconfig="$state/kubeconfig" --authorization-kubeconfig="$state/kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port="$sched_port"
  kube-scheduler_ready() { curl -sfk "https://127.0.0.1:$sched_port/readyz"; }
  wait_until kube-scheduler 60 "$state/logs/kube-scheduler.log" kube-scheduler_ready
  cat >> "$state/run/ready.sh" <<READY
  kube-scheduler_ready() { curl -sfk "https://127.0.0.1:$sched_port/readyz"; }
READY
fi

cat > "$state/env" <<ENV
export KUBECONFIG=$state/kubeconfig
export BATCHLEASE_CP_DIR=$state
export PATH=$bin:\$PATH
export BATCHLEASE_KUBECTL=$bin/kubectl
export BATCHLEASE_HELM=$bin/helm
export BATCHLEASE_AUDIT_LOG=$state/audit/audit.log
ENV
log "up: KUBECONFIG=$state/kubeconfig (logs in $state/logs)"
echo "$state"
