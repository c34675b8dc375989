#!/bin/sh
# The HAProxy of Serve's direct ingress, with kernel splicing off (-dS): see
# DIRECT_INGRESS_ENV in cluster/topology.py.
exec "${KVRAY_HAPROXY_BINARY:-haproxy}" -dS "$@"
