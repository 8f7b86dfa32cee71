"""Stage 0, the file system and the process: atomic commits, folder locks, opening an input
file once (and reading it through that descriptor), the open-file limit and collector pauses.
Imports nothing of weightmap but its errors.
"""
