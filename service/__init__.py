"""cmtune service side and the `cmtune` command line."""
