"""Computing one output tensor in chunks, in bounded memory, over memory-mapped inputs.

Each chunk is a slice along one output dimension, small enough that its intermediates stay
within the chunk budget; it is computed from views of only the input regions it needs
(``chunks.py``) into a buffer the thread reuses, and written at its offset. The input pages a
chunk read are unmapped once it is written (``Checkpoint.release``), so the process's resident
memory stays at the chunk budget plus the interpreter and torch whatever the input's size; a
tensor read out of order (a transpose reads every input row for each chunk) is unmapped band
by band as it is gathered, and later chunks map its pages again from the page cache.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from weightmap.errors import ExecutionError
from weightmap.execute.chunks import chunk_plan, concat_pieces, region, scratch, tree_nodes
from weightmap.execute.kernels import OPAQUE_DTYPES, evaluate, tensor_bytes
from weightmap.execute.nans import settle, strategy
from weightmap.format.dtypes import DTYPES, nbytes, numel
from weightmap.format.transfer import DIRECT_ALIGN
from weightmap.inputs.checkpoint import Checkpoint
from weightmap.plan.nodes import Cast, Concat, Node, Source, int_cast_fits

if TYPE_CHECKING:
    import torch

__all__ = ["Computer", "Sink"]


class Sink(Protocol):
    """Where computed bytes go: the checkpoint writer, or a task's view of the staged shards."""

    def write(self, name: str, data: bytes | memoryview, offset: int = 0) -> None: ...


class Computer:
    """Computes output tensors into a writer, chunk by chunk; one instance serves all threads.

    ``where`` maps each input tensor to its file and the absolute ``[begin, end)`` of its
    bytes, to unmap what a chunk read. ``report(n)`` is called with the bytes of each written chunk;
    ``checksums`` (when not None) receives each tensor's CRC-32.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        writer: Sink,
        where: Mapping[str, tuple[Path, int, int]],
        chunk_bytes: int,
        report: Callable[[int], None],
        checksums: dict[str, int] | None,
    ) -> None:
        self.ckpt = ckpt
        self.writer = writer
        self.where = where
        self.chunk_bytes = chunk_bytes
        self.report = report
        self.checksums = checksums
        # Each thread's buffers (an _Arena), reused chunk after chunk: a fresh allocation per
        # chunk costs a page fault per page (and its zeroing) every time.
        self._scratch = threading.local()

    def run(self, name: str, node: Node, rows: tuple[int, int] | None = None) -> int:
        """Compute output ``name`` and write it; afterwards no page of its inputs stays mapped.

        ``rows`` computes only indices ``[start, stop)`` of the dimension ``chunk_plan``
        chunks along (``start`` a multiple of its step, so the chunks are the ones the whole
        tensor is computed in). Returns the CRC-32 of the bytes written (0 without
        ``checksums``); the checksum of a whole tensor is also recorded in ``checksums``.
        """
        opaque = sorted({n.dtype for n in tree_nodes(node)} & OPAQUE_DTYPES)
        if opaque:
            raise ExecutionError(
                f"{name}: {opaque[0]} data can only be renamed, kept, reshaped, or split and "
                "merged along whole bytes; this rule needs arithmetic on it"
            )
        try:
            crc = self._chunks(name, node, rows)
        finally:
            for src in {n.name for n in tree_nodes(node) if isinstance(n, Source)}:
                self.ckpt.release(*self.where[src])
        if self.checksums is not None and rows is None:
            self.checksums[name] = crc
        return crc

    def _chunks(self, name: str, node: Node, rows: tuple[int, int] | None) -> int:
        size = nbytes(node.dtype, node.shape)
        if size == 0:
            return 0
        dim, step = chunk_plan(node, self.chunk_bytes)
        extent = node.shape[dim] if node.shape else 1
        first, last = (0, max(extent, 1)) if rows is None else rows
        crc = 0
        offset = size // max(extent, 1) * first  # the dims before ``dim`` are all 1
        phase: Callable[[str, int], int] | None = getattr(self.writer, "phase", None)
        for start in range(first, last, step):
            stop = min(last, start + step)
            seen: list[tuple[str, torch.Tensor]] = []
            if node.shape:
                # The output buffer placed as the bytes land in a disk block (see _buffer).
                self._scratch.phase = phase(name, offset) if phase is not None else 0
                self._arena().start()
                with scratch(self._buffer):  # (its buffers hold ``data`` until the next chunk)
                    data = self._chunk(node, dim, start, stop, name, seen)
            else:
                data = memoryview(tensor_bytes(evaluate(node, self.ckpt.view, name)))
            if data.nbytes:
                self.writer.write(name, data, offset)
                if self.checksums is not None:
                    crc = zlib.crc32(data, crc)
            offset += data.nbytes
            self.report(data.nbytes)
            del data
            self._release(seen)
        return crc

    def _release(self, seen: list[tuple[str, torch.Tensor]]) -> None:
        """Unmap the input pages a chunk read: the span of each view, from its first byte to
        its last. The next chunk reads the range after a contiguous view; a strided one (a
        transpose reads a column block of every input row) spans pages later chunks read again,
        and they map them again from the page cache rather than keep the whole input mapped."""
        for src, view in seen:
            self._release_view(src, view)

    def _release_view(self, src: str, view: torch.Tensor) -> None:
        """Unmap the pages under ``view``, a view of input ``src`` (strides are never negative)."""
        if not view.numel():
            return
        path, begin, _ = self.where[src]
        base = self.ckpt.view(src)
        start = begin + view.data_ptr() - base.data_ptr()
        last = sum((n - 1) * st for n, st in zip(view.shape, view.stride(), strict=True))
        self.ckpt.release(path, start, start + (last + 1) * view.element_size())

    def _chunk(
        self,
        node: Node,
        dim: int,
        start: int,
        stop: int,
        name: str,
        seen: list[tuple[str, torch.Tensor]],
    ) -> memoryview:
        """The bytes of ``node`` over ``[start, stop)`` along ``dim``, without a copy to bytes.

        A cast at the top (the common whole-checkpoint cast) converts straight from the
        memory-mapped input into the thread's buffer: ``copy_`` is what ``Tensor.to`` does
        after allocating. Integer casts that may lose values keep the checked path.
        """
        if (
            isinstance(node, Cast)
            and node.src.dtype != node.dtype
            and int_cast_fits(node.src.dtype, node.dtype)
        ):
            src = region(node.src, dim, start, stop, self.ckpt.view, name, seen)
            out = self._buffer(DTYPES[node.dtype].torch(), tuple(src.shape))
            how = strategy(src.dtype, out.dtype)  # NaN bits independent of chunks (nans.py)
            if how == "contiguous" and not src.is_contiguous():
                staged = self._buffer(src.dtype, tuple(src.shape), slot=2)
                self._copy_into(staged, src, seen)  # same dtype: moves bytes, converts nothing
                src = staged
            self._copy_into(out, src, seen)
            if how == "settle":
                settle(out, src)
            self._release_early(seen)
            return _memory(out)
        if isinstance(node, Concat):
            # Joined straight into the thread's buffer (the ranks of a tensor-parallel
            # checkpoint along dim 1): a fresh tensor per chunk would leave chunk-sized blocks
            # to the allocator, several per thread.

            ends: list[int] = []  # where each piece's input views end in ``seen``

            def sub(n: Node, d: int, lo: int, hi: int) -> torch.Tensor:
                piece = region(n, d, lo, hi, self.ckpt.view, name, seen)
                ends.append(len(seen))
                return piece

            pieces = concat_pieces(node, dim, start, stop, sub)
            shape = list(node.shape)
            shape[dim] = stop - start
            out = self._buffer(DTYPES[node.dtype].torch(), tuple(shape))
            # Piece by piece, each one's input unmapped once it is copied, so one piece's
            # pages are mapped at a time, not the whole chunk's (8 ranks' worth).
            at, begin = 0, 0
            for piece, end in zip(pieces, ends, strict=True):
                n = piece.shape[node.dim]
                out.narrow(node.dim, at, n).copy_(piece)
                at += n
                self._release(seen[begin:end])
                begin = end
            del pieces
            seen.clear()
            return _memory(out)
        part = region(node, dim, start, stop, self.ckpt.view, name, seen)
        if part.is_contiguous():
            if _input_of(part, seen) is None:  # computed into memory of its own
                self._release_early(seen)
            return _memory(part)  # (else a view of the input: released once it is written)
        out = self._buffer(part.dtype, tuple(part.shape))
        self._copy_into(out, part, seen)
        del part
        self._release_early(seen)
        return _memory(out)

    def _release_early(self, seen: list[tuple[str, torch.Tensor]]) -> None:
        """Unmap the input a chunk read as soon as its values are in the thread's buffer,
        rather than after the buffer is written: the write takes as long as the read, and
        eight ranks' worth of mapped pages per thread would otherwise wait through it."""
        self._release(seen)
        seen.clear()

    def _copy_into(
        self,
        out: torch.Tensor,
        src: torch.Tensor,
        seen: list[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """``out.copy_(src)``; a transposed view is first gathered in its own memory order.

        Copied directly, a transposed view reads every element from a different row of the
        input, a cache miss each. Gathering the view's rows into a compact block reads the
        input in order, and the copy out of that block is a permute of a contiguous tensor,
        which torch transposes in cache-sized tiles (2-D). Same elements, same result.

        Where the view is of a memory-mapped input (one of ``seen``), it is gathered in bands
        of ``_BAND_BYTES`` of the input, each band's pages unmapped once it is copied: the
        kernel maps a file's pages in blocks around each one read, so a column block of every
        row would otherwise map the whole input, for every chunk of the tensor.
        """
        if src.dim() < 2 or src.stride(-1) == 1:
            out.copy_(src)
            return
        strides = src.stride()
        order = sorted(range(src.dim()), key=lambda d: -strides[d])
        staged = src.permute(order)
        block = self._buffer(src.dtype, tuple(staged.shape), slot=1)
        mapped = _input_of(staged, seen or [])
        if mapped is None:
            block.copy_(staged)
        else:
            rows = max(1, _BAND_BYTES // max(1, staged.stride(0) * staged.element_size()))
            for lo in range(0, staged.shape[0], rows):
                band = staged[lo : lo + rows]
                block[lo : lo + rows].copy_(band)
                self._release_view(mapped, band)
        inverse = [0] * len(order)
        for i, d in enumerate(order):
            inverse[d] = i
        out.copy_(block.permute(inverse))

    def _arena(self) -> _Arena:
        arena: _Arena | None = getattr(self._scratch, "arena", None)
        if arena is None:
            # Room for a chunk's intermediates as chunk_plan bounds them, the output buffer's
            # shift into its disk block, and each buffer's alignment.
            reserve = self.chunk_bytes + DIRECT_ALIGN + 16 * _Arena.ALIGN
            arena = self._scratch.arena = _Arena(reserve)
        return arena

    def _buffer(self, dtype: torch.dtype, shape: tuple[int, ...], slot: int = 0) -> torch.Tensor:
        """This chunk's buffer ``slot`` on this thread (see ``_Arena``), as ``dtype[shape]``.

        The output buffer (slot 0) starts where the chunk's first byte lands in a disk block
        (``phase``): the writer then sends its whole blocks to the disk straight from it,
        where a buffer placed anywhere would be copied into an aligned one first.
        """
        size = numel(shape) * dtype.itemsize
        room = self._arena().take(size + (DIRECT_ALIGN if slot == 0 else 0), slot)
        shift = 0
        if slot == 0:
            shift = (getattr(self._scratch, "phase", 0) - room.data_ptr()) % DIRECT_ALIGN
            if shift % 8:  # (a dtype view needs its elements' alignment: no shift then)
                shift = 0
        return room[shift : shift + size].view(dtype).view(shape)


class _Arena:
    """One thread's scratch memory: every buffer a chunk takes (its output, a staged copy, the
    copies ``region`` makes) is carved from one block, reused chunk after chunk.

    The block is ``reserve`` bytes from the start (the chunk budget: a page of it is memory
    only once a chunk writes it), so the thread holds the most one chunk wrote at once.
    Buffers kept per slot would each grow to the largest its slot ever held, and a thread
    would keep their sum: a rotary permute's two copies and a join's output buffer, never live
    in the same chunk, all stayed. A chunk larger than the budget (one row over it) grows the
    block.
    """

    __slots__ = ("block", "reserve", "taken", "used")

    # Where each buffer starts in the block: a multiple of every dtype's alignment.
    ALIGN = 64

    def __init__(self, reserve: int = 0) -> None:
        self.block: torch.Tensor | None = None
        self.reserve = reserve
        self.used = 0  # bytes the current chunk has taken, padding included
        self.taken: dict[int, torch.Tensor] = {}

    def start(self) -> None:
        """A new chunk: the block grown to what the last chunk took, taken from its start."""
        if self.used > self._size():
            self._grow(self.used)
        self.used = 0
        self.taken.clear()

    def take(self, size: int, slot: int) -> torch.Tensor:
        """``size`` bytes for ``slot`` in this chunk: the ones it took already if they are
        enough, else the next free bytes of the block. A chunk's first buffer that does not
        fit grows the block at once (nothing of the chunk is in it yet); a later one gets a
        tensor of its own, and the block grows at the next chunk."""
        import torch

        room = self.taken.get(slot)
        if room is not None and room.numel() >= size:
            return room
        at = -(-self.used // self.ALIGN) * self.ALIGN
        self.used = at + size
        if self.used > self._size() and not self.taken:
            self._grow(max(self.used, self.reserve))
        if self.block is not None and self.used <= self.block.numel():
            room = self.block[at : self.used]
        else:
            room = torch.empty(size, dtype=torch.uint8)
        self.taken[slot] = room
        return room

    def _size(self) -> int:
        return 0 if self.block is None else self.block.numel()

    def _grow(self, need: int) -> None:
        """A block of at least ``need`` bytes, and a quarter more than the last one: chunks of
        one tensor differ by a few rows, and each growth maps a new block and drops the old."""
        import torch

        size = max(need, self._size() * 5 // 4)
        self.block = None  # (let the old block go before allocating the larger one)
        self.block = torch.empty(size, dtype=torch.uint8)


# How much of a memory-mapped input a strided gather reads before unmapping it (see
# ``Computer._copy_into``): small against the 300 MiB a conversion keeps to, large enough
# that the unmapping is a few calls per chunk.
_BAND_BYTES = 8 * 2**20


def _input_of(view: torch.Tensor, seen: list[tuple[str, torch.Tensor]]) -> str | None:
    """The input ``view`` is a view of (its memory is that input's map), or None."""
    storage = view.untyped_storage().data_ptr()
    for src, read in seen:
        if read.untyped_storage().data_ptr() == storage:
            return src
    return None


def _memory(t: torch.Tensor) -> memoryview:
    """The row-major bytes of a contiguous tensor, as a view (the bytes ``tensor_bytes`` gives)."""
    import torch

    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().data
