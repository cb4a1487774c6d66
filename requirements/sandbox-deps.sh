#!/bin/sh
# What the local sandbox needs from the system (hermes_lab/sandbox/isolation.py): bubblewrap (a root of its own
# for every run) and libseccomp (its seccomp filter). Run by `make round`, `make test` and `make bench`: installed
# with apt-get when missing and that is possible (root with apt-get: CI, containers); otherwise this says what to
# install, and `hermes-lab doctor --params FILE` says which layers then hold (sandbox.require_isolation refuses
# to train with the tests reward without them). Never fails the build by itself.
# Also ripgrep: Hermes Agent's search_files runs rg (without it, a `grep --exclude-dir='.*' PATTERN .` fallback
# that finds nothing here).
if command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' \
    && command -v rg >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "sandbox: installing bubblewrap, libseccomp2 and ripgrep with apt-get (log: /tmp/hermes-lab-apt-sandbox.log) ..."
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libseccomp2 ripgrep) \
      >/tmp/hermes-lab-apt-sandbox.log 2>&1; then
    exit 0
  fi
  echo "sandbox: apt-get could not install them (see /tmp/hermes-lab-apt-sandbox.log)"
else
  echo "sandbox: bubblewrap, libseccomp or ripgrep missing and no root apt-get: sudo apt-get install bubblewrap libseccomp2 ripgrep"
fi
echo "  (hermes-lab doctor --params params/embedded.yaml says which sandbox layers hold here)"
exit 0
