#!/bin/sh
# Install Debian's Chromium, which the Perfetto validation tests use to run the WASM
# trace processor headless (tests/support/perfetto_tp.py, docs/perfetto-validation.md).
#
# Idempotent: exits 0 at once when /usr/bin/chromium exists. Meant for CI, which runs
# it as root with no stdin; an ordinary user needs password-less sudo.
set -eu

if [ -x /usr/bin/chromium ]; then
    echo "install-chromium: /usr/bin/chromium is already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "install-chromium: run as root (or with password-less sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update </dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium </dev/null

if [ ! -x /usr/bin/chromium ]; then
    echo "install-chromium: apt-get finished but /usr/bin/chromium is missing" >&2
    exit 1
fi
echo "install-chromium: installed $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
