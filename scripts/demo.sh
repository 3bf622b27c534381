#!/usr/bin/env bash
# Set up, then run a master on the embedded SQLite database with a demo writer,
# a worker copying events into replicated_events (worker.db), and a tail, so
# rows can be seen flowing. Ctrl-C stops everything, and so does SIGTERM. (Started as a
# background job of a non-interactive shell, e.g. `demo.sh &` in a script, bash ignores
# SIGINT for it and that cannot be undone here: stop it with SIGTERM then.)
#   DEMO_SECONDS=N   stop by itself after N seconds (default: run until stopped)
#   TICKLINE_CONFIG  configuration file (default: sample_config.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

config="${TICKLINE_CONFIG:-sample_config.yaml}"
tickline=.venv/bin/tickline
pids=()
cleanup() {
    trap - EXIT INT TERM
    # Readers first, the master last, so nobody reports a lost master.
    for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
        kill "${pids[i]}" 2>/dev/null || true
        wait "${pids[i]}" 2>/dev/null || true
    done
    wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 0' INT TERM

"$tickline" check-config -c "$config" >/dev/null
"$tickline" master -c "$config" &
pids+=($!)
.venv/bin/python -m scripts.demo_writer -c "$config" &
pids+=($!)
# Wait for the master, then follow the events stream from the beginning.
for _ in $(seq 100); do
    "$tickline" tail -c "$config" --count 0 events 2>/dev/null && break
    sleep 0.1
done
"$tickline" worker -c "$config" --name demo-worker --replicate events &
pids+=($!)
"$tickline" tail -c "$config" --from 0 events &
pids+=($!)
if [ -n "${DEMO_SECONDS:-}" ]; then
    sleep "$DEMO_SECONDS"
else
    wait
fi
