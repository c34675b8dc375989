#!/bin/sh
# The HAProxy of Serve's direct ingress, with kernel splicing off (-dS): see
# DIRECT_INGRESS_ENV in cluster/topology.py. Where util-linux's setpriv is present, HAProxy
# also ends with the Ray actor that started it: `ray stop --force` kills that actor, and an
# orphaned HAProxy kept port 8000, so the next `serve run` failed to start its own.
# KVRAY_HAPROXY_BUSY_POLLING=1 adds HAProxy's `busy-polling` (its threads never sleep in
# the poller: lower latency in a virtual machine, one busy CPU per HAProxy thread).
haproxy="${KVRAY_HAPROXY_BINARY:-haproxy}"
extra=""
if [ "${KVRAY_HAPROXY_BUSY_POLLING:-0}" = 1 ]; then
    extra="${TMPDIR:-/tmp}/kvray-haproxy-busy-polling.cfg"
    printf 'global\n    busy-polling\n' >"$extra"
    set -- -f "$extra" "$@"
fi
if command -v setpriv >/dev/null 2>&1; then
    exec setpriv --pdeathsig TERM "$haproxy" -dS "$@"
fi
exec "$haproxy" -dS "$@"
