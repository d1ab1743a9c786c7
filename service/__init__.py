"""The cmtune service: the REST API over the SQL store, leasing, look-ups, the dashboard; `cmtune serve|token|db`."""
