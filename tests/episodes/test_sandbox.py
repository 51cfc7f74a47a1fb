"""The code sandbox (torchrl_grpo/episodes/sandbox.py): each limit and refusal, measured in a real child process."""
import os
import pickle
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import ROOT
from torchrl_grpo.core.errors import RunError
from torchrl_grpo.episodes.sandbox import run_python


@pytest.fixture(scope="module", autouse=True)
def kernel_layers():
    """The sandbox needs Landlock and namespaces: where the kernel or a container's seccomp profile lacks them
    it refuses to start (RunError) and these tests skip, saying why; never under CI (``CI`` set), whose
    machine has them, so that their absence fails there."""
    try:
        run_python("pass")
    except RunError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the sandbox cannot start on this machine ({err})")


@pytest.fixture(autouse=True)
def own_tmp(tmp_path, monkeypatch):
    """Each test's sandbox folders are made under its own tmp_path, so leftovers can be counted."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_ok_output_and_plain_data():
    r = run_python("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)")
    assert (r.status, r.exit_code, r.output) == ("ok", 0, "42\nto stderr\n")
    assert pickle.loads(pickle.dumps(r)) == r and r.seconds > 0


def test_exception_traceback_comes_back():
    r = run_python("def f():\n    return 1 / 0\nf()\n")
    assert (r.status, r.exit_code) == ("error", 1)
    assert 'File "snippet.py", line 2, in f' in r.output and r.output.rstrip().endswith(
        "ZeroDivisionError: division by zero")
    assert "<string>" not in r.output  # the bootstrap's frame is not shown


def _state(pid: int) -> str:
    """A process's state letter, or "" when it is gone (a zombie, Z, is dead too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def _running(cmdline: str) -> list[int]:
    """The live processes (zombies are dead) whose command line is ``cmdline``, as this machine's /proc sees them."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().replace(b"\0", b" ").decode().strip() == cmdline and _state(int(pid)) not in ("", "Z"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_endless_loop_times_out_and_its_children_are_killed():
    # a child started by reaching around the audit hook (it is defence in depth) still dies with the sandbox
    code = ("import subprocess, types\nsubprocess.sys = types.SimpleNamespace(audit=lambda *a: None)\n"
            "subprocess.Popen(['sleep', '61.25'])\nwhile True:\n    pass\n")
    start = time.monotonic()
    r = run_python(code, timeout_s=1.0)
    assert time.monotonic() - start < 2.0
    assert (r.status, r.exit_code) == ("timeout", None)
    assert r.output.endswith("[sandbox: timed out after 1 s (wall clock); killed]")
    give_up = time.monotonic() + 2  # SIGKILLed with the call; gone a moment later
    while _running("sleep 61.25") and time.monotonic() < give_up:
        time.sleep(0.05)
    assert _running("sleep 61.25") == []


def test_a_process_that_leaves_the_session_dies_with_the_call():
    """os.setsid is not audited: a child that starts a session of its own leaves the process group the sandbox
    kills. It is in the call's PID namespace, which ends when the call does."""
    code = ("import os, subprocess, types\nsubprocess.sys = types.SimpleNamespace(audit=lambda *a: None)\n"
            "subprocess.Popen(['sleep', '62.5'], start_new_session=True)\nprint('started', os.getpid())\n")
    r = run_python(code)
    assert r.status == "ok" and r.output == "started 2\n"  # the code runs as pid 2 of its namespace
    time.sleep(0.1)
    assert _running("sleep 62.5") == []


def test_signals_to_the_trainer_are_refused(trainer_with_a_secret):
    """Reaching around the audit hook to a `kill` program: Landlock's signal scope (ABI 6) and the PID namespace
    (the trainer has no pid there) keep it alive."""
    pid = trainer_with_a_secret.pid
    code = ("import subprocess, types\nsubprocess.sys = types.SimpleNamespace(audit=lambda *a: None)\n"
            f"print(subprocess.run(['kill', '-9', '{pid}'], capture_output=True).returncode)\n")
    r = run_python(code)
    assert r.status == "ok" and r.output.strip() != "0"
    time.sleep(0.1)
    assert trainer_with_a_secret.poll() is None


def test_the_folder_holds_a_bounded_amount(own_tmp):
    """Files of the largest size one at a time until the folder is full: a tmpfs of FOLDER_LIMIT bytes, in memory,
    gone with the call; the disk under it is untouched."""
    from torchrl_grpo.episodes.sandbox import FILE_SIZE_LIMIT, FOLDER_LIMIT

    code = ("import os\nchunk = b'x' * (1 << 20)\ntry:\n    for i in range(1000):\n"
            "        with open(f'f{i}', 'wb') as f:\n"
            "            for _ in range(16):\n                f.write(chunk)\nexcept OSError as e:\n"
            "    print(i, e.errno, sum(os.path.getsize(n) for n in os.listdir('.')))\n")
    r = run_python(code)
    files, errno, written = r.output.split()
    assert r.status == "ok" and errno == "28"  # ENOSPC
    assert int(written) <= FOLDER_LIMIT and int(files) <= FOLDER_LIMIT // FILE_SIZE_LIMIT
    assert list(own_tmp.iterdir()) == []  # the folder is removed, and nothing was written beneath the tmpfs


def test_cpu_time_limit():
    """The CPU limit, not the wall clock, ends a busy loop (a wall clock limit far above it: a loaded machine
    gives the loop its second of CPU late)."""
    r = run_python("import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU))\n"
                   "resource.setrlimit(resource.RLIMIT_CPU, (1, 2))\nwhile True:\n    pass\n", timeout_s=60.0)
    assert r.output.startswith("(61, 62)\n")  # ceil(60) + 1, and SIGKILL a second later
    assert (r.status, r.exit_code) == ("timeout", -24) and "CPU time limit" in r.output


def test_huge_allocation_is_a_memory_error():
    r = run_python("x = bytearray(8 << 30)", memory_mb=256)
    assert (r.status, r.exit_code) == ("memory", 120)
    assert "MemoryError" in r.output and r.output.endswith("[sandbox: memory limit of 256 MB exceeded]")
    assert run_python("x = bytearray(100 << 20)\nprint(len(x))", memory_mb=256).output == f"{100 << 20}\n"


def test_output_flood_is_truncated():
    """Killed when its output passes the cap, not when the (far later) wall clock limit comes."""
    r = run_python("while True:\n    print('y' * 99)", max_output_bytes=1000, timeout_s=60.0)
    assert (r.status, r.exit_code) == ("output_truncated", None)
    assert r.output == "y" * 99 + "\n" + ("y" * 99 + "\n") * 9 + "[sandbox: output truncated at 1000 bytes; killed]"


def test_writes_outside_the_folder_are_refused_inside_allowed(own_tmp):
    outside = own_tmp / "outside.txt"
    repo_file = os.path.join(str(ROOT), "sandbox_escape.txt")
    for path in (outside, repo_file):
        r = run_python(f"open({str(path)!r}, 'w').write('x')")
        assert r.status == "error" and "PermissionError: sandbox: open outside the working folder" in r.output
        assert not os.path.exists(path)
    # Landlock, the kernel layer, holds where the audit hook is fooled (a path relative to another folder)
    r = run_python(f"import os\nfd = os.open({str(own_tmp)!r}, os.O_RDONLY)\n"
                   "os.open('outside.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)")
    assert r.status == "error" and "PermissionError: [Errno 13] Permission denied" in r.output
    assert not outside.exists()
    r = run_python("import os\nos.mkdir('d')\nopen('d/a.txt', 'w').write('inside')\nprint(open('d/a.txt').read())")
    assert (r.status, r.output) == ("ok", "inside\n")


def test_file_size_limit():
    r = run_python("open('big', 'wb').write(b'x' * (17 << 20))")
    assert r.status == "error" and "OSError: [Errno 27] File too large" in r.output


@pytest.mark.parametrize("code", ["import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
                                  "import socket\nsocket.getaddrinfo('example.com', 80)"])
def test_network_is_refused(code):
    r = run_python(code)
    assert r.status == "error" and "PermissionError: sandbox: socket." in r.output


def test_network_namespace_has_no_interface_up():
    # the kernel layer under the audit hook: only a loopback, with nothing sent or received
    r = run_python("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in r.output.splitlines()[2:] if ":" in line]
    assert r.status == "ok" and interfaces == ["lo"]


def test_env_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-w")
    monkeypatch.setenv("OPENAI_API_KEY", "secret-o")
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('WANDB_API_KEY'))")
    assert r.status == "ok" and "secret" not in r.output and "API_KEY" not in r.output
    assert r.output.splitlines()[1] == "None"


SECRET = "sk-test-5ecret-value-0123456789"


@pytest.fixture
def trainer_with_a_secret():
    """A process of the run holding an API key in its environment, as the trainer, its ranks and Ray actors do."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={"PATH": os.environ["PATH"], "WANDB_API_KEY": SECRET})
    yield proc
    proc.kill()
    proc.wait()


def test_no_other_process_is_readable(trainer_with_a_secret):
    """/proc is out of the sandbox's reach (Landlock reads): neither another process's environ nor the list of
    processes; so is the parent's."""
    pid = trainer_with_a_secret.pid
    for code in (f"print(open('/proc/{pid}/environ').read())", f"print(open('/proc/{pid}/cmdline').read())",
                 "import os\nprint(open(f'/proc/{os.getppid()}/environ').read())",
                 "import os\nprint(os.listdir('/proc'))",
                 f"import os\nprint(os.readlink('/proc/{pid}/cwd'))"):
        r = run_python(code)
        assert r.status == "error" and SECRET not in r.output and "WANDB" not in r.output, (code, r.output)
        assert "PermissionError" in r.output or "Permission denied" in r.output, (code, r.output)


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_files_outside_the_folder_are_unreadable_whatever_their_mode(own_tmp, mode):
    """The sandbox runs as the trainer's user (root here): file modes do not protect a token, a run directory or the
    user's data. Landlock grants reads beneath its folder, the interpreter's installation and system libraries."""
    run_dir = own_tmp / "outputs" / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    token = run_dir / "token"
    token.write_text(SECRET)
    token.chmod(mode)
    (run_dir / "metrics.csv").write_text(f"step,reward\n1,{SECRET}\n")
    for code in (f"print(open({str(token)!r}).read())", f"import os\nprint(os.listdir({str(run_dir)!r}))",
                 f"print(open({str(run_dir / 'metrics.csv')!r}).read())",
                 f"import os\nprint(os.listdir({str(own_tmp)!r}))",
                 f"import os\nprint(os.listdir({os.path.expanduser('~')!r}))", "print(open('/etc/hostname').read())"):
        r = run_python(code)
        hidden = "No such file" in r.output  # under a folder only root can search (pytest's): gone from its view
        assert r.status == "error" and SECRET not in r.output and ("Permission" in r.output or hidden), (code, r.output)


def test_the_interpreter_the_libraries_and_the_folder_stay_readable():
    code = ("import json, numpy, os, sys\nopen('data.txt', 'w').write('7')\nprint(open('data.txt').read(), "
            "int(numpy.ones(3).sum()), json.dumps([1]), os.cpu_count() > 0, open('/dev/null').read() == '')")
    r = run_python(code)
    assert (r.status, r.output) == ("ok", "7 3 [1] True True\n")


def test_the_code_runs_as_nobody_without_capabilities_where_the_trainer_is_root():
    """Under root, file modes protect again: the code is uid and gid 65534 with no group and no capability. The
    interpreter may live under a home of mode 700 (pyenv under /root): the test above imports numpy all the same."""
    if os.getuid() != 0:
        pytest.skip("the trainer is not root: the code runs as its user, in a user namespace")
    code = ("import os\nprint(os.getresuid(), os.getresgid(), os.getgroups())\n"
            "print(*[line.split()[1] for line in open('/proc/self/status') if line.startswith(('CapEff', 'CapPrm'))])")
    r = run_python(code)
    assert (r.status, r.output) == ("ok", "(65534, 65534, 65534) (65534, 65534, 65534) []\n"
                                          "0000000000000000 0000000000000000\n")


def test_the_readable_paths_hold_no_repository_or_home():
    """An editable install puts the repository on sys.path (its outputs/, checkpoints, data): it is not readable."""
    from torchrl_grpo.episodes.sandbox import readable_paths

    paths = readable_paths()
    repository = str(ROOT)
    assert repository not in paths and os.path.expanduser("~") not in paths and "/" not in paths
    assert not any(p in ("/proc", "/etc", "/tmp", "/home", "/root", "/sys") for p in paths)


@pytest.mark.parametrize("code, event", [("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
                                         ("import os\nos.system('true')", "os.system"),
                                         ("import os\nos.fork()", "os.fork"),
                                         ("import os\nos.kill(1, 0)", "os.kill"),
                                         ("import ctypes\nctypes.CDLL(None).getpid()", "ctypes.dlsym")])
def test_processes_signals_and_ctypes_are_refused(code, event):
    r = run_python(code)
    assert r.status == "error" and r.output.rstrip().endswith(f"PermissionError: sandbox: {event} is not allowed")


def test_python_that_cannot_start_is_a_run_error():
    with pytest.raises(RunError, match="sandbox: python did not start"):
        run_python("print(1)", memory_mb=1)


def test_many_calls_leave_no_process_or_folder(own_tmp):
    # (code, timeout): what ends by itself has time to on a loaded machine (an interpreter's start alone can take
    # 0.5 s there); it ends as soon as it has. Only the endless loops get 0.5 s
    codes = [("print(1)", 30), ("1/0", 30), ("while True: pass", 0.5), ("while True: print(1)", 30),
             ("import os\nos.close(1)\nos.close(2)\nwhile True: pass", 0.5)]  # output closed, yet it runs on
    statuses = [run_python(code, timeout_s=timeout, max_output_bytes=1000).status for code, timeout in codes]
    assert statuses == ["ok", "error", "timeout", "output_truncated", "timeout"]
    assert list(own_tmp.iterdir()) == []

    def leftovers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(own_tmp).encode() in f.read() and _state(int(pid)) not in ("", "Z"):
                        found.append(pid)
            except OSError:
                pass
        return found

    # a killed call's processes (the bootstrap, its namespace's pid 1, the code) are SIGKILLed when it returns
    # and gone a moment later
    give_up = time.monotonic() + 2
    while leftovers() and time.monotonic() < give_up:
        time.sleep(0.05)
    assert leftovers() == []
