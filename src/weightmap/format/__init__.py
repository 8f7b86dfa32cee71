"""Stage 1, the safetensors format: dtypes, headers, checkpoints, the writer, atomic commits.

Knows nothing of mappings or plans; every stage above reads and writes files through it.
"""
