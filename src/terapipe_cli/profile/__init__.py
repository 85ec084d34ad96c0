"""Cost-model profiles: measurement on the local device (measure, fit, comm) and analytic estimates."""
