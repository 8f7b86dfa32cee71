"""Stage 4, the plan: operation trees over input tensors, as immutable, serializable values.

What the compiler produces and the executors consume; it never touches tensor data.
"""
