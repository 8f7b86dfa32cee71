"""Several checkpoints read as one: each one's tensors under a prefix (``adapter:``,
``ranks:3:``), in one namespace. The inputs a mapping declares are joined so (binding.py), and
so is an output of several files when it is read back to be verified."""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

from weightmap.errors import CheckpointError
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.inputs.pickles import prefixed_header

__all__ = ["join"]


def join(
    main: Checkpoint, parts: list[tuple[str, Checkpoint]], names: tuple[str, ...]
) -> Checkpoint:
    """One checkpoint of ``main``'s tensors and every part's, each part's names prefixed."""
    claimed = re.compile(f"(?:{'|'.join(map(re.escape, names))}):")
    clash = next((n for n in main if claimed.match(n)), None)
    if clash is not None:
        raise CheckpointError(
            f"the main input holds a tensor named {clash!r}, which reads as one of input "
            f"{clash.split(':', 1)[0]!r}'s; rename that input in the mapping",
            path=main.root,
            rule="input-name",
        )
    headers = dict(main.headers)
    tensors = dict(main.stored())
    owner: dict[Path, str] = {p.resolve(): "the main input" for p in headers}
    prefixes: dict[Path, str] = {}
    loaded = dict(main._loaded)
    for prefix, ckpt in parts:
        for path, header in ckpt.headers.items():
            real = path.resolve()
            if real in owner:
                raise CheckpointError(
                    f"is read as {owner[real]} and as input {prefix.split(':')[0]!r}: bind "
                    "each input to its own files",
                    path=path,
                    rule="input-twice",
                )
            owner[real] = f"input {prefix.split(':')[0]!r}"
            renamed = prefixed_header(header, prefix)
            headers[path] = renamed
            prefixes[path] = prefix
            tensors.update((n, (path, info)) for n, info in renamed.tensors.items())
            if path in ckpt._loaded:
                loaded[path] = {prefix + n: t for n, t in ckpt._loaded[path].items()}
    joined = Checkpoint(main.root, headers, tensors, main.config, main.index_path)
    joined.borrow([main, *(ckpt for _prefix, ckpt in parts)])
    joined._loaded = loaded
    joined.prefixes = MappingProxyType(prefixes)
    return joined
