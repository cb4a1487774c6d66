#!/bin/sh
# Chromium and chromedriver for tests/e2e/test_browser.py (run by `make test`). Installed with apt-get when they are
# missing and that is possible (root with apt-get: CI, containers); otherwise this says so and the browser tests
# skip, naming what is missing. Never fails the build by itself.
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "browser tests: installing chromium and chromium-driver with apt-get (log: /tmp/hermes-lab-apt.log) ..."
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
      >/tmp/hermes-lab-apt.log 2>&1; then
    exit 0
  fi
  echo "browser tests: apt-get could not install chromium (see /tmp/hermes-lab-apt.log); they will skip"
else
  echo "browser tests: /usr/bin/chromium or /usr/bin/chromedriver missing and no root apt-get; they will skip"
  echo "  (Debian/Ubuntu: sudo apt-get install chromium chromium-driver)"
fi
exit 0
