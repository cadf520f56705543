"""`workdir:` the directory shipped with a job: which files, their content hash, the archive.

A pure reading of the tree (no clock, no randomness; git is asked, never changed):

- `snapshot(job)` walks `workdir.dir` (relative to the job file) and returns a `Snapshot`: the
  files that ship, sorted, each with its mode (0644, or 0755 when executable, as git keeps it),
  size and sha256; symlinks that stay inside the tree as links (relative), none that leave it.
  Left out: `.git/`, ddpkit's own outputs (`own_outputs`), what the tree's `.gitignore` files say (each for its own directory, as
  git reads them, through `pathspec`), then `workdir.exclude` (the job file's, last, so it can
  re-include). Its `digest` is the content hash, a sha256 over every file's path, mode, size
  and bytes in path order: the same tree gives the same hash wherever it lies and whenever it
  was touched; `git` is the commit and a dirty flag when the tree is inside a git work tree.
- `problems(job)` is what is wrong with the tree (deploy/problems.py: `ddpkit validate`, render
  and submit report the same lines, nothing shipped): no such directory, over `max_size`, a
  symlink out of the tree, a file that is not one, a `script:` that is not in the snapshot.
- `Snapshot.image(repository, base)` is the tag of the tree as a thin image layer on `base`
  (`workdir.image`: deploy/image.py `build_workdir_image` builds it at submit).
- `Snapshot.archive()` is a deterministic tar.gz of it (sorted, fixed times and owners): the
  same bytes for the same hash. `Snapshot.write(parent)` copies it to `parent/NAME-workdir-HASH`
  (content-addressed, made whole by a rename: a job, a requeue, a second submit of the same
  tree find it complete or not at all). Both check every file's bytes against the hash while
  reading them: a file edited between the hash and the copy stops the shipping.

Renderers put the hash in what they render (a render is a function of the job file and the
tree); the targets' submit, `run --local` and `run --docker` do the shipping.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from deploy.errors import RuntimeFailure
from deploy.problems import Problem, refuse
from trainer.contract import WORKDIR_COMMIT_VAR, WORKDIR_DIRTY_VAR, WORKDIR_HASH_VAR

if TYPE_CHECKING:
    from deploy.spec import JobSpec

#: Never shipped, whatever the patterns say: git's own database.
ALWAYS_LEFT_OUT = (".git",)
IGNORE_FILE = ".gitignore"
#: The time and owner of every archive entry (the archive depends on the content only).
ARCHIVE_MTIME = 946684800  # 2000-01-01T00:00:00Z
#: Where a Kubernetes object says which tree it carries (the full sha256).
HASH_ANNOTATION = "ddpkit.io/workdir-sha256"
#: The hash as it is shown and named: `sha256:` + the first SHORT hex digits.
SHORT = 12
LARGEST_SHOWN = 3


@dataclass(frozen=True)
class File:
    """One entry of the snapshot: a regular file, or a symlink (`link`: its relative target)."""

    path: str  # POSIX, relative to the root
    mode: int  # 0o644 or 0o755; 0o777 for a symlink
    size: int
    sha256: str  # of the bytes, or of the link's target
    link: str | None = None


@dataclass(frozen=True)
class Git:
    """The git work tree the directory is in: HEAD (None before the first commit) and whether
    the shipped files differ from it (changes or untracked files under the directory)."""

    commit: str | None
    dirty: bool

    def __str__(self) -> str:
        return f"git {self.commit[:SHORT] if self.commit else '(no commit)'}{' (dirty)' if self.dirty else ''}"


@dataclass(frozen=True)
class Snapshot:
    """What `workdir:` ships: the files of the tree at `root`, their hash and git's state."""

    root: Path
    files: tuple[File, ...]
    digest: str  # sha256 hex of the tree
    git: Git | None

    @property
    def size(self) -> int:
        """Bytes of the files (before compression)."""
        return sum(f.size for f in self.files if f.link is None)

    @property
    def short(self) -> str:
        return self.digest[:SHORT]

    def dir_name(self, job_name: str) -> str:
        """Where a copy of it lives, beside a job's logs or run directory."""
        return f"{job_name}-workdir-{self.short}"

    def image(self, repository: str, base: str) -> str:
        """The tag of the tree as a thin layer FROM `base` (`workdir.image`): the content hash of
        both, so a changed tree or another base image is another tag."""
        both = hashlib.sha256(f"{base}\0{self.digest}".encode()).hexdigest()
        return f"{repository}:workdir-{both[:SHORT]}"

    def describe(self) -> str:
        """`sha256:HASH, N files, SIZE[, git COMMIT (dirty)]`: what --dry-run and the logs say."""
        git = f", {self.git}" if self.git else ""
        return f"sha256:{self.short}, {len(self.files)} files, {human(self.size)}{git}"

    def read(self, entry: File) -> bytes:
        """The bytes of `entry` as they are now, checked against the hash."""
        path = self.root / entry.path
        if entry.link is not None:
            data = os.readlink(path).encode()
            now = _relative_link(self.root, path, data.decode())
            data = (now or "").encode()
        else:
            data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise RuntimeFailure(f"workdir {self.root}: {entry.path} changed while it was being "
                                 "shipped; nothing was shipped, submit again")
        return data

    def archive(self) -> bytes:
        """A deterministic tar.gz of the snapshot (cached: the same bytes for the same hash)."""
        cached = _ARCHIVES.get((self.root, self.digest))
        if cached is not None:
            return cached
        import gzip  # here: `render` and `validate` of a job without a workdir never need them
        import tarfile

        raw = io.BytesIO()
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in self.files:
                data = self.read(entry)
                info = tarfile.TarInfo(entry.path)
                info.mtime, info.uid, info.gid, info.uname, info.gname = ARCHIVE_MTIME, 0, 0, "", ""
                if entry.link is not None:
                    info.type, info.linkname, info.mode = tarfile.SYMTYPE, data.decode(), 0o777
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(data), entry.mode
                    tar.addfile(info, io.BytesIO(data))
        _ARCHIVES[(self.root, self.digest)] = out = raw.getvalue()
        return out

    def write(self, parent: Path, job_name: str) -> tuple[Path, bool]:
        """Copy the snapshot to `parent/<job>-workdir-<hash>`; (that path, whether it was
        written now: False when a copy of the same hash was already there)."""
        dest = parent / self.dir_name(job_name)
        if dest.is_dir():
            return dest, False
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{dest.name}."))
        try:
            for entry in self.files:
                data = self.read(entry)
                path = tmp / entry.path
                path.parent.mkdir(parents=True, exist_ok=True)
                if entry.link is not None:
                    os.symlink(data.decode(), path)
                else:
                    path.write_bytes(data)
                    path.chmod(entry.mode)
            tmp.chmod(0o755)
            try:
                tmp.rename(dest)
            except OSError:
                if not dest.is_dir():  # not another submit's copy of the same tree: a failure
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return dest, False
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest, True


def record_env(snap: Snapshot) -> dict[str, str]:
    """The variables that tell the launcher what it runs (trainer/contract.py), for its records."""
    env = {WORKDIR_HASH_VAR: snap.digest}
    if snap.git is not None:
        if snap.git.commit:
            env[WORKDIR_COMMIT_VAR] = snap.git.commit
        env[WORKDIR_DIRTY_VAR] = "1" if snap.git.dirty else "0"
    return env


_ARCHIVES: dict[tuple[Path, str], bytes] = {}
#: sha256 of a file already read in this process, by what stat says of it (git's index trick):
#: a tree read for check, render and submit is hashed once.
_DIGESTS: dict[tuple, str] = {}


def human(size: int) -> str:
    """Bytes as people read them: 812 B, 4.2 KiB, 51.0 MiB."""
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"


def root_of(job: JobSpec) -> Path:
    """The directory `workdir.dir` names (relative to the job file), absolute."""
    assert job.workdir is not None
    return (job.base_dir / job.workdir.dir).absolute()


class _Ignore:
    """The patterns that leave files out: each `.gitignore` for its own directory (the deeper
    one decides), then the job's `workdir.exclude` from the root (last word)."""

    def __init__(self, exclude: list[str]):
        import pathspec  # only jobs with a workdir read patterns

        self._pathspec = pathspec
        self._files: dict[str, object] = {}
        self._job = pathspec.GitIgnoreSpec.from_lines(exclude)

    def read(self, rel_dir: str, directory: Path) -> None:
        try:
            lines = (directory / IGNORE_FILE).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return
        self._files[rel_dir] = self._pathspec.GitIgnoreSpec.from_lines(lines)

    def left_out(self, rel: str, is_dir: bool) -> bool:
        if PurePosixPath(rel).name in ALWAYS_LEFT_OUT:
            return True
        verdict = None
        parts = rel.split("/")
        for depth in range(len(parts)):
            base = "/".join(parts[:depth])
            spec = self._files.get(base)
            if spec is not None:
                sub = "/".join(parts[depth:]) + ("/" if is_dir else "")
                found = spec.check_file(sub).include
                verdict = found if found is not None else verdict
        found = self._job.check_file(rel + ("/" if is_dir else "")).include
        return bool(found if found is not None else verdict)


def _relative_link(root: Path, path: Path, target: str) -> str | None:
    """A symlink's target as a path relative to the link, when it stays inside `root`."""
    resolved = Path(os.path.normpath(path.parent / target)) if not os.path.isabs(target) else Path(target)
    try:
        resolved = resolved.resolve()
        resolved.relative_to(root.resolve())
    except (ValueError, OSError, RuntimeError):
        return None
    return os.path.relpath(resolved, path.parent.resolve())


def _digest(path: Path, st: os.stat_result) -> str:
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    found = _DIGESTS.get(key)
    if found is None:
        sha = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                sha.update(block)
        found = _DIGESTS[key] = sha.hexdigest()
    return found


def own_outputs(job: JobSpec) -> set[Path]:
    """Where ddpkit itself writes, seen from the current directory (the submit directory):
    the Slurm logs (and the snapshots beside them) and the run directories. Never shipped, so
    that a tree holding them (`workdir: .` beside the job file) hashes the same after a run."""
    return {Path(job.slurm.log_dir).absolute(), Path(job.train.output_dir).absolute()}


def _walk(root: Path, exclude: list[str], max_bytes: int, outputs: set[Path] = frozenset()) \
        -> tuple[list[tuple[str, Path, os.stat_result, str | None]], list[Problem]]:
    """(path, absolute path, stat, link target) of every entry that ships, unhashed; and the
    problems of the tree (a symlink out of it, something that is no file)."""
    ignore = _Ignore(exclude)
    found, problems = [], []
    for directory, dirs, names in os.walk(root, topdown=True, followlinks=False):
        here = Path(directory)
        rel_dir = here.relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        ignore.read(rel_dir, here)
        kept = []
        for name in sorted(dirs):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if ignore.left_out(rel, True) or here / name in outputs:
                continue
            if (here / name).is_symlink():
                names.append(name)  # a link to a directory ships as a link
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            path = here / name
            st = path.lstat()
            if ignore.left_out(rel, stat.S_ISDIR(st.st_mode)):
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                inside = _relative_link(root, path, target)
                if inside is None:
                    problems.append(Problem("workdir.dir", f"{rel} is a symlink to {target}, outside "
                                            f"the tree {root}: the nodes would not have it",
                                            f"copy what it points to into the tree, or leave it out "
                                            f"(workdir.exclude: [{rel}])"))
                    continue
                found.append((rel, path, st, inside))
            elif stat.S_ISREG(st.st_mode):
                found.append((rel, path, st, None))
            else:
                problems.append(Problem("workdir.dir", f"{rel} is not a regular file (a socket, "
                                        "pipe or device cannot be shipped)",
                                        f"leave it out (workdir.exclude: [{rel}])"))
    found.sort(key=lambda item: item[0])  # one order whatever the walk's: by path
    size = sum(st.st_size for _, _, st, link in found if link is None)
    if size > max_bytes:
        largest = sorted(((st.st_size, rel) for rel, _, st, link in found if link is None), reverse=True)
        shown = ", ".join(f"{rel} ({human(n)})" for n, rel in largest[:LARGEST_SHOWN])
        problems.append(Problem("workdir.max_size", f"the tree {root} holds {human(size)} in "
                                f"{len(found)} files, over {human(max_bytes)}; the largest: {shown}",
                                "leave out what the job does not need (workdir.exclude, or "
                                ".gitignore) or raise workdir.max_size"))
    return found, problems


def git_state(root: Path) -> Git | None:
    """The commit and dirty flag of the git work tree holding `root`; None outside one (or
    without git)."""
    import subprocess  # here: `render` and `validate` of a job without a workdir never need it

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})

    try:
        inside = git("rev-parse", "--is-inside-work-tree")
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return None
        head = git("rev-parse", "--verify", "--quiet", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=normal", "--", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip() if head.returncode == 0 else None
    return Git(commit, bool(status.stdout.strip()) or commit is None)


def _tree_problems(job: JobSpec) -> tuple[Path, list, list[Problem]]:
    workdir = job.workdir
    root = root_of(job)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "no such directory"
        return root, [], [Problem("workdir.dir", f"{root}: {what}",
                                  f"give a directory relative to the job file's ({job.base_dir.absolute()})")]
    found, problems = _walk(root, list(workdir.exclude), workdir.max_bytes, own_outputs(job))
    if job.script is not None and not problems:
        script = os.path.normpath(job.script).replace(os.sep, "/")
        if not any(rel == script for rel, *_ in found):
            why = ("is left out by .gitignore or workdir.exclude" if (root / script).is_file()
                   else "no such file")
            problems.append(Problem("script", f"{job.script}: {why} in workdir {root}",
                                    "give the path of a file in the tree, relative to workdir.dir"))
    return root, found, problems


def image_of(job: JobSpec) -> str | None:
    """The thin image the job's tree ships in (`workdir.image`), None where it ships otherwise."""
    if job.workdir is None or job.workdir.image is None:
        return None
    return snapshot(job).image(job.workdir.image, job.image)


def problems(job: JobSpec) -> list[Problem]:
    """What is wrong with the job's tree (none without a workdir); reads no file's bytes."""
    if job.workdir is None:
        return []
    return _tree_problems(job)[2]


def snapshot(job: JobSpec) -> Snapshot | None:
    """The job's workdir as it is now (None without one); UserError with every problem."""
    if job.workdir is None:
        return None
    root, found, found_problems = _tree_problems(job)
    refuse(job, found_problems)
    files = []
    tree = hashlib.sha256()
    for rel, path, st, link in found:
        if link is not None:
            data = link.encode()
            entry = File(rel, 0o777, len(data), hashlib.sha256(data).hexdigest(), link)
        else:
            mode = 0o755 if st.st_mode & 0o111 else 0o644
            entry = File(rel, mode, st.st_size, _digest(path, st))
        files.append(entry)
        tree.update(f"{entry.mode:o}\0{entry.size}\0{entry.sha256}\0{entry.path}\0".encode())
    return Snapshot(root, tuple(files), tree.hexdigest(), git_state(root))
