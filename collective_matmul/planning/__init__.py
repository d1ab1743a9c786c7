"""Keys and planning, without JAX: decompositions (`decomposition`), problems, hardware and software
(`problem`), model shapes and their problems (`models`), the candidate space (`space`), the cost model
(`costmodel`), XLA's options per platform (`xla_options`) and bounded text (`text`)."""
