"""A class-data-sharing archive for the driver JVM: Spark's classes loaded once, mapped by every
later start.

Every `sparkpoint run`, Dagster run and Airflow task on a Spark of its own starts a JVM, which
loads and verifies some 15,000 of Spark's classes before the first job: measured here, 6 s of a
new process's 13 s to its first Python job. Java 13+ can record the classes a run loaded into an
archive when that JVM exits (`-XX:ArchiveClassesAtExit`) and map the archive at the next start
(`-XX:SharedArchiveFile`): the same start then takes about 7 s.

The archive lives in a cache directory (`SPARKPOINT_JVM_CACHE`, default
`$XDG_CACHE_HOME/sparkpoint/jvm`, "off" to never use one), named by a key of the JDK and Spark's
jars, so another JDK or Spark version records its own. What a JVM maps is code, and a JVM that
maps a truncated archive dies of SIGBUS (measured with JDK 17), so:

* a JVM without an archive records one at its exit into `<key>.<random>.jsa.tmp` and logs
  "Written dynamic archive" to `<key>.<random>.log` once the file is whole; a later start
  renames a recording whose log says so to `<key>.<size>.jsa`. Nothing waits for the dump: the
  JVM writes it after the driver has exited;
* an archive is used only if it is a regular file of this user of the size its name says, in a
  directory that is this user's and writable by no one else; a JVM verifies its checksums as it
  maps it (`-XX:+VerifySharedSpaces`, about 0.1 s) and starts without it when they fail;
* a recording whose log never says it was written (a JVM killed mid-dump) is never used, and is
  removed after an hour.

The JVM's own notes about the archive (classes it cannot share) are kept off the terminal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "SPARKPOINT_JVM_CACHE"
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
ABANDONED_SECONDS = 3600  # a .tmp older than this was left by a JVM that died mid-dump


def cache_dir() -> Path | None:
    """Where archives are kept, or None when the user turned them off."""
    configured = os.environ.get(ENV, "").strip()
    if configured.lower() in ("off", "0", "false", "no", "none"):
        return None
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "sparkpoint" / "jvm"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return Path(os.path.realpath(found)) if found and os.path.exists(found) else None


def archive_key(spark_home: str | Path) -> str | None:
    """The JDK (its binary and its module image) and Spark (version, every jar by name and
    size): any change names another archive. None when no JVM can be found."""
    java = _java()
    if java is None:
        return None
    digest = hashlib.sha256(str(java).encode())
    for part in (java, java.parent.parent / "lib" / "modules"):
        try:
            st = part.stat()
        except OSError:
            continue
        digest.update(f"|{part}:{st.st_size}:{st.st_mtime_ns}".encode())
    jars = Path(spark_home) / "jars"
    try:
        for entry in sorted(os.scandir(jars), key=lambda e: e.name):
            digest.update(f"|{entry.name}:{entry.stat().st_size}".encode())
    except OSError:
        return None  # not a Spark we know how to key: no archive
    return digest.hexdigest()[:24]


def _private(directory: Path) -> bool:
    """The directory is a real directory of this user that no one else may write into."""
    try:
        st = directory.lstat()
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def usable_archive(directory: Path, key: str) -> Path | None:
    """`<key>.<size>.jsa` in `directory`: a regular file (not a link) of that size, or None."""
    pattern = re.compile(rf"^{re.escape(key)}\.(\d+)\.jsa$")
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return None
    for entry in entries:
        match = pattern.match(entry.name)
        if not match:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size == int(match.group(1)):
            return Path(entry.path)
    return None


_PLAIN_PATH = re.compile(r"^[\w./+@-]+$", re.ASCII)
WRITTEN = b"Written dynamic archive"  # what JDK 13+ logs (cds+dynamic=info) once the archive is whole


def _adopt_recording(directory: Path, key: str) -> Path | None:
    """Rename the first whole recording to `<key>.<size>.jsa`; drop recordings abandoned long ago."""
    now = time.time()
    adopted: Path | None = None
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not (entry.name.startswith(f"{key}.") and entry.name.endswith(".jsa.tmp")):
            continue
        record = Path(entry.path)
        record_log = record.with_name(record.name[: -len(".jsa.tmp")] + ".log")
        try:
            st = record.lstat()
            with open(record_log, "rb") as f:  # never a link: a recording's log is the JVM's own file
                whole = stat.S_ISREG(os.fstat(f.fileno()).st_mode) and WRITTEN in f.read(1 << 20)
            if adopted is None and whole and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                adopted = directory / f"{key}.{st.st_size}.jsa"
                os.replace(record, adopted)
                record_log.unlink(missing_ok=True)
            elif now - st.st_mtime > ABANDONED_SECONDS:
                record.unlink(missing_ok=True)
                record_log.unlink(missing_ok=True)
        except OSError:
            continue
    return adopted


class ClassArchive:
    """What the driver JVM of this process is told: map an archive, or record one at its exit."""

    def __init__(self, spark_home: str | Path) -> None:
        self.use: Path | None = None
        self.record: Path | None = None
        try:
            directory = cache_dir()
        except (RuntimeError, KeyError) as e:  # no home directory to put it in
            log.debug("no JVM class archive: %s", e)
            return
        key = archive_key(spark_home) if directory is not None else None
        if directory is None or key is None:
            return
        if not _PLAIN_PATH.match(str(directory)):
            # The JVM's option syntax has no quoting for these (spaces split extraJavaOptions,
            # ':' and ',' split -Xlog): an archive path with them would be read as something else.
            log.warning("not using JVM class archives in %r: set %s to a path of letters, digits and ./_-+@ only",
                        str(directory), ENV)
            return
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            log.debug("no JVM class archive: cannot create %s (%s)", directory, e)
            return
        if not _private(directory):
            log.warning("not using JVM class archives in %s: it is a link, not this user's, or writable by others",
                        directory)
            return
        self.use = usable_archive(directory, key) or _adopt_recording(directory, key)
        if self.use is None:
            self.record = directory / f"{key}.{uuid.uuid4().hex[:12]}.jsa.tmp"

    def java_options(self) -> str:
        """The driver JVM's options for it ("" when there is no cache)."""
        if self.use is not None:
            return f"-XX:SharedArchiveFile={self.use} -XX:+VerifySharedSpaces {QUIET}"
        if self.record is not None:
            record_log = self.record.with_name(self.record.name[: -len(".jsa.tmp")] + ".log")
            return (f"-XX:ArchiveClassesAtExit={self.record} {QUIET} "
                    f"-Xlog:cds+dynamic=info:file={record_log}::filecount=0")
        return ""
