#!/usr/bin/env bash
# Starts a node of the control plane CP_DIR (e2e/controlplane/up.sh; default
# $BATCHLEASE_CP_DIR) under STATE_DIR: containerd (runc from e2e/oci/build.sh
# as its runtime) and the kubelet, each with its own root, state, sockets and
# free ports under STATE_DIR, so nothing of the host's (/var/lib/kubelet,
# /run/containerd, /var/log/pods, 10250) is used. Waits until the node is
# Ready. Writes STATE_DIR/env (BATCHLEASE_NODE, BATCHLEASE_CTR, …) for
# callers to source; logs in STATE_DIR/logs. Stop with down.sh STATE_DIR.
#
#   up.sh STATE_DIR [CP_DIR]
#
# The pod network: CNI's bridge plugin on a bridge of this host
# (BATCHLEASE_POD_BRIDGE, default blcni0) with host-local addresses from
# BATCHLEASE_POD_CIDR (default 10.244.0.0/24); the host is the gateway,
# nothing is masqueraded or routed beyond this host, and there is no
# kube-proxy (Service IPs lead nowhere). A pod reaches the API server at
# this host's address when the control plane listens there
# (BATCHLEASE_CP_BIND=host): BATCHLEASE_API_FROM_PODS in the env then
# names it (host:port, for KUBERNETES_SERVICE_HOST/PORT). hostNetwork pods
# run as well. Nothing is ever pulled:
# images come from archives (import.sh), the sandbox image is built here
# (build.sh) and pinned, and every registry is mapped to 127.0.0.1:1.
# The node is tainted batchlease.dev/e2e-node:NoSchedule: only pods that
# tolerate it run here (other tests' Deployments stay Pending as before).
# Needs root (namespaces, cgroups, mounts).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=node
. "$here/../lib/common.sh"

state=${1:?usage: up.sh STATE_DIR [CP_DIR]}
cp_dir=${2:-${BATCHLEASE_CP_DIR:-}}
[ -n "$cp_dir" ] && [ -f "$cp_dir/kubeconfig" ] || die "no control plane: pass CP_DIR or source its env (BATCHLEASE_CP_DIR)"
cp_dir=$(cd "$cp_dir" && pwd)
[ "$(id -u)" = 0 ] || die "a node needs root (it mounts, and creates namespaces and cgroups)"
[ -d /sys/fs/cgroup ] || die "no /sys/fs/cgroup: containers cannot be placed in cgroups"
mkdir -p "$state"/{pki,logs,run,kubelet,pod-logs,cni/net.d,cni/ipam,containerd/certs.d/_default}
state=$(cd "$state" && pwd)
started=$SECONDS

cp_bin=$("$here/../controlplane/build.sh")
node_bin=$("$here/build.sh")
oci_bin=$("$here/../oci/build.sh")
. "$here/versions.env"

# The kubelet refuses a loopback node IP: the host's own address. Nothing
# is sent to it from outside; the API server reaches the kubelet there.
node_ip=$(hostname -I 2>/dev/null | awk '{print $1}')
[ -n "$node_ip" ] || die "this host has no non-loopback IPv4 address for the node"
node_name=${BATCHLEASE_NODE_NAME:-e2e-node}
kubectl() { KUBECONFIG="$cp_dir/kubeconfig" "$cp_bin/kubectl" "$@"; }
# A kubelet is machine-wide in one respect: its device-plugin socket is
# always /var/lib/kubelet/device-plugins/kubelet.sock. Refuse to start a
# second one (found by its command line; nothing is stopped).
for p in /proc/[0-9]*; do
  cmd=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null) || continue
  case $cmd in
    */kubelet\ *--root-dir=*) die "a kubelet already runs on this machine (pid ${p#/proc/}: $cmd); stop its node first" ;;
  esac
done
if kubectl get node "$node_name" >/dev/null 2>&1; then
  die "node $node_name is already registered with this control plane (another node up.sh?)"
fi
# A start that fails midway stops what it started (a kubelet left running
# would refuse every later start on this machine).
trap 'rc=$?; [ "$rc" = 0 ] || "$here/down.sh" "$state" >&2 || true' EXIT

# --- certificates from the control plane's CA: the kubelet's client
# identity (the Node authorizer's system:node:<name>) and its serving
# certificate (the API server checks it when it fetches logs) ---
pki=$state/pki
ca=$cp_dir/pki/ca.crt
leaf() { # name subject extensions...
  local name=$1 subj=$2; shift 2
  gen genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/$name.key"
  gen req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr"
  printf '%s\n' "$@" > "$pki/$name.ext"
  gen x509 -req -in "$pki/$name.csr" -CA "$ca" -CAkey "$cp_dir/pki/ca.key" -CAcreateserial \
    -CAserial "$pki/ca.srl" -days 3 -extfile "$pki/$name.ext" -out "$pki/$name.crt"
}
leaf kubelet-client "/O=system:nodes/CN=system:node:$node_name" \
  "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=clientAuth"
leaf kubelet-serving "/CN=$node_name" "subjectAltName=IP:$node_ip,IP:127.0.0.1,DNS:$node_name" \
  "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth"
server=$(sed -n 's/^ *server: //p' "$cp_dir/kubeconfig")
cat > "$state/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "$server", certificate-authority: "$ca"}
users:
- name: kubelet
  user: {client-certificate: "$pki/kubelet-client.crt", client-key: "$pki/kubelet-client.key"}
contexts:
- name: kubelet
  context: {cluster: e2e, user: kubelet}
current-context: kubelet
KC

# launch NAME CMD...: starts a component logging to logs/NAME.log.
launch() {
  local name=$1; shift
  printf '%q ' "$@" > "$state/run/$name.cmd"
  "$@" >>"$state/logs/$name.log" 2>&1 &
  echo $! > "$state/run/$name.pid"
}

# --- containerd ---
sock=$state/run/containerd.sock
pause_ref="batchlease.local/pause:$PAUSE_TAG"
cat > "$state/containerd/config.toml" <<TOML
version = 3
root = "$state/containerd/root"
state = "$state/containerd/state"
temp = "$state/containerd/tmp"
# Plugins that would reach outside STATE_DIR (NRI's socket under /var/run)
# or need what this host lacks.
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.snapshotter.v1.erofs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  level = "info"

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = "$state/containerd/opt"
  [plugins.'io.containerd.image-verifier.v1.bindir']
    bin_dir = "$state/containerd/image-verifiers"
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = "overlayfs"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "$pause_ref"
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = "$state/containerd/certs.d"
  [plugins.'io.containerd.cri.v1.runtime']
    # No CAP_SYS_RESOURCE in this sandbox: the sandbox's -998 cannot be set.
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    cdi_spec_dirs = []
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = "$oci_bin/runc"
          Root = "$state/containerd/runc"
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ["$node_bin/cni"]
      conf_dir = "$state/cni/net.d"
  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
TOML
# Every registry goes to a port nobody serves: a pull fails at once
# instead of leaving this host.
cat > "$state/containerd/certs.d/_default/hosts.toml" <<'HOSTS'
server = "https://127.0.0.1:1"
[host."https://127.0.0.1:1"]
  capabilities = ["pull", "resolve"]
HOSTS
pod_cidr=${BATCHLEASE_POD_CIDR:-10.244.0.0/24}
pod_bridge=${BATCHLEASE_POD_BRIDGE:-blcni0}
# The pod network must not shadow a route this host already has.
if ip -4 route show | awk '{print $1}' | grep -qxF "$pod_cidr" &&
  ! ip link show "$pod_bridge" >/dev/null 2>&1; then
  die "this host already routes $pod_cidr; pick another BATCHLEASE_POD_CIDR"
fi
cat > "$state/cni/net.d/10-batchlease-e2e.conflist" <<CNI
{
  "cniVersion": "1.0.0",
  "name": "batchlease-e2e",
  "plugins": [{
    "type": "bridge",
    "bridge": "$pod_bridge",
    "isGateway": true,
    "ipMasq": false,
    "hairpinMode": true,
    "ipam": {
      "type": "host-local",
      "ranges": [[{"subnet": "$pod_cidr"}]],
      "routes": [{"dst": "0.0.0.0/0"}],
      "dataDir": "$state/cni/ipam"
    }
  }]
}
CNI
echo "$pod_bridge" > "$state/run/pod-bridge"
PATH="$node_bin:$PATH" launch containerd "$node_bin/containerd" --config "$state/containerd/config.toml"
ctr() { "$node_bin/ctr" --address "$sock" "$@"; }
containerd_ready() { ctr version; }
wait_until containerd 60 "$state/logs/containerd.log" containerd_ready
ctr -n k8s.io images import "$node_bin/pause.oci.tar" >/dev/null ||
  die "importing $pause_ref failed"

# --- kubelet ---
kubelet_port=$(free_port); healthz_port=$(free_port)
while [ "$healthz_port" = "$kubelet_port" ]; do healthz_port=$(free_port); done
cat > "$state/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: "$node_ip"
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
tlsCertFile: "$pki/kubelet-serving.crt"
tlsPrivateKeyFile: "$pki/kubelet-serving.key"
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$ca"}
authorization: {mode: Webhook}
containerRuntimeEndpoint: "unix://$sock"
imageServiceEndpoint: "unix://$sock"
podLogsDir: "$state/pod-logs"
volumePluginDir: "$state/kubelet/volume-plugins"
staticPodPath: ""
# cgroup v1 here, and the sandbox grants no control over the host's
# top-level cgroups: no QoS hierarchy, nothing reserved.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
registerWithTaints:
  - {key: batchlease.dev/e2e-node, effect: NoSchedule}
# The images are imported, never pulled: keep them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# A test node evicts nothing until the disk is really full: 1% of a large
# disk is gigabytes, and a nearly full build machine (cargo targets) put the
# node under DiskPressure — tainted, every test pod unschedulable.
evictionHard: {memory.available: 100Mi, nodefs.available: 256Mi, imagefs.available: 256Mi, nodefs.inodesFree: 1%}
evictionPressureTransitionPeriod: 10s
serializeImagePulls: false
resolvConf: /etc/resolv.conf
YAML
launch kubelet "$cp_bin/kubelet" --config="$state/kubelet.yaml" --kubeconfig="$state/kubeconfig" \
  --root-dir="$state/kubelet" --cert-dir="$state/kubelet/pki" \
  --hostname-override="$node_name" --node-ip="$node_ip" --v=1
kubelet_ready() { curl -sf "http://127.0.0.1:$healthz_port/healthz"; }
wait_until kubelet 60 "$state/logs/kubelet.log" kubelet_ready
# Ready, and schedulable: the node-lifecycle controller has lifted the
# node.kubernetes.io/not-ready taint the kubelet registered with.
node_ready() {
  [ "$(kubectl get node "$node_name" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ] &&
    [ "$(kubectl get node "$node_name" -o 'jsonpath={.spec.taints[*].key}')" = batchlease.dev/e2e-node ]
}
wait_until "node $node_name Ready and schedulable" 120 "$state/logs/kubelet.log" node_ready ||
  { kubectl describe node "$node_name" >&2 || true; tail -n 20 "$state/logs/containerd.log" >&2; exit 1; }

# Can a pod reach the API server? Only if it listens on this host's
# address (a pod's packets arrive from the bridge, not on loopback).
api_port=${server##*:}
api_from_pods=""
if curl -s -o /dev/null --max-time 5 --cacert "$ca" "https://$node_ip:$api_port/version"; then
  api_from_pods=$node_ip:$api_port
else
  log "the API server does not answer at $node_ip:$api_port (BATCHLEASE_CP_BIND=host not set?): pods on the pod network cannot reach it"
fi
cat > "$state/env" <<ENV
export BATCHLEASE_NODE=$node_name
export BATCHLEASE_NODE_DIR=$state
export BATCHLEASE_NODE_IP=$node_ip
export BATCHLEASE_NODE_TAINT=batchlease.dev/e2e-node
export BATCHLEASE_CTR=$node_bin/ctr
export BATCHLEASE_CONTAINERD_ADDRESS=$sock
export BATCHLEASE_POD_CIDR=$pod_cidr
export BATCHLEASE_API_FROM_PODS=$api_from_pods
ENV
log "up in $((SECONDS - started))s: node $node_name ($node_ip, kubelet :$kubelet_port), containerd $sock (logs in $state/logs)"
echo "$state"
