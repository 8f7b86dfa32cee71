"""Stage 5, the compiler: a mapping + input headers + config -> a :class:`~weightmap.plan.Plan`.

Every check that needs names, shapes and dtypes happens here, and all problems are reported
together before any byte is read. ``invert`` turns a mapping around.
"""
