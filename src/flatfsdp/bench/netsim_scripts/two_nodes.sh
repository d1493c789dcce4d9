#!/usr/bin/env bash
# Two simulated nodes on one host: namespaces NAME-a and NAME-b joined by a veth pair, each end throttled to RATE
# on its way out (a token bucket per direction, as a full-duplex network link). Inside each namespace the end is
# called "wire" (so every rank reads the same device name) and has a link-local address, 169.254.77.1 in -a and
# .2 in -b, that exists only inside these namespaces. Ranks of one node reach each other through their own
# namespace's loopback, unthrottled, as on one machine; ranks of different nodes cross the wire. Idempotent.
# Needs root (ip, tc). Used by `python -m flatfsdp.bench --nnodes 2 --link RATE`.
# Usage: two_nodes.sh NAME RATE   then run node 0 under `ip netns exec NAME-a env GLOO_SOCKET_IFNAME=wire ...`
# with --master_addr 169.254.77.1, node 1 likewise in NAME-b; remove with teardown.sh NAME
set -euo pipefail
ns=$1 rate=$2
for side in a b; do
  [ -e "/run/netns/$ns-$side" ] || ip netns add "$ns-$side"
  ip netns exec "$ns-$side" ip link set lo up
done
if ! ip netns exec "$ns-a" ip link show wire >/dev/null 2>&1; then
  # Interface names live in the host's namespace until moved: derive them from NAME so two benches setting up
  # at once cannot collide, within the 15-character limit (v + a checksum of at most 10 digits + a|b).
  tmp=$(printf '%s' "$ns" | cksum | cut -d' ' -f1)
  ip link add "v${tmp}a" type veth peer name "v${tmp}b"
  ip link set "v${tmp}a" netns "$ns-a"
  ip link set "v${tmp}b" netns "$ns-b"
  n=1
  for side in a b; do
    ip netns exec "$ns-$side" ip link set "v${tmp}$side" name wire
    ip netns exec "$ns-$side" ip addr add "169.254.77.$n/24" dev wire
    # No IPv6 on the wire: its neighbour discovery would add chatter to the byte counters the bench reads.
    ip netns exec "$ns-$side" sysctl -qw net.ipv6.conf.wire.disable_ipv6=1
    ip netns exec "$ns-$side" ip link set wire up
    n=2
  done
fi
for side in a b; do
  ip netns exec "$ns-$side" tc qdisc replace dev wire root tbf rate "$rate" burst 1mb latency 200ms
done
