#!/bin/sh
# The HAProxy of Serve's direct ingress, with kernel splicing off (-dS): see
# DIRECT_INGRESS_ENV in cluster/topology.py. Where util-linux's setpriv is present, HAProxy
# also ends with the Ray actor that started it: `ray stop --force` kills that actor, and an
# orphaned HAProxy kept port 8000, so the next `serve run` failed to start its own.
haproxy="${KVRAY_HAPROXY_BINARY:-haproxy}"
if command -v setpriv >/dev/null 2>&1; then
    exec setpriv --pdeathsig TERM "$haproxy" -dS "$@"
fi
exec "$haproxy" -dS "$@"
