#!/usr/bin/env bash
# Remove what one_link.sh / two_nodes.sh made for NAME: the namespaces NAME, NAME-a and NAME-b, whichever exist.
# Deleting a namespace destroys the interfaces inside it (the veth pair with it). Safe to run twice.
# Usage: teardown.sh NAME
set -uo pipefail
ns=$1
for n in "$ns" "$ns-a" "$ns-b"; do
  if [ -e "/run/netns/$n" ]; then ip netns del "$n"; fi
done
exit 0
