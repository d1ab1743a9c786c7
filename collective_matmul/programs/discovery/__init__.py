"""Discovery: the collective matmuls of a user's own training step, read from its partitioned module.

`discover` lowers and compiles the step for its mesh without running it (abstract arguments
will do), takes the module as XLA's SPMD partitioner left it, and `scan` finds in it:

- an all-gather feeding a dot on one of the activation's row dimensions, the weight being the
  dot's other operand: an ``allgather_matmul`` (column-parallel projection);
- a dot whose product is reduce-scattered on its rows, or all-reduced and then dynamically sliced
  (what the partitioner emits before a later pass fuses them): a ``matmul_reduce_scatter``
  (row-parallel projection);
- in the backward, the dots of the same role: its input gradient (a dot with the forward's weight
  as an operand) and its weight gradient (a dot of two activations, contracting the rows, whose
  result has the weight's shape).  Their problems come from the one rule of
  `collective_matmul.planning.models.slot_problems`, applied to the forward call;
- an all-gather of the weight feeding a projection (FSDP): a ``weight_allgather_matmul_k`` (the weight gathered
  on its contracting dimension) or ``_n`` (on its output dimension), whose slots are the weight gathered again
  for the input gradient and the weight gradient reduce-scattered onto the weight's layout
  (``reduce_scatter_grad_weight``; the CPU backend prints it as an all-reduce and slices).

Each problem gets its slot, its role (`collective_matmul.programs.roles`) and how often it runs per step
(a ``scan`` over layers counts its trip count; remat's recomputation is not counted again).
Gathers that feed no activation × weight product (attention's K/V, both operands gathered) and
all-reduces that are not scattered are listed as skipped, with the reason.  The asynchronous
``all-gather-start`` / ``-done`` pairs of accelerator backends are read too.

Global sizes follow the sequence-parallel layout the ops use (`collective_matmul.ops.collective`): m is the
rows one ring sees (the batch of one data shard times the sequence), k and n the full matmul.

The package, from the bottom: `records` (what `discover` returns), `flow` (what feeds a product and what it
feeds), `rules` (what one forward product is), `tally`, `loops` (XLA's own windowed einsum), `scanning` (module
text in, a `Discovery` out: no JAX), `cache` and `lowering` (the step compiled, JAX imported when it is).  The
products of a module are read by `collective_matmul.programs.products`, beside the HLO reader.
"""

from collective_matmul.programs.discovery.lowering import discover, partitioned_module
from collective_matmul.programs.discovery.records import Discovery, SkippedCollective, XlaDecomposed
from collective_matmul.programs.discovery.scanning import scan
from collective_matmul.programs.products import as_product, is_product, products

__all__ = ["Discovery", "SkippedCollective", "XlaDecomposed", "as_product", "discover", "is_product",
           "partitioned_module", "products", "scan"]
