#!/usr/bin/env bash
# Builds local stand-ins for the two base images of Dockerfile.training, for machines that reach Debian's archive,
# PyPI and crates.io but no container registry (`make container-test` uses them):
#   recipe-t5-standin/rust:1.95.0-bookworm   for rust:1.95.0-bookworm: Debian 12 (debootstrap) with gcc, libc's
#                                            headers, CA certificates and this machine's Rust toolchain, which must
#                                            be the tag's version (rustc 1.95.0), laid out as the real image's
#                                            (RUSTUP_HOME=/usr/local/rustup, CARGO_HOME=/usr/local/cargo).
#   recipe-t5-standin/cuda:13.0.2-base       for nvidia/cuda:13.0.2-base-ubuntu24.04: Debian 13 (debootstrap, the
#                                            Debian release nearest Ubuntu 24.04: Python 3.13 where Ubuntu has
#                                            3.12) without CUDA. The image's pinned wheels bring CUDA's libraries
#                                            as they do on the real base; only the driver is missing, as on a CPU.
# Both carry this machine's CA certificates (/etc/ssl/certs/ca-certificates.crt, also as pip's `cert`), so that
# HTTPS from inside a build works wherever this machine's does. An image that exists already is kept
# (`--rebuild` makes both again). Needs root (debootstrap) and a running Docker engine.
set -euo pipefail

RUST_TAG=recipe-t5-standin/rust:1.95.0-bookworm
CUDA_TAG=recipe-t5-standin/cuda:13.0.2-base
RUST_VERSION=1.95.0
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

say() { echo "standins: $*" >&2; }
die() { say "$*"; exit 2; }

rebuild=0
[[ ${1:-} == --rebuild ]] && rebuild=1
[[ $(id -u) == 0 ]] || die "debootstrap needs root: run as root, or build the stand-ins once as root"
command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
docker info >/dev/null 2>&1 || die "no Docker engine answers: docker/test/engine.sh start"
[[ -f $CA_BUNDLE ]] || die "no CA bundle at $CA_BUNDLE"

work=$(mktemp -d /tmp/recipe-t5-standins.XXXXXX)
trap 'rm -rf "$work"' EXIT

# Debian's minimal system, with this machine's CA certificates trusted (update-ca-certificates keeps them when a
# build installs ca-certificates again) and named to pip.
rootfs() {  # rootfs SUITE DIR PACKAGES
  local suite=$1 dir=$2 packages=$3 started=$SECONDS
  say "debootstrap $suite (a minute or two: Debian's packages are downloaded)"
  debootstrap --variant=minbase --include="$packages" "$suite" "$dir" "$MIRROR" >"$work/$suite.log" 2>&1 \
    || { tail -20 "$work/$suite.log" >&2; die "debootstrap $suite failed (log above)"; }
  install -D -m 644 "$CA_BUNDLE" "$dir/usr/local/share/ca-certificates/build-host.crt"
  chroot "$dir" update-ca-certificates >/dev/null 2>&1
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$dir/etc/pip.conf"
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  say "debootstrap $suite done in $((SECONDS - started)) s"
}

exists() { docker image inspect "$1" >/dev/null 2>&1; }

if ((rebuild)) || ! exists "$RUST_TAG"; then
  sysroot=$(rustc --print sysroot 2>/dev/null) || die "no Rust toolchain here (rustc): the Rust stand-in copies it"
  version=$(rustc --version | awk '{print $2}')
  [[ $version == "$RUST_VERSION" ]] \
    || die "this machine's rustc is $version; the stand-in for rust:$RUST_VERSION-bookworm needs $RUST_VERSION"
  rootfs bookworm "$work/rust" ca-certificates,gcc,libc6-dev
  toolchain=/usr/local/rustup/toolchains/$RUST_VERSION-x86_64-unknown-linux-gnu
  mkdir -p "$work/rust$toolchain" "$work/rust/usr/local/cargo/bin"
  # The compiler, cargo and the standard library; no documentation (share/ is 0.8 GB of it).
  cp -a "$sysroot/bin" "$sysroot/lib" "$sysroot/libexec" "$work/rust$toolchain/" 2>/dev/null \
    || cp -a "$sysroot/bin" "$sysroot/lib" "$work/rust$toolchain/"
  for tool in cargo rustc rustdoc; do ln -s "$toolchain/bin/$tool" "$work/rust/usr/local/cargo/bin/$tool"; done
  tar -C "$work/rust" -c . | docker import \
    --change 'ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo RUST_VERSION=1.95.0' \
    --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$RUST_TAG" >/dev/null
  rm -rf "$work/rust"
  say "built $RUST_TAG"
else
  say "$RUST_TAG exists"
fi

if ((rebuild)) || ! exists "$CUDA_TAG"; then
  rootfs trixie "$work/cuda" ca-certificates
  tar -C "$work/cuda" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$CUDA_TAG" >/dev/null
  rm -rf "$work/cuda"
  say "built $CUDA_TAG"
else
  say "$CUDA_TAG exists"
fi
