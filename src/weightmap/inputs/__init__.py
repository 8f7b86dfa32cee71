"""Stage 2, inputs: where tensors come from.

Checkpoint folders and files (safetensors shards, PyTorch pickles), Hugging Face Hub ids, the
side files a model folder carries, and comparisons of two checkpoints. Reads bytes through
``weightmap.format`` and the file system through ``weightmap.fs``; knows nothing of mappings.
"""
