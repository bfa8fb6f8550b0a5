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
  links the largest recording whose log says so as `<key>.<size>.jsa`. Nothing waits for the dump
  (about 20 s here): the JVM writes it after the driver has exited, and its output passes through
  the driver, so a reader of the run's output (a pipe, a CI log) sees it end with the driver;
* an archive is used only if it is a regular file of this user of the size its name says, in a
  directory that is this user's and writable by no one else; a JVM verifies its checksums as it
  maps it (`-XX:+VerifySharedSpaces`, about 0.1 s) and starts without it when they fail;
* a recording whose log never says it was written (a JVM killed mid-dump) is never used, and is
  removed after an hour; whole recordings left once an archive exists (starts that recorded at
  the same time) are removed by the next start;
* each start marks the archive it maps as used (its mtime); the archives and recordings of another
  key (a JDK or Spark since upgraded, another installation sharing the cache) that no start has
  used for 30 days are removed, so upgrades do not pile up archives of some 150 MB each.

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
UNUSED_SECONDS = 30 * 86400  # another key's archive no start has mapped for this long goes
_OURS = re.compile(r"^[0-9a-f]{24}\.[0-9a-z]+\.(jsa|jsa\.tmp|log)$")  # what this module names files


def cache_dir() -> Path | None:
    """Where archives are kept, or None when the user turned them off."""
    configured = os.environ.get(ENV, "").strip()
    if configured.lower() in ("off", "0", "false", "no", "none"):
        return None
    if configured:
        return Path(configured).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "sparkpoint" / "jvm"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return Path(os.path.realpath(found)) if found and os.path.exists(found) else None


def archive_key(spark_home: str | Path) -> str | None:
    """The JDK (its binary and its module image) and Spark (where it is, every jar by name, size
    and mtime, as the JVM checks them when it maps an archive): any change names another
    archive. None when no JVM can be found."""
    java = _java()
    if java is None:
        return None
    home = os.path.realpath(spark_home)
    digest = hashlib.sha256(f"{java}|{home}".encode())
    for part in (java, java.parent.parent / "lib" / "modules"):
        try:
            st = part.stat()
        except OSError:
            continue
        digest.update(f"|{part}:{st.st_size}:{st.st_mtime_ns}".encode())
    try:
        for entry in sorted(os.scandir(Path(home) / "jars"), key=lambda e: e.name):
            st = entry.stat()
            digest.update(f"|{entry.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        return None  # not a Spark we know how to key: no archive
    return digest.hexdigest()[:24]


def spark_conf_dir(spark_home: str | Path) -> Path:
    """The directory Spark reads `spark-defaults.conf` from, and puts first on the class path."""
    return Path(os.environ.get("SPARK_CONF_DIR") or Path(spark_home) / "conf")


def can_record(spark_home: str | Path) -> bool:
    """JDK 17 will not record an archive when a non-empty directory is on the class path, and
    Spark puts its conf directory first (a Spark distribution ships templates in it; pip's
    pyspark has none): such a JVM would pay for a recording it never writes."""
    try:
        return not any(os.scandir(spark_conf_dir(spark_home)))
    except OSError:
        return True  # no conf directory: nothing on the class path to refuse


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


_PLAIN_PATH = re.compile(r"[\w./+@-]+", re.ASCII)
WRITTEN = b"Written dynamic archive"  # what JDK 13+ logs (cds+dynamic=info) once the archive is whole


def _log_of(record: Path) -> Path:
    return record.with_name(record.name[: -len(".jsa.tmp")] + ".log")


def _logged_whole(record_log: Path) -> bool:
    try:  # never through a link, never blocking on a FIFO planted there
        fd = os.open(record_log, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return stat.S_ISREG(os.fstat(fd).st_mode) and WRITTEN in f.read(1 << 20)


def _tidy(directory: Path, key: str, *, adopt: bool) -> Path | None:
    """With `adopt`, make the largest whole recording `<key>.<size>.jsa` (the one that saw the
    most of Spark's classes). Whole recordings left over once an archive exists, and anything of a
    recording older than an hour (a JVM killed mid-dump, one that refused to record), go."""
    now = time.time()
    whole: list[tuple[int, Path]] = []
    for entry in list(os.scandir(directory)):
        if not entry.name.startswith(f"{key}.") or not entry.name.endswith((".jsa.tmp", ".log")):
            continue
        path = Path(entry.path)
        try:
            st = path.lstat()
        except OSError:
            continue
        if entry.name.endswith(".jsa.tmp") and stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() \
                and _logged_whole(_log_of(path)):
            whole.append((st.st_size, path))
        elif now - st.st_mtime > ABANDONED_SECONDS:
            path.unlink(missing_ok=True)
    adopted: Path | None = None
    for size, record in sorted(whole, reverse=True):
        if adopt and adopted is None:
            target = directory / f"{key}.{size}.jsa"
            try:
                # A link, not a rename: never replaces an archive a JVM on another host has mapped.
                os.link(record, target)
                adopted = target
            except FileExistsError:
                adopted = usable_archive(directory, key)
            except OSError:
                continue
        record.unlink(missing_ok=True)
        _log_of(record).unlink(missing_ok=True)
    return adopted


def _forget_unused(directory: Path, key: str) -> list[str]:
    """Remove the files of other keys (archives, recordings, their logs) that are this user's,
    named as this module names them, and untouched for `UNUSED_SECONDS`; their names."""
    now = time.time()
    removed = []
    for entry in list(os.scandir(directory)):
        if entry.name.startswith(f"{key}.") or not _OURS.match(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not (stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and now - st.st_mtime > UNUSED_SECONDS):
                continue
            # Looked at again just before: a start of that installation may have marked it used
            # since (one that maps it in the instant between starts without it, and records anew).
            if now - os.lstat(entry.path).st_mtime > UNUSED_SECONDS:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:  # gone already, or not ours to remove
            continue
    return removed


def _mark_used(archive: Path) -> None:
    try:
        os.utime(archive)
    except OSError:  # a read-only cache: the archive is still mapped, only never counted as used
        pass


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
        if not _PLAIN_PATH.fullmatch(str(directory)):
            # The JVM's option syntax has no quoting for these (spaces split extraJavaOptions,
            # ':' and ',' split -Xlog): an archive path with them would be read as something else.
            # Said at info: a home directory with a space is the user's, not a fault to repeat each run.
            log.info("not using JVM class archives in %r: set %s to a path of letters, digits and ./_-+@ only",
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
        try:
            self.use = usable_archive(directory, key)
            adopted = _tidy(directory, key, adopt=self.use is None)
            self.use = self.use or adopted
            if self.use is not None:
                _mark_used(self.use)
            if removed := _forget_unused(directory, key):
                log.info("removed JVM class archives no start has used for 30 days: %s", ", ".join(removed))
        except OSError as e:  # the directory went away under us, or cannot be listed
            log.debug("no JVM class archive in %s: %s", directory, e)
            return
        if self.use is None and can_record(spark_home):
            self.record = directory / f"{key}.{uuid.uuid4().hex[:12]}.jsa.tmp"

    def java_options(self) -> str:
        """The driver JVM's options for it ("" when there is no cache)."""
        if self.use is not None:
            return f"-XX:SharedArchiveFile={self.use} -XX:+VerifySharedSpaces {QUIET}"
        if self.record is not None:
            return (f"-XX:ArchiveClassesAtExit={self.record} {QUIET} "
                    f"-Xlog:cds+dynamic=info:file={_log_of(self.record)}::filecount=0")
        return ""
