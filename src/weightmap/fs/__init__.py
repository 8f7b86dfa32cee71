"""Stage 0, the file system and the process: atomic commits, folder locks, the open-file limit
and collector pauses. Imports nothing of weightmap but its errors.
"""
