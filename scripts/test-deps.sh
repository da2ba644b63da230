#!/usr/bin/env bash
# Make sure the Debian packages in scripts/test-packages.txt are installed before `make test`.
# As root on Debian (or with passwordless sudo) the missing ones are installed; otherwise one line says what is missing
# and how to get it. Exits 0 either way: pytest then fails on a test skipped for a missing package (KILN_ALLOW_SKIPS=1 allows it).
set -u
cd "$(dirname "$0")/.."
mapfile -t PACKAGES < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/test-packages.txt | awk '{print $1}')
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: missing ${missing[*]}: install them with your package manager (tests needing them are skipped, and make test fails unless KILN_ALLOW_SKIPS=1)"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "test-deps: missing ${missing[*]}: run 'sudo apt-get install -y ${missing[*]}' (make test fails on their skipped tests unless KILN_ALLOW_SKIPS=1)"
    exit 0
  fi
fi
echo "test-deps: installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null \
  || echo "test-deps: apt-get could not install ${missing[*]}; install them by hand (apt-get install -y ${missing[*]})"
exit 0
