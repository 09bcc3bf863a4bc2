#!/usr/bin/env bash
# Installs what a fresh machine lacks for the tests: Debian packages
# (PostgreSQL server, openssl, curl, gcc, libseccomp-dev, chromium and
# chromedriver), the Rust components (rustfmt, clippy), and builds the
# control plane binaries, the OCI tools (runc, crane), the node's
# (containerd, the pause image) and promtool into the cache (a no-op when
# cached).
# Needs root (or sudo) only when a Debian package is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
LOG_TAG=deps
. "$root/e2e/lib/common.sh"

missing=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
command -v python3 >/dev/null || missing+=(python3)
# python/test.sh makes a venv (Debian splits venv and ensurepip out).
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
command -v runuser >/dev/null || missing+=(util-linux)
# runc is built with cgo (e2e/oci/build.sh); hack/image.sh unpacks Debian
# packages with dpkg-deb.
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
# runc is built with seccomp (the node's pods ask for a profile), and the
# node's pause image is a static C binary (e2e/node/build.sh).
[ -f /usr/include/seccomp.h ] || missing+=(libseccomp-dev)
ls /usr/lib/*/libc.a >/dev/null 2>&1 || missing+=(libc6-dev)
command -v dpkg-deb >/dev/null || missing+=(dpkg)
# The e2e harness signals workers (STOP/CONT/TERM) with the kill binary.
[ -x /bin/kill ] || [ -x /usr/bin/kill ] || missing+=(procps)
# Workers whose wall clock is off (e2e/tests/clock_skew.rs) run under
# libfaketime; the control plane's certificates are backdated with it.
command -v faketime >/dev/null || missing+=(faketime)
# The dashboard's browser tests (e2e/src/browser.rs) drive a headless
# Chromium through chromedriver (Debian packages it separately).
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if ((${#missing[@]})); then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # Debian starts a default cluster on install; the tests use their own.
  $sudo pg_ctlcluster --help >/dev/null 2>&1 && $sudo service postgresql stop >/dev/null 2>&1 || true
fi

command -v cargo >/dev/null || die "Rust is required (https://rustup.rs)"
command -v go >/dev/null || die "Go >= 1.26 is required to build the control plane"
if command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi

"$root/e2e/controlplane/build.sh" >/dev/null
"$root/e2e/oci/build.sh" >/dev/null
"$root/e2e/node/build.sh" >/dev/null
"$root/e2e/promtool/build.sh" >/dev/null
