#!/usr/bin/env bash
# One slow link on one host: a network namespace NAME whose loopback is throttled to RATE by a token bucket
# (tc tbf). Every rank of a run inside NAME talks over that loopback, so all of the run's traffic -- both
# directions together, since each packet leaves lo's queue once -- shares RATE. Idempotent: a rerun keeps the
# namespace and replaces the limit. Needs root (ip, tc). Used by `python -m flatfsdp.bench --link RATE`.
# Usage: one_link.sh NAME RATE   (RATE in tc's units: 2gbit, 500mbit, 100mbps); remove with teardown.sh NAME
set -euo pipefail
ns=$1 rate=$2
[ -e "/run/netns/$ns" ] || ip netns add "$ns"
ip netns exec "$ns" ip link set lo up
# burst 1mb: at most 1 MB passes at memory speed after an idle moment, negligible against a step's tens of MB;
# latency 200ms: how long a packet may queue before tbf drops it (TCP then backs off rather than losing data).
ip netns exec "$ns" tc qdisc replace dev lo root tbf rate "$rate" burst 1mb latency 200ms
