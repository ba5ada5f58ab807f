#!/usr/bin/env bash
# System packages the tests drive for real: Debian chromium (the chat page in a headless browser)
# and openssh-server (deploy tests start their own sshd on loopback). Installs what is missing when
# run as root with apt; otherwise says what to install (those tests then skip, saying why).
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing system packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
  echo "warning: missing ${need[*]}; install them (sudo apt-get install ${need[*]}) or the browser/deploy tests skip" >&2
fi
