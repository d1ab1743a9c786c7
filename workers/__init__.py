"""Worker side of cmtune: hardware detection and multi-process (multi-host) execution."""
