"""Ray Serve apps, the cluster layer and the monitoring stack."""
