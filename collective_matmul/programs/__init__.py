"""Reading compiled programs, without JAX at import: a step's collective matmuls (`discovery`), the
partitioned-HLO reader (`hlo`), a schedule's overlap verdict (`schedule`), TPU topologies (`topology`) and
the labels of call sites (`roles`, one rule for discovery and the drop-in)."""
