#!/usr/bin/env bash
# The demo corpus includes Debian packages fetched with `apt-get download`, which needs package lists.
# Refresh them once if this machine has none (root, or passwordless sudo); otherwise say what to do.
set -u
command -v apt-get >/dev/null 2>&1 || { echo "apt-get not found: Debian sources in conf/sources/*.yaml will be unavailable; use pip or local sources"; exit 0; }
if ls /var/lib/apt/lists/ 2>/dev/null | grep -q '_Packages'; then exit 0; fi
if [ "$(id -u)" = 0 ]; then apt-get update -qq; elif sudo -n true 2>/dev/null; then sudo apt-get update -qq; else
  echo "Run 'sudo apt-get update' once so the Debian demo sources can be downloaded."; fi
