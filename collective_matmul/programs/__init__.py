"""Reading compiled programs, without JAX at import: a step's collective matmuls (`discovery`, a package), the
partitioned-HLO reader (`hlo`) and the matrix products of a module (`products`), a schedule's overlap verdict
(`schedule`), TPU topologies (`topology`) and the labels of call sites (`roles`, one rule for discovery and the
drop-in)."""
