#!/usr/bin/env bash
# The Debian packages some tests need (ci/apt-packages.txt: a real Prometheus server, headless
# Chromium, faketime, ...): installed when missing and we are root; otherwise listed, and those
# tests skip saying why.
set -euo pipefail
cd "$(dirname "$0")"
missing=()
while read -r pkg _; do
    [[ -z "$pkg" || "$pkg" == \#* ]] && continue
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done < apt-packages.txt
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "ci/apt.sh: not installed (tests that need them skip): ${missing[*]}" >&2
fi
