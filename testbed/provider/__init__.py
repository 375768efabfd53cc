"""The provider side: a fabric manager that plans offloads from tenant hints and telemetry."""
