#!/usr/bin/env bash
# Debian's headless Chromium and its driver, for the browser tests of the chat page (tests/browser/).
# Idempotent: nothing to do when both are there. The tests never download a browser at run time.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
