"""Stage 6, the executors: a plan over a checkpoint, streamed to disk or yielded in memory.

``kernels`` defines what each operation computes; ``streaming`` writes a new checkpoint in
bounded memory; ``memory`` yields tensors; ``inplace`` rewrites headers where they are.
"""
