#!/usr/bin/env bash
# Install everything tickline needs into .venv/ (and Debian packages when missing).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# nc and sqlite3 for people and tests; PostgreSQL's server for the test suite
# (tests start a throwaway server of their own; the package's cluster is not used).
# Spark snapshots: a Java runtime and the JDBC drivers (/usr/share/java/postgresql.jar,
# /usr/share/java/sqlite-jdbc.jar); pyspark ships no JDBC driver and nothing is downloaded at run time.
APT_PACKAGES=(netcat-openbsd sqlite3 postgresql libpostgresql-jdbc-java libxerial-sqlite-jdbc-java)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
command -v java >/dev/null 2>&1 || missing+=(JAVA)
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: need root to install Debian packages: ${missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    if [[ " ${missing[*]} " == *" JAVA "* ]]; then  # Java 17 where offered, else Debian's default
        java_pkg=openjdk-17-jre-headless
        apt-cache show "$java_pkg" >/dev/null 2>&1 || java_pkg=default-jre-headless
        missing=("${missing[@]/JAVA/$java_pkg}")
    fi
    echo "setup: installing Debian packages: ${missing[*]}"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
# Reinstall only when the declared dependencies changed since the last run.
stamp=.venv/.tickline-setup
want="$(sha256sum setup.cfg pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c "import replication, twisted, orjson, psycopg2, pyspark, matplotlib, hypothesis, mypy" 2>/dev/null; then
    echo "setup: installing Python packages into .venv"
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[postgres,spark,bench,test]'
    echo "$want" > "$stamp"
fi
# Byte-compile tickline's own modules: where PYTHONDONTWRITEBYTECODE is set, every
# `tickline` process would otherwise compile them from source (about 90 ms of each start).
# Only stale files are compiled again; a file changed later is compiled in memory until then.
.venv/bin/python -m compileall -q replication storage workers scripts >/dev/null
