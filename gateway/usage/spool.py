"""The durable spool: one producer's append-only segments of usage events, its committed
position and its quarantine (the file layout is described in ``gateway/usage/producer.py``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import uuid
import zlib
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import orjson

from gateway.usage.events import MARK_PREFIX, record_request_id, settled_record

log = logging.getLogger("gateway.usage")

_READ_CHUNK = 1 << 20
SEGMENT_NAME = re.compile(r"usage-.+-\d{10}\.spool")


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until everything is written: a short count is not an error."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, "write wrote nothing")
        view = view[n:]


def fsync_dir(directory: Path) -> None:
    """Make file creations, renames and removals in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_position(seq: int, offset: int) -> bytes:
    body = b"%010d %020d" % (seq, offset)
    return body + b" %08x\n" % zlib.crc32(body)


def decode_position(raw: bytes) -> tuple[int, int] | None:
    """``(seq, offset)``, or None for an empty, torn or garbled record."""
    parts = raw.split(b"\n", 1)[0].split(b" ")
    if len(parts) != 3:
        return None
    body = parts[0] + b" " + parts[1]
    try:
        if int(parts[2], 16) != zlib.crc32(body):
            return None
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


class _Segment:
    __slots__ = ("fd", "path", "seq", "size")

    def __init__(self, seq: int, path: Path, fd: int, size: int) -> None:
        self.seq = seq
        self.path = path
        self.fd = fd
        self.size = size  # bytes of whole lines; anything past it is not ours to read


class Spool:
    """One producer's files: a lock, numbered segments of JSON lines, a committed position.

    ``segments[0]`` is the head the sender reads from (``committed`` is an offset in it),
    ``segments[-1]`` the tail the writer appends to. Callers serialise ``append``,
    ``rotate``, ``pending``, ``acknowledge`` and ``settle_inflight`` (the producer's lock);
    ``save_position`` and ``quarantine`` are the sender's alone.

    ``inflight`` maps the request id of every in-flight mark in the files that no event
    follows to that mark's latest line. The files alone must tell it after a crash, so a
    new segment starts with a copy of these marks (a checkpoint) before it is used: the
    older segments can then be deleted without losing a mark. Opening a spool rebuilds it
    by reading every segment through, the acknowledged part of the head included.
    """

    def __init__(self, directory: Path, name: str, lock_fd: int) -> None:
        self.directory = directory
        self.name = name
        self._lock_fd = lock_fd  # holds the flock for the owner's lifetime
        self.segments: list[_Segment] = []
        self.committed = 0
        self.depth = 0  # lines past the committed position, marks included
        self.inflight: dict[bytes, bytes] = {}
        self._pos_fd = os.open(self.pos_path, os.O_RDWR | os.O_CREAT, 0o600)
        self._quarantine_fd: int | None = None
        # Last failed append whose cut-back also failed: cut again before the next one.
        self._dirty = False
        # Head offset up to which bad lines are already in the quarantine file.
        self.quarantined_through = 0
        # Delivery state, the sender's: each spool backs off on its own.
        self.retry_at = 0.0
        self.backoff = 0.1
        self.failed = False

    # -- names ----------------------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.directory / f"{self.name}.lock"

    @property
    def pos_path(self) -> Path:
        return self.directory / f"{self.name}.pos"

    @property
    def quarantine_path(self) -> Path:
        return self.directory / f"{self.name}.quarantine"

    def segment_path(self, seq: int) -> Path:
        return self.directory / f"{self.name}-{seq:010d}.spool"

    @property
    def path(self) -> Path:
        """The segment the writer appends to."""
        return self.segments[-1].path

    # -- opening ----------------------------------------------------------------------------
    @staticmethod
    def _make_lock(directory: Path, name: str) -> int | None:
        """A new lock file, flocked before it appears under its name; None if it exists."""
        tmp = directory / f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(tmp, directory / f"{name}.lock")  # unlike rename, never replaces one
        except FileExistsError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        return fd

    @classmethod
    def create(cls, directory: Path, name: str) -> Spool:
        """This process's spool, locked before it becomes visible under its final name.

        Files left under the same name by a process that is gone are taken over and resumed.
        """
        directory.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            fd = cls._make_lock(directory, name)
            if fd is not None:
                spool = cls(directory, name, fd)
                spool._open()
                spool._start_tail()
                fsync_dir(directory)
                return spool
            adopted = cls.adopt(directory / f"{name}.lock")
            if adopted is not None:
                adopted._start_tail()
                return adopted
        raise RuntimeError(f"usage spool {name} in {directory} is held by a live process")

    @classmethod
    def adopt_legacy(cls, path: Path) -> Spool | None:
        """Adopt a spool of the earlier one-file layout left by an older gateway version
        (``usage-<instance>.spool``, locked itself, its offset in ``.offset``): the file
        becomes segment 1 of this layout, resumed from that offset."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    return None
            except (BlockingIOError, FileNotFoundError):
                return None
            directory, name = path.parent, path.name.removesuffix(".spool")
            lock_fd = cls._make_lock(directory, name)
            if lock_fd is None:
                # A migration that died half-way: its lock is adopted (and, holding no
                # segment, removed) by the next scan, and the one after migrates again.
                return None
            spool = cls(directory, name, lock_fd)
            try:
                legacy_offset = directory / f"{name}.offset"
                try:
                    offset = int(legacy_offset.read_bytes()[:20] or b"0")
                except (FileNotFoundError, ValueError):
                    offset = 0
                spool._write_position(1, offset)  # checked against the file by _open
                os.rename(path, spool.segment_path(1))
                fsync_dir(directory)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(legacy_offset)
                spool._open()
            except BaseException:
                spool.close()
                raise
            return spool
        finally:
            os.close(fd)

    @classmethod
    def adopt(cls, lock_path: Path) -> Spool | None:
        """Open another process's spool if that process is gone (its lock is free)."""
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Drained and removed by another adopter meanwhile (we may hold a dead inode).
            if os.stat(lock_path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(lock_path)
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return None
        spool = cls(lock_path.parent, lock_path.name.removesuffix(".lock"), fd)
        try:
            spool._open()
        except BaseException:
            spool.close()
            raise
        return spool

    def _list_segments(self) -> list[tuple[int, Path]]:
        pattern = re.compile(re.escape(self.name) + r"-(\d{10})\.spool")
        found = []
        for path in self.directory.iterdir():
            match = pattern.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _open(self) -> None:
        position = decode_position(os.pread(self._pos_fd, 64, 0))
        listed = self._list_segments()
        start_seq, offset = -1, 0
        if position is not None and listed and position[0] <= listed[-1][0]:
            start_seq, offset = position
            # Older segments were acknowledged to their end before the position moved on.
            for seq, path in listed:
                if seq < start_seq:
                    log.info("removing acknowledged usage spool segment %s", path)
                    os.unlink(path)
            listed = [(seq, path) for seq, path in listed if seq >= start_seq]
        elif position is not None and listed:
            log.warning("usage spool %s: position %s is past every segment", self.name, position)
        for seq, path in listed:
            fd = os.open(path, os.O_RDWR | os.O_APPEND)
            segment = _Segment(seq, path, fd, os.fstat(fd).st_size)
            self.segments.append(segment)
            self._cut_torn_tail(segment)
        if listed and listed[0][0] != start_seq:
            offset = 0  # the position's segment is gone (or no position): from the start
        if self.segments:
            self.committed = self._safe_offset(self.segments[0], offset)
        for segment in self.segments:
            self._scan_inflight(segment)
        self.depth = sum(
            self._count_lines(s, self.committed if i == 0 else 0, s.size)
            for i, s in enumerate(self.segments)
        )

    def _scan_inflight(self, segment: _Segment) -> None:
        pos, rest = 0, b""
        while pos < segment.size:
            chunk = os.pread(segment.fd, min(_READ_CHUNK, segment.size - pos), pos)
            if not chunk:
                break
            pos += len(chunk)
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            self._track(lines)

    def _track(self, records: Sequence[bytes]) -> None:
        """Follow marks and events written to the files (in their order)."""
        inflight = self.inflight
        for record in records:
            request_id = record_request_id(record)
            if request_id is None:
                continue
            if record.startswith(MARK_PREFIX):
                inflight[request_id] = record
            else:
                inflight.pop(request_id, None)

    def settle_inflight(self) -> int:
        """Turn every mark without an event into its event, appended and fsynced (a spool
        adopted from a dead process only: a live owner's marks are requests still running).
        Returns how many; raises ``OSError`` and keeps the marks if the disk refuses."""
        if not self.inflight or not self.segments:
            return 0
        records = [settled_record(mark) for mark in self.inflight.values()]
        self.append(records)
        return len(records)

    def _start_tail(self) -> None:
        if not self.segments:
            last = decode_position(os.pread(self._pos_fd, 64, 0))
            self._add_segment((last[0] if last else 0) + 1)

    def _add_segment(self, seq: int) -> None:
        path = self.segment_path(seq)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        # The checkpoint of open marks goes in before the segment is used (and before the
        # sender may delete the older segments that hold them).
        checkpoint = b"".join(mark + b"\n" for mark in self.inflight.values())
        try:
            if checkpoint:
                _write_all(fd, checkpoint)
                os.fsync(fd)
            fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self.segments.append(_Segment(seq, path, fd, len(checkpoint)))
        self.depth += len(self.inflight)

    def _cut_torn_tail(self, segment: _Segment) -> None:
        """Move a partial last line (a crash mid-append) to the quarantine file."""
        size = segment.size
        if size == 0 or os.pread(segment.fd, 1, size - 1) == b"\n":
            return
        end = self._line_start(segment, size)
        torn = os.pread(segment.fd, size - end, end)
        log.warning("usage spool %s: %d torn bytes at its end", segment.path, len(torn))
        self._quarantine_lines(segment, [(end, torn, "torn_tail")])
        os.ftruncate(segment.fd, end)
        os.fsync(segment.fd)
        segment.size = end

    def _safe_offset(self, segment: _Segment, offset: int) -> int:
        """``offset`` if it is a line start inside the segment, else an earlier one."""
        if offset > segment.size or offset < 0:
            log.warning(
                "usage spool %s: committed offset %d beyond its %d bytes; resending from 0",
                segment.path,
                offset,
                segment.size,
            )
            return 0
        if offset == 0 or os.pread(segment.fd, 1, offset - 1) == b"\n":
            return offset
        end = self._line_start(segment, offset)
        log.warning(
            "usage spool %s: committed offset %d is mid-line; resending from %d",
            segment.path,
            offset,
            end,
        )
        return end

    @staticmethod
    def _line_start(segment: _Segment, offset: int) -> int:
        """The start of the line that holds the byte just before ``offset``."""
        end = offset
        while end > 0:
            start = max(0, end - 65536)
            cut = os.pread(segment.fd, end - start, start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            end = start
        return 0

    @staticmethod
    def _count_lines(segment: _Segment, start: int, end: int) -> int:
        count, pos = 0, start
        while pos < end:
            chunk = os.pread(segment.fd, min(_READ_CHUNK, end - pos), pos)
            if not chunk:
                break
            count += chunk.count(b"\n")
            pos += len(chunk)
        return count

    # -- the writer's side --------------------------------------------------------------------
    def append(self, records: Sequence[bytes]) -> None:
        """Write and fsync ``records`` to the tail, all or nothing.

        On an error the tail is cut back to its last good size, so no half line is left for
        the next append to run into; the caller still holds the records and retries.
        """
        tail = self.segments[-1]
        if self._dirty:
            os.ftruncate(tail.fd, tail.size)
            self._dirty = False
        data = b"".join(r + b"\n" for r in records)
        try:
            _write_all(tail.fd, data)
            os.fsync(tail.fd)
        except BaseException:
            try:
                os.ftruncate(tail.fd, tail.size)
            except OSError:
                self._dirty = True
            raise
        tail.size += len(data)
        self.depth += len(records)
        self._track(records)

    def rotate(self, segment_bytes: int) -> None:
        """Start a new tail once the current one is past ``segment_bytes``."""
        tail = self.segments[-1]
        if tail.size < segment_bytes:
            return
        try:
            self._add_segment(tail.seq + 1)
        except OSError as exc:  # keep appending to the current tail; try again next time
            log.warning("usage spool %s: cannot start a new segment: %r", self.name, exc)

    # -- the sender's side ----------------------------------------------------------------------
    def pending(self, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` uncommitted lines of the head segment, each with the offset just
        past it. A head that is acknowledged to its end is deleted first if a newer exists."""
        if not self.segments:
            return []
        self._retire_done()
        head = self.segments[0]
        out: list[tuple[int, bytes]] = []
        pos = self.committed
        while pos < head.size and len(out) < limit:
            chunk = os.pread(head.fd, min(_READ_CHUNK, head.size - pos), pos)
            start = 0
            while len(out) < limit:
                end = chunk.find(b"\n", start)
                if end < 0:
                    break
                out.append((pos + end + 1, chunk[start:end]))
                start = end + 1
            if start == 0:
                if out:
                    break
                # One line longer than a read: only a corrupted one is (an event is < 1 KiB).
                # Hand it on whole, to be quarantined, rather than stall on it.
                end = self._line_end(head, pos)
                out.append((end, os.pread(head.fd, end - 1 - pos, pos)))
                pos = end
                continue
            pos += start
        return out

    @staticmethod
    def _line_end(segment: _Segment, pos: int) -> int:
        """The offset just past the line that starts at ``pos`` (segments end in a newline)."""
        while pos < segment.size:
            chunk = os.pread(segment.fd, min(_READ_CHUNK, segment.size - pos), pos)
            cut = chunk.find(b"\n")
            if cut >= 0:
                return pos + cut + 1
            pos += len(chunk)
        return segment.size + 1  # unreachable: trimmed to whole lines on open

    def _retire_done(self) -> None:
        while len(self.segments) > 1 and self.committed >= self.segments[0].size:
            head, after = self.segments[0], self.segments[1]
            # The position moves on (durably) before the file goes: a crash in between
            # leaves an acknowledged segment that the next open deletes, never a gap.
            self._write_position(after.seq, 0)
            self.segments.pop(0)
            self.committed = 0
            self.quarantined_through = 0
            os.close(head.fd)
            try:
                os.unlink(head.path)
                fsync_dir(self.directory)
            except OSError as exc:
                log.warning("usage spool: cannot remove %s: %r", head.path, exc)

    def commit(self, offset: int, count: int) -> None:
        """Lines of the head up to ``offset`` (``count`` of them) are acknowledged."""
        self.acknowledge(offset, count)
        self.save_position()

    def acknowledge(self, offset: int, count: int) -> None:
        """``commit`` in memory only (the part that needs the producer's lock)."""
        self.committed = offset
        self.depth -= count

    def save_position(self) -> None:
        """Write and fsync the committed position (the sender's alone: no lock needed)."""
        try:
            self._write_position(self.segments[0].seq, self.committed)
        except OSError as exc:
            # The events are delivered; a stale position only re-sends them after a crash.
            log.warning("usage spool %s: cannot write its position: %r", self.name, exc)

    def _write_position(self, seq: int, offset: int) -> None:
        record = encode_position(seq, offset)
        if os.pwrite(self._pos_fd, record, 0) != len(record):
            raise OSError(errno.EIO, "short write of the spool position")
        os.fsync(self._pos_fd)

    def quarantine(self, lines: Sequence[tuple[int, bytes, str]]) -> None:
        """Append ``(start offset, line, reason)`` of head lines to the quarantine file and
        fsync it; the caller commits past them only after this returned."""
        self._quarantine_lines(self.segments[0], lines)

    def _quarantine_lines(self, segment: _Segment, lines: Sequence[tuple[int, bytes, str]]) -> None:
        if self._quarantine_fd is None:
            created = not self.quarantine_path.exists()
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
            self._quarantine_fd = os.open(self.quarantine_path, flags, 0o600)
            if created:
                fsync_dir(self.directory)
        fd = self._quarantine_fd
        now = datetime.now(UTC).isoformat()
        data = b"".join(
            orjson.dumps(
                {
                    "quarantined_at": now,
                    "segment": segment.path.name,
                    "offset": offset,
                    "reason": reason,
                    "line": line.decode("utf-8", "backslashreplace"),
                }
            )
            + b"\n"
            for offset, line, reason in lines
        )
        size = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise

    # -- the end ------------------------------------------------------------------------------
    def remove(self) -> None:
        """Delete a drained spool's files (the quarantine file stays), then release it."""
        for segment in self.segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pos_path)
        # The lock goes last: whoever finds it may still find segments, never the reverse.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_path)
        with contextlib.suppress(OSError):
            fsync_dir(self.directory)
        self.close()

    def close(self) -> None:
        fds = [s.fd for s in self.segments] + [self._pos_fd, self._quarantine_fd, self._lock_fd]
        self.segments = []
        self._quarantine_fd = None
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
