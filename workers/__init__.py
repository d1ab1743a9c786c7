"""The worker daemon: registers with the service, leases trials, runs them on its devices (or its
multi-host group), reports; `cmtune worker`."""
