"""A block's element spans against the disk tier's chunks: which chunks a span touches, the part of a
cached chunk it owns, and spans that cross chunks, gathered into one buffer and scattered back."""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from megatrain_lightning.store.memory import host_empty


class ChunkedSpans:
    """Mixed into the disk store, which provides the chunking (``_chunks``, ``chunk_numel``), each kind's
    element range (``kind_span``, ``layout``) and the pins of cached chunks (``_pinned_keys``)."""

    _chunks: list[list[tuple[int, int]]]  # block -> its chunks' element spans
    chunk_numel: int

    def _chunks_in(self, block: int, span: tuple[int, int] | None) -> list[int]:
        """The chunks of ``block`` that ``span`` (``None``: all of it) overlaps; an empty span, the one it
        is in."""
        spans = self._chunks[block]
        if span is None:
            return list(range(len(spans)))
        start, stop = span
        first = min(start // self.chunk_numel, len(spans) - 1)
        last = max(first, min(-(-stop // self.chunk_numel), len(spans)) - 1)
        return list(range(first, last + 1))

    def _part(self, block: int, kind: str, chunk: int, span: tuple[int, int] | None, buf: Tensor) -> Tensor:
        """The part of ``kind``'s cached ``chunk`` that block elements ``span`` own."""
        if span is None:
            return buf
        origin = self.kind_span(block, kind, self._chunks[block][chunk])[0]
        start, stop = self.kind_span(block, kind, span)
        return buf[start - origin : stop - origin]

    def _overlaps(
        self, block: int, kind: str, span: tuple[int, int] | None
    ) -> Iterator[tuple[int, slice, slice]]:
        """Per chunk that ``span`` overlaps: the chunk, and the overlap as slices of the span's ``kind``
        range and of the chunk's."""
        start, stop = self.kind_span(block, kind, span)
        for chunk in self._chunks_in(block, span):
            lo, hi = self.kind_span(block, kind, self._chunks[block][chunk])
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                yield chunk, slice(a - start, b - start), slice(a - lo, b - lo)

    def _gather(self, block: int, kinds: list[str], span: tuple[int, int] | None) -> dict[str, Tensor]:
        flats = {}
        for kind in kinds:
            start, stop = self.kind_span(block, kind, span)
            flat = flats[kind] = host_empty(stop - start, self.layout(block, kind)[0])
            for chunk, mine, theirs in self._overlaps(block, kind, span):
                with self._pinned_keys([(block, kind, chunk)], False) as (buf,):
                    flat[mine].copy_(buf[theirs])
        return flats

    def _scatter(self, block: int, flats: dict[str, Tensor], span: tuple[int, int] | None) -> None:
        for kind, flat in flats.items():
            for chunk, mine, theirs in self._overlaps(block, kind, span):
                with self._pinned_keys([(block, kind, chunk)], True) as (buf,):
                    buf[theirs].copy_(flat[mine])
