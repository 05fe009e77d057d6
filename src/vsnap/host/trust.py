"""The image trust model: what root may act on, checked before anything runs.

An image holds process memory that root will run, and paths that root will write to. So root
restores, validates or replaces only what no one else could have chosen:

* the image directory, every file and directory in it, and every ancestor of it are owned by
  root (this process's user) and not writable by group or others (a root-owned sticky directory
  such as /tmp may be an ancestor: others cannot rename or remove what root put there);
* nothing in the image is a symlink, a device, a FIFO or a socket, and no file has a second name
  (a hard link) elsewhere;
* every path the manifest names is a plain relative path inside the image (no `..`, no absolute
  path, no empty part) and every name it asks vsnap to create elsewhere is one plain file name;
* the directories vsnap writes into (the control directory and its instances) have trusted
  ancestors too, and are created without following links.

Each refusal is one ImageUntrusted line naming the path and the reason.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Callable, Iterable

from vsnap.host.paths import PATH_MAX
from vsnap.protocol.errors import ImageUntrusted

DIRECTORY_HINT = ("a directory vsnap reads from or writes into, and its parents, must be root's alone: "
                  "chown root and chmod go-w it, or choose another directory")


def _owner_and_mode(path: Path, st: os.stat_result, what: str, hint: str = "") -> None:
    if st.st_uid != os.geteuid():
        raise ImageUntrusted(path, f"{what} is owned by uid {st.st_uid}, not by root (uid {os.geteuid()})", hint=hint)
    sticky_root_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o022 and not sticky_root_dir:
        raise ImageUntrusted(path, f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can write it",
                             hint=hint)


def require_trusted_ancestors(path: Path) -> None:
    """Every directory above ``path`` (and the real directories behind any link among them) is root's.

    Links among the ancestors are allowed only when root owns them (such as /var/run -> /run).
    """
    path = Path(os.path.abspath(path))
    for ancestor in reversed(path.parents):
        try:
            st = os.lstat(ancestor)
        except FileNotFoundError:
            return  # created by vsnap from here down, privately
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid != os.geteuid():
                raise ImageUntrusted(ancestor, f"is a symlink owned by uid {st.st_uid}; vsnap follows only root's links",
                                     hint=DIRECTORY_HINT)
            require_trusted_ancestors(Path(os.path.realpath(ancestor)) / "x")
            continue
        _owner_and_mode(ancestor, st, "a parent directory", DIRECTORY_HINT)


MAX_LINKS = 40  # like the kernel's own limit on links in one path


def _follow_roots_link(fd: int, step: int, part: str, st: os.stat_result, parts: list[str], links: int, *,
                       refuse: Callable[[int], Exception], too_many: Callable[[], Exception]
                       ) -> tuple[int | None, list[str], int]:
    """One link met while walking a path through directory fds (``step``: its O_PATH fd, closed
    here): refuse it unless root owns it, else splice its target into the parts still to walk.
    Returns (an fd of / where an absolute target restarts the walk, else None; parts; links seen).
    The walk's own ``fd`` is never closed here: the caller swaps the new one in first, then closes
    the old, so that an exception from a signal handler never leaves an fd to be closed twice."""
    try:
        if st.st_uid != os.geteuid():
            raise refuse(st.st_uid)
        links += 1
        if links > MAX_LINKS:
            raise too_many()
        target = os.readlink(part, dir_fd=fd)
    finally:
        os.close(step)
    if not target.startswith("/"):
        return None, list(Path(target).parts) + parts, links
    return os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), list(Path(target).parts[1:]) + parts, links


def make_trusted_dirs(path: Path) -> Path:
    """Create ``path`` and its missing ancestors, walking down through directory fds.

    ``mkdir -p`` by path is not safe as root: where an ancestor is missing under a directory others
    can write to (a sticky /tmp), another user may create it first, or put a link there, and the
    next mkdir would go through it. Here each component is made (0700) or found relative to the fd
    of its parent, opened without following links, and checked before the walk goes into it: a
    link is followed only if root owns it, and every directory must be root's and not writable by
    others (a root-owned sticky directory such as /tmp may be passed through).
    """
    path = Path(os.path.abspath(path))
    parts = list(path.parts[1:])
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    walked = Path("/")
    links = 0
    try:
        while parts:
            part = parts.pop(0)
            if part in ("", "."):
                continue
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise ImageUntrusted(walked / part, f"cannot be created: {exc.strerror}",
                                     hint="choose a directory under one that root owns") from None
            try:
                step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:  # removed or replaced between our mkdir and this open: someone is racing us
                raise ImageUntrusted(walked / part, f"changed while vsnap made it ({exc.strerror})",
                                     hint=DIRECTORY_HINT) from None
            st = os.fstat(step)
            if stat.S_ISLNK(st.st_mode):
                root, parts, links = _follow_roots_link(
                    fd, step, part, st, parts, links,
                    refuse=lambda uid: ImageUntrusted(walked / part, f"is a symlink owned by uid {uid}; vsnap follows "
                                                                     "only root's links", hint=DIRECTORY_HINT),
                    too_many=lambda: ImageUntrusted(path, "has too many levels of symbolic links"))
                if root is not None:
                    previous, fd, walked = fd, root, Path("/")
                    os.close(previous)
                continue
            if not stat.S_ISDIR(st.st_mode):
                os.close(step)
                raise ImageUntrusted(walked / part, "is not a directory", hint="remove it, or choose another directory")
            try:
                _owner_and_mode(walked / part, st, "a directory on the way" if parts else "the directory",
                                DIRECTORY_HINT)
            except ImageUntrusted:
                os.close(step)
                raise
            # the walk's fd moves on before the old one is closed: an exception from a signal
            # handler (vsnap serve's SIGTERM) between the two must not leave `finally` closing an
            # fd already closed (EBADF replaced the stop with a traceback)
            previous, fd, walked = fd, step, walked / part
            os.close(previous)
    finally:
        os.close(fd)
    return path


def is_private_dir(path: Path) -> bool:
    """A directory as vsnap makes its staging ones (mkdir 0700): real (not a link), root's, and
    private. Only such a directory at a name of vsnap's is taken as its own leftover."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def require_trusted_tree(root: Path) -> list[str]:
    """The image directory and everything in it: real directories and regular files, root's, not
    group/other-writable. Returns the files found (relative paths), for the manifest comparison."""
    require_trusted_ancestors(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise ImageUntrusted(root, "does not exist", hint="capture an image with `vsnap capture SPEC`") from None
    if stat.S_ISLNK(st.st_mode):
        raise ImageUntrusted(root, "is a symlink; an image directory must be a real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise ImageUntrusted(root, "is not a directory")
    _owner_and_mode(root, st, "the image directory")
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            entry = os.lstat(path)
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(entry.st_mode):
                raise ImageUntrusted(path, "is a symlink; nothing in an image may be a link")
            if stat.S_ISDIR(entry.st_mode):
                _owner_and_mode(path, entry, "a directory of the image")
            elif stat.S_ISREG(entry.st_mode):
                _owner_and_mode(path, entry, "a file of the image")
                if entry.st_nlink != 1:  # another name for it may lie where someone else can write
                    raise ImageUntrusted(path, f"has {entry.st_nlink} hard links; an image file must have one",
                                         hint="copy the image into a new directory (cp -r), do not link it")
                files.append(rel)
            else:
                raise ImageUntrusted(path, "is not a regular file or directory")
    return files


def require_inside(rel: str, what: str) -> str:
    """``rel`` is a plain relative path that stays inside the image."""
    pure = PurePosixPath(rel)
    if not rel or rel.startswith("/") or pure.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")) \
            or "\0" in rel:
        raise ImageUntrusted(rel, f"{what} names a path outside the image (only plain relative paths are allowed)",
                             hint="the manifest was altered; capture the image again")
    return rel


def require_plain_names(names: Iterable[str], what: str) -> None:
    """Each name is one file name: no directory part, no `..`."""
    for name in names:
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise ImageUntrusted(name, f"{what} must be plain file names",
                                 hint="the manifest was altered; capture the image again")


def _copy_data(src: int, dst: int, size: int) -> None:
    """Copy only the data regions (SEEK_DATA/SEEK_HOLE) and keep the holes: vLLM's shared-memory
    rings in /dev/shm are 400 MB files of which a few KB are written."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = os.lseek(src, start, os.SEEK_HOLE)
        os.lseek(dst, start, os.SEEK_SET)  # sendfile writes at the destination's own position
        position = start
        while position < end:
            sent = os.sendfile(dst, src, position, end - position)
            if sent == 0:
                break
            position += sent
        offset = end
    os.ftruncate(dst, size)


def copy_no_follow(source: Path, destination: Path) -> None:
    """Copy a regular file, following no link on either side, keeping its holes; the destination
    must not exist."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise ImageUntrusted(source, "is not a regular file")
        dst = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      stat.S_IMODE(st.st_mode) & 0o700)
        try:
            _copy_data(src, dst, st.st_size)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


MODEL_HINT = ("root loads the model and a restore relies on it staying as it was captured: "
              "chown -R root:root and chmod -R go-w it, or copy it into a directory of root's")


def untrusted_file(path: Path, checked: set[Path] | None = None) -> str | None:
    """Why root should not rely on this host file staying unchanged (not root's, writable by
    others, or below a directory others can write to), or None. ``checked`` caches ancestors."""
    given = Path(os.path.abspath(path))
    if checked is None or given.parent not in checked:  # the path as recorded: CRIU reopens it by that name
        try:
            require_trusted_ancestors(given)
        except ImageUntrusted as exc:
            return f"below {exc.path}: {exc.reason}"
    try:
        link = os.lstat(given)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
        return f"a symlink owned by uid {link.st_uid}"
    real = Path(os.path.realpath(given))
    try:
        st = os.stat(real)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"mode {stat.S_IMODE(st.st_mode):04o}: group or others can write it"
    parent = real.parent
    if checked is None or parent not in checked:
        try:
            require_trusted_ancestors(real)
        except ImageUntrusted as exc:
            return f"below {exc.path}: {exc.reason}"
        if checked is not None:
            checked.add(parent)
    if checked is not None:
        checked.add(given.parent)
    return None


# Never a model's files: a clone's history (its config may hold a token), caches of tools beside it.
# Left out of the dependencies and of `push --model`; still checked for trust like the rest.
NOT_MODEL_FILES = frozenset({".git", ".hg", ".svn", ".cache"})
# Pseudo file systems: a file there has no fixed bytes (/proc/self/pagemap reads 256 GiB)
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")


def _link_roots(model_dir: Path) -> tuple[Path, ...]:
    """Where a link in the real model directory may point: inside it, and for a folder of Hugging
    Face's cache (models--ORG--NAME/snapshots/REV/[SUB/]F -> ../../blobs/SHA) into that repository's
    blobs."""
    for folder in (model_dir, *model_dir.parents):
        repository = folder.parent.parent
        if folder.parent.name == "snapshots" and repository.name.startswith(("models--", "datasets--")):
            return model_dir, repository / "blobs"
    return (model_dir,)


def _is_hub_blob(real: Path) -> bool:
    """A file of Hugging Face's cache (models--ORG--NAME/blobs/SHA): where huggingface_hub 0.17 to
    0.22's `download --local-dir` links a model's files by default."""
    return (real.parent.name == "blobs" and real.parent.parent.name.startswith("models--")
            and len(real.name) in (40, 64) and all(c in "0123456789abcdef" for c in real.name))


def _inside(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _resolve_through_roots_links(path: Path) -> tuple[Path, os.stat_result]:
    """Where ``path`` leads and what is there, every link on the way root's (a link of another
    user's in the middle of a chain could be re-pointed after the check): walked one component at
    a time through fds (open_following_only_roots_links). ImageUntrusted or OSError."""
    fd = open_following_only_roots_links(path, os.O_PATH)
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}")), os.fstat(fd)
    finally:
        os.close(fd)


SHAPE_HINT = "remove or replace it: vsnap loads, hashes and pushes only the model's own regular files"


def _model_entry_problem(path: Path, roots: tuple[Path, ...], checked: set[Path], what: str) -> ImageUntrusted | None:
    """Why one entry of a model directory is not something root may load, hash and push: a name
    that is not UTF-8 or too long, not a regular file or a directory (a FIFO or device blocks or
    never ends), a link someone else owns or that leads out of the model (push would send what it
    points to: /etc/shadow), or a file that is not root's alone (untrusted_file)."""
    def refuse(reason: str, hint: str = SHAPE_HINT) -> ImageUntrusted:
        return ImageUntrusted(path, reason, hint=hint)
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        return refuse(f"is named in {what} directory with bytes that are not UTF-8")
    if len(str(path)) > PATH_MAX:  # a Dependency record's own limit
        return refuse(f"is a path in {what} directory longer than {PATH_MAX} characters")
    try:
        link = os.lstat(path)
    except OSError as exc:
        return refuse(f"in {what} directory cannot be read ({exc.strerror})")
    mode = link.st_mode
    if stat.S_ISLNK(mode):
        if link.st_uid != os.geteuid():
            return refuse(f"is a symlink owned by uid {link.st_uid} in {what} directory", MODEL_HINT)
        try:
            real, target = _resolve_through_roots_links(path)
        except ImageUntrusted as exc:
            return refuse(f"is a symlink in {what} directory that leads through a link root does not own "
                          f"({exc.reason})", MODEL_HINT)
        except OSError as exc:
            return refuse(f"is a symlink in {what} directory to {os.path.realpath(path)}, which cannot be read "
                          f"({exc.strerror})", "finish the download, or remove the link")
        mode = target.st_mode
        if stat.S_ISDIR(mode) and not _inside(real, roots[:1]):  # never walked: nothing under it is checked
            return refuse(f"is a symlink out of {what} directory, to the directory {real}")
        if not (_inside(real, roots) or _is_hub_blob(real)):
            return refuse(f"is a symlink out of {what} directory, to {real}")
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return refuse(f"in {what} directory is not a regular file or a directory (a FIFO, a device or a socket)")
    problem = untrusted_file(path, checked)
    return ImageUntrusted(path, f"a file of {what} is {problem}", hint=MODEL_HINT) if problem else None


def require_trusted_model(model_dir: Path, what: str = "the model") -> Path:
    """The model directory as given (every component: a link among them must be root's), its real
    directory, everything in it and what its links point to are root's alone, regular files or
    directories, and links lead nowhere outside it (_model_entry_problem). Returns the real path,
    the one a capture records and the engine reopens (never one someone else can re-point).
    ``what`` names it in the refusal (a LoRA adapter, a tokenizer: "the serve.tokenizer")."""
    try:
        require_trusted_ancestors(Path(model_dir) / "x")  # model_dir itself too, by lstat
    except OSError as exc:
        raise ImageUntrusted(model_dir, f"{what} directory cannot be read ({exc.strerror})", hint=MODEL_HINT) from None
    model_dir = Path(os.path.realpath(model_dir))
    if _inside(model_dir, (Path("/dev/shm"),)):
        raise ImageUntrusted(model_dir, f"{what} directory is in /dev/shm, which each engine tree replaces with "
                             "its own: the engine would not see it", hint="put it in a tmpfs mounted elsewhere "
                             "(mount -t tmpfs -o size=SIZE,huge=always none /mnt/models)")
    if _inside(model_dir, tuple(Path(root) for root in PSEUDO_ROOTS)):
        raise ImageUntrusted(model_dir, f"{what} directory is under {', '.join(PSEUDO_ROOTS)}, whose files have "
                             "no fixed bytes", hint="point it at a directory of model files")
    checked: set[Path] = set()
    problem = untrusted_file(model_dir, checked)
    if problem:
        raise ImageUntrusted(model_dir, f"{what} directory is {problem}", hint=MODEL_HINT)
    roots = _link_roots(model_dir)
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=False):
        for name in dirnames + filenames:
            refusal = _model_entry_problem(Path(dirpath) / name, roots, checked, what)
            if refusal:
                raise refusal
    return model_dir


def model_file_paths(model_dir: Path) -> list[Path]:
    """The files of a trusted model directory (require_trusted_model) that are the model's: every
    regular file, through root's links that stay inside it, but none named in NOT_MODEL_FILES at its
    top, nor under such a directory (a clone's .git, a download tool's .cache)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=False):
        if Path(dirpath) == Path(model_dir):  # a submodule's or worktree's .git is a file
            dirnames[:] = [d for d in dirnames if d not in NOT_MODEL_FILES]
            filenames = [f for f in filenames if f not in NOT_MODEL_FILES]
        files += [Path(dirpath) / name for name in filenames if (Path(dirpath) / name).is_file()]
    return sorted(files)


FILE_HINT = ("the engine reads it as root: chown root and chmod go-w it (and the directories above it), or copy it "
             "into a directory of root's")


def require_trusted_file(path: Path, what: str) -> Path:
    """One file the engine reads as root (a chat template, a TLS key): the path as given and the real
    file are root's alone (untrusted_file), and it is a regular file (not a FIFO or a device, which
    could block or never end). Returns the real path."""
    problem = untrusted_file(Path(path))
    if problem:
        raise ImageUntrusted(path, f"{what} {problem}" if problem.startswith("cannot") else f"{what} is {problem}",
                             hint=FILE_HINT)
    real = Path(os.path.realpath(path))
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise ImageUntrusted(path, f"{what} is not a regular file", hint="point it at a file")
    return real


def require_trusted_path(path: Path, what: str) -> Path:
    """A directory (every file in it: require_trusted_model) or a single file (require_trusted_file)."""
    if os.path.isdir(path):
        return require_trusted_model(path, what)
    return require_trusted_file(path, what)


def unreadable_by_others(path: Path) -> str | None:
    """Why a user other than root could not read ``path`` (its real file not readable by others, or
    a directory above it they cannot enter), or None. For a file whose text the engine hands to
    every HTTP client: naming one only root may read (/etc/shadow) would disclose it."""
    real = Path(os.path.realpath(path))
    mode = stat.S_IMODE(os.stat(real).st_mode)
    if not mode & stat.S_IROTH:
        return f"{real} has mode {mode:04o}: only root may read it"
    for directory in real.parents:
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if not mode & stat.S_IXOTH:
            return f"{directory} has mode {mode:04o}: others cannot reach {real}"
    return None


def untrusted_module(qualname: str, search_path: Iterable[str], roots: Iterable[str]) -> str | None:
    """Why importing the module of ``qualname`` (package.module.Class) in the engine could run code
    other than what root installed, or None. It is looked up as the import system would, without
    importing anything (a package's __init__ is code): the first match on ``search_path`` for each
    part must be a regular package or module with a file inside one of ``roots`` (root's
    site-packages), and that file, its cached bytecode and the directories above it root's alone. A
    namespace package (no __init__: its parts may lie anywhere on the path) is refused."""
    from importlib.machinery import PathFinder

    roots = list(roots)
    real_roots = [os.path.realpath(root) for root in roots]
    path: list[str] | None = [entry for entry in search_path if entry]
    name = ""
    for part in qualname.split(".")[:-1]:
        name = f"{name}.{part}" if name else part
        spec = PathFinder.find_spec(name, path)
        if spec is None or not spec.has_location or not spec.origin:
            return f"{name} is not a module or regular package on the engine's path"
        origin = os.path.realpath(spec.origin)
        if not any(origin.startswith(root + os.sep) for root in real_roots):
            return f"{name} is {spec.origin}, not a module installed in {', '.join(roots)}"
        cache = os.path.dirname(spec.cached) if spec.cached else None  # where a planted .pyc would be loaded from
        for file in (spec.origin, cache, spec.cached):
            problem = untrusted_file(Path(file)) if file and os.path.lexists(file) else None
            if problem:
                return f"{file} is {problem}"
        path = list(spec.submodule_search_locations or [])
    return None



def open_following_only_roots_links(path: Path, flags: int = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY) -> int:
    """Open ``path`` resolving it one component at a time through directory fds, following a
    symlink only if root owns it (a link of another user's, such as a spec that points at
    /etc/shadow, is refused). Nothing can be swapped in between: every step is relative to an fd
    already opened without following links. Raises ImageUntrusted, or OSError as os.open does."""
    parts = list(Path(os.path.abspath(path)).parts[1:])
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    try:
        while parts:
            part = parts.pop(0)
            step = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            st = os.fstat(step)
            if stat.S_ISLNK(st.st_mode):
                root, parts, links = _follow_roots_link(
                    fd, step, part, st, parts, links,
                    refuse=lambda uid: ImageUntrusted(path, f"is reached through a symlink ({part}) owned by uid {uid}; "
                                                            "vsnap follows only root's links",
                                                      hint="give the real path of a file you may read"),
                    too_many=lambda: OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path)))
                if root is not None:
                    previous, fd = fd, root
                    os.close(previous)
                continue
            previous, fd = fd, step  # as in make_trusted_dirs: never an fd closed twice
            os.close(previous)
        opened = os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)  # reopen the final O_PATH fd for reading
        return opened
    finally:
        os.close(fd)
