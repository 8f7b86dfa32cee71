"""Stage 1, the safetensors format: dtypes, headers, output layouts, the writer.

Knows nothing of checkpoints' folders, mappings or plans; every stage above reads and writes
safetensors bytes through it.
"""
