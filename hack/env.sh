# Sourced by the hack/ scripts: caches live outside the repository, keyed by
# toolchain version, so clean clones reuse them and warm runs are fast.
cache_root=${BATCHLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchlease}
rustc_v=$(rustc --version 2>/dev/null | awk '{print $2}')
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache_root/cargo-target-${rustc_v:-unknown}}
export BATCHLEASE_CACHE=$cache_root
