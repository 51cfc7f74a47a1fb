"""Run model-written Python in a separate, limited process: the sandbox of a Python tool.

Model-written code is hostile input. `run_python(code)` starts a fresh `python -I` (not a fork of the trainer) in its
own session, with its cwd a new temporary folder (removed afterwards) and an environment holding only PATH,
HOME/TMPDIR (the folder) and the locale. It returns plain data (`SandboxResult`, picklable for Ray actors); a call
that breaches a limit gets a status and a `[sandbox: ...]` line in its output, it never hangs the caller. The
bootstrap forks twice: the code runs as pid 2 of a PID namespace of its own, whose pid 1 reaps it and reports how it
ended. The layers, measured on Linux 6.18 as root in a container (tests/episodes/test_sandbox.py, as an attacker would):

- wall clock: the parent reads with a deadline and SIGKILLs the whole process group on expiry;
- rlimits, set in the child before the code runs (hard limits, so the code cannot raise them): RLIMIT_CPU
  (SIGXCPU at the wall clock limit rounded up + 1 s, SIGKILL a second later), RLIMIT_AS (an allocation past it
  is a MemoryError, the machine is untouched; it also bounds threads: 14 under 512 MB, measured), RLIMIT_FSIZE
  (a bigger file write is OSError EFBIG), RLIMIT_NOFILE, RLIMIT_CORE=0.
  RLIMIT_NPROC is not used: the kernel exempts uid 0 from it and for other users it counts every process and thread
  of the user (trainer, Ray, vLLM); the PID namespace is what bounds the processes' lifetime;
- output: at most `max_output_bytes` are kept; past that the process group is killed (a flood costs no memory);
- namespaces (kernel; with CLONE_NEWUSER where they need privilege): network (no interface but a down loopback:
  connect, bind and DNS fail whatever the code does); PID (no other process has a pid there, and when the code's
  pid 1 ends, the kernel kills what is left: a child that leaves the process group with os.setsid, which is not
  audited, dies with the call too); mount (the folder is a tmpfs of `FOLDER_LIMIT` bytes, in memory, gone with the
  call: writing past it is ENOSPC, the disk is untouched);
- an unprivileged uid, where the trainer runs as root (many containers): after the namespaces are set up the code
  drops to uid and gid 65534 (nobody), no supplementary group and no capability, so file modes protect again and
  no signal reaches a process of root's. The interpreter may live under a home only root can search (pyenv under
  /root, mode 700): in the sandbox's mount namespace such a directory is a tmpfs holding only the readable paths,
  bound back in (`_reachable`). A trainer that is not root runs the code as its own user in a user namespace;
- Landlock (kernel >= 5.13), for the process and every child: reads and execution only beneath the folder, the
  interpreter's prefixes and site-packages, the system's libraries and a few device and CPU files
  (`readable_paths`), and its own /proc entry: no other process's environ (where the trainer's API keys are), no
  token, run directory, home or data of the trainer's user, whatever the file modes; file creation, writing,
  removal and renaming only in the folder; ABI >= 4 also refuses TCP bind/connect, ABI >= 6 signals to processes
  outside the sandbox;
- an audit hook (sys.addaudithook) installed just before the code: refuses sockets, DNS, subprocess, os.system,
  os.exec*/spawn*/fork, os.kill, ctypes library and symbol loading (importing ctypes stays allowed: numpy needs
  it), and writes or removals outside the folder, each with a clear error. It is defence in depth, not a
  boundary: Python code can reach around it (patching the modules it calls, as tests/episodes/test_sandbox.py does to
  start a child, `_posixsubprocess`, ctypes.memmove), so the kernel layers above are what hold.
With `strict=True` (the default) a kernel layer that cannot be set up fails the call with RunError (never a
silent fallback); `strict=False` runs with the layers that work. Not limited: CPU time of processes started by
reaching around the hook beyond their own RLIMIT_CPU (they die with the call), and reads of the system's libraries
and the interpreter's installation (nothing of the run's is there).
"""
import dataclasses
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from torchrl_grpo.core.errors import RunError

FILE_SIZE_LIMIT = 16 << 20  # bytes per file the code may write
FOLDER_LIMIT = 64 << 20  # bytes the code may write in all (its folder: a tmpfs, in memory)
OPEN_FILES_LIMIT = 256
MEMORY_EXIT = 120  # the child's exit code for a MemoryError
READY = b"\0"  # the child's first output byte once its layers are set up, before the code runs


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    output: str  # stdout and stderr interleaved, capped, with a "[sandbox: ...]" line when a limit hit
    status: str  # "ok", "error", "timeout", "memory" or "output_truncated"
    exit_code: int | None  # the process's code (negative: killed by that signal); None if killed by the sandbox
    seconds: float  # wall clock of the whole call


# The child's bootstrap (run as `python -c`): limits, namespaces, uid, Landlock, audit hook, then the code.
# argv: folder, memory bytes, CPU seconds, file size bytes, open files, strict (0/1), folder bytes, then the paths it
# may read. The process that runs the code is the third: bootstrap -> pid 1 of its PID namespace -> the code.
_BOOT = r'''
import os, sys, resource, signal, traceback
def _contain():
    """Fork twice; return in the code's process, pid 2 of the new PID namespace (pid 1 ignores default-action
    signals, such as RLIMIT_CPU's). Pid 1 reaps, reports the code's wait status, and ends, which kills whatever is
    left in the namespace; the bootstrap then ends as the code did."""
    r, w = os.pipe()
    if (init := os.fork()) != 0:
        os.close(w)
        os.waitpid(init, 0)
        status = int(os.read(r, 32) or b"256")
        if os.WIFSIGNALED(status):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
            os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(os.WEXITSTATUS(status))
    os.close(r)
    if (code := os.fork()) != 0:
        while (ended := os.wait())[0] != code:
            pass
        os.write(w, str(ended[1]).encode())
        os._exit(0)
    os.close(w)
NOBODY = 65534
def _reachable(libc, paths):
    """Let uid NOBODY reach `paths`: over each directory it could not search above them (a home of mode 700 holding
    the interpreter), mount a tmpfs of mode 755 with only those paths bound back in; the rest of it is gone."""
    hidden = {}
    for path in paths:
        parts = path.split("/")
        for i in range(2, len(parts)):
            if not os.stat(above := "/".join(parts[:i])).st_mode & 0o001:
                hidden.setdefault(above, []).append(path)
                break
    for above, inner in hidden.items():
        inner = [p for p in inner if not any(p.startswith(q + "/") for q in inner)]
        kept = [(p, os.open(p, os.O_PATH)) for p in inner]  # before the tmpfs hides them
        if libc.mount(b"tmpfs", above.encode(), b"tmpfs", 0x2 | 0x4, b"size=1m,mode=755") != 0:
            return False
        for path, fd in kept:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
                open(path, "a").close()
            if libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, 0x1000 | 0x4000, None) != 0:
                return False  # MS_BIND | MS_REC
            os.close(fd)
    return True
def _setup():
    root, (mem, cpu, fsize, nofile, strict, disk) = sys.argv[1], map(int, sys.argv[2:8])
    readable = sys.argv[8:]
    for lim, soft, hard in ((resource.RLIMIT_AS, mem, mem), (resource.RLIMIT_CPU, cpu, cpu + 1),
                            (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                            (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(lim, (soft, hard))
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def fail(layer):
        if strict:
            sys.stderr.write(f"{layer}: {os.strerror(ctypes.get_errno())}\n")
            os._exit(1)
    source = open("snippet.py").read()
    # namespaces: network (no interface up), PID (nothing it starts outlives it), mount (its folder a bounded tmpfs)
    privileged = libc.unshare(0x40000000 | 0x20000000 | 0x00020000) == 0  # NEWNET | NEWPID | NEWNS
    if not privileged:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(0x40000000 | 0x20000000 | 0x00020000 | 0x10000000) == 0:  # | NEWUSER: no privilege needed
            for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(line)
        else:
            fail("namespaces (unshare CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS)")
    _contain()
    drop = privileged and os.getuid() == 0  # root: the code runs as nobody
    owner = f",uid={NOBODY},gid={NOBODY}" if drop else ""
    if (libc.mount(None, b"/", None, 0x40000 | 0x4000, None) != 0  # MS_REC | MS_PRIVATE: nothing propagates out
            or libc.mount(b"tmpfs", root.encode(), b"tmpfs", 0x2 | 0x4, f"size={disk},mode=700{owner}".encode())):
        fail(f"a tmpfs of {disk >> 20} MiB on the folder (mount)")  # MS_NOSUID | MS_NODEV
    os.chdir(root)
    with open("snippet.py", "w") as f:
        f.write(source)
    if drop and not _reachable(libc, [*readable, root]):
        fail(f"a view of the readable paths for uid {NOBODY} (mount)")
    elif drop:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)  # every capability goes with uid 0
        libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its own /proc entry stays readable to it
    readable.append(os.path.join("/proc", os.readlink("/proc/self")))  # its own /proc entry, no other process's
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
    if abi < 1:
        fail("Landlock (kernel >= 5.13 with landlock in its LSM list)")
    else:
        read = 0b1101  # execute, read a file, read a directory
        fs = read | 0b1_1111_1111_0010 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)  # + writes
        net = 0b11 if abi >= 4 else 0  # TCP bind, connect
        scoped = 0b11 if abi >= 6 else 0  # abstract unix sockets, signals
        attr = (ctypes.c_uint64 * 3)(fs, net, scoped)
        size = 24 if abi >= 6 else 16 if abi >= 4 else 8
        ruleset = libc.syscall(444, ctypes.byref(attr), size, 0)
        def allow(path, rights):  # landlock_add_rule(PATH_BENEATH): rights on path and everything below it
            if not os.path.isdir(path):  # a file takes file rights only: execute, write, read, truncate
                rights &= 0b111 | (1 << 14)
            beneath = ctypes.create_string_buffer(rights.to_bytes(8, "little") +
                                                  os.open(path, os.O_PATH).to_bytes(4, "little"), 12)
            return libc.syscall(445, ruleset, 1, beneath, 0) == 0
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        if (ruleset < 0 or not allow(root, fs) or not all(allow(p, read) for p in readable)
                or libc.syscall(446, ruleset, 0) != 0):
            fail("Landlock ruleset")
    refused = ("socket.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
               "subprocess.", "os.kill", "gc.get_", "sys._current_frames", "ctypes.dlsym", "ctypes.call_function",
               "ctypes.cdata", "ctypes.string_at", "ctypes.wstring_at")  # importing ctypes stays allowed: numpy
    paths = ("open", "os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.symlink", "os.link", "os.chmod",
             "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "os.setxattr", "os.removexattr")
    write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    def inside(path):
        path = os.path.realpath(os.fsdecode(path))
        return path == root or path.startswith(root + os.sep)
    def hook(event, args):
        if event.startswith(refused) or event == "ctypes.dlopen" and args[0] is not None:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "object.__setattr__" and args[1] == "__code__":
            raise PermissionError("sandbox: replacing a function's code is not allowed")
        if event in paths:
            flags, mode = args[2], args[1] or ""
            if event == "open" and not (flags & write if isinstance(flags, int) else set(mode) & set("wax+")):
                return  # reading
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"sandbox: {event} outside the working folder is not allowed: {arg!r}")
    sys.addaudithook(hook)
_setup()
del _setup
os.write(1, b"\0")
sys.argv = ["snippet.py"]
with open("snippet.py") as f:
    _code = compile(f.read(), "snippet.py", "exec")
try:
    exec(_code, {"__name__": "__main__", "__file__": "snippet.py", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as err:
    traceback.print_exception(type(err), err, err.__traceback__.tb_next)
    os._exit(''' + str(MEMORY_EXIT) + r''' if isinstance(err, MemoryError) else 1)
'''


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 16384,
               strict: bool = True) -> SandboxResult:
    """Run `code` in the sandbox and return its output and status. Never raises for what the code does; raises
    RunError when the sandbox itself cannot start (a kernel layer missing under `strict`, python not starting)."""
    start = time.monotonic()
    deadline = start + timeout_s
    folder = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-"))
    try:
        with open(os.path.join(folder, "snippet.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        argv = [sys.executable, "-I", "-u", "-B", "-X", "utf8", "-c", _BOOT, folder, str(memory_mb << 20),
                str(_cpu_limit(timeout_s)), str(FILE_SIZE_LIMIT), str(OPEN_FILES_LIMIT), str(int(strict)),
                str(FOLDER_LIMIT), *readable_paths()]
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        output, ending = _read_capped(proc, deadline, max_output_bytes + len(READY))
        if ending == "eof" and not _exited(proc, deadline):  # closed its output but runs on
            ending = "timeout"
        try:  # the leader is not reaped yet (WNOWAIT), so its group id cannot have been reused
            os.killpg(proc.pid, signal.SIGKILL)  # the code and anything it started
        except ProcessLookupError:
            pass
        exit_code = proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not output.startswith(READY) and ending == "eof":
        text = output.decode("utf-8", errors="replace").strip() or f"exit code {exit_code}"
        raise RunError(f"sandbox: python did not start: {text}; run_python(strict=False) runs without a kernel "
                       "layer this machine lacks")
    text = output[len(READY):].decode("utf-8", errors="replace")
    status, note = _status(ending, exit_code, timeout_s, memory_mb, max_output_bytes)
    if note:
        text += ("" if not text or text.endswith("\n") else "\n") + f"[sandbox: {note}]"
    return SandboxResult(text, status, exit_code if ending == "eof" else None, time.monotonic() - start)


# What every program needs to read besides the interpreter: shared libraries, the loader's cache, random bytes, the
# CPU count (numpy's BLAS reads it); no other /etc, /proc, /sys, /home, /root, /tmp or run directory.
SYSTEM_READABLE = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/dev/null", "/dev/urandom",
                   "/dev/random", "/dev/zero", "/proc/cpuinfo", "/sys/devices/system/cpu")


def readable_paths() -> list[str]:
    """The paths the sandboxed code may read (and execute) besides its folder: the interpreter's installation and
    standard library (its prefixes), the site-packages it imports from, and :data:`SYSTEM_READABLE`. Not sys.path's
    other entries: an editable install puts a repository (its runs, checkpoints, data) there."""
    import site

    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    packages = {p for p in site.getsitepackages() if os.path.isdir(p)}
    return sorted({os.path.realpath(p) for p in (*prefixes, *packages, *SYSTEM_READABLE) if os.path.exists(p)})


def _cpu_limit(timeout_s: float) -> int:
    """RLIMIT_CPU's soft limit (SIGXCPU; SIGKILL a second later): the wall clock limit rounded up, plus one."""
    return math.ceil(timeout_s) + 1


def _read_capped(proc, deadline: float, cap: int) -> tuple[bytes, str]:
    """The process's output up to `cap` bytes and why reading stopped: "eof", "timeout" or "truncated"."""
    fd, chunks, size = proc.stdout.fileno(), [], 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), "timeout"
            if not select.select([fd], [], [], left)[0]:
                continue
            data = os.read(fd, 65536)
            if not data:
                return b"".join(chunks), "eof"
            chunks.append(data[: cap - size])
            size += len(data)
            if size > cap:
                return b"".join(chunks), "truncated"
    finally:
        proc.stdout.close()


def _exited(proc, deadline: float) -> bool:
    """Whether the process exits by `deadline`, leaving it unreaped (a zombie keeps its process group id)."""
    try:
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
    except ChildProcessError:  # reaped already: the caller's process ignores SIGCHLD
        pass
    return True


def _status(ending: str, code: int, timeout_s: float, memory_mb: int, cap: int) -> tuple[str, str | None]:
    """The result's status and the note for the model, from why reading stopped and the exit code."""
    if ending == "timeout":
        return "timeout", f"timed out after {timeout_s:g} s (wall clock); killed"
    if ending == "truncated":
        return "output_truncated", f"output truncated at {cap} bytes; killed"
    if code == -signal.SIGXCPU:
        return "timeout", f"CPU time limit of {_cpu_limit(timeout_s)} s exceeded; killed"
    if code == MEMORY_EXIT:
        return "memory", f"memory limit of {memory_mb} MB exceeded"
    if code < 0:
        return "error", f"killed by signal {signal.Signals(-code).name}"
    return ("ok", None) if code == 0 else ("error", None)
