"""The tuner: the study engine and its store interface, the search, the measurement protocol, local runs
(`cmtune tune|bench|problems`) and multi-process groups.  Importing it imports no JAX."""
